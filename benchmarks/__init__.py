"""Benchmarks for otel_hicache (run from the repository root: ``python -m benchmarks --help``)."""
