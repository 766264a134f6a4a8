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

Further modules an engine needs (SGLang's ``prefix.py`` and ``stat_loggers.py``) sit beside them, below ``hooks``.

**What the base does the same way for every engine:**

* ``instrument()`` checks the installed engine's version (also under ``skip_dep_check``, which
  ``opentelemetry-instrument`` passes: the wrappers rely on the supported shapes) and registers one post-import hook per
  target module (:func:`wrapt.register_post_import_hook`): it imports nothing of the engine (nor torch), each target is
  patched when the engine imports its module (at once if it already has), and a target module this release does not
  have is warned about at ``instrument()``;
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
import hashlib
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import stat
import sys
import tempfile
import threading
import weakref
from abc import abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Final, NamedTuple, TypeVar

import wrapt
from opentelemetry import metrics, trace
from opentelemetry.instrumentation.dependencies import DependencyConflict, get_dependency_conflicts
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.instrumentation.utils import is_instrumentation_enabled, unwrap

from otel_hicache import semconv as sc
from otel_hicache.records import PoolUsage
from otel_hicache.telemetry import HiCacheTelemetry

_log = logging.getLogger(__name__)

#: The modules of every adapter package (see the module docstring); the README's "Add an engine" lists the same.
ADAPTER_LAYOUT: Final[tuple[str, ...]] = ("__init__.py", "semconv.py", "hooks.py", "instrumentor.py", "plugin.py")
#: Entries an adapter remembers per engine object (submitted transfers, links) until the engine completes them;
#: beyond this the oldest are forgotten (:func:`trim`), so what the engine never completes cannot grow memory.
MAX_PENDING: Final = 4096
_DISABLED_ENV = "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"

#: A wrapt wrapper: ``(wrapped, instance, args, kwargs) -> result``.
Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]
_W = TypeVar("_W", bound=Callable[..., Any])
_CHECKS_SUPPRESSION = "_otel_hicache_checks_suppression"
#: What a wrapt wrapper is an instance of (wrapt 2 splits ``BaseObjectProxy`` off ``ObjectProxy``).
_PROXY: type = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)


class Target(NamedTuple):
    """One engine attribute to wrap: ``module.owner.attribute`` (``owner`` empty for a module-level function).

    ``params``: the leading parameters the wrapper reads (after ``self`` for a method), by name and position; a
    function whose parameters do not start so is left unpatched. Empty: the wrapper reads no argument.
    """

    module: str
    owner: str
    attribute: str
    params: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return ".".join(filter(None, (self.owner, self.attribute)))


class Ranks(NamedTuple):
    """A process's place in the engine's parallel layout, read when its telemetry is built."""

    #: ``tp`` / ``pp`` / ``dp`` ranks, on the Resource as ``hicache.rank.*``.
    ranks: Mapping[str, int] = {}
    #: Whether this process reports the instruments counted in tokens: true on one rank of each group whose ranks
    #: all see the same logical tokens (a sum over processes is then the logical token flow).
    token_metrics: bool = True
    #: Further Resource attributes (e.g. SGLang's attention-TP rank).
    resource: Mapping[str, Any] = {}


# ---------------------------------------------------------------------------------------------- warnings and failures
class _Once:
    """Which problems were warned about, in this process and in its process family.

    The family is the process group (an engine's launcher and the rank processes it spawns share it); its first
    process to warn about a problem leaves a marker file that its siblings see. Where no marker can be made (no
    ``/proc``, an unsafe directory) each process warns once.
    """

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.directory: Path = Path(tempfile.gettempdir()) / f"otel-hicache-{os.getuid()}"
        self._lock = threading.Lock()

    def first(self, key: str) -> bool:
        """Whether this is the first time ``key`` comes up in this process and in its family."""
        with self._lock:
            if key in self.seen:
                return False
            self.seen.add(key)
        try:
            return self._first_in_family(key)
        except Exception:  # no family marker here: once per process
            return True

    def _first_in_family(self, key: str) -> bool:
        family = _family()
        if family is None:
            return True
        directory = self.directory
        directory.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return True  # not ours alone: a marker there proves nothing
        digest = hashlib.sha256(f"{family[0]}\0{key}".encode()).hexdigest()[:24]
        try:
            os.close(os.open(directory / f"{family[1]}-{digest}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return False
        _forget_dead_families(directory)
        return True


def _family() -> tuple[str, str] | None:
    """(this process family's identity, its process group's marker prefix), or None where it cannot be told."""
    pgid = os.getpgrp()
    start = _start_time(pgid)
    if start is None:
        return None
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}:{pgid}:{start}", f"{pgid}.{start}"


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None if it is not running."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _forget_dead_families(directory: Path) -> None:
    """Remove the markers of process groups that are gone (a later group may reuse their id)."""
    for marker in directory.iterdir():
        pgid, _, rest = marker.name.partition(".")
        start = rest.partition("-")[0]
        if pgid.isdigit() and _start_time(int(pgid)) != start:
            marker.unlink(missing_ok=True)


ONCE: Final = _Once()


def warn_once(key: str, message: str, *args: Any, exc_info: bool = False) -> None:
    """Log ``message`` as a warning the first time ``key`` comes up in this process family; at debug level after."""
    if ONCE.first(key):
        _log.warning(message, *args, exc_info=exc_info)
    else:
        _log.debug(message, *args, exc_info=exc_info)


def hook_failed(engine: str, hook: str) -> None:
    """The failure rule: our code around ``engine``'s ``hook`` raised (call from its ``except`` block)."""
    warn_once(
        f"failed:{engine}:{hook}",
        "otel_hicache: our %s hook %s failed; %s runs unchanged, this hook's telemetry may be incomplete. Further "
        "failures of this hook are not logged.",
        engine,
        hook,
        engine,
        exc_info=True,
    )


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


# ---------------------------------------------------------------------------------------------- bookkeeping
def trim(table: dict[Any, Any]) -> None:
    """Forget ``table``'s oldest entries beyond :data:`MAX_PENDING`; another thread may take entries meanwhile."""
    while len(table) > MAX_PENDING:
        try:
            table.pop(next(iter(table)), None)
        except (RuntimeError, StopIteration):  # it took one meanwhile
            continue


class WeakPoolSource:
    """A pool-usage source (:meth:`~otel_hicache.telemetry.HiCacheTelemetry.add_pool_usage_source`) reading
    ``read(owner)`` at collection while the engine's ``owner`` lives, and removing itself once it is gone."""

    __slots__ = ("__weakref__", "_owner", "_read", "_telemetry")

    def __init__(self, owner: Any, read: Callable[[Any], Iterable[PoolUsage]], telemetry: HiCacheTelemetry) -> None:
        self._owner = weakref.ref(owner)
        self._read = read
        self._telemetry = telemetry

    def __call__(self) -> Iterable[PoolUsage]:
        owner = self._owner()
        if owner is None:
            self._telemetry.remove_pool_usage_source(self)
            return ()
        return self._read(owner)


class ProcessSink:
    """Where an adapter's records go: one :class:`~otel_hicache.telemetry.HiCacheTelemetry` for the process.

    Given ``telemetry``, that one. Otherwise it is built by the first :meth:`get` (the process's first event, when the
    engine knows the process's ranks): from the ``OTEL_*`` environment with :func:`otel_hicache.sdk.configure`
    (``from_environment``; its meter provider becomes the global one where none is installed, if ``install_globals``:
    the engine's own series routed over OTel need it; no tracer provider is installed, so that over OTLP the process
    runs no span processor of ours for nothing: an engine that traces requests installs its own first), or
    on ``providers`` (the global ones where ``None``). A build that fails is logged once and not retried: the process
    then reports nothing.
    """

    def __init__(
        self,
        engine: sc.Engine,
        *,
        telemetry: HiCacheTelemetry | None = None,
        extra_pools: Sequence[str] = (),
        providers: tuple[trace.TracerProvider | None, metrics.MeterProvider | None] = (None, None),
        from_environment: bool = False,
        install_globals: bool = False,
    ) -> None:
        self.engine = engine
        self.telemetry = telemetry
        self.setup: Any = None  # the TelemetrySetup that owns a telemetry built from the environment
        self._extra_pools = tuple(extra_pools)
        self._providers = providers
        self._from_environment = from_environment
        self._install_globals = install_globals
        self._done = telemetry is not None
        self._lock = threading.Lock()

    def get(self, ranks: Callable[[], Ranks] | None = None) -> HiCacheTelemetry | None:
        """The process's telemetry, built now (with ``ranks()``) if this is its first event."""
        if self._done:
            return self.telemetry
        with self._lock:
            if not self._done:
                try:
                    self.telemetry = self._build(Ranks() if ranks is None else ranks())
                except Exception as exc:
                    warn_once(
                        f"sink:{self.engine}",
                        "otel_hicache: %s is not reported in this process: %s",
                        self.engine.value,
                        exc,
                        exc_info=not isinstance(exc, ValueError),  # a ConfigError says it all in one line
                    )
                self._done = True
        return self.telemetry

    def _build(self, ranks: Ranks) -> HiCacheTelemetry:
        if not self._from_environment:
            return HiCacheTelemetry(*self._providers, extra_pools=self._extra_pools, token_metrics=ranks.token_metrics)
        from otel_hicache.sdk import configure

        self.setup = setup = configure(
            ranks=dict(ranks.ranks),
            resource_attributes={sc.RESOURCE_ENGINE: self.engine.value, **ranks.resource},
            extra_pools=self._extra_pools,
            token_metrics=ranks.token_metrics,
        )
        if self._install_globals and _unset(metrics.get_meter_provider()):
            metrics.set_meter_provider(setup.meter_provider)
        return setup.telemetry


class EngineHooks:
    """Base of an adapter's groups of wrappers (wrapt signature ``(wrapped, instance, args, kwargs)``): they report
    through the process's :class:`ProcessSink`, built at the first event with the engine's rank rule, ``ranks(*at)``
    (what the rank is read from, where the engine does not publish it per process)."""

    def __init__(self, sink: ProcessSink, ranks: Callable[..., Ranks] | None = None) -> None:
        self.sink = sink
        self._ranks = ranks

    @property
    def telemetry(self) -> HiCacheTelemetry | None:
        """The process's telemetry, once built."""
        return self.sink.telemetry

    def _sink(self, *at: Any) -> HiCacheTelemetry | None:
        """The process's telemetry, built now (with ``ranks(*at)``) if this is its first event; ``None`` when this
        process reports nothing."""
        ranks = self._ranks
        return self.sink.get(None if ranks is None else lambda: ranks(*at))


def _unset(provider: Any) -> bool:
    """Whether ``provider`` is OTel's placeholder (nothing installed yet)."""
    return type(provider).__name__ == "_ProxyMeterProvider"


# ---------------------------------------------------------------------------------------------- the instrumentor
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
    _patch: _Patching | None = None
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
            if conflict is not None:
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
        wrappers = self._patches(self._process_sink(kwargs), kwargs)
        patches = [(target, _safe(wrapper, self._engine, target.name)) for target, wrapper in wrappers]
        self._patch = _Patching(self, patches)
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
        self._flush()

    def _flush(self) -> None:
        try:  # never raise out of uninstrument or an exit handler
            telemetry = self.telemetry
            if telemetry is not None:
                telemetry.flush()
        except Exception:
            _log.debug("otel_hicache: flushing the telemetry failed", exc_info=True)


class _Patching:
    """One ``instrument()``'s patches: armed post-import hooks, and what they wrapped (to undo exactly that)."""

    def __init__(self, owner: EngineInstrumentor, patches: list[tuple[Target, Wrapper]]) -> None:
        self._engine = owner._engine
        self._lock = threading.Lock()
        self._armed = True
        self._done: list[tuple[Any, str]] = []
        # by module; emptied by undo(): wrapt keeps a hook until its module is imported, and a hook must not keep
        # the wrappers (and the telemetry they report to) alive after uninstrument()
        self._pending: dict[str, list[tuple[Target, Wrapper]]] = {}
        for target, wrapper in patches:
            self._pending.setdefault(target.module, []).append((target, wrapper))
        for module, targets in list(self._pending.items()):
            if _findable(module) is False:  # this release has no such module: its hook would never fire
                warn_once(
                    f"module:{self._engine}:{module}",
                    "otel_hicache: this %s has no module %s; %s are not reported, the rest is instrumented.",
                    self._engine,
                    module,
                    ", ".join(target.name for target, _ in targets),
                )
            # Fires at once where the module is already imported, else right after the engine imports it.
            wrapt.register_post_import_hook(self._hook(module), module)

    def _hook(self, module_name: str) -> Callable[[ModuleType], None]:
        def apply(module: ModuleType) -> None:
            try:  # never raise into the engine's import
                self._apply(module_name, module)
            except Exception:
                hook_failed(self._engine, f"patching {module_name}")

        return apply

    def _apply(self, module_name: str, module: ModuleType) -> None:
        refused = []
        with self._lock:
            if not self._armed:  # uninstrumented before the engine imported this module
                return
            for target, wrapper in self._pending.pop(module_name, []):
                holder = getattr(module, target.owner, None) if target.owner else module
                problem = _shape_problem(holder, target)
                if problem is not None:
                    refused.append(f"{target.name} ({problem})")
                    continue
                if _is_ours(vars(holder)[target.attribute]):
                    continue  # wrapped by an instrument() that was never undone: never wrap twice
                wrapt.wrap_function_wrapper(holder, target.attribute, wrapper)
                self._done.append((holder, target.attribute))
        if refused:
            warn_once(
                f"shape:{self._engine}:{module_name}:{refused}",
                "otel_hicache: in this %s, %s: left unpatched, so not reported: %s; the rest is instrumented.",
                self._engine,
                module_name,
                "; ".join(refused),
            )

    def undo(self) -> None:
        with self._lock:
            self._armed = False
            done, self._done = self._done, []
            self._pending.clear()
        for holder, attribute in reversed(done):
            if _is_ours(vars(holder).get(attribute)):
                unwrap(holder, attribute)


def _findable(module: str) -> bool | None:
    """Whether ``module`` can be imported, found on disk without importing anything; None where that cannot be told
    (the engine is not installed, or it is not loaded from directories)."""
    if module in sys.modules:
        return True
    top, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
        locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    except (ImportError, ValueError):
        return None
    if not locations or not all(os.path.isdir(location) for location in locations):
        return None
    parts = rest.split(".") if rest else []
    for depth, part in enumerate(parts):
        packages = [os.path.join(base, part) for base in locations if os.path.isdir(os.path.join(base, part))]
        if depth == len(parts) - 1:
            suffixes = importlib.machinery.all_suffixes()
            files = (os.path.join(base, part) + suffix for base in locations for suffix in suffixes)
            return bool(packages) or any(os.path.isfile(file) for file in files)
        if not packages:
            return False
        locations = packages  # a package, or a namespace package's portions
    return True


def _shape_problem(holder: Any, target: Target) -> str | None:
    """What keeps ``target`` from being the function its wrapper was written for, or None if it is."""
    if holder is None or (target.owner and not isinstance(holder, type)):
        return "missing" if holder is None else f"{target.owner} is not a class"
    attribute: Any = vars(holder).get(target.attribute)
    if attribute is None:
        return "missing"
    # another party's wrapt wrapper: the function it wraps (wrapping it again is fine)
    function = inspect.unwrap(attribute) if _is_proxy(attribute) else attribute
    if not inspect.isfunction(function):
        return f"a {type(attribute).__name__}, not a function"
    names = list(inspect.signature(function).parameters)[1 if target.owner else 0 :]
    if target.params and names[: len(target.params)] != list(target.params):
        return f"parameters ({', '.join(names)}), expected ({', '.join(target.params)}, ...)"
    return None


class _Call:
    """The engine's method as a wrapper sees it: called at most once; remembers its result or its exception."""

    __slots__ = ("called", "raised", "result", "wrapped")

    def __init__(self, wrapped: Callable[..., Any]) -> None:
        self.wrapped = wrapped
        self.called = False
        self.raised: BaseException | None = None
        self.result: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.called = True
        try:
            self.result = self.wrapped(*args, **kwargs)
        except BaseException as exc:
            self.raised = exc
            raise
        return self.result


def _safe(wrapper: Wrapper, engine: str, hook: str) -> Wrapper:
    """``wrapper`` under the failure rule, and passing straight through under ``suppress_instrumentation()`` unless
    it is marked :func:`checks_suppression`."""
    guarded = not _checks_suppression(wrapper)

    def safe(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if guarded and not is_instrumentation_enabled():
            return wrapped(*args, **kwargs)
        call = _Call(wrapped)
        try:
            return wrapper(call, instance, args, kwargs)
        except Exception as exc:
            if exc is call.raised:
                raise  # the engine's own exception, unchanged
            hook_failed(engine, hook)
        if not call.called:
            return wrapped(*args, **kwargs)
        if call.raised is not None:
            raise call.raised  # ours failed while the engine's exception was on its way: the engine's, as it was
        return call.result

    return safe


def checks_suppression(wrapper: _W) -> _W:
    """Mark ``wrapper`` as checking ``suppress_instrumentation()`` itself: it is installed without the guard.

    For wrappers whose bookkeeping must stay true under suppression while they report nothing there (SGLang's
    submission hooks mark an ack submitted there as not to be reported; its reset hook forgets queued acks either way).
    """
    wrapper.__dict__[_CHECKS_SUPPRESSION] = True
    return wrapper


def _checks_suppression(wrapper: Wrapper) -> bool:
    return bool(getattr(wrapper, _CHECKS_SUPPRESSION, False))  # a bound method reads its function's mark


def _is_proxy(attribute: Any) -> bool:
    return isinstance(attribute, _PROXY)


def _is_ours(attribute: Any) -> bool:
    """Whether ``attribute`` is a wrapt wrapper installed by this package."""
    if not _is_proxy(attribute):
        return False
    return (getattr(getattr(attribute, "_self_wrapper", None), "__module__", "") or "").startswith("otel_hicache.")
