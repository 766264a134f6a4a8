"""The host-side worker of a telemetry: its host thread, what runs on it, and the telemetry's life across fork.

One thread per telemetry (:data:`HOST_THREAD_NAME`), started by the first record (or deferred queue, pool source,
engine check; over OTLP by the constructor). Each round (:meth:`HostWorker.work`) it

* reads the pool-usage sources and runs the engine checks about once a second (:data:`POOL_INTERVAL_S`);
* builds deferred records, each queue oldest first, for the rest of a slice of :data:`SLICE_NS`
  (:data:`BACKLOG_SLICE_NS` with a backlog), then pauses :data:`PAUSE_S` if more waits (:data:`BACKLOG_PAUSE_S`); a
  build that outlasts its slice (a capacity lookup of a long prompt) pauses within itself the same way
  (:mod:`~otel_hicache._internal.host.pacing`);
* tends the consumer about once a second (:data:`TEND_INTERVAL_S`): moves the counters into shared memory once it can
  be had, relays the export process's log lines, replaces an exporter that died;
* in-process, turns the ring's records into spans and points in slices, at least every flush interval.

It ticks every :data:`DEFERRED_TICK_S` while it has deferred records to build, and always in-process, where it drains
the ring; every :data:`PATIENT_TICK_S` for patient queues alone (capacity lookups, and counts read only at collection:
vLLM's engine core); else every :data:`TEND_INTERVAL_S` (pool sources alone need no faster tick). It pauses
:data:`PAUSE_S` after a busy round, so the scheduler thread gets the GIL back. Reads of the counters wait (bounded) for
what is queued to be built (:meth:`HostWorker.settle`); while a flush or a shutdown waits, the thread builds without
pausing between its slices (it only lets go of the GIL): the waiting thread needs nothing else, and every pause costs a
wake. ``fork``: the child starts from zero as its own process (its own table, ring, thread and exporter); the parent
stays exact; no lock is inherited held. What cannot be had (a thread, shared memory) never raises into the caller: it is
logged once and tried again.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec

from otel_hicache._internal.host import fork, pacing, validation
from otel_hicache._internal.host.consumers import Consumer
from otel_hicache._internal.host.counting import Tally
from otel_hicache._internal.host.deferred import Build, DeferredQueue
from otel_hicache._internal.host.pacing import SLICE_NS
from otel_hicache._internal.host.validation import Rejected
from otel_hicache._internal.shared.accumulation import CapacityReading
from otel_hicache._internal.shared.channel import Channel
from otel_hicache._internal.shared.ids import ARENA_BYTES, IdRing, TierRow
from otel_hicache.capacity import CapacityFeed
from otel_hicache.records import PoolUsage, TransferRecord
from otel_hicache.semconv import OTHER_POOL, Problem, RecordKind, Tier

#: The pause after a busy round: the scheduler thread runs undisturbed at least this long. Every round costs the
#: scheduler thread beyond the round itself (a hand-over of the GIL, caches it finds cold), so fewer rounds cost it
#: less: on SGLang's real path, 1 ms pauses cost its scheduler thread about half what 0.2 ms pauses did per transfer
#: (``benchmarks sglang``). No pause at all (only letting go of the GIL between slices, as a flush does) halved the
#: host thread's CPU there, but a tick's work then ran as one burst that a waiting scheduler thread kept losing the GIL
#: to (it wakes after the holder has taken the GIL back): ``benchmarks loop`` read the step p99 +43 % at 1,000
#: transfers/s against +2 to +3 %. A 0.1 ms pause kept half of that (+10 %) for little of the CPU gain.
PAUSE_S = 0.001
#: Deferred records waiting, as a share of ``max_queue``, past which a round works BACKLOG_SLICE_NS and pauses
#: BACKLOG_PAUSE_S: a scheduler thread that seldom releases the GIL hands it over once per switch interval (5 ms), and
#: shedding is worse than longer, more frequent rounds.
BACKLOG_SHARE = 0.25
BACKLOG_SLICE_NS = 100_000
BACKLOG_PAUSE_S = 0.0002
#: The most entries a batched queue's build gets at once: one build stays within a slice (summing a prefill batch's
#: split costs ~1 us an entry, ~4 us one that must be checked alone), however many wait after a stall.
BATCH_ENTRIES = 16
#: How often the host thread looks for deferred records to build. Every wake costs the scheduler thread (a hand-over
#: of the GIL, caches both threads find cold), so fewer wakes with more records each cost it less; what a SIGKILL
#: loses is about one tick of consumed acks, and those of the tick before still being built (``benchmarks sigkill``).
DEFERRED_TICK_S = 0.05
#: How often it looks at patient queues when no deferred record needs the faster tick: capacity lookups, which only
#: feed an estimate published once a second (POOL_INTERVAL_S), and records that only add to counts read at collection
#: (which waits for them to be built). Four wakes a second instead of twenty keep a queue short (a quarter second of
#: admissions) and leave the engine's threads alone; a SIGKILL loses about one tick of those counts.
PATIENT_TICK_S = 0.25
#: The host thread's name (what a profiler or py-spy shows).
HOST_THREAD_NAME = "otel-hicache-host"
#: How often the host thread reads the pool-usage sources.
POOL_INTERVAL_S = 1.0
#: How long a read of the counters (snapshot, collection) waits for deferred records to be counted.
SETTLE_TIMEOUT_S = 1.0
#: How often the host thread tends the export process (relays its log lines, replaces it if it died), and how long
#: the host thread sleeps when it has nothing else to do.
TEND_INTERVAL_S = 1.0
#: How long after a failed start (no thread could be had) the next record tries again.
RETRY_START_S = 1.0

PoolSource = Callable[[], Iterable[PoolUsage]]
#: An engine self-check: the names of our instruments whose totals disagree with the engine's own counters.
EngineCheck = Callable[[], Iterable[str]]
#: Told what an engine check reported, after it is counted; True ends that check (an adapter that turned itself off).
MismatchHandler = Callable[[list[str]], bool]
_P = ParamSpec("_P")
_log = logging.getLogger("otel_hicache.telemetry")


class HostWorker:
    """The host thread of one telemetry and everything it serves (see the module docstring).

    ``count``: how a deferred record that was built is counted (the telemetry's ``record_transfer``, held weakly);
    ``shared``: the consumer is another process, which maps the channel (else it is private memory).
    :meth:`attach` hands it the consumer, built on :attr:`channel`.
    """

    def __init__(
        self,
        tally: Tally,
        count: Callable[[TransferRecord], None],
        *,
        max_queue: int,
        interval_s: float,
        shared: bool,
    ) -> None:
        self._tally = tally
        self._count = count
        self._max_queue = max_queue
        self._interval_s = interval_s
        self.shared = shared
        self.capacity: CapacityFeed | None = None  # the process's capacity estimator, when a producer feeds one
        self._described: tuple[IdRing, int] | None = None  # the id ring and feed generation last described in it
        self.schedule = pacing.Schedule()  # the host thread's slices in its round, which a long build keeps to
        self.pool_sources: list[PoolSource] = []
        self.engine_checks: list[tuple[EngineCheck, MismatchHandler | None]] = []
        self._checking = threading.Lock()  # one run of the engine checks at a time; a check may call snapshot()
        self._pools_reported = False  # the gauges hold a reading (cleared once the last source is gone)
        # record_transfer_deferred's queue first, then the producers' own (new_queue())
        self.deferred = DeferredQueue(_build_deferred_call, max_queue)
        self.queues: list[DeferredQueue] = [self.deferred]
        self._building = False
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()  # one thread starts the consumer; the others go on
        self._wake = threading.Event()
        self._hurried = 0  # threads in a flush or shutdown waiting for the deferred records: no pauses meanwhile
        self._hurry_lock = threading.Lock()
        self._drained = threading.Event()  # set by a hurried round that left no deferred record unbuilt
        self.started = False  # consumer tended and host thread running
        self._next_start_attempt = 0.0
        # how often the host thread wakes: DEFERRED_TICK_S in-process or once deferred records come, PATIENT_TICK_S
        # for patient queues alone, else TEND_INTERVAL_S
        self._tick_s = DEFERRED_TICK_S if not shared else TEND_INTERVAL_S
        self.fast_ready = False  # ... it ticks every DEFERRED_TICK_S, and it runs
        self.consumer: Consumer
        tally.bind(self._new_channel())

    @property
    def channel(self) -> Channel:
        return self._tally.channel

    @property
    def closed(self) -> bool:
        return self._tally.closed

    def attach(self, consumer: Consumer) -> None:
        """Serve ``consumer`` (built on :attr:`channel`); one in another process is started at once."""
        self.consumer = consumer
        fork.track(self)
        if self.shared:
            self.start()

    # ------------------------------------------------------------------ what producers hand over
    def new_queue(
        self, build: Build, kind: RecordKind = RecordKind.TRANSFER, batched: bool = False, patient: bool = False
    ) -> DeferredQueue:
        queue = DeferredQueue(build, self._max_queue, kind, batched)
        self.queues.append(queue)
        if patient:
            self._want_tick(PATIENT_TICK_S)
        else:
            self.want_fast()
        return queue

    def add_pool_source(self, source: PoolSource) -> None:
        self.pool_sources.append(source)
        self.start()  # read every POOL_INTERVAL_S: no faster tick (vLLM's engine core would wake 20 times a second)

    def add_engine_check(self, check: EngineCheck, on_mismatch: MismatchHandler | None = None) -> None:
        self.engine_checks.append((check, on_mismatch))
        if self._thread is None:
            self._start_thread()

    def remove_pool_source(self, source: PoolSource) -> None:
        if source in self.pool_sources:
            self.pool_sources.remove(source)

    def remove_engine_check(self, check: EngineCheck) -> None:
        self.engine_checks = [entry for entry in self.engine_checks if entry[0] is not check]

    # ------------------------------------------------------------------ starting
    def start(self) -> bool:
        """Start the consumer (the export process: synchronously) and the host thread that looks after it; True once
        both run. A failure is logged once and retried at most once a second (the export process retries its own
        launches with back-off), never raised into the caller; a thread that is starting them meanwhile is not
        waited for."""
        now = time.monotonic()
        if self.started or self.closed or now < self._next_start_attempt:
            return self.started
        if not self._starting.acquire(blocking=False):
            return False
        try:
            if not self.started:
                self.tend(now=True)
                if self._start_thread():
                    self.started = True
                else:
                    self._next_start_attempt = now + RETRY_START_S
            return self.started
        finally:
            self._starting.release()

    def want_fast(self) -> None:
        """Deferred records: the host thread ticks every DEFERRED_TICK_S from now on."""
        self.fast_ready = self._want_tick(DEFERRED_TICK_S)

    def _want_tick(self, tick_s: float) -> bool:
        """The host thread ticks at least every ``tick_s`` from now on; True once it runs (woken to take it up)."""
        self._tick_s = min(self._tick_s, tick_s)
        if not self.start():
            return False
        self._wake.set()
        return True

    def _start_thread(self) -> bool:
        with self._tally.lock:
            if self._thread is not None or self.closed:
                return self._thread is not None
            # The thread holds the worker weakly: a telemetry dropped without shutdown() is freed, thread and all.
            thread = self._thread = threading.Thread(
                target=_run, args=(weakref.ref(self), self._wake), daemon=True, name=HOST_THREAD_NAME
            )
        try:
            thread.start()
        except RuntimeError as exc:  # can't start new thread (RLIMIT_NPROC, ...)
            with self._tally.lock:
                self._thread = None
            self._tally.warn_export("no_thread", f"no host thread can be started now ({exc}); retrying")
            return False
        return True

    # ------------------------------------------------------------------ the host thread's round
    def work(self, state: dict[str, float]) -> float | None:
        """One round of the host thread: builds deferred records, reads pool sources, and (in-process) emits spans,
        each in slices of at most SLICE_NS (BACKLOG_SLICE_NS with a backlog). When more is waiting, how long the
        thread pauses before it comes back (PAUSE_S, BACKLOG_PAUSE_S with a backlog); else None."""
        started = time.perf_counter_ns()
        busy = False
        now = time.monotonic()
        if (self.pool_sources or self.engine_checks or self.capacity) and now >= state["pools"]:
            state["pools"] = now + POOL_INTERVAL_S
            self.read_pools()
            self.publish_capacity()
            self.run_engine_checks()
            busy = True
        backlog = self.waiting() > self._max_queue * BACKLOG_SHARE
        slice_ns, pause_s = (BACKLOG_SLICE_NS, BACKLOG_PAUSE_S) if backlog else (SLICE_NS, PAUSE_S)
        # the once-a-second work above is part of this round's slice: a round stays within it
        schedule = self.schedule
        schedule.end_ns, schedule.slice_ns, schedule.pause_s = started + slice_ns, slice_ns, pause_s
        if self._hurried:
            schedule.pause_s = 0.0
        more = self._build_deferred(schedule)
        if self._hurried:  # a flush waits: only let go of the GIL between slices, and say when all is built
            pause_s = 0.0
            if not more:
                self._drained.set()
        busy = more or busy
        if self.shared:  # the export process drains the ring itself
            if now >= state["tend"]:
                state["tend"] = now + TEND_INTERVAL_S
                self.tend()
        elif self.started and (now >= state["drain"] or self.channel.pending() > self._max_queue // 2):
            if not self.consumer.drain(SLICE_NS):
                state["drain"] = now + self._interval_s  # drained: back in one flush interval
            busy = True
        return pause_s if busy else None

    def waiting(self) -> int:
        """Deferred entries queued and not yet taken by the host thread."""
        return sum(len(queue) for queue in self.queues)

    def tick_s(self) -> float:
        return min(self._interval_s, DEFERRED_TICK_S) if self._tick_s <= DEFERRED_TICK_S else self._tick_s

    def _build_deferred(self, schedule: pacing.Schedule) -> bool:
        """Build and count deferred records, each queue oldest first (a batched one: up to BATCH_ENTRIES in one
        build), until ``schedule``'s slice ends (a long build pauses within itself as the round would,
        :func:`~.pacing.pace`). True if some remain. Only the host thread takes from the queues."""
        for queue in list(self.queues):
            while queue:
                self._building = True
                try:
                    try:
                        shed, taken = queue.take_batch(BATCH_ENTRIES) if queue.batched else queue.take()
                    except IndexError:  # emptied by a discard() (a close that gave up waiting for this thread)
                        break
                    if shed:
                        self._tally.shed(shed, "deferred records shed", queue.kind)
                    try:
                        record = queue.build(taken)
                    except Exception:  # a batched build raises before it reports any: each entry counted
                        self._tally.reject(queue.kind, Problem.BUILD_FAILED, len(taken) if queue.batched else 1)
                        continue
                    if record is not None:
                        self._count(record)  # not a record: refused as malformed
                finally:
                    self._building = False
                if time.perf_counter_ns() >= schedule.end_ns:
                    return any(self.queues)
            if queue.closed and not queue:
                self.queues.remove(queue)
        return False

    def read_pools(self) -> None:
        """Read every pool source (outside the lock: a source may be slow) and replace the gauges at once."""
        if not self.pool_sources and not self._pools_reported:
            return
        readings: dict[tuple[str, str], tuple[int, int]] = {}
        refused: list[Problem] = []
        corrections: list[Problem] = []
        for source in list(self.pool_sources):
            try:
                usages = validation.pool_usages(source(), self._tally.known, corrections)
            except Exception as exc:
                refused.append(exc.problem if isinstance(exc, Rejected) else Problem.SOURCE_FAILED)
                continue
            for usage in usages:
                used, limit = readings.get((usage.tier.value, usage.pool), (0, 0))
                readings[(usage.tier.value, usage.pool)] = (used + usage.used, limit + usage.limit)
        self._pools_reported = bool(readings)
        self._tally.pools(readings, refused, corrections)

    def put_ids(self, feed: CapacityFeed, ids: Any, prompt_tokens: int, seed: int, stride: int) -> bool:
        """A capacity lookup's token ids (or ``bytes`` of page keys, ``stride`` words each) into the channel's id ring,
        for the export process (the engine's thread); False when the channel has none now (private memory: the lookup
        is queued for this process instead). A full ring drops the lookup, counted as ``queue_full``; ids that are not
        int64 are counted as ``build_failed``."""
        problem = None
        with self._tally.lock:  # the channel is swapped under it (moved into shared memory, released at shutdown)
            ring = self.channel.ids
            if ring is None or feed is not self.capacity:
                return ring is not None  # a replaced feed's lookups: for no model any more
            if self._described != (ring, feed.generation):
                ring.describe(feed.page_tokens, _tier_rows(feed, self.channel.layout.pools))
                self._described = (ring, feed.generation)
            try:
                if not ring.put(ids, prompt_tokens, seed, stride):
                    problem = Problem.QUEUE_FULL
            except (OverflowError, TypeError, ValueError):
                problem = Problem.BUILD_FAILED
        if problem is Problem.QUEUE_FULL:
            self._tally.shed(1, "capacity lookups faster than the export process reads them", RecordKind.CAPACITY)
        elif problem is not None:
            self._tally.reject(RecordKind.CAPACITY, problem)
        return True

    def publish_capacity(self) -> None:
        """Write the capacity estimator's curve (after the pool reading: a tier's capacity may come from it), unless
        its lookups go to the export process (the channel's id ring describes the feed): that one runs the estimator
        then, and alone writes the curve."""
        feed = self.capacity
        described = self._described
        if feed is None or (described is not None and described[0] is self.channel.ids):
            return
        try:
            limits = {(tier, pool): limit for tier, pool, _, limit in self.channel.counters.pools()}
            curves = {t: CapacityReading.of(c) for t, c in feed.curve(limits).items()}
        except Exception:  # the model is ours: a bug, never the host's problem
            _log.debug("otel_hicache: reading the capacity curve failed", exc_info=True)
            return
        self._tally.capacity(curves)

    def run_engine_checks(self) -> None:
        """Run every engine check (outside the telemetry's lock) and count what they report."""
        if not self.engine_checks or not self._checking.acquire(blocking=False):
            return  # none, or running on another thread (or a check called snapshot())
        try:
            for check, on_mismatch in list(self.engine_checks):
                try:
                    names = list(check())
                except Exception:
                    self._tally.reject(RecordKind.ENGINE_CHECK, Problem.SOURCE_FAILED)
                    continue
                self._tally.mismatches(names)
                if names and on_mismatch is not None and on_mismatch(names):
                    self.remove_engine_check(check)
        finally:
            self._checking.release()

    # ------------------------------------------------------------------ reading, flushing, closing
    def settle(self, timeout_s: float = SETTLE_TIMEOUT_S, *, hurry: bool = False) -> bool:
        """Wait (bounded) until every deferred record has been built and counted by the host thread. ``hurry`` (a
        flush, a shutdown): the host thread builds without pausing meanwhile; else (a read of the counters) it keeps
        its pace."""
        if self.closed:  # no host thread builds any more: what producers put since shutdown is shed, and counted
            self._shed_deferred()
        if not self._unbuilt():
            return True
        if self._thread is None or threading.current_thread() is self._thread:
            return False
        deadline = time.monotonic() + timeout_s
        if hurry:
            self._hurry(1)
        try:
            while True:
                self._drained.clear()
                if not self._unbuilt():
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._wake.set()
                # a hurried round says when all is built; the bound covers one begun before the hurry (it says nothing)
                self._drained.wait(min(remaining, 0.01 if hurry else 0.001))
        finally:
            if hurry:
                self._hurry(-1)

    def _hurry(self, change: int) -> None:
        with self._hurry_lock:
            self._hurried += change

    def _unbuilt(self) -> bool:
        return self._building or any(self.queues)

    def before_collect(self) -> None:
        """What an in-process collection waits for first: deferred records counted, pools read, engines checked (at
        the host thread's pace: a collection is no reason to hold the GIL longer)."""
        self.settle(SETTLE_TIMEOUT_S / 2)
        self.read_pools()
        self.publish_capacity()
        self.run_engine_checks()

    def tend(self, now: bool = False) -> None:
        """Look after the consumer (host thread, flush, start): move into shared memory once it can be had, relay the
        export process's lines, replace it if it died (``now``: whatever its back-off says)."""
        if self.closed:
            return
        if self.shared and self.channel.fd is None:
            self._share()
        self.consumer.tend(self.channel, now)

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        settled = self.settle(timeout_s, hurry=True)
        self.publish_capacity()
        self.run_engine_checks()
        if not self.started:
            self.start()
        self.tend(now=True)
        return self.consumer.flush(max(0.0, deadline - time.monotonic())) and settled

    def close(self, timeout_s: float) -> None:
        """Count what is queued, stop the thread, hand the last records to the consumer, within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self.settle(timeout_s / 2, hurry=True)
        self._tally.closed = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()) / 2)
        self._shed_deferred()
        if self.shared and self.channel.fd is None:
            self._share()  # one more try: the last window goes out only from shared memory
        self.consumer.close(self.channel, max(0.0, deadline - time.monotonic()))
        if self.shared:  # keep counting (records after shutdown still count) in a private copy; let shared memory go
            self._tally.swap(Channel.private_copy).close()
        fork.untrack(self)

    def _shed_deferred(self) -> None:
        """Count every deferred record that will never be built (the host thread has stopped)."""
        for queue in list(self.queues):
            shed = queue.discard()
            if shed:
                self._tally.shed(shed, "deferred records not built before shutdown", queue.kind)

    # ------------------------------------------------------------------ memory
    def _new_channel(self) -> Channel:
        """Shared memory for the export process, or (none to be had: no fds, no memfd) private memory for now."""
        layout = self._tally.layout
        if self.shared:
            try:
                return Channel(layout, self._max_queue, shared=True, ids=ARENA_BYTES)
            except OSError as exc:
                self._tally.warn_export(
                    "no_shared_memory",
                    f"no shared memory for the export process now ({exc!r}); counting in private memory, retrying",
                )
        return Channel(layout, self._max_queue, shared=False)

    def _share(self) -> None:
        """Move the counters and the ring into shared memory (they started in private memory: none could be had)."""
        try:
            old = self._tally.swap(Channel.shared_copy)
        except OSError:
            return  # still none: the next tend tries again
        old.close()

    # ------------------------------------------------------------------ fork
    def before_fork(self) -> tuple[bool, bool]:
        """Hold the consumer (no span half-emitted in the SDK) and the producer lock (no half-written slot or counter)
        across fork. Bounded: a fork from inside our own code proceeds after a second."""
        consumer = self.consumer.before_fork()
        return consumer, self._tally.lock.acquire(timeout=1.0)

    def after_fork_in_parent(self, held: tuple[bool, bool]) -> None:
        if held[1]:
            self._tally.lock.release()
        self.consumer.after_fork_in_parent(held[0])

    def after_fork_in_child(self) -> None:
        """Start from zero, as a new process: new locks, table and ring, no threads; the parent's are untouched."""
        self._tally.lock = threading.Lock()
        self._starting = threading.Lock()
        self._wake = threading.Event()
        self._hurried = 0
        self._hurry_lock = threading.Lock()
        self._drained = threading.Event()
        self._checking = threading.Lock()
        self._thread = None
        self.fast_ready = False
        self._building = False
        for queue in self.queues:
            queue.discard()  # the parent's entries: built and counted by the parent
        if self.capacity is not None:
            self.capacity.restart()
        self.started = False
        self._next_start_attempt = 0.0
        if not self.shared:  # a private mapping: the child's own copy
            self.channel.reset()
        else:  # the parent's shared memory: never written by the child
            self.channel.close()
            self._tally.bind(self._new_channel())
        self.consumer = self.consumer.after_fork_in_child(self.channel)
        if self.pool_sources or self.engine_checks or len(self.queues) > 1:  # nothing else would start it
            # its first tend launches the child's exporter; a deferred record still speeds up a capacity-only tick
            self.fast_ready = self._start_thread() and self._tick_s <= DEFERRED_TICK_S


def weakly(method: Callable[_P, Any]) -> Callable[_P, None]:
    """``method`` called through a weak reference to its object: a callback that does not keep the object alive
    (once it is gone, a call does nothing)."""
    ref = weakref.WeakMethod(method)

    def call(*args: _P.args, **kwargs: _P.kwargs) -> None:
        live = ref()
        if live is not None:
            live(*args, **kwargs)

    return call


def _tier_rows(feed: CapacityFeed, pools: tuple[str, ...]) -> list[TierRow]:
    """``feed``'s tiers as the id ring describes them (a pool the channel does not know: ``other``)."""
    return [
        TierRow(
            list(Tier).index(Tier(t.tier)),
            -1 if t.tokens is None else t.tokens,
            t.inclusive,
            t.reclaims_copies,
            pools.index(t.pool) if t.pool in pools else pools.index(OTHER_POOL),
        )
        for t in feed.tiers
    ]


def _build_deferred_call(entry: tuple[int, Callable[[Any], TransferRecord | None], Any]) -> TransferRecord | None:
    """record_transfer_deferred's entries: ``(seq, build, payload)``."""
    _, build, payload = entry
    return build(payload)


def _run(ref: weakref.ref[HostWorker], wake: threading.Event) -> None:
    """The host thread's loop; it pauses after a busy round (as long as the round says) so the scheduler thread gets
    the GIL back."""
    state = {"pools": 0.0, "drain": 0.0, "tend": 0.0}
    tick, pause = DEFERRED_TICK_S, None
    worker = ref()
    if worker is not None:
        pacing.keeping(worker.schedule)  # its long builds pace themselves by it
        del worker
    while True:
        if pause is not None:  # 0: a flush waits, only let go of the GIL (time.sleep(0) would cost a wake as well)
            pacing.pause(pause)
        else:
            wake.wait(tick)
            wake.clear()
        worker = ref()
        if worker is None or worker.closed or worker._wake is not wake:  # gone, shut down, or forked
            return
        tick = worker.tick_s()
        pause = worker.work(state)
        del worker


# ---------------------------------------------------------------------- at exit (the at-fork hooks: fork.py)
def _flush_at_exit() -> None:
    """Count deferred records before the interpreter stops the host thread: half a second in all, however many."""
    deadline = time.monotonic() + 0.5
    for worker in fork.tracked():
        worker.settle(max(0.0, deadline - time.monotonic()), hurry=True)


atexit.register(_flush_at_exit)
