"""``SGLangHiCacheInstrumentor``: patches SGLang's HiCache classes with the wrappers of :mod:`.hooks`."""

from __future__ import annotations

import atexit
import importlib
import logging
from collections.abc import Collection
from typing import Any, NamedTuple

import wrapt
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_hicache.integrations.sglang import stat_loggers
from otel_hicache.integrations.sglang.hooks import HiCacheHooks
from otel_hicache.telemetry import HiCacheTelemetry

_log = logging.getLogger(__name__)

#: The SGLang releases whose HiCache shape (UnifiedRadixCache, HiCacheAck with per-pool tokens and bytes) we wrap.
_INSTRUMENTS = ("sglang >= 0.5.23",)


class Target(NamedTuple):
    module: str
    owner: str  # class name, or "" for a module-level function
    attribute: str
    hook: str  # HiCacheHooks method name


_CONTROLLER = "sglang.srt.managers.cache_controller"
_TREE = "sglang.srt.mem_cache.unified_radix_cache"
_POLICY = "sglang.srt.managers.schedule_policy"

#: Every patch, in one table: what ``uninstrument`` undoes is exactly this list.
TARGETS: tuple[Target, ...] = (
    Target(_CONTROLLER, "HiCacheController", "start_writing", "start_writing"),
    Target(_CONTROLLER, "HiCacheController", "start_loading", "start_loading"),
    Target(_CONTROLLER, "HiCacheController", "reset", "reset"),
    Target(_CONTROLLER, "HiCacheController", "_page_backup_or_log", "storage_backup"),
    Target(_TREE, "UnifiedRadixCache", "writing_check", "writing_check"),
    Target(_TREE, "UnifiedRadixCache", "loading_check", "loading_check"),
    Target(_TREE, "UnifiedRadixCache", "_evict", "evict"),
    Target(_TREE, "UnifiedRadixCache", "_record_dropped_tokens", "record_dropped_tokens"),
    Target(_TREE, "UnifiedRadixCache", "_handle_prefetch_result", "storage_prefetch"),
    Target(_TREE, "UnifiedRadixCache", "init_hicache", "init_hicache"),
    Target(_POLICY, "PrefillAdder", "_update_prefill_budget", "prefill_admission"),
    Target(_POLICY, "PrefillAdder", "_account_prefill_cache_admission", "prefill_admission"),
)

#: Modules that bound ``resolve_collector_class`` by name for the roles we serve.
STAT_LOGGER_MODULES: tuple[str, ...] = (
    "sglang.srt.observability.metrics_collector",  # scheduler role
    "sglang.srt.mem_cache.base_prefix_cache",  # radix_cache role
    "sglang.srt.mem_cache.unified_cache.storage_attachment",  # storage role
)

_warned: set[str] = set()
#: What a wrapt wrapper is an instance of (wrapt 2 splits ``BaseObjectProxy`` off ``ObjectProxy``).
_PROXY: type = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        _log.warning(message, *args)


class SGLangHiCacheInstrumentor(BaseInstrumentor):
    """Spans and metrics for SGLang HiCache transfers, drops, evictions and per-tier prefill hits.

    ``instrument(**kwargs)`` accepts:

    * ``tracer_provider``, ``meter_provider``: where the telemetry goes (the global providers by default);
    * ``telemetry``: an existing :class:`~otel_hicache.telemetry.HiCacheTelemetry` to report through instead;
    * ``stat_loggers`` (default ``True``): also route SGLang's own ``sglang:*`` series over OTel (see
      :mod:`.stat_loggers`) for the ``scheduler``, ``storage`` and ``radix_cache`` roles the user left unset.
    """

    _telemetry: HiCacheTelemetry | None = None
    _owns_telemetry = False
    _providers: tuple[Any, Any] = (None, None)
    _patched: list[tuple[Any, str]]

    def instrumentation_dependencies(self) -> Collection[str]:
        return _INSTRUMENTS

    @property
    def telemetry(self) -> HiCacheTelemetry | None:
        """The sink the wrappers report through (``None`` before the first ``instrument()``)."""
        return self._telemetry

    def instrument(self, **kwargs: Any) -> Any:
        """Patch SGLang; a missing or unsupported SGLang gives one warning and patches nothing.

        The SGLang version check always runs, also under ``skip_dep_check`` (what ``opentelemetry-instrument``
        passes): the wrappers rely on 0.5.23's shapes. Auto-instrumenting a process without SGLang is silent.
        """
        if not self.is_instrumented_by_opentelemetry:
            conflict = self._check_dependency_conflicts()
            if conflict is not None:
                if getattr(conflict, "found", None) is None and kwargs.get("skip_dep_check", False):
                    _log.debug("otel_hicache: SGLang is not installed; nothing to instrument.")
                else:
                    _warn_once(
                        "dependency",
                        "otel_hicache: SGLang HiCache is not instrumented: %s (this instrumentation supports %s).",
                        _describe_conflict(conflict),
                        ", ".join(_INSTRUMENTS),
                    )
                return None
        kwargs["skip_dep_check"] = True
        return super().instrument(**kwargs)

    def _instrument(self, **kwargs: Any) -> None:
        self._patched = []
        try:
            targets = [(target, _resolve(target)) for target in TARGETS]
            stat_modules = [importlib.import_module(name) for name in STAT_LOGGER_MODULES]
        except Exception as exc:  # an SGLang that does not import here: no patching at all
            _warn_once("import", "otel_hicache: SGLang HiCache is not instrumented: importing SGLang failed (%r).", exc)
            return
        hooks = HiCacheHooks(self._sink(kwargs))
        if not getattr(self, "_flush_registered", False):
            # Spans wait in the telemetry queue for its worker; hand them to the SDK before the SDK's own exit
            # handlers (registered earlier, so run later) shut the providers down.
            atexit.register(self._flush_at_exit)
            self._flush_registered = True
        missing = []
        for target, owner in targets:
            if owner is None or target.attribute not in vars(owner):
                missing.append(f"{target.owner}.{target.attribute}")
                continue
            if _is_ours(vars(owner)[target.attribute]):
                continue  # already wrapped by an earlier, not undone instrument(): never wrap twice
            wrapt.wrap_function_wrapper(owner, target.attribute, getattr(hooks, target.hook))
            self._patched.append((owner, target.attribute))
        if missing:
            _warn_once(
                "missing",
                "otel_hicache: this SGLang lacks %s; those signals are not reported, the rest is instrumented.",
                ", ".join(missing),
            )
        if kwargs.get("stat_loggers", True):
            stat_loggers.set_meter_provider(kwargs.get("meter_provider"))
            for module in stat_modules:
                current = getattr(module, "resolve_collector_class", None)
                if current is None or _is_ours(current):
                    continue
                wrapt.wrap_function_wrapper(module, "resolve_collector_class", stat_loggers.resolve_collector_class)
                self._patched.append((module, "resolve_collector_class"))

    def _uninstrument(self, **kwargs: Any) -> None:
        for owner, attribute in reversed(getattr(self, "_patched", [])):
            current = vars(owner).get(attribute)
            if isinstance(current, _PROXY):
                setattr(owner, attribute, current.__wrapped__)
        self._patched = []
        try:  # hand over what the wrappers queued; never raise out of uninstrument
            if self._telemetry is not None:
                self._telemetry.flush()
        except Exception:
            _log.debug("otel_hicache: flushing on uninstrument failed", exc_info=True)

    def _flush_at_exit(self) -> None:
        try:
            if self._telemetry is not None:
                self._telemetry.flush()
        except Exception:
            _log.debug("otel_hicache: flushing at exit failed", exc_info=True)

    def _sink(self, kwargs: dict[str, Any]) -> HiCacheTelemetry:
        """The telemetry to report through; one per provider pair, kept across uninstrument/instrument cycles so
        re-instrumenting never registers the same instruments twice."""
        given = kwargs.get("telemetry")
        if given is not None:
            self._telemetry, self._owns_telemetry = given, False
            return given
        providers = (kwargs.get("tracer_provider"), kwargs.get("meter_provider"))
        if self._telemetry is None or not self._owns_telemetry or providers != self._providers:
            self._telemetry = HiCacheTelemetry(*providers)
            self._owns_telemetry, self._providers = True, providers
        return self._telemetry


def _resolve(target: Target) -> Any:
    module = importlib.import_module(target.module)
    return getattr(module, target.owner, None) if target.owner else module


def _is_ours(attribute: Any) -> bool:
    """Whether ``attribute`` is a wrapt wrapper installed by this package."""
    if not isinstance(attribute, _PROXY):
        return False
    wrapper = getattr(attribute, "_self_wrapper", None)
    owner = getattr(wrapper, "__self__", None)
    module = getattr(wrapper, "__module__", "") or ""
    return isinstance(owner, HiCacheHooks) or module.startswith("otel_hicache.")


def _describe_conflict(conflict: Any) -> str:
    found = getattr(conflict, "found", None)
    required = getattr(conflict, "required", None)
    if found is None:
        return "sglang is not installed"
    return f"found {found}, need {required}"
