"""Every at-fork hook of the package, in one module (as the OTel SDK keeps one ``_fork.py``).

After ``fork`` a child starts from zero as its own process - its own table, ring and exporter, its own
``process.pid`` - the parent stays exact, and no lock is inherited held. Registered once, when the host side is first
imported: before a fork, each live telemetry's worker holds what a child must not inherit mid-use
(:meth:`~otel_hicache._internal.host.worker.HostWorker.before_fork`, bounded); after it the parent lets go, and the
child resets each worker (:meth:`~otel_hicache._internal.host.worker.HostWorker.after_fork_in_child`) and forgets
its parent's finishing exporters (:func:`otel_hicache._internal.export.handle.forget_left_in_child`).
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Protocol

from otel_hicache._internal.export.handle import forget_left_in_child

_log = logging.getLogger("otel_hicache.telemetry")


class Forked(Protocol):
    """What lives across a fork (a telemetry's host-side worker)."""

    def before_fork(self) -> Any: ...  # what it holds, handed back to the two hooks below
    def after_fork_in_parent(self, held: Any) -> None: ...
    def after_fork_in_child(self) -> None: ...
    def settle(self, timeout_s: float = ..., *, hurry: bool = ...) -> Any: ...  # the flush at exit


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # weak: no instance leaks
_HELD: list[tuple[Forked, Any]] = []


def track(worker: Forked) -> None:
    _LIVE.add(worker)


def untrack(worker: Forked) -> None:
    _LIVE.discard(worker)


def tracked() -> list[Forked]:
    """The live workers now."""
    return list(_LIVE)


def _before_fork() -> None:
    _HELD[:] = [(worker, worker.before_fork()) for worker in list(_LIVE)]


def _after_fork_in_parent() -> None:
    for worker, held in _HELD:
        worker.after_fork_in_parent(held)
    _HELD.clear()


def _after_fork_in_child() -> None:
    held = list(_HELD)
    _HELD.clear()
    for worker, _ in held:
        try:
            worker.after_fork_in_child()
        except Exception:
            _log.debug("otel_hicache: resetting telemetry in a forked child failed", exc_info=True)
    forget_left_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
