"""Deferred transfers: bounded queues a producer's hottest path fills and the telemetry's host thread builds from.

A :class:`DeferredQueue` is what :meth:`~otel_hicache.telemetry.HiCacheTelemetry.deferred_queue` hands a producer. The
producer appends an entry ``(next(queue.seq), ...)`` - a tuple whose first item is the sequence number, the rest what
the record is made of - with ``queue.put``: a ``deque.append`` and an ``itertools.count``, two C calls that enter no
Python frame and never wait (one tuple per entry: what stays alive until it is built is what the garbage collector
of the host has to walk). The host thread takes the entries in order and builds each into a record with the queue's
``build(entry)``.

Bounded without a check on the producer's side: the deque keeps at most ``limit`` unbuilt entries and discards the
oldest past that; the taker counts every entry it never saw from the gap in sequence numbers, so what is shed is
counted exactly (``otel_hicache.records.rejected{problem=queue_full}``). One producer thread per queue (the sequence
numbers are then in order); the taker is the host thread alone.

A *batched* queue is built a batch at a time: ``build(entries)`` gets the entries waiting, oldest first, up to a
bound, in one call (:meth:`DeferredQueue.take_batch`): a producer whose entries only add to counters has them summed
there, one count for all of them, where one call per entry would cost the host thread a Python call chain each.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from typing import Any

from otel_hicache.records import TransferRecord
from otel_hicache.semconv import RecordKind

#: ``build(entry)``: the record of one entry (``entry[0]`` is its sequence number), or None: nothing (more) to report
#: (a build may report through :meth:`~otel_hicache.telemetry.HiCacheTelemetry.record_transfer_at` itself). A batched
#: queue's ``build(entries)`` gets the entries waiting, oldest first, reports what it makes itself and returns None;
#: it reports all of them or raises before it reports any (then each is counted as refused, ``build_failed``).
Build = Callable[[Any], "TransferRecord | None"]


class DeferredQueue:
    """One producer's bounded queue of entries to build (see the module docstring)."""

    __slots__ = ("_entries", "_expected", "batched", "build", "closed", "kind", "put", "seq")

    def __init__(self, build: Build, limit: int, kind: RecordKind = RecordKind.TRANSFER, batched: bool = False) -> None:
        self._entries: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=limit)
        self.put = self._entries.append  # the producer's: put((next(seq), ...))
        self.seq = itertools.count()
        self.build = build
        self.batched = batched  # build(entries): the entries waiting, a batch at a time (take_batch)
        self.kind = kind  # what a shed entry or a failed build is counted as
        self.closed = False  # the producer is done: dropped by the telemetry once drained
        self._expected = 0  # the sequence number the taker sees next when nothing was shed

    def __len__(self) -> int:
        return len(self._entries)

    def put_numbered(self, build: Any, payload: Any) -> None:
        """``put((next(seq), build, payload))`` as one C call: for a queue several threads fill (a number drawn on
        one thread and appended after another thread's later one would count as shed, then as a negative shed)."""
        self._entries.extend(itertools.islice(zip(self.seq, (build,), (payload,), strict=False), 1))

    def take(self) -> tuple[int, tuple[Any, ...]]:
        """``(entries shed just before this one, entry)`` of the oldest entry; IndexError when empty."""
        entry = self._entries.popleft()
        seq = entry[0]
        shed, self._expected = seq - self._expected, seq + 1
        return shed, entry

    def take_batch(self, limit: int) -> tuple[int, list[tuple[Any, ...]]]:
        """``(entries shed before or among them, entries)``: the entries waiting now, oldest first, at most ``limit``
        (IndexError when none wait). Those the deque discarded while they were taken count as shed. None are returned
        when a :meth:`discard` ran meanwhile (a close that gave up waiting for the host thread): it counted them."""
        expected, pop, taken = self._expected, self._entries.popleft, []
        try:
            for _ in range(limit):
                taken.append(pop())
        except IndexError:  # all taken, or cleared by a discard()
            if not taken:
                raise
        if self._expected != expected:  # discard() counted every entry not built so far as never built
            return 0, []
        last = taken[-1][0]
        shed, self._expected = last + 1 - expected - len(taken), last + 1
        return shed, taken

    def discard(self) -> int:
        """Drop every unbuilt entry (shutdown; a forked child's copy): how many were never built, shed ones too."""
        handed_out = next(self.seq)  # entries so far were numbered below this one, which no entry will use
        self._entries.clear()
        never_built, self._expected = handed_out - self._expected, handed_out + 1
        return never_built

    def close(self) -> None:
        self.closed = True
