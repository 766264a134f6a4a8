"""Eviction bookkeeping: the radix nodes each eviction pass frees, and how long ago each was used.

A pass (device ``_evict``, ``evict_host``) opens on :class:`Evictions`; the per-node wrappers inside it add one
:class:`~otel_hicache.records.EvictedEntry` per node, with SGLang's ``last_access_time`` (a logical counter) in place
of its age until :class:`AccessClock` turns that into seconds. A load back marks the nodes whose host copies it reads
(:data:`READ`, an attribute on SGLang's node), so a host copy evicted unread is known as wasted.
"""

from __future__ import annotations

import bisect
import contextlib
import sys
import threading
from collections import deque
from collections.abc import Iterator
from time import monotonic_ns
from typing import Any

from otel_hicache.records import EvictedEntry
from otel_hicache.semconv import MAX_EVICTION_ENTRIES

#: The mark SGLang's radix node gets when a load back reads its host copy.
READ = "_otel_hicache_read"
#: Samples of SGLang's access counter kept (one per event that found it moved): the age of a node used before the
#: oldest sample is counted from that sample (a lower bound).
CLOCK_SAMPLES = 4096
#: SGLang's module holding the access counter its radix nodes' ``last_access_time`` is read from.
_COUNTER_MODULE = "sglang.srt.mem_cache.unified_cache.components.base"
_COUNTER = "_LAST_ACCESS_TIME_COUNTER_FLOAT"


def radix_node(core: Any, node_id: Any) -> Any:
    """SGLang's radix node object, or None where the TreeCore has none to give (the Rust one)."""
    try:
        return core.node_by_id(node_id)
    except NotImplementedError:
        return None


def full_tokens(tracker: Any) -> int:
    """The full-attention tokens an eviction tracker (``{ComponentType: tokens}``) has counted."""
    return sum(int(n) for kind, n in tracker.items() if getattr(kind, "name", None) == "FULL")


class Evictions:
    """The eviction passes open on each thread (a device pass may run a host pass inside), collecting the entries
    of the nodes each evicts: :class:`~otel_hicache.records.EvictedEntry` with SGLang's ``last_access_time``
    counter in place of ``idle_s`` until :meth:`AccessClock.idle` turns it into seconds."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _stack(self) -> list[tuple[list[EvictedEntry], int]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    @contextlib.contextmanager
    def open(self, bytes_per_token: int) -> Iterator[list[EvictedEntry]]:
        """A pass: what its nodes' entries are added to (``bytes_per_token``: of the tier's copies, for waste)."""
        stack = self._stack()
        entries: list[EvictedEntry] = []
        stack.append((entries, bytes_per_token))
        try:
            yield entries
        finally:
            stack.pop()

    def add(self, entry: EvictedEntry) -> None:
        stack = self._stack()
        if stack and len(stack[-1][0]) < MAX_EVICTION_ENTRIES:  # the first ones; the pass's total stays exact
            stack[-1][0].append(entry)

    def bytes_per_token(self) -> int:
        stack = self._stack()
        return stack[-1][1] if stack else 0


class AccessClock:
    """When SGLang's access counter had which value: radix nodes record their last use as that counter (a logical
    clock), so the age of an evicted node is the time since the first sample after its last use (a lower bound).
    Samples are taken at admissions and eviction passes on the scheduler thread, and as each consumed transfer is
    reported on the telemetry's host thread (a sample is the counter's value and the time it was read, whichever
    thread reads it)."""

    def __init__(self) -> None:
        self._counters: deque[float] = deque(maxlen=CLOCK_SAMPLES)
        self._times: deque[int] = deque(maxlen=CLOCK_SAMPLES)
        self._lock = threading.Lock()  # two threads sample: keep each pair together and the samples in order

    def sample(self) -> None:
        module = sys.modules.get(_COUNTER_MODULE)
        counter = getattr(module, _COUNTER, None)
        if counter is None:
            return
        with self._lock:
            if self._counters and self._counters[-1] >= counter:
                return
            self._counters.append(counter)
            self._times.append(monotonic_ns())

    def idle(self, entries: list[EvictedEntry]) -> list[EvictedEntry]:
        """``entries`` with each node's age in seconds (``idle_s``) in place of its access counter."""
        if not entries:
            return entries
        self.sample()
        with self._lock:
            counters, times = list(self._counters), list(self._times)
        now = monotonic_ns()
        aged = []
        for entry in entries:
            used = entry.idle_s
            if used is None or not times:
                aged.append(entry._replace(idle_s=None))
                continue
            after = bisect.bisect_right(counters, used)  # the first sample taken after the node's last use
            idle_ns = now - times[after] if after < len(times) else 0
            aged.append(entry._replace(idle_s=idle_ns / 1e9))
        return aged
