"""``SGLangHiCacheInstrumentor``: the wrappers of :mod:`.hooks` on SGLang's HiCache classes, through :mod:`.._base`."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any, Final

from otel_hicache.integrations._base import EngineInstrumentor, Target, Wrapper
from otel_hicache.integrations.sglang.hooks import HiCacheHooks
from otel_hicache.integrations.sglang.plugin import ranked_telemetry
from otel_hicache.integrations.sglang.semconv import SGLANG_POOLS
from otel_hicache.integrations.sglang.stat_loggers import OTelStatLoggers
from otel_hicache.package import _instruments_sglang
from otel_hicache.sdk import TelemetrySetup
from otel_hicache.telemetry import HiCacheTelemetry

_CONTROLLER = "sglang.srt.managers.cache_controller"
_TREE = "sglang.srt.mem_cache.unified_radix_cache"
_POLICY = "sglang.srt.managers.schedule_policy"

#: Every HiCache patch, in one table: (target, name of the :class:`HiCacheHooks` method that wraps it).
_TARGETS: Final[tuple[tuple[Target, str], ...]] = (
    (Target(_CONTROLLER, "HiCacheController", "start_writing"), "start_writing"),
    (Target(_CONTROLLER, "HiCacheController", "start_loading"), "start_loading"),
    (Target(_CONTROLLER, "HiCacheController", "reset"), "reset"),
    (Target(_CONTROLLER, "HiCacheController", "_page_backup_or_log"), "storage_backup"),
    (Target(_TREE, "UnifiedRadixCache", "load_back"), "load_back"),
    (Target(_TREE, "UnifiedRadixCache", "checkpoint_into_tree"), "checkpoint"),
    (Target(_TREE, "UnifiedRadixCache", "advance_unpublished_req"), "checkpoint"),
    (Target(_TREE, "UnifiedRadixCache", "_evict"), "evict"),
    (Target(_TREE, "UnifiedRadixCache", "_record_dropped_tokens"), "record_dropped_tokens"),
    (Target(_TREE, "UnifiedRadixCache", "_handle_prefetch_result"), "storage_prefetch"),
    (Target(_TREE, "UnifiedRadixCache", "init_hicache"), "init_hicache"),
    (Target(_POLICY, "PrefillAdder", "_update_prefill_budget"), "prefill_admission"),
    (Target(_POLICY, "PrefillAdder", "_account_prefill_cache_admission"), "prefill_admission"),
)

#: Stands for "no sink yet" between ``_sink`` and ``_wrappers`` (the base class passes a sink along).
_LAZY: Any = object()

#: Modules that bound ``resolve_collector_class`` by name for the stat-logger roles we serve.
_STAT_LOGGER_MODULES: Final[tuple[str, ...]] = (
    "sglang.srt.observability.metrics_collector",  # scheduler role
    "sglang.srt.mem_cache.base_prefix_cache",  # radix_cache role
    "sglang.srt.mem_cache.unified_cache.storage_attachment",  # storage role
)


class SGLangHiCacheInstrumentor(EngineInstrumentor):
    """Spans and metrics for SGLang HiCache transfers, drops, evictions and per-tier prefill hits.

    ``instrument(**kwargs)`` accepts:

    * ``tracer_provider``, ``meter_provider``: where the telemetry goes;
    * ``telemetry``: an existing :class:`~otel_hicache.telemetry.HiCacheTelemetry` to report through instead;
    * none of these (the plugin and ``opentelemetry-instrument`` routes): each process builds its telemetry on its
      first HiCache event, from the ``OTEL_*`` environment, with its SGLang ranks
      (:func:`.plugin.ranked_telemetry`);
    * ``stat_loggers`` (default ``True``): also route SGLang's own ``sglang:*`` series over OTel (see
      :mod:`.stat_loggers`) for the ``scheduler``, ``storage`` and ``radix_cache`` roles the user left unset.
    """

    _engine = "SGLang HiCache"
    _extra_pools = SGLANG_POOLS
    _setup: TelemetrySetup | None = None  # this process's telemetry, once built (plugin / opentelemetry-instrument)
    _hooks: HiCacheHooks | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments_sglang

    @property
    def telemetry(self) -> HiCacheTelemetry | None:
        """The sink the wrappers report through (``None`` until built: see ``instrument``)."""
        return self._telemetry if self._hooks is None else self._hooks.telemetry

    def _sink(self, kwargs: dict[str, Any]) -> HiCacheTelemetry:
        if any(kwargs.get(k) is not None for k in ("telemetry", "tracer_provider", "meter_provider")):
            return super()._sink(kwargs)
        return _LAZY  # built per process by ranked_telemetry() on its first HiCache event

    def _ranked_telemetry(self) -> HiCacheTelemetry:
        telemetry, self._setup = ranked_telemetry()
        self._telemetry, self._owns_telemetry = telemetry, False  # the setup owns it (shut down at exit)
        return telemetry

    def _uninstrument(self, **kwargs: Any) -> None:
        if self._hooks is not None:
            self._hooks.detach()  # adopted ack queues stay lists for SGLang and stop reporting
        super()._uninstrument(**kwargs)

    def _wrappers(self, telemetry: HiCacheTelemetry, options: Mapping[str, Any]) -> Iterable[tuple[Target, Wrapper]]:
        if telemetry is _LAZY:  # once built, a process's telemetry is kept across uninstrument/instrument
            built = None if self._setup is None else self._setup.telemetry
            hooks = self._hooks = HiCacheHooks(built, None if built is not None else self._ranked_telemetry)
        else:
            hooks = self._hooks = HiCacheHooks(telemetry)
        patches: list[tuple[Target, Wrapper]] = [(target, getattr(hooks, hook)) for target, hook in _TARGETS]
        if options.get("stat_loggers", True):
            loggers = OTelStatLoggers(options.get("meter_provider"))
            patches += [
                (Target(module, "", "resolve_collector_class"), loggers.resolve_collector_class)
                for module in _STAT_LOGGER_MODULES
            ]
        return patches
