"""The channel between a host process and its exporter: one block of memory both map.

Layout (all int64-aligned)::

    header (HEADER_INTS int64)  |  counters, pool gauges, histograms (accumulation.Layout)  |  transfer ring (slots)
    |  id ring (shared only: :mod:`~otel_hicache._internal.shared.ids`)

* The **table** holds every metric exactly: each counter series, the last pool reading, and each histogram series'
  bucket counts and sum (:mod:`otel_hicache._internal.shared.accumulation`). The host adds into it; an exporter only
  reads it, so no metric depends on an exporter's memory or on an export succeeding: a replacement exporter reads the
  same cumulative state, and ``START_NS`` (when the table was made) is the start time of every cumulative point.
* The **transfer ring** is a bounded single-producer / single-consumer queue of fixed-size slots: the host packs each
  transfer (for its span) into the next free slot; when the ring is full the span is shed and counted, never waited
  for. The producer publishes a slot by advancing ``WRITE`` after writing it; the consumer advances ``READ`` after
  decoding and ``SETTLED`` once the spans built from the slots are exported (or counted as lost). A slot is free again
  only once settled, so an exporter that replaces a dead one builds and sends again what its predecessor took but
  never settled, under the same span and trace ids (``ID_SEED`` and the slot's sequence number make them), as an OTLP
  retry would.
* The **header** also carries the flush handshake (``FLUSH_REQ`` / ``FLUSH_DONE``), the exporter's pid and the spans
  whose export failed (``EXPORT_DROPPED``, written by the exporter alone and reported in
  ``otel_hicache.records.dropped`` with the host's own count: see :class:`ChannelCounters`), and those every span
  exporter took (``SPANS_EXPORTED``, the exporter's too: what a summary calls delivered).

Shared (``os.memfd_create``, mode ``0600``, inherited by the export process as a file descriptor, so nothing is left
on disk or in ``/dev/shm`` when either side dies) or private (an anonymous mapping, for the in-process consumer).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import time
import weakref
from typing import Any, NamedTuple

from opentelemetry.trace import SpanContext, TraceFlags

from otel_hicache import semconv as sc
from otel_hicache._internal.shared.accumulation import Counters, Key, Layout
from otel_hicache._internal.shared.ids import ARENA_BYTES, IdRing, region_bytes
from otel_hicache.records import TransferRecord
from otel_hicache.semconv import Problem, TimingSource, TransferOperation

#: Longest write policy / io backend kept on a span, in UTF-8 bytes.
MAX_LABEL_BYTES = 32


class Link(NamedTuple):
    """A link to a request span, as plain values."""

    trace_id: int
    span_id: int
    trace_flags: int
    is_remote: bool


class Transfer(NamedTuple):
    """A checked transfer: every count an ``int``, pools known (or ``other``), links valid."""

    operation: TransferOperation
    tokens: list[tuple[str, int]]  # (pool, tokens), pools unique
    num_bytes: int
    bytes_by_pool: list[tuple[str, int]] | None
    submit_time_ns: int
    complete_time_ns: int
    copy_duration_s: float | None
    timing_source: TimingSource  # NONE exactly when copy_duration_s is None
    merged_ops: int
    node_count: int
    write_policy: str | None
    io_backend: str | None
    links: tuple[Link, ...]
    corrections: tuple[Problem, ...]  # what was normalized, each counted once for this record


# header slots
MAGIC, WRITE, READ, SETTLED, FLUSH_REQ, FLUSH_DONE, EXPORTER_PID, EXPORT_DROPPED, ID_SEED, START_NS, SPANS_EXPORTED = (
    range(11)
)
HEADER_INTS = 16
_MAGIC = 0x4849434143484532  # "HICACHE2": the table holds histograms

_OPS = list(sc.TransferOperation)
_OP_INDEX = {op: i for i, op in enumerate(_OPS)}
_SOURCES = list(sc.TimingSource)
_SOURCE_INDEX = {s: i for i, s in enumerate(_SOURCES)}

# operation, timing source, pools, links, split by pool; times, duration (NaN: none), bytes, counts, labels
_FIXED = struct.Struct(f"<5B3x qqd qqq {MAX_LABEL_BYTES}s{MAX_LABEL_BYTES}s")
_POOL = struct.Struct("<Hxxxxxxqq")  # pool index, tokens (-1: none), bytes (-1: not split by pool)
_LINK = struct.Struct("<16s8sBBxxxxxx")  # trace id, span id, trace flags, is_remote


def slot_size(pools: int) -> int:
    size = _FIXED.size + pools * _POOL.size + sc.MAX_LINKS * _LINK.size
    return (size + 7) & ~7


class Channel:
    """Header, counters and ring over one memory block; ``fd`` is set when the block can be shared. ``ids``: the id
    ring's arena in bytes (0: none; only a shared channel has one)."""

    def __init__(self, layout: Layout, capacity: int, *, shared: bool, fd: int | None = None, ids: int = 0) -> None:
        if capacity < 1:
            raise ValueError("the ring needs at least one slot")
        self.layout = layout
        self.capacity = capacity
        self.ids_bytes = ids
        self.slot = slot_size(len(layout.pools))
        self.ring_offset = (layout.end * 8 + 63) & ~63
        self.ids_offset = (self.ring_offset + capacity * self.slot + 63) & ~63
        size = self.ids_offset + region_bytes(ids)
        attach = fd is not None
        if shared and fd is None:
            fd = _anonymous_file(size)
        self.fd = fd
        # The descriptor is closed exactly once: by release_fd()/close(), or when the channel is dropped.
        self._close_fd = None if fd is None else weakref.finalize(self, os.close, fd)
        if self._close_fd is not None:
            self._close_fd.atexit = False  # at exit the shutdown still launches from it; the OS closes it after
        # Pages mapped in up front: no page fault on the hot path the first time a ring slot is written.
        populate = getattr(mmap, "MAP_POPULATE", 0)
        if fd is None:  # private: a forked child gets its own copy, never the parent's counts
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        else:
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
        self.ints = memoryview(self._map).cast("B").cast("q")
        self.floats = memoryview(self._map).cast("B").cast("d")  # the same slots, read as float64 (histogram sums)
        self.bytes = memoryview(self._map)
        self.counters = ChannelCounters(layout, self.ints, self.floats)
        self.ids = IdRing(self.bytes[self.ids_offset :]) if ids else None
        self._pool_index = {pool: i for i, pool in enumerate(layout.pools)}
        self._labels: dict[str | None, bytes] = {None: b""}
        if attach:
            if self.ints[MAGIC] != _MAGIC:
                raise ValueError("not an otel_hicache channel")
        else:
            self._stamp()

    def _stamp(self) -> None:
        self.ints[MAGIC] = _MAGIC
        self.ints[ID_SEED] = int.from_bytes(os.urandom(8), "little") >> 1  # this ring's span and trace ids
        self.ints[START_NS] = time.time_ns()  # the start of every cumulative point read from this table

    def private_copy(self) -> Channel:
        """A private channel with this one's header and counters and a one-slot ring: what a telemetry keeps
        counting into once its shared memory is released."""
        copy = Channel(self.layout, 1, shared=False)
        copy.ints[: self.layout.end] = self.ints[: self.layout.end]
        copy.ints[WRITE] = copy.ints[READ] = copy.ints[SETTLED] = copy.ints[EXPORTER_PID] = 0
        return copy

    def shared_copy(self) -> Channel:
        """A shared channel holding everything this private one holds, ring included: a telemetry that could not
        have shared memory at first moves into it once it can. Raises OSError when it still cannot."""
        copy = Channel(self.layout, self.capacity, shared=True, ids=self.ids_bytes or ARENA_BYTES)
        copy.bytes[: len(self.bytes)] = self.bytes
        return copy

    def reset(self) -> None:
        """Everything back to zero: counters, gauges, an empty ring (a forked child's private copy)."""
        self.bytes[:] = bytes(len(self.bytes))
        self._stamp()

    def release_fd(self) -> None:
        """Close the descriptor, keep the mapping (needed only to start an exporter)."""
        if self._close_fd is not None:
            self._close_fd()
        self.fd = None

    def close(self) -> None:
        """Unmap and close the descriptor; the memory lives on while the other side still maps it."""
        if self.ids is not None:
            self.ids.release()
        self.ints.release()
        self.floats.release()
        self.bytes.release()
        self._map.close()
        self.release_fd()

    # ------------------------------------------------------------------ producer (host, under its lock)
    def _label(self, value: str | None) -> bytes:
        """A label as the ring holds it, cut between characters (half of one would reach the span as U+FFFD); kept
        for the next record (write policies and io backends are a handful of names)."""
        cut = value.encode("utf-8", "replace")[:MAX_LABEL_BYTES] if value else b""
        encoded = cut.decode("utf-8", "ignore").encode("utf-8")
        if len(self._labels) < 256:
            self._labels[value] = encoded
        return encoded

    def put_transfer(self, t: Transfer) -> bool:
        """Pack a checked transfer into the next slot; False when the ring is full."""
        ints = self.ints
        write: int = ints[WRITE]
        if write - ints[SETTLED] >= self.capacity:
            return False
        buf, index, labels = self.bytes, self._pool_index, self._labels
        offset = self.ring_offset + (write % self.capacity) * self.slot
        tokens, by_pool, links = t.tokens, t.bytes_by_pool, t.links
        at = offset + _FIXED.size
        if by_pool is None:  # the common case, packed without an intermediate list
            n_pools = len(tokens)
            for pool, n in tokens:
                _POOL.pack_into(buf, at, index[pool], n, -1)
                at += _POOL.size
        else:  # (tokens, bytes) per pool; a pool may have bytes and no tokens (a sidecar)
            pools: dict[str, list[int]] = {pool: [n, -1] for pool, n in tokens}
            for pool, n in by_pool:
                pools.setdefault(pool, [-1, -1])[1] = n
            n_pools = len(pools)
            for pool, (n, size) in pools.items():
                _POOL.pack_into(buf, at, index[pool], n, size)
                at += _POOL.size
        for trace_id, span_id, flags, remote in links:
            _LINK.pack_into(buf, at, trace_id.to_bytes(16, "big"), span_id.to_bytes(8, "big"), flags, remote)
            at += _LINK.size
        policy, backend, duration = labels.get(t.write_policy), labels.get(t.io_backend), t.copy_duration_s
        if policy is None:
            policy = self._label(t.write_policy)
        if backend is None:
            backend = self._label(t.io_backend)
        _FIXED.pack_into(
            buf,
            offset,
            _OP_INDEX[t.operation],
            _SOURCE_INDEX[t.timing_source],
            n_pools,
            len(links),
            by_pool is not None,
            t.submit_time_ns,
            t.complete_time_ns,
            math.nan if duration is None else duration,
            t.num_bytes,
            t.merged_ops,
            t.node_count,
            policy,
            backend,
        )
        self.ints[WRITE] = write + 1
        return True

    def pending(self) -> int:
        return int(self.ints[WRITE] - self.ints[READ])

    # ------------------------------------------------------------------ consumer (exporter, one thread)
    def take(self, limit: int) -> list[TransferRecord]:
        """Decode up to ``limit`` transfers (one a slot), oldest first; their slots are free again at :meth:`settle`."""
        ints = self.ints
        read, write = ints[READ], ints[WRITE]
        end = min(write, read + limit)
        out = [self._decode(self.ring_offset + (i % self.capacity) * self.slot) for i in range(read, end)]
        ints[READ] = end
        return out

    def settle(self, upto: int | None = None) -> None:
        """Everything taken so far (or before the sequence number ``upto``) is done with (exported, or counted as
        lost): its slots are free again."""
        self.ints[SETTLED] = self.ints[READ] if upto is None else upto

    def _decode(self, offset: int) -> TransferRecord:
        buf, pools = self.bytes, self.layout.pools
        (
            which,
            source,
            n_pools,
            n_links,
            split,
            start,
            end,
            duration,
            num_bytes,
            merged,
            nodes,
            policy,
            backend,
        ) = _FIXED.unpack_from(buf, offset)
        at = offset + _FIXED.size
        tokens: dict[str, int] = {}
        by_pool: dict[str, int] = {}
        for _ in range(n_pools):
            index, n, size = _POOL.unpack_from(buf, at)
            at += _POOL.size
            if n >= 0:
                tokens[pools[index]] = n
            if size >= 0:
                by_pool[pools[index]] = size
        links = []
        for _ in range(n_links):
            links.append(_context(buf, at))
            at += _LINK.size
        return TransferRecord(
            operation=_OPS[which],
            tokens_by_pool=tokens,
            num_bytes=num_bytes,
            submit_time_ns=start,
            complete_time_ns=end,
            copy_duration_s=None if math.isnan(duration) else duration,
            timing_source=_SOURCES[source],
            merged_ops=merged,
            node_count=nodes,
            bytes_by_pool=by_pool if split else None,
            write_policy=_text(policy),
            io_backend=_text(backend),
            links=tuple(links),
        )


class ChannelCounters(Counters):
    """The table, plus what only the exporter counts: spans whose export failed are reported in
    ``otel_hicache.records.dropped{transfer}`` with those the host could not queue (one writer per slot: the host
    writes the table, the exporter ``EXPORT_DROPPED``); and the table's start, the start of its cumulative points."""

    @property
    def start_ns(self) -> int:
        return int(self.ints[START_NS])

    def values(self, name: str) -> dict[Key, int]:
        out = super().values(name)
        if name == sc.METRIC_RECORDS_DROPPED and self.ints[EXPORT_DROPPED]:
            key = (sc.RecordKind.TRANSFER.value,)
            out[key] = out.get(key, 0) + self.ints[EXPORT_DROPPED]
        return out


def _context(buf: memoryview, at: int) -> SpanContext:
    trace_id, span_id, flags, remote = _LINK.unpack_from(buf, at)
    return SpanContext(int.from_bytes(trace_id, "big"), int.from_bytes(span_id, "big"), bool(remote), TraceFlags(flags))


def _text(raw: bytes) -> str | None:
    text = raw.rstrip(b"\0").decode("utf-8", "replace")
    return text or None


def _anonymous_file(size: int) -> int:
    """A descriptor for ``size`` bytes of memory with no name anywhere (memfd where the OS has it)."""
    memfd_create: Any = getattr(os, "memfd_create", None)
    if memfd_create is not None:
        fd = int(memfd_create("otel-hicache"))  # close-on-exec: only the exporter gets it (pass_fds)
    else:  # an unlinked temporary file
        import tempfile

        handle, path = tempfile.mkstemp(prefix="otel-hicache-")
        os.unlink(path)
        fd = handle
    os.fchmod(fd, 0o600)  # the id ring is in it: no other user opens it (through /proc/<pid>/fd/N)
    os.ftruncate(fd, size)
    return fd
