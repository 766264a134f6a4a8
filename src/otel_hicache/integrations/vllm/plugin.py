"""The ``vllm.general_plugins`` entry point: vLLM loads it in each of its processes, before any model code.

It arms the instrumentor with nothing built: a process configures telemetry from the ``OTEL_*`` environment only
when the engine builds its offloading - a worker's KV caches registered, the scheduler's CPU tier built, both while
the engine starts - and waits for its export process to be up before the engine serves (:class:`~.._base.ProcessSink`),
so API-server processes and engines without offloading cost nothing, and nothing of ours starts up while requests
are served. Naming ``vllm_kv_offload`` in ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` (or ``*``)
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
