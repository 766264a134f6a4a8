"""The host thread's pace within a round, which a long piece of work on it keeps to.

The host thread works in rounds (:mod:`otel_hicache._internal.host.worker`): slices of :data:`SLICE_NS` of work, each
followed by a pause that hands the GIL to the host's own threads; the build in hand when a slice ends is finished
first. A build that can outlast its slice by far - a capacity lookup of a prompt of thousands of pages, ~1 ms - calls
:func:`pace` between its pieces: on the host thread, once the round has held the GIL :data:`MAX_HOLD_NS`, it pauses as
the round would have and goes on in a new slice; on any other thread it does nothing.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

#: How long a host thread works before pausing so the scheduler thread can take the GIL (the build in hand is finished
#: first; a long one pauses within itself, :func:`pace`): no round holds the GIL for more than 200 us (``benchmarks
#: loop``).
SLICE_NS = 50_000
#: The longest a round holds the GIL before a long build in it pauses (``benchmarks loop``'s goal for a round). Not
#: the slice: every pause costs a wake and two hand-overs of the GIL, and a lookup that pauses every slice paid about
#: a round of this VM's CPU (~0.2 ms) per 50 us of its work.
MAX_HOLD_NS = 200_000
#: Lets go of the GIL and of the CPU for a moment (no timer: a wake costs tens of microseconds of CPU on a VM). It is no
#: hand-over: another CPU's thread waiting for the GIL often finds it taken again.
let_go: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))


class Schedule:
    """The host thread's slices in its current round: the slice ends at ``end_ns``; each slice is ``slice_ns`` long and
    followed by a pause of ``pause_s`` (0: only letting go of the GIL, while a flush waits). The worker sets them at
    each round's start."""

    __slots__ = ("end_ns", "pause_s", "slice_ns")

    def __init__(self) -> None:
        self.end_ns, self.slice_ns, self.pause_s = 0, SLICE_NS, 0.0

    def pace(self) -> None:
        """Within a build: once the round has held the GIL :data:`MAX_HOLD_NS`, pause, then a new slice."""
        if time.perf_counter_ns() >= self.end_ns - self.slice_ns + MAX_HOLD_NS:
            pause(self.pause_s)
            self.end_ns = time.perf_counter_ns() + self.slice_ns


def pause(seconds: float) -> None:
    """A round's pause: sleeps ``seconds``, or (0: while a flush waits) only lets go of the GIL."""
    if seconds:
        time.sleep(seconds)
    else:
        let_go()


_current = threading.local()


def keeping(schedule: Schedule | None) -> None:
    """The calling thread's builds keep to ``schedule`` from now on (None: to none): the host thread's, at its start."""
    _current.schedule = schedule


def pace() -> None:
    """Between two pieces of a long build: keeps to the calling thread's schedule (the host thread's), if it has one."""
    schedule: Schedule | None = getattr(_current, "schedule", None)
    if schedule is not None:
        schedule.pace()
