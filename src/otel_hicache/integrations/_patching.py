"""Putting wrappers on an engine, and taking them off: the target table's entries (:class:`Target`), the shape check,
lazy patching as the engine's modules are imported (:class:`Patching`), the failure rule (:func:`guarded`): a
wrapper never raises into the engine and never changes the engine's exception, an engine object that calls the
engine's method past our wrapper (:class:`Skips`), and the switch that turns an untested release's adapter off
(:class:`AdapterSwitch`)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import inspect
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any, NamedTuple, TypeVar

import wrapt
from opentelemetry.context import get_current
from opentelemetry.instrumentation.utils import is_instrumentation_enabled

from otel_hicache.integrations._once import hook_failed, warn_once

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


class Patching:
    """One ``instrument()``'s patches: armed post-import hooks, and what they wrapped (to undo exactly that).
    ``engine``: the engine's name in log lines."""

    def __init__(self, engine: str, patches: list[tuple[Target, Wrapper]]) -> None:
        self._engine = engine
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
            wrapper = vars(holder).get(attribute)
            if _is_ours(wrapper):
                # what the class held (OTel's unwrap reads the attribute through the class: a classmethod's would be
                # put back bound to that class)
                setattr(holder, attribute, wrapper.__wrapped__)


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
    if target.owner and isinstance(function, classmethod):  # its parameters after ``cls``, as a method's after self
        function = function.__func__
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


class AdapterSwitch:
    """Whether an adapter's wrappers report in this process.

    A release above the tested range (:attr:`untested`, ``"name version"``) is instrumented by shape, and the
    adapter's self-check against the engine's own counters is what says the numbers still mean what they say: the
    first mismatch it finds in a process turns the adapter off there (:meth:`mismatched`), with one warning naming the
    instruments. Its wrappers then pass straight through and its pool readings stop; the mismatch stays counted in
    ``otel_hicache.engine.mismatch``. In the tested range a mismatch is counted and warned only (a bug of ours to
    report, while the rest of the adapter's telemetry still holds). A forked child inherits the switch (the same
    release, the same code); a new ``instrument()`` turns it on again.
    """

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.untested: str | None = None
        self.off = False

    def mismatched(self, names: list[str]) -> bool:
        """An engine check's report (``on_mismatch``): turn off if the release is untested; True, the check ends."""
        if self.untested is None:
            return False
        if not self.off:
            self.off = True
            warn_once(
                f"off:{self.engine}:{self.untested}",
                "otel_hicache: %s: %s disagrees with the engine's own counters on the untested %s; the %s "
                "instrumentation is off in this process (pin a tested release to keep it).",
                self.engine,
                ", ".join(sorted(names)),
                self.untested,
                self.engine,
            )
        return True


def guarded(wrapper: Wrapper, engine: str, hook: str, switch: AdapterSwitch) -> Wrapper:
    """``wrapper`` under the failure rule, passing straight through while ``switch`` is off, and under
    ``suppress_instrumentation()`` unless it is marked :func:`checks_suppression`."""
    guarded = not _checks_suppression(wrapper)

    def safe(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if switch.off or (guarded and suppressed()):
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


def suppressed() -> bool:
    """Whether the caller is inside ``suppress_instrumentation()``. That is a value of the current context: an empty
    one (an engine's threads, as a rule) holds none, and saying so takes two calls where
    ``is_instrumentation_enabled()`` makes seven (every wrapped call asks)."""
    return bool(get_current()) and not is_instrumentation_enabled()


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


class Skips:
    """Which of our wrappers of its class's methods ``instance`` skips, each switched by one write to the instance's
    ``__dict__`` (method lookup finds it before the class's wrapper), for wrappers with nothing to do for a while or
    for good: the instance calls the engine's method directly (a wrapped call costs an engine's step ~10 us cold, a
    skipped one a Python call). Only ``attributes`` whose class attribute is our wrapper (when the skip starts), and
    that the instance does not hold itself (another party's patch), are ever skipped; :meth:`end` (at
    ``uninstrument()``) skips none again. Holds ``instance`` weakly: the engine's object goes when the engine drops it.
    """

    __slots__ = ("_direct", "_instance")

    def __init__(self, instance: Any, attributes: Iterable[str]) -> None:
        self._direct: dict[str, tuple[Any, _Direct]] = {}  # attribute -> (our wrapper, what skips it)
        held = getattr(instance, "__dict__", None)
        try:
            self._instance = weakref.ref(instance)
        except TypeError:  # no weak reference to be had: nothing is skipped
            return
        if held is None:  # __slots__: nothing can be skipped
            return
        for attribute in attributes:
            current = held.get(attribute)
            if isinstance(current, _Direct):  # skipped under an earlier instrument(), never ended
                del held[attribute]
            elif current is not None:
                continue
            wrapper = _class_attribute(instance, attribute)
            if _is_ours(wrapper):
                self._direct[attribute] = (wrapper, _Direct(wrapper.__wrapped__, instance))

    def set(self, attribute: str, skipped: bool) -> None:
        entry = self._direct.get(attribute)
        instance = None if entry is None else self._instance()
        if entry is None or instance is None:
            return
        wrapper, direct = entry
        held = vars(instance)
        current = held.get(attribute)
        if skipped and current is None and _class_attribute(instance, attribute) is wrapper:
            held[attribute] = direct
        elif not skipped and current is direct:
            del held[attribute]

    def end(self) -> None:
        for attribute in self._direct:
            self.set(attribute, False)


def _class_attribute(instance: Any, attribute: str) -> Any:
    """What ``instance``'s class holds as ``attribute`` (no descriptor called), None if nothing."""
    for klass in type(instance).__mro__:
        if attribute in vars(klass):
            return vars(klass)[attribute]
    return None


class _Direct:
    """``function`` called as a method of ``owner``, holding ``owner`` weakly: a bound method kept on its own instance
    would be a reference cycle, keeping the engine's object (and its memory) alive until a garbage collection."""

    __slots__ = ("_function", "_owner")

    def __init__(self, function: Callable[..., Any], owner: Any) -> None:
        self._function = function
        self._owner = weakref.ref(owner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._function(self._owner(), *args, **kwargs)
