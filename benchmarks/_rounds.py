"""The telemetry's host thread as the benchmarks see it: each of its rounds timed from the holder's side (and, asked
for, each record it builds, first in its round or later: a round's first record finds the caches cold), and what
one wake of a thread costs this machine before any work (the host thread wakes once per round), and a control thread
that keeps the host thread's schedule with no work of ours.

A measuring device of the telemetry host thread's rounds and wake cost, used by loop and sglang.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

from otel_hicache._internal.host.worker import HOST_THREAD_NAME, PAUSE_S, SLICE_NS


class RoundTimer:
    """Times each round of the telemetry's host thread from the holder's side: a round starts when the thread has
    the GIL back (its wait or pause returned) and ends when it pauses. Its CPU time is the work it did holding the
    GIL (collections it triggered included, and timed apart: a collection runs on whichever thread's allocation
    crosses the threshold); its wall time adds any time the OS preempted it meanwhile."""

    def __init__(self, telemetry: Any, builds: bool = False) -> None:
        self.rounds: list[tuple[int, int, int]] = []  # (CPU, wall, CPU in collections)
        #: with ``builds``: each record build's CPU by its builder's name, (first in its round, later in it)
        self.builds: dict[str, tuple[list[int], list[int]]] = {}
        self._first = [True]  # the next build is its round's first
        host = telemetry._host  # the telemetry's HostWorker: its thread calls host.work(state) each round
        work, rounds, first = host.work, self.rounds, self._first
        wall, cpu = time.perf_counter_ns, time.thread_time_ns
        collected = self._collected = [0, 0]  # host-thread CPU in collections so far, start of the current one

        def timed(state: dict[str, float]) -> float | None:
            if builds:  # queues made since the last round (outside the round's time)
                for queue in host.queues:
                    if not getattr(queue.build, "timed", False):
                        queue.build = self._timed_build(queue.build)
            first[0] = True
            w0, c0, g0 = wall(), cpu(), collected[0]
            try:
                return work(state)
            finally:
                rounds.append((cpu() - c0, wall() - w0, collected[0] - g0))

        host.work = timed
        gc.callbacks.append(self._on_collection)

    def _timed_build(self, build: Callable[[Any], Any]) -> Callable[[Any], Any]:
        name = getattr(build, "__qualname__", type(build).__name__)
        builds, first, cpu = self.builds, self._first, time.thread_time_ns

        def timed(entry: Any) -> Any:
            c0 = cpu()
            try:
                return build(entry)
            finally:
                spent = cpu() - c0
                builds.setdefault(name, ([], []))[0 if first[0] else 1].append(spent)
                first[0] = False

        timed.timed = True  # type: ignore[attr-defined]
        return timed

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if threading.current_thread().name != HOST_THREAD_NAME:
            return
        if phase == "start":
            self._collected[1] = time.thread_time_ns()
        else:
            self._collected[0] += time.thread_time_ns() - self._collected[1]

    def close(self) -> None:
        gc.callbacks.remove(self._on_collection)


def wake_cpu_ns(pause_s: float = PAUSE_S, wakes: int = 300) -> float:
    """The CPU one thread is charged per ``time.sleep(pause_s)`` here, the process otherwise idle: the kernel's part
    of a wake (timer, switch in and out), before the thread does anything. The host thread pays it once per round
    (and the wait for the GIL after it, when another thread holds it, once more)."""
    spent: list[float] = []

    def sleeper() -> None:
        c0 = time.thread_time_ns()
        for _ in range(wakes):
            time.sleep(pause_s)
        spent.append((time.thread_time_ns() - c0) / wakes)

    thread = threading.Thread(target=sleeper, name="bench-wake-floor")
    thread.start()
    thread.join()
    return spent[0]


class ScheduleControl:
    """A thread on the schedule the host thread keeps while work waits - it holds the GIL for a slice
    (:data:`SLICE_NS`, spinning: no work), then sleeps :data:`PAUSE_S` - and nothing else: what the wakes and GIL
    hand-overs of that schedule alone cost the threads beside it on this machine. Started per measured block."""

    def __init__(self) -> None:
        self.rounds = 0  # slices held so far, over every block
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="bench-schedule-control", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        clock, stop = time.perf_counter_ns, self._stop
        while not stop.is_set():
            end = clock() + SLICE_NS
            while clock() < end:
                pass
            self.rounds += 1
            time.sleep(PAUSE_S)
