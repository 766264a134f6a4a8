"""The SGLang general plugin (entry-point group ``sglang.srt.plugins``).

SGLang's ``load_plugins()`` runs first thing in every scheduler process (``run_scheduler_process``), and in the
detokenizer, DP controller and engine processes. :func:`load` only arms the lazy patches (nothing of SGLang or torch is
imported, no thread or exporter is started); each process builds its telemetry on its first HiCache event
(``init_hicache``, a decode-offload controller's first ack, ...), when SGLang has already published the process's
ranks (:func:`.instrumentor.sglang_ranks`), from the standard ``OTEL_*`` environment. A process that never runs HiCache
(the launcher, tokenizer, detokenizer) builds nothing and exports nothing.
"""

from __future__ import annotations

from otel_hicache.integrations._base import load_plugin
from otel_hicache.integrations.sglang.instrumentor import SGLangHiCacheInstrumentor
from otel_hicache.integrations.sglang.semconv import ENTRY_POINT


def load() -> None:
    """SGLang general plugin: instrument this process lazily, unless ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` names
    ``sglang_hicache`` (or is ``*``) or the process is instrumented already (e.g. by ``opentelemetry-instrument``).
    Never raises into SGLang's start-up."""
    load_plugin(SGLangHiCacheInstrumentor, ENTRY_POINT)


__all__ = ["ENTRY_POINT", "load"]
