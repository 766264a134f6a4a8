"""The ``vllm.general_plugins`` entry point: vLLM loads it in each of its processes, before any model code.

It arms the instrumentor with nothing built: a process configures telemetry from the ``OTEL_*`` environment only
when it first offloads or builds a CPU tier (:class:`~.instrumentor.EnvironmentSinks`), so API-server processes
and engines without offloading cost nothing. Naming ``vllm_kv_offload`` in ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``
turns it off; a process already instrumented (``opentelemetry-instrument``, or in code) is left as it is.
"""

from __future__ import annotations

import logging
import os

from otel_hicache.integrations.vllm.instrumentor import VLLMOffloadInstrumentor
from otel_hicache.integrations.vllm.semconv import ENTRY_POINT

_log = logging.getLogger(__name__)


def register() -> None:
    """Instrument vLLM's KV offloading in this process from the environment (never raises into vLLM)."""
    try:
        disabled = {name.strip() for name in os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "").split(",")}
        if ENTRY_POINT in disabled:
            return
        instrumentor = VLLMOffloadInstrumentor()
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument(from_environment=True)
    except Exception:
        _log.warning("otel_hicache: the vLLM plugin could not instrument this process", exc_info=True)
