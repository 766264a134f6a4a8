"""Counting and refusals: the producer side of a telemetry's channel.

A :class:`Tally` adds the counts of each checked record (:mod:`otel_hicache._internal.validation`) to the channel's
exact int64 slot table and queues its span or histogram points on the ring, under one lock, from any thread; a count
past int64 leaves the table as it was, and a record whose span or points the ring cannot take still counts
(``otel_hicache.records.dropped``). It counts what was refused (``otel_hicache.records.rejected``) or corrected
(``otel_hicache.records.normalized``) too, and says so once per kind of problem. Slot numbers are looked up in tables
built once from the layout: the hot path indexes dicts and never builds a key.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from otel_hicache import semconv as sc
from otel_hicache._internal.accumulation import Layout
from otel_hicache._internal.channel import Channel
from otel_hicache._internal.validation import Drop, Eviction, Failure, Link, Pools, Rejected, Transfer, Wait
from otel_hicache.semconv import PrefillMode, Problem, RecordKind

_log = logging.getLogger("otel_hicache.telemetry")
_T = TypeVar("_T")


class Tally:
    """The slot table and the ring's producer side of one telemetry (see the module docstring).

    ``known``: the pool names records may carry (each mapped to itself), the rest counts as ``other``. ``closed``:
    the telemetry is shut down; records still count, their spans and points are dropped and counted. ``channel`` is
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
        self._size_slots = {
            (op, source): {pool: sizes[op, pool, source] for pool in (None, *layout.pools)}
            for op in sc.TransferOperation
            for source in sc.TimingSource
        }
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
        self.channel, self._ints = channel, channel.ints

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
        """Count a checked transfer and queue its span (the hot path)."""
        by_pool, corrections = t.bytes_by_pool, t.corrections
        token_slots, size_slots = self._token_slots[t.operation], self._size_slots[t.operation, t.timing_source]
        # the common case without a comprehension (in 3.11 one more Python frame per transfer)
        adds = [(size_slots[None], t.num_bytes)] if by_pool is None else [(size_slots[p], n) for p, n in by_pool]
        for pool, n in t.tokens:
            adds.append((token_slots[pool], n))
        with self.lock:
            counted = self._apply(adds)
            if counted:
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
        """Count a pass (per entry: reuse, wasted bytes) and queue its duration and the entries' ages."""
        tier, entries = eviction.tier, eviction.entries
        by_reuse: dict[bool | None, int] = {}
        adds: list[tuple[int, int]] = []
        for entry in entries:
            by_reuse[entry.reused] = by_reuse.get(entry.reused, 0) + entry.tokens
            if entry.unread_bytes:
                adds.append((self._wasted_slot[(entry.written_by,)], entry.unread_bytes))
        unknown = eviction.tokens - sum(by_reuse.values())  # tokens of the pass no entry accounts for
        if unknown or not by_reuse:
            by_reuse[None] = by_reuse.get(None, 0) + unknown
        adds += [(self._evicted_slot[(tier, reused)], n) for reused, n in by_reuse.items()]
        ages = [entry.idle_s for entry in entries if entry.idle_s is not None]
        with self.lock:
            if not self._apply(adds):
                queued = None
            else:
                time_ns = eviction.time_ns
                queued = self._put_points(sc.METRIC_EVICTION_DURATION, (tier,), [eviction.duration_s], time_ns, None)
                if ages and queued:
                    queued = self._put_points(sc.METRIC_EVICTION_AGE, (tier,), ages, time_ns, None)
                if not queued:
                    self._ints[self._dropped_slot[(RecordKind.EVICTION,)]] += 1
        if queued is None:
            self.reject(RecordKind.EVICTION, Problem.ABSURD_COUNT)
        elif not queued:
            self._span_lost(RecordKind.EVICTION)

    def kv_wait(self, wait: Wait, context: Link | None) -> None:
        """Queue a request's wait (its histogram point; ``context``: the request's span, for the exemplar)."""
        with self.lock:
            queued = self._put_points(sc.METRIC_REQUEST_KV_WAIT, (wait.tier,), [wait.seconds], wait.time_ns, context)
            if not queued:
                self._ints[self._dropped_slot[(RecordKind.KV_WAIT,)]] += 1
        if not queued:
            self._span_lost(RecordKind.KV_WAIT)

    def prefill(self, counts: dict[PrefillMode, int]) -> None:
        self.add([(self._prefill_slot[(mode,)], n) for mode, n in counts.items()])

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

    def capacity(self, curves: dict[str, tuple[int, list[float]]]) -> None:
        """Replace the capacity curves with one complete reading: ``tier -> (tokens, ratio per factor)``."""
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

    def reject(self, kind: RecordKind, problem: Problem) -> None:
        try:
            self.add([(self._rejected_slot[(kind, problem)], 1)])
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

    def _put_points(
        self, name: str, key: tuple[Any, ...], values: list[float], time_ns: int, context: Link | None
    ) -> bool:
        """Queue histogram points of the series ``key`` (under the lock); False when they could not be queued."""
        try:  # all or nothing: a failure leaves the ring as it was
            return not self.closed and self.channel.put_points(name, key, values, time_ns, context)
        except Exception:
            return False
