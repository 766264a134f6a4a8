"""Integrations that feed otel_hicache from a serving engine without changing its code.

* :mod:`otel_hicache.integrations._base`: what every engine adapter shares (targets, version check, lazy patching,
  ``suppress_instrumentation()``, ``uninstrument()``, flush at exit);
* :mod:`otel_hicache.integrations.sglang`: SGLang HiCache (0.5.23 and later), as an OpenTelemetry instrumentor;
* :mod:`otel_hicache.integrations.vllm`: vLLM's KV offloading connector (0.32 and later), as an OpenTelemetry
  instrumentor and a ``vllm.general_plugins`` plugin.
"""
