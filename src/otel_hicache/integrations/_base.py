"""What every engine adapter shares, so that each adapter holds only what its engine spells.

**Layout.** An adapter is the package ``otel_hicache/integrations/<engine>/`` with these modules
(:data:`ADAPTER_LAYOUT`), imported in one direction only, ``plugin -> instrumentor -> hooks -> semconv``:

* ``__init__.py``: the user manual (its docstring) and the public names;
* ``semconv.py``: the names only this engine spells (its entry-point name, pool names, its series and ours);
* ``hooks.py``: the wrapt wrappers (groups of them on :class:`EngineHooks`), bound to a :class:`ProcessSink`; they
  read only what the engine computed;
* ``instrumentor.py``: the :class:`EngineInstrumentor` subclass: the target table (each :class:`Target` with the
  shape its wrapper relies on), the supported releases (from :mod:`otel_hicache.package`) and the rank rule;
* ``plugin.py``: the engine's own plugin entry point, one call of :func:`load_plugin`.

Further modules an engine needs (SGLang's ack queues, self-check, eviction bookkeeping, ...) sit beside them, below
``hooks``.

**This module** is what adapters import (its ``__all__``) and the instrumentor base; the parts live beside it, one
job each: ``_once.py`` (one warning per problem per process family, the failure rule's log line), ``_sink.py`` (the
per-process sink, ranks, :class:`EngineHooks`, bounded bookkeeping) and ``_patching.py`` (targets, the shape check,
lazy patching, the failure rule, :class:`Skips`).

**What the base does the same way for every engine:**

* ``instrument()`` checks the installed engine's version (also under ``skip_dep_check``, which
  ``opentelemetry-instrument`` passes: the wrappers rely on the supported shapes): a release in the tested range is
  instrumented; one above it is instrumented untested, with one info line naming it (:func:`newer_than_tested`: the
  shape check below decides target by target, and the first mismatch the adapter's self-check against the engine's
  own counters finds in a process turns the adapter off there, with one warning: :class:`AdapterSwitch`); one below
  it, or none, is refused with one warning. It then registers one post-import hook per target module
  (:func:`wrapt.register_post_import_hook`): it imports nothing of the engine (nor torch), each target is patched when
  the engine imports its module (at once if it already has), and a target module this release does not have is
  warned about at ``instrument()``;
* **shape check**: a target that is missing, is not a plain function (a property, a C function, a class), or whose
  leading parameters are not the ones its wrapper reads (:attr:`Target.params`) is left unpatched, with one warning
  naming it; the rest is instrumented;
* **failure rule**: a wrapper never raises into the engine and never changes the engine's exception. If the wrapper's
  own code fails, the engine's method still runs exactly once and its result (or its exception) is what the caller
  gets; the failure is logged once (:func:`hook_failed`);
* every wrapper passes straight through under :func:`opentelemetry.instrumentation.utils.suppress_instrumentation`
  (a wrapper marked :func:`checks_suppression` decides that itself);
* **one lazy sink per process** (:class:`ProcessSink`): the :class:`~otel_hicache.telemetry.HiCacheTelemetry` is built
  at the process's first event, with the ranks the adapter reads then (:class:`Ranks`): the instruments counted in
  tokens are reported by one rank per group only (``token_metrics``), bytes, time and spans by every rank;
* **one warning per problem per process family** (:func:`warn_once`): an engine runs one process per rank, and the
  first process of the family (its process group) to meet a problem says so; its siblings log it at debug level;
* ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` (a name, or ``*``) is read by :func:`disabled`, for both the plugin and the
  ``opentelemetry-instrument`` route;
* bounded bookkeeping (:data:`MAX_PENDING`, :func:`trim`), pool-usage sources that hold the engine's object weakly
  (:class:`WeakPoolSource`);
* ``uninstrument()`` restores exactly what was patched (with the contrib
  :func:`~opentelemetry.instrumentation.utils.unwrap`), disarms the hooks that have not fired yet and hands queued
  spans to the SDK; at interpreter exit spans still queued are handed to the SDK before it shuts down.
"""

from __future__ import annotations

import atexit
import logging
import os
from abc import abstractmethod
from collections.abc import Collection, Iterable, Mapping, Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version
from typing import Any, Final

from opentelemetry.instrumentation.dependencies import DependencyConflict, get_dependency_conflicts
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from otel_hicache import semconv as sc
from otel_hicache.integrations._once import ONCE, hook_failed, inform_once, warn_once
from otel_hicache.integrations._patching import (
    AdapterSwitch,
    Patching,
    Skips,
    Target,
    Wrapper,
    checks_suppression,
    guarded,
    suppressed,
)
from otel_hicache.integrations._sink import (
    MAX_PENDING,
    AdmissionHooks,
    CapacityFeeder,
    EngineHooks,
    ProcessSink,
    Ranks,
    WeakPoolSource,
    trim,
)
from otel_hicache.telemetry import HiCacheTelemetry

__all__ = [
    "ADAPTER_LAYOUT",
    "MAX_PENDING",
    "ONCE",
    "AdapterSwitch",
    "AdmissionHooks",
    "CapacityFeeder",
    "EngineHooks",
    "EngineInstrumentor",
    "ProcessSink",
    "Ranks",
    "Skips",
    "Target",
    "WeakPoolSource",
    "Wrapper",
    "checks_suppression",
    "disabled",
    "hook_failed",
    "inform_once",
    "load_plugin",
    "suppressed",
    "trim",
    "warn_once",
]

_log = logging.getLogger(__name__)

#: The modules of every adapter package (see the module docstring); the README's "Add an engine" lists the same.
ADAPTER_LAYOUT: Final[tuple[str, ...]] = ("__init__.py", "semconv.py", "hooks.py", "instrumentor.py", "plugin.py")
_DISABLED_ENV = "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"


def disabled(entry_point: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` names ``entry_point`` (or is ``*``)."""
    raw = (os.environ if env is None else env).get(_DISABLED_ENV, "")
    names = {name.strip() for name in raw.split(",")}
    return entry_point in names or "*" in names


def load_plugin(instrumentor: type[EngineInstrumentor], entry_point: str, **kwargs: Any) -> None:
    """An engine's plugin entry point: instrument this process lazily, unless ``entry_point`` is disabled or the
    process is instrumented already (``opentelemetry-instrument``, or in code). Never raises into the engine."""
    try:
        if disabled(entry_point):
            return
        adapter = instrumentor()  # a singleton: the instance opentelemetry-instrument made, if any
        if not adapter.is_instrumented_by_opentelemetry:
            adapter.instrument(**kwargs)
    except Exception:
        hook_failed(instrumentor._engine, "plugin")


def newer_than_tested(requirements: Iterable[str]) -> str | None:
    """``"name version"`` of the first installed distribution that one of ``requirements`` names at a release above
    its range (its lower bounds hold, an upper one does not), or ``None``. Such a release is admitted untested: each
    target is shape-checked as it is patched. A release below the range, or one excluded otherwise, is not."""
    for line in requirements:
        try:
            requirement = Requirement(line)
            found = Version(distribution_version(requirement.name))
        except (InvalidRequirement, InvalidVersion, PackageNotFoundError):
            continue
        lower = SpecifierSet(",".join(str(s) for s in requirement.specifier if s.operator in (">=", ">")))
        if not requirement.specifier.contains(found, prereleases=True) and lower.contains(found, prereleases=True):
            return f"{requirement.name} {found}"
    return None


class EngineInstrumentor(BaseInstrumentor):
    """Base of every engine adapter (see the module docstring). Subclasses set ``_engine``, ``_engine_id`` and
    implement ``instrumentation_dependencies`` and ``_patches``.

    ``instrument(**kwargs)`` accepts ``telemetry`` (an existing sink to report through), ``tracer_provider`` /
    ``meter_provider`` (a telemetry on them, built per process at its first event with the rank rule), or
    ``from_environment`` (each process configures its own from the ``OTEL_*`` environment; the adapter's default is
    ``_from_environment``, used where no provider is given).
    """

    #: The engine's name in log lines.
    _engine = "the engine"
    #: The engine's ``hicache.engine`` Resource value.
    _engine_id: sc.Engine = sc.Engine.REFERENCE
    #: Pool names the engine reports besides :data:`otel_hicache.semconv.POOLS`.
    _extra_pools: Sequence[str] = ()
    #: Whether a process configures its telemetry from the environment when no provider is given.
    _from_environment = False
    #: Whether a telemetry configured from the environment installs its providers as the global ones (where none is).
    _install_globals = False

    _sink: ProcessSink | None = None
    _sink_key: tuple[Any, ...] = ()
    _patch: Patching | None = None
    _hooks: tuple[EngineHooks, ...] = ()  # the groups of wrappers patched (detached at uninstrument)
    _untested: str | None = None  # "name version" of a release above the tested range, instrumented by shape
    _exit_registered = False

    @abstractmethod
    def instrumentation_dependencies(self) -> Collection[str]:
        """Requirement strings of the supported engine releases (from :mod:`otel_hicache.package`); any one of them
        installed at a supported version will do."""

    @abstractmethod
    def _patches(self, sink: ProcessSink, options: Mapping[str, Any]) -> Iterable[tuple[Target, Wrapper]]:
        """Each target and the wrapper that goes on it, reporting through ``sink``; ``options`` are the keyword
        arguments ``instrument()`` was given."""

    @property
    def telemetry(self) -> HiCacheTelemetry | None:
        """The sink the wrappers report through (``None`` until built: see :class:`ProcessSink`)."""
        return None if self._sink is None else self._sink.telemetry

    def _check_dependency_conflicts(self) -> DependencyConflict | None:
        return get_dependency_conflicts((), self.instrumentation_dependencies())

    def instrument(self, **kwargs: Any) -> Any:
        """Patch the engine as its modules are imported; a missing or unsupported engine gives one warning (none
        under ``opentelemetry-instrument``, which passes ``skip_dep_check``, when the engine is simply absent)."""
        if not self.is_instrumented_by_opentelemetry:
            conflict = self._check_dependency_conflicts()
            untested = None if conflict is None else newer_than_tested(self.instrumentation_dependencies())
            self._untested = untested
            if untested is not None:
                # the shape check decides, target by target; the self-check says where the numbers disagree
                message = "otel_hicache: %s: %s is newer than the tested %s; instrumenting it untested, by shape."
                args = (self._engine, untested, ", ".join(self.instrumentation_dependencies()))
                inform_once(f"untested:{self._engine}:{untested}", message, *args)
            elif conflict is not None:
                found = conflict.found or ", ".join(conflict.found_any or ())
                if not found and kwargs.get("skip_dep_check", False):
                    _log.debug("otel_hicache: %s is not installed; nothing to instrument.", self._engine)
                else:
                    wanted = ", ".join(self.instrumentation_dependencies())
                    warn_once(
                        f"dependency:{self._engine}:{found}",
                        "otel_hicache: %s is not instrumented: %s (this instrumentation supports %s).",
                        self._engine,
                        f"found {found}, need {wanted}" if found else f"{wanted} is not installed",
                        wanted,
                    )
                return None
        kwargs["skip_dep_check"] = True
        return super().instrument(**kwargs)

    def _instrument(self, **kwargs: Any) -> None:
        """Arm the post-import hooks that put the adapter's wrappers on their targets (each under the failure rule),
        and the exit flush."""
        sink = self._process_sink(kwargs)
        sink.switch.untested, sink.switch.off = self._untested, False  # instrument() again: on again
        wrappers = list(self._patches(sink, kwargs))
        hooks = (getattr(wrapper, "__self__", None) for _, wrapper in wrappers)
        self._hooks = tuple({id(h): h for h in hooks if isinstance(h, EngineHooks)}.values())
        patches = [(target, guarded(wrapper, self._engine, target.name, sink.switch)) for target, wrapper in wrappers]
        self._patch = Patching(self._engine, patches)
        if not self._exit_registered:
            # Spans wait in the telemetry queue for its worker; hand them to the SDK before the SDK's own exit
            # handlers (registered earlier, so run later) shut the providers down.
            atexit.register(self._flush)
            self._exit_registered = True

    def _process_sink(self, kwargs: Mapping[str, Any]) -> ProcessSink:
        """The sink for these arguments; kept across uninstrument/instrument cycles with the same arguments, so a
        process never configures twice nor registers the same instruments twice."""
        given = kwargs.get("telemetry")
        providers = (kwargs.get("tracer_provider"), kwargs.get("meter_provider"))
        from_environment = (
            given is None and providers == (None, None) and bool(kwargs.get("from_environment", self._from_environment))
        )
        key = (given, from_environment, *providers)
        if self._sink is None or self._sink_key != key:
            if self._sink is not None:
                self._sink.release()
            self._sink = ProcessSink(
                self._engine_id,
                telemetry=given,
                extra_pools=self._extra_pools,
                providers=providers,
                from_environment=from_environment,
                install_globals=self._install_globals,
            )
            self._sink_key = key
        return self._sink

    def _uninstrument(self, **kwargs: Any) -> None:
        patch, self._patch = self._patch, None
        if patch is not None:
            patch.undo()
        hooks, self._hooks = self._hooks, ()
        for group in hooks:  # after the undo: no wrapper that starts now changes an engine object again
            try:
                group.detach()
            except Exception:  # an engine thread changing what a group holds meanwhile: never raise out of here
                _log.debug("otel_hicache: detaching %s failed", type(group).__name__, exc_info=True)
        self._flush()

    def _flush(self) -> None:
        try:  # never raise out of uninstrument or an exit handler
            telemetry = self.telemetry
            if telemetry is not None:
                telemetry.flush()
        except Exception:
            _log.debug("otel_hicache: flushing the telemetry failed", exc_info=True)
