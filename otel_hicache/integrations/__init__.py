"""Integrations that feed otel_hicache from a serving engine without changing its code.

* :mod:`otel_hicache.integrations.sglang`: SGLang HiCache (0.5.23 and later), as an OpenTelemetry instrumentor.
"""
