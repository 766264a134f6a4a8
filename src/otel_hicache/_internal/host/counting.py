"""Counting and refusals: the producer side of a telemetry's channel.

A :class:`Tally` adds the counts and histogram values of each checked record
(:mod:`otel_hicache._internal.host.validation`) to the channel's exact table and queues a transfer's span on the ring,
under one lock, from any thread; a count past int64 leaves the table as it was, and a transfer whose span the ring
cannot take still counts (``otel_hicache.records.dropped``). A histogram value costs a bucket search (``bisect`` over
the row's boundaries, outside the lock) and two adds under it: the bucket's count and the float64 sum. It counts what
was refused (``otel_hicache.records.rejected``) or corrected (``otel_hicache.records.normalized``) too, and says so once
per kind of problem. Slot numbers are looked up in tables built once from the layout: the hot path indexes dicts and
never builds a key.
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from otel_hicache import semconv as sc
from otel_hicache._internal.host.validation import Drop, Eviction, Failure, Pools, Rejected, Transfer, Wait
from otel_hicache._internal.shared.accumulation import HISTOGRAM_BUCKETS, HISTOGRAM_SUM, CapacityReading, Key, Layout
from otel_hicache._internal.shared.channel import Channel
from otel_hicache.semconv import PrefillMode, Problem, RecordKind

_log = logging.getLogger("otel_hicache.telemetry")
_T = TypeVar("_T")


class Tally:
    """The slot table and the ring's producer side of one telemetry (see the module docstring).

    ``known``: the pool names records may carry (each mapped to itself), the rest counts as ``other``. ``closed``:
    the telemetry is shut down; records still count, their spans are dropped and counted. ``channel`` is
    the memory counted into, given by :meth:`bind` and replaced by :meth:`swap` (the worker's: private memory, shared
    memory once it can be had, a forked child's own).
    """

    channel: Channel

    def __init__(self, layout: Layout, known: Pools) -> None:
        self.layout = layout
        self.known = known
        self.lock = threading.Lock()  # the counter table and the ring's producer side
        self.closed = False
        self._warned: set[tuple[str, str]] = set()
        slots = layout.slots
        # per operation (and timing source): the hot path looks a slot up by pool alone
        tokens, sizes = slots[sc.METRIC_TRANSFER_TOKENS], slots[sc.METRIC_TRANSFER_SIZE]
        self._token_slots = {op: {pool: tokens[op, pool] for pool in layout.pools} for op in sc.TransferOperation}
        # and per (operation, timing source) the duration's series: its sum and its first bucket
        durations = layout.histograms[sc.METRIC_TRANSFER_DURATION]
        self._size_slots = {
            (op, source): (
                {pool: sizes[op, pool, source] for pool in (None, *layout.pools)},
                durations[op, source] + HISTOGRAM_SUM,
                durations[op, source] + HISTOGRAM_BUCKETS,
            )
            for op in sc.TransferOperation
            for source in sc.TimingSource
        }
        self._duration_bounds = layout.bounds[sc.METRIC_TRANSFER_DURATION]
        self._failure_slot = slots[sc.METRIC_TRANSFER_FAILURES]
        self._drop_slot = slots[sc.METRIC_DROPPED_TOKENS]
        self._evicted_slot = slots[sc.METRIC_EVICTION_TOKENS]
        self._wasted_slot = slots[sc.METRIC_WASTED_SIZE]
        self._mismatch_slot = slots[sc.METRIC_ENGINE_MISMATCH]
        self._prefill_slot = slots[sc.METRIC_PREFILL_TOKENS]
        self._rejected_slot = slots[sc.METRIC_RECORDS_REJECTED]
        self._normalized_slot = slots[sc.METRIC_RECORDS_NORMALIZED]
        self._dropped_slot = slots[sc.METRIC_RECORDS_DROPPED]

    def bind(self, channel: Channel) -> None:
        """Count into ``channel`` (no record is counted meanwhile: construction, a forked child)."""
        self.channel, self._ints, self._floats = channel, channel.ints, channel.floats

    def swap(self, make: Callable[[Channel], Channel]) -> Channel:
        """Count into ``make(channel)`` from now on, made under the lock (so it holds every count so far); the old
        channel is returned. What ``make`` raises propagates, and nothing changes."""
        with self.lock:
            old = self.channel
            self.bind(make(old))
        return old

    def snapshot(self) -> dict[str, dict[tuple[Any, ...], int]]:
        with self.lock:
            return self.channel.counters.snapshot()

    # ------------------------------------------------------------------ checked records
    def transfer(self, t: Transfer) -> None:
        """Count a checked transfer, add its copy duration to its histogram series and queue its span (the hot
        path)."""
        by_pool, corrections, seconds = t.bytes_by_pool, t.corrections, t.copy_duration_s
        token_slots = self._token_slots[t.operation]
        size_slots, sum_slot, buckets = self._size_slots[t.operation, t.timing_source]
        # the common case without a comprehension (in 3.11 one more Python frame per transfer)
        adds = [(size_slots[None], t.num_bytes)] if by_pool is None else [(size_slots[p], n) for p, n in by_pool]
        for pool, n in t.tokens:
            adds.append((token_slots[pool], n))
        if seconds is not None:  # the count of its bucket, with the other counts; its sum below
            adds.append((buckets + bisect_left(self._duration_bounds, seconds), 1))
        with self.lock:
            counted = self._apply(adds)
            if counted:
                if seconds is not None:
                    self._floats[sum_slot] += seconds
                try:  # a slot is published only once whole: a failure leaves the ring as it was
                    queued = not self.closed and self.channel.put_transfer(t)
                except Exception:
                    queued = False
                if not queued or corrections:
                    self._count_span_loss_and_corrections(queued, corrections)
        if not counted:
            self.reject(RecordKind.TRANSFER, Problem.ABSURD_COUNT)
        elif corrections or not queued:
            self._warn_transfer(corrections, queued)

    def _count_span_loss_and_corrections(self, queued: bool, corrections: tuple[Problem, ...]) -> None:
        ints = self._ints  # under the lock
        if not queued:
            ints[self._dropped_slot[(RecordKind.TRANSFER,)]] += 1
        for problem in corrections:
            ints[self._normalized_slot[RecordKind.TRANSFER, problem]] += 1

    def _warn_transfer(self, corrections: tuple[Problem, ...], queued: bool) -> None:
        for problem in corrections:
            self.warn_once(RecordKind.TRANSFER, problem, "record corrected and counted")
        if not queued:
            self._span_lost(RecordKind.TRANSFER)

    def failure(self, failure: Failure) -> None:
        self.add([(self._failure_slot[failure], 1)])

    def drop(self, drop: Drop, corrections: list[Problem]) -> None:
        adds = [(self._drop_slot[(drop.reason, pool)], n) for pool, n in drop.tokens]
        self.add(adds + [(self._normalized_slot[(RecordKind.DROP, p)], 1) for p in corrections])
        for problem in corrections:
            self.warn_once(RecordKind.DROP, problem, "record corrected and counted")

    def eviction(self, eviction: Eviction) -> None:
        """Count a pass (its tokens by reuse, wasted bytes) and add its duration and its entries' ages to their
        histogram series."""
        tier, ages = eviction.tier, eviction.ages
        adds = [(self._evicted_slot[(tier, reused)], n) for reused, n in eviction.tokens_by_reuse.items()]
        adds += [(self._wasted_slot[(op,)], n) for op, n in eviction.unread_bytes.items()]
        bucket, duration_sum_slot = self._point(sc.METRIC_EVICTION_DURATION, (tier,), eviction.duration_s)
        adds.append((bucket, 1))
        age_sum_slot, age_sum = -1, 0.0
        if ages:  # the ages as counts per bucket, added with the pass's counts; their sum as one float
            base = self.layout.histograms[sc.METRIC_EVICTION_AGE][(tier,)]
            counts = self.layout.bucket_counts(sc.METRIC_EVICTION_AGE, ages)
            adds += [(base + HISTOGRAM_BUCKETS + i, n) for i, n in enumerate(counts) if n]
            age_sum_slot, age_sum = base + HISTOGRAM_SUM, sum(ages)
        with self.lock:
            counted = self._apply(adds)
            if counted:
                self._floats[duration_sum_slot] += eviction.duration_s
                if ages:
                    self._floats[age_sum_slot] += age_sum
        if not counted:
            self.reject(RecordKind.EVICTION, Problem.ABSURD_COUNT)

    def kv_wait(self, wait: Wait) -> None:
        """Add a request's wait to its histogram series."""
        self.observe(sc.METRIC_REQUEST_KV_WAIT, (wait.tier,), wait.seconds)

    def observe(self, name: str, key: Key, value: float) -> None:
        """Add ``value`` to the series ``key`` (its attributes' values, in its row's order) of histogram ``name``: what
        a producer call of a new histogram row does. KeyError for a value outside its attribute's closed set."""
        bucket, sum_slot = self._point(name, key, value)
        with self.lock:
            if self._apply([(bucket, 1)]):
                self._floats[sum_slot] += value

    def _point(self, name: str, key: Key, value: float) -> tuple[int, int]:
        """Where ``value`` goes: the slots of its bucket's count and of its series' sum (found outside the lock)."""
        base = self.layout.histograms[name][key]
        return base + HISTOGRAM_BUCKETS + bisect_left(self.layout.bounds[name], value), base + HISTOGRAM_SUM

    def prefill(self, counts: dict[PrefillMode, int], rows: int = 1) -> None:
        """Count ``rows`` prefills' split, summed; all of it or, past an int64 counter, none of it (refused)."""
        with self.lock:
            counted = self._apply([(self._prefill_slot[(mode,)], n) for mode, n in counts.items() if n])  # 0: no series
        if not counted:
            self.reject(RecordKind.PREFIX_SPLIT, Problem.ABSURD_COUNT, rows)

    def mismatches(self, names: Iterable[Any]) -> None:
        """Count what one engine check reported: each name of one of our instruments (a plain string) once."""
        for name in names:
            slot = self._mismatch_slot.get((name,)) if type(name) is str else None
            if slot is None:
                self.reject(RecordKind.ENGINE_CHECK, Problem.MALFORMED)
                continue
            self.add([(slot, 1)])
            if ("mismatch", name) not in self._warned:
                self._warned.add(("mismatch", name))
                _log.warning(
                    "otel_hicache: %s disagrees with the engine's own counter in this process (an engine change the "
                    "adapter does not know?); counted in %s.",
                    name,
                    sc.METRIC_ENGINE_MISMATCH,
                )

    def pools(
        self,
        readings: dict[tuple[str, str], tuple[int, int]],
        refused: list[Problem],
        corrections: list[Problem],
    ) -> None:
        """Replace the pool gauges with one complete reading; count the sources ``refused`` and the ``corrections``."""
        adds = [(self._rejected_slot[(RecordKind.POOL_USAGE, p)], 1) for p in refused]
        adds += [(self._normalized_slot[(RecordKind.POOL_USAGE, p)], 1) for p in corrections]
        with self.lock:
            self.channel.counters.set_pools(readings)
            for slot, n in adds:
                self._ints[slot] += n
        for problem in refused:
            self.warn_once(RecordKind.POOL_USAGE, problem, "pool-usage source skipped")

    def capacity(self, curves: dict[str, CapacityReading]) -> None:
        """Replace the capacity curves with one complete reading by tier."""
        with self.lock:
            self.channel.counters.set_capacity(curves)

    def shed(self, n: int, why: str, kind: RecordKind = RecordKind.TRANSFER) -> None:
        """Count ``n`` deferred records that will never be built (``queue_full``)."""
        self.add([(self._rejected_slot[kind, Problem.QUEUE_FULL], n)])
        self.warn_once(kind, Problem.QUEUE_FULL, why)

    # ------------------------------------------------------------------ refusals
    def checked(self, kind: RecordKind, check: Callable[..., _T], *args: Any) -> _T | None:
        """``check(*args)``, or None after counting the refusal (never raises)."""
        try:
            return check(*args)
        except Exception as exc:
            self.refuse(kind, exc)
        return None

    def refuse(self, kind: RecordKind, exc: Exception) -> None:
        """Count a record its check refused (an unexpected error: malformed)."""
        self.reject(kind, exc.problem if isinstance(exc, Rejected) else Problem.MALFORMED)

    def reject(self, kind: RecordKind, problem: Problem, n: int = 1) -> None:
        try:
            self.add([(self._rejected_slot[(kind, problem)], n)])
            self.warn_once(kind, problem, "record rejected; nothing of it was counted")
        except Exception:  # the last line of defence: never raise into the host
            pass

    def warn_once(self, kind: str, problem: str, message: str) -> None:
        if (kind, problem) in self._warned:
            return
        self._warned.add((kind, problem))
        _log.warning("otel_hicache: %s record: %s (%s). Further occurrences are only counted.", kind, message, problem)

    def warn_export(self, problem: str, message: str) -> None:
        """A problem of the export machinery (no thread, no shared memory), logged once."""
        if ("export", problem) not in self._warned:
            self._warned.add(("export", problem))
            _log.warning("otel_hicache: %s (logged once)", message)

    def _span_lost(self, kind: RecordKind) -> None:
        """A record counted but not queued for its span: say so once."""
        self.warn_once(kind, "not_queued", "span queue full (or telemetry shut down); spans are dropped and counted")

    # ------------------------------------------------------------------ the table (under the lock)
    def add(self, adds: list[tuple[int, int]]) -> None:
        with self.lock:
            self._apply(adds)

    def _apply(self, adds: list[tuple[int, int]]) -> bool:
        """Add every ``(slot, n)`` or none (under the lock): a count past int64 leaves the table as it was."""
        ints = self._ints
        done = 0
        try:
            for slot, n in adds:
                ints[slot] += n
                done += 1
        except ValueError:  # the int64 slot would overflow: not written
            for slot, n in adds[:done]:
                ints[slot] -= n
            return False
        return True
