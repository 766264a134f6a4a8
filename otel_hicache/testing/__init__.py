"""Helpers for testing and benchmarking otel_hicache against real OTel exporters (not needed in production)."""
