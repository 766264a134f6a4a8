"""``SGLangHiCacheInstrumentor``: the wrappers of :mod:`.hooks` on SGLang's HiCache classes, through :mod:`.._base`,
and SGLang's rank rule.

TP semantics (:func:`sglang_ranks`): one rank of each attention-TP x attention-CP x pipeline group of a DP replica
(``attn_tp_rank == 0``, ``attn_cp_rank == 0``, ``pp_rank == 0``) reports the instruments counted in tokens (transfer,
dropped and evicted tokens, prefill split, pool usage and limit); the others report bytes, durations and spans, which
are per rank. A ``sum`` over processes is then the logical token flow and the total bytes moved. SGLang 0.5.23 logs its
scheduler token stats (``prefill_effective_tokens``, its host-pool gauges) on the same ranks
(``attn_tp_rank == 0 and attn_cp_rank == 0``) but labels its radix-cache series per ``tp_rank``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any, Final

from otel_hicache import semconv as sc
from otel_hicache.integrations._base import EngineInstrumentor, ProcessSink, Ranks, Target, Wrapper
from otel_hicache.integrations.sglang.hooks import HiCacheHooks
from otel_hicache.integrations.sglang.semconv import SGLANG_POOLS
from otel_hicache.integrations.sglang.stat_loggers import OTelStatLoggers
from otel_hicache.package import _instruments_sglang

_CONTROLLER = "sglang.srt.managers.cache_controller"
_TREE = "sglang.srt.mem_cache.unified_radix_cache"
_STATS = "sglang.srt.managers.scheduler_components.metrics_reporter"
_TREE_CORE = "sglang.srt.mem_cache.unified_cache.unified_tree_core"


def hicache_patches(hooks: HiCacheHooks) -> list[tuple[Target, Wrapper]]:
    """Every HiCache patch, in one table: each target, with the parameters its wrapper reads, and the method of
    ``hooks`` that wraps it."""
    return [
        (Target(_CONTROLLER, "HiCacheController", "start_writing"), hooks.start_writing),
        (Target(_CONTROLLER, "HiCacheController", "start_loading"), hooks.start_loading),
        (Target(_CONTROLLER, "HiCacheController", "reset"), hooks.reset),
        (Target(_CONTROLLER, "HiCacheController", "_page_backup_or_log", ("operation",)), hooks.storage_backup),
        (Target(_TREE, "UnifiedRadixCache", "load_back", ("node_id", "mem_quota", "req")), hooks.load_back),
        (Target(_TREE, "UnifiedRadixCache", "checkpoint_into_tree", ("req",)), hooks.checkpoint),
        (Target(_TREE, "UnifiedRadixCache", "advance_unpublished_req", ("req",)), hooks.checkpoint),
        (Target(_TREE, "UnifiedRadixCache", "_evict"), hooks.evict),
        (Target(_TREE, "UnifiedRadixCache", "_evict_device_leaf", ("node_id", "tracker")), hooks.device_entry),
        (Target(_TREE, "UnifiedRadixCache", "_demote", ("node_id", "tracker")), hooks.device_entry),
        (Target(_TREE, "UnifiedRadixCache", "evict_host", ("num_tokens",)), hooks.evict_host),
        (Target(_TREE_CORE, "UnifiedTreeCore", "_evict_host_leaf", ("node", "tracker")), hooks.host_entry),
        (
            Target(_TREE, "UnifiedRadixCache", "_record_dropped_tokens", ("dropped_tokens", "reason")),
            hooks.dropped_tokens,
        ),
        (Target(_TREE, "UnifiedRadixCache", "_handle_prefetch_result", ("operation",)), hooks.storage_prefetch),
        (Target(_TREE, "UnifiedRadixCache", "check_prefetch_progress", ("request",)), hooks.prefetch_progress),
        (Target(_TREE, "UnifiedRadixCache", "init_hicache"), hooks.init_hicache),
        # the batch's split, its admissions (hicache.capacity.*, a traced request's split)
        (Target(_STATS, "PrefillStats", "from_adder", ("adder",)), hooks.prefill_batch),
    ]


#: Modules that bound ``resolve_collector_class`` by name for the stat-logger roles we serve.
_STAT_LOGGER_MODULES: Final[tuple[str, ...]] = (
    "sglang.srt.observability.metrics_collector",  # scheduler role
    "sglang.srt.mem_cache.base_prefix_cache",  # radix_cache role
    "sglang.srt.mem_cache.unified_cache.storage_attachment",  # storage role
)
#: SGLang's parallel-context field for each rank we read.
_RANK_FIELDS: Final = {
    "tp": "tp_rank",
    "pp": "pp_rank",
    "dp": "dp_rank",
    "attn_tp": "attn_tp_rank",
    "attn_cp": "attn_cp_rank",
}


class SGLangHiCacheInstrumentor(EngineInstrumentor):
    """Spans and metrics for SGLang HiCache transfers, drops, evictions and per-tier prefill hits.

    ``instrument(**kwargs)`` accepts:

    * ``tracer_provider``, ``meter_provider``: where the telemetry goes (built per process at its first HiCache event,
      with SGLang's rank rule);
    * ``telemetry``: an existing :class:`~otel_hicache.telemetry.HiCacheTelemetry` to report through instead;
    * none of these (the plugin and ``opentelemetry-instrument`` routes): each process builds its telemetry on its
      first HiCache event, from the ``OTEL_*`` environment, with its SGLang ranks (:func:`sglang_ranks`);
    * ``stat_loggers`` (default ``True``): also route SGLang's own ``sglang:*`` series over OTel (see
      :mod:`.stat_loggers`) for the ``scheduler``, ``storage`` and ``radix_cache`` roles the user left unset.
    """

    _engine = "SGLang HiCache"
    _engine_id = sc.Engine.SGLANG
    _extra_pools = SGLANG_POOLS
    _from_environment = True
    # SGLang's stat loggers use the global meter provider: ours where none is installed (its --enable-trace sets a
    # tracer provider of its own in process_tracing_init, before HiCache starts).
    _install_globals = True

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments_sglang

    def _patches(self, sink: ProcessSink, options: Mapping[str, Any]) -> Iterable[tuple[Target, Wrapper]]:
        patches = hicache_patches(HiCacheHooks(sink, sglang_ranks))
        if options.get("stat_loggers", True):
            resolve = OTelStatLoggers(options.get("meter_provider")).resolve_collector_class
            patches += [
                (Target(module, "", "resolve_collector_class", ("role", "default_cls")), resolve)
                for module in _STAT_LOGGER_MODULES
            ]
        return patches


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
    unknown), attention-CP rank 0 and PP rank 0; an unknown rank counts as 0 (a single-process server)."""
    return ranks.get("attn_tp", ranks.get("tp", 0)) == 0 and ranks.get("attn_cp", 0) == 0 and ranks.get("pp", 0) == 0


def sglang_ranks() -> Ranks:
    """This process's :class:`~.._base.Ranks`: tp / pp / dp on the Resource, the attention-TP rank too, and the rank
    rule of :func:`reports_tokens`."""
    ranks = parallel_ranks()
    token_metrics = reports_tokens(ranks)
    attn_tp = ranks.pop("attn_tp", None)
    ranks.pop("attn_cp", None)
    return Ranks(
        ranks=ranks,
        token_metrics=token_metrics,
        resource={} if attn_tp is None else {sc.RESOURCE_ATTN_TP_RANK: attn_tp},
    )
