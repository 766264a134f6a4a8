"""What every engine adapter shares: a table of patch targets, the version check, lazy patching, flush at exit.

An adapter is one subclass of :class:`EngineInstrumentor` that says which engine releases it fits
(``instrumentation_dependencies``, from :mod:`otel_hicache.package`), which pool names the engine reports besides
the core's (``_extra_pools``) and which wrapper goes on which engine attribute (``_wrappers``). The base class does
the rest, the same way for every engine:

* ``instrument()`` checks the installed engine's version (also under ``skip_dep_check``: the wrappers rely on the
  supported shapes), builds the :class:`~otel_hicache.telemetry.HiCacheTelemetry` sink and registers one post-import
  hook per target module (:func:`wrapt.register_post_import_hook`): it imports nothing of the engine (nor torch), and
  each target is patched when the engine imports its module (at once if it already has);
* every wrapper passes straight through under :func:`opentelemetry.instrumentation.utils.suppress_instrumentation`
  (a wrapper marked :func:`checks_suppression` reports nothing there, and checks that itself);
* ``uninstrument()`` restores exactly what was patched (with the contrib
  :func:`~opentelemetry.instrumentation.utils.unwrap`), disarms the hooks that have not fired yet and hands queued
  spans to the SDK;
* at interpreter exit, spans still queued are handed to the SDK before it shuts down.
"""

from __future__ import annotations

import atexit
import logging
import threading
from abc import abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any, NamedTuple, TypeVar

import wrapt
from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.instrumentation.utils import is_instrumentation_enabled, unwrap

from otel_hicache.telemetry import HiCacheTelemetry

_log = logging.getLogger(__name__)

#: A wrapt wrapper: ``(wrapped, instance, args, kwargs) -> result``.
Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]
_W = TypeVar("_W", bound=Callable[..., Any])
_CHECKS_SUPPRESSION = "_otel_hicache_checks_suppression"
#: What a wrapt wrapper is an instance of (wrapt 2 splits ``BaseObjectProxy`` off ``ObjectProxy``).
_PROXY: type = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)


class Target(NamedTuple):
    """One engine attribute to wrap: ``module.owner.attribute`` (``owner`` empty for a module-level function)."""

    module: str
    owner: str
    attribute: str


class EngineInstrumentor(BaseInstrumentor):
    """Base of every engine adapter (see the module docstring). Subclasses set ``_engine`` and implement
    ``instrumentation_dependencies`` and ``_wrappers``; ``instrument(**kwargs)`` accepts ``tracer_provider``,
    ``meter_provider`` (the global providers by default) or ``telemetry`` (an existing sink to report through)."""

    #: The engine's name in log lines.
    _engine = "the engine"
    #: Pool names the engine reports besides :data:`otel_hicache.semconv.POOLS`.
    _extra_pools: Sequence[str] = ()

    _telemetry: HiCacheTelemetry | None = None
    _owns_telemetry = False
    _providers: tuple[Any, Any] = (None, None)
    _patch: _Patching | None = None
    _exit_registered = False

    @abstractmethod
    def instrumentation_dependencies(self) -> Collection[str]:
        """Requirement strings of the supported engine releases (from :mod:`otel_hicache.package`)."""

    @abstractmethod
    def _wrappers(self, telemetry: HiCacheTelemetry, options: Mapping[str, Any]) -> Iterable[tuple[Target, Wrapper]]:
        """Each target and the wrapper that goes on it, reporting through ``telemetry``; ``options`` are the
        keyword arguments ``instrument()`` was given."""

    @property
    def telemetry(self) -> HiCacheTelemetry | None:
        """The sink the wrappers report through (``None`` before the first ``instrument()``)."""
        return self._telemetry

    def instrument(self, **kwargs: Any) -> Any:
        """Patch the engine as its modules are imported; a missing or unsupported engine gives one warning (none
        under ``opentelemetry-instrument``, which passes ``skip_dep_check``, when the engine is simply absent)."""
        if not self.is_instrumented_by_opentelemetry:
            conflict = self._check_dependency_conflicts()
            if conflict is not None:
                if getattr(conflict, "found", None) is None and kwargs.get("skip_dep_check", False):
                    _log.debug("otel_hicache: %s is not installed; nothing to instrument.", self._engine)
                else:
                    self._warn_once(
                        "dependency",
                        "otel_hicache: %s is not instrumented: %s (this instrumentation supports %s).",
                        self._engine,
                        _describe_conflict(conflict),
                        ", ".join(self.instrumentation_dependencies()),
                    )
                return None
        kwargs["skip_dep_check"] = True
        return super().instrument(**kwargs)

    def _instrument(self, **kwargs: Any) -> None:
        self._install(self._wrappers(self._sink(kwargs), kwargs))

    def _install(self, wrappers: Iterable[tuple[Target, Wrapper]]) -> None:
        """Arm the post-import hooks that put ``wrappers`` on their targets (each guarded), and the exit flush."""
        patches = [
            (target, wrapper if _checks_suppression(wrapper) else _guarded(wrapper)) for target, wrapper in wrappers
        ]
        self._patch = _Patching(self, patches)
        if not self._exit_registered:
            # Spans wait in the telemetry queue for its worker; hand them to the SDK before the SDK's own exit
            # handlers (registered earlier, so run later) shut the providers down.
            atexit.register(self._flush)
            self._exit_registered = True

    def _uninstrument(self, **kwargs: Any) -> None:
        patch, self._patch = self._patch, None
        if patch is not None:
            patch.undo()
        self._flush()

    def _flush(self) -> None:
        try:  # never raise out of uninstrument or an exit handler
            if self._telemetry is not None:
                self._telemetry.flush()
        except Exception:
            _log.debug("otel_hicache: flushing the telemetry failed", exc_info=True)

    def _sink(self, kwargs: dict[str, Any]) -> HiCacheTelemetry:
        """The telemetry to report through; one per provider pair, kept across uninstrument/instrument cycles so
        re-instrumenting never registers the same instruments twice."""
        given = kwargs.get("telemetry")
        if given is not None:
            self._telemetry, self._owns_telemetry = given, False
            return given
        providers: tuple[trace.TracerProvider | None, metrics.MeterProvider | None] = (
            kwargs.get("tracer_provider"),
            kwargs.get("meter_provider"),
        )
        if self._telemetry is None or not self._owns_telemetry or providers != self._providers:
            self._telemetry = HiCacheTelemetry(*providers, extra_pools=self._extra_pools)
            self._owns_telemetry, self._providers = True, providers
        return self._telemetry

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        warned: set[str] = self.__dict__.setdefault("_warned", set())
        if key not in warned:
            warned.add(key)
            _log.warning(message, *args)


class _Patching:
    """One ``instrument()``'s patches: armed post-import hooks, and what they wrapped (to undo exactly that)."""

    def __init__(self, owner: EngineInstrumentor, patches: list[tuple[Target, Wrapper]]) -> None:
        self._owner = owner
        self._lock = threading.Lock()
        self._armed = True
        self._done: list[tuple[Any, str]] = []
        # by module; emptied by undo(): wrapt keeps a hook until its module is imported, and a hook must not keep
        # the wrappers (and the telemetry they report to) alive after uninstrument()
        self._pending: dict[str, list[tuple[Target, Wrapper]]] = {}
        for target, wrapper in patches:
            self._pending.setdefault(target.module, []).append((target, wrapper))
        for module in list(self._pending):
            # Fires at once where the module is already imported, else right after the engine imports it.
            wrapt.register_post_import_hook(self._hook(module), module)

    def _hook(self, module_name: str) -> Callable[[ModuleType], None]:
        def apply(module: ModuleType) -> None:
            missing = []
            with self._lock:
                if not self._armed:  # uninstrumented before the engine imported this module
                    return
                for target, wrapper in self._pending.pop(module_name, []):
                    holder = getattr(module, target.owner, None) if target.owner else module
                    if holder is None or target.attribute not in vars(holder):
                        missing.append(".".join(filter(None, (target.owner, target.attribute))))
                        continue
                    if _is_ours(vars(holder)[target.attribute]):
                        continue  # wrapped by an instrument() that was never undone: never wrap twice
                    wrapt.wrap_function_wrapper(holder, target.attribute, wrapper)
                    self._done.append((holder, target.attribute))
            if missing:
                self._owner._warn_once(
                    f"missing:{module.__name__}",
                    "otel_hicache: this %s lacks %s; those signals are not reported, the rest is instrumented.",
                    self._owner._engine,
                    ", ".join(missing),
                )

        return apply

    def undo(self) -> None:
        with self._lock:
            self._armed = False
            done, self._done = self._done, []
            self._pending.clear()
        for holder, attribute in reversed(done):
            if _is_ours(vars(holder).get(attribute)):
                unwrap(holder, attribute)


def _guarded(wrapper: Wrapper) -> Wrapper:
    """``wrapper``, except under ``suppress_instrumentation()``, where the engine's call passes straight through."""

    def guarded(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if is_instrumentation_enabled():
            return wrapper(wrapped, instance, args, kwargs)
        return wrapped(*args, **kwargs)

    return guarded


def checks_suppression(wrapper: _W) -> _W:
    """Mark ``wrapper`` as checking ``suppress_instrumentation()`` itself: it is installed without the guard.

    For wrappers whose bookkeeping must stay true under suppression while they report nothing there (SGLang's
    submission hooks mark an ack submitted there as not to be reported; its reset hook forgets queued acks either way).
    """
    wrapper.__dict__[_CHECKS_SUPPRESSION] = True
    return wrapper


def _checks_suppression(wrapper: Wrapper) -> bool:
    return bool(getattr(wrapper, _CHECKS_SUPPRESSION, False))  # a bound method reads its function's mark


def _is_ours(attribute: Any) -> bool:
    """Whether ``attribute`` is a wrapt wrapper installed by this package."""
    if not isinstance(attribute, _PROXY):
        return False
    return (getattr(getattr(attribute, "_self_wrapper", None), "__module__", "") or "").startswith("otel_hicache.")


def _describe_conflict(conflict: Any) -> str:
    found = getattr(conflict, "found", None)
    if found is None:
        return f"{conflict.required} is not installed"
    return f"found {found}, need {conflict.required}"
