"""The ``vllm.general_plugins`` entry point: vLLM loads it in each of its processes, before any model code.

It arms the instrumentor with nothing built: a process configures telemetry from the ``OTEL_*`` environment only
when it first offloads or builds a CPU tier (:class:`~.._base.ProcessSink`), so API-server processes and engines
without offloading cost nothing. Naming ``vllm_kv_offload`` in ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` (or ``*``)
turns it off; a process already instrumented (``opentelemetry-instrument``, or in code) is left as it is.
"""

from __future__ import annotations

from otel_hicache.integrations._base import load_plugin
from otel_hicache.integrations.vllm.instrumentor import VLLMOffloadInstrumentor
from otel_hicache.integrations.vllm.semconv import ENTRY_POINT


def register() -> None:
    """Instrument vLLM's KV offloading in this process from the environment (never raises into vLLM)."""
    load_plugin(VLLMOffloadInstrumentor, ENTRY_POINT, from_environment=True)


__all__ = ["ENTRY_POINT", "register"]
