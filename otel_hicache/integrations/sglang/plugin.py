"""The SGLang general plugin (entry-point group ``sglang.srt.plugins``) and the per-process telemetry of both routes.

SGLang's ``load_plugins()`` runs first thing in every scheduler process (``run_scheduler_process``), and in the
detokenizer, DP controller and engine processes. :func:`load` only arms the lazy patches (nothing of SGLang or torch is
imported, no thread or exporter is started). The telemetry of a process is built on its first HiCache event
(``init_hicache``, a decode-offload controller's first ack, ...), when SGLang has already published the process's
ranks: :func:`ranked_telemetry` reads them from ``sglang.srt.runtime_context.get_parallel()`` and builds the telemetry
with :func:`otel_hicache.sdk.configure` from the standard ``OTEL_*`` environment. A process that never runs HiCache
(the launcher, tokenizer, detokenizer) builds nothing and exports nothing.

TP semantics: one rank of each tensor-parallel x pipeline group of a DP replica (attention-TP rank 0 and PP rank 0)
reports the instruments counted in tokens (transfer, dropped and evicted tokens, prefill split, pool usage and limit);
the others pass ``token_metrics=False`` and report bytes, durations and spans, which are per rank. A ``sum`` over
processes is then the logical token flow and the total bytes moved. SGLang makes the same choice for
``prefill_effective_tokens`` and its host-pool gauges (``attn_tp_rank == 0`` only) but labels its radix-cache series
per ``tp_rank``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import metrics

from otel_hicache import semconv as sc
from otel_hicache.integrations.sglang.semconv import SGLANG_POOLS
from otel_hicache.sdk import TelemetrySetup, configure
from otel_hicache.telemetry import HiCacheTelemetry

_log = logging.getLogger(__name__)

#: The name of both entry points (``opentelemetry_instrumentor`` and ``sglang.srt.plugins``): listing it in
#: ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` turns both routes off.
ENTRY_POINT = "sglang_hicache"
_DISABLED_ENV = "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"
#: SGLang's parallel-context field for each rank we report.
_RANK_FIELDS = {"tp": "tp_rank", "pp": "pp_rank", "dp": "dp_rank", "attn_tp": "attn_tp_rank"}


def disabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` names this instrumentation (or is ``*``)."""
    raw = (os.environ if env is None else env).get(_DISABLED_ENV, "")
    names = {name.strip() for name in raw.split(",")}
    return ENTRY_POINT in names or "*" in names


def load() -> None:
    """SGLang general plugin: instrument this process lazily, unless disabled or instrumented already (e.g. by
    ``opentelemetry-instrument``). Never raises into SGLang's start-up."""
    try:
        if disabled():
            return
        from otel_hicache.integrations.sglang.instrumentor import SGLangHiCacheInstrumentor

        instrumentor = SGLangHiCacheInstrumentor()  # a singleton: the instance opentelemetry-instrument made, if any
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument()
    except Exception:
        _log.warning("otel_hicache: the SGLang plugin failed; SGLang runs uninstrumented.", exc_info=True)


def parallel_ranks() -> dict[str, int]:
    """This process's ranks as SGLang published them (``get_parallel()``); a rank not published is left out."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
    except Exception:
        return {}
    ranks = {}
    for name, field in _RANK_FIELDS.items():
        try:
            value = getattr(parallel, field)
        except Exception:  # not published in this process (SGLang raises on an unwritten rank)
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            ranks[name] = value
    return ranks


def reports_tokens(ranks: Mapping[str, int]) -> bool:
    """Whether this rank reports the token-counted instruments: attention-TP rank 0 (TP rank where attention-TP is
    unknown) and PP rank 0; an unknown rank counts as 0 (a single-process server)."""
    return ranks.get("attn_tp", ranks.get("tp", 0)) == 0 and ranks.get("pp", 0) == 0


def ranked_telemetry() -> tuple[HiCacheTelemetry, TelemetrySetup]:
    """Build this process's telemetry from the ``OTEL_*`` environment with its SGLang ranks on the Resource.

    Over OTLP it is exported by an export process that outlives a SIGKILL of this one. This process's meter
    provider (built now, from the same environment) becomes the global one where none is installed: it carries
    SGLang's ``sglang:*`` series routed by the stat loggers. No tracer provider is installed: SGLang's request spans
    exist only under its ``--enable-trace`` (set up earlier in ``run_scheduler_process``) or
    ``opentelemetry-instrument``, which install their own, and the process keeps that one.
    """
    ranks = parallel_ranks()
    attn_tp = ranks.pop("attn_tp", None)
    resource: dict[str, Any] = {sc.RESOURCE_ENGINE: sc.Engine.SGLANG.value}
    if attn_tp is not None:
        resource[sc.RESOURCE_ATTN_TP_RANK] = attn_tp
    setup = configure(
        ranks=ranks,
        resource_attributes=resource,
        extra_pools=SGLANG_POOLS,
        token_metrics=reports_tokens({**ranks, **({} if attn_tp is None else {"attn_tp": attn_tp})}),
    )
    if _unset(metrics.get_meter_provider()):
        metrics.set_meter_provider(setup.meter_provider)
    return setup.telemetry, setup


def _unset(provider: Any) -> bool:
    """Whether ``provider`` is OTel's placeholder (nothing installed yet)."""
    return type(provider).__name__ in ("ProxyTracerProvider", "_ProxyMeterProvider")


__all__ = ["ENTRY_POINT", "disabled", "load", "parallel_ranks", "ranked_telemetry", "reports_tokens"]
