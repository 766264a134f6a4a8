"""Transfer controller between the device (L1) and host (L2) pools, after SGLang's ``HiCacheController``.

``write`` / ``load`` allocate the destination slots (``None`` when that pool is full, recorded as a
:class:`TransferFailure`) and queue an op; ``start_writing`` / ``start_loading`` merge every pending op into one
transfer, issue its copies on a dedicated device->host / host->device stream (plain tensor copies on CPU) with a
timing event pair recorded around the copy loop only, and append one ack. ``poll_writes`` / ``poll_loads`` pop the
leading acks whose finish event ``query()`` is true (FIFO) and report each as one :class:`TransferRecord`.

A load can carry a :class:`KvWaiter`: the request whose prefill needs those pages, and an event recorded where its
forward runs (the compute stream; the host clock on a CPU) at the moment it started to need them. When the load's
ack is seen complete, the time from that event to the copy's finish event is the request's ``hicache.request.kv_wait``
on tier ``host`` (read from events already complete, never synchronising); a copy that finished before the request
needed it is no wait and records nothing. The load's transfer record links to the request's span.

Counting follows SGLang: tokens per owning pool (sidecars that reuse another pool's indices excluded), bytes of
everything copied (sidecars and draft piggyback included), both fixed at submit time so the per-ack path only reads
the clock, the events and hands the record over.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from opentelemetry.trace import Span, SpanContext

from otel_hicache.cache.pools import PoolGroup, Value
from otel_hicache.records import KvWait, TransferFailure, TransferRecord
from otel_hicache.semconv import Tier, TimingSource, TransferOperation
from otel_hicache.telemetry import HiCacheTelemetry
from otel_hicache.timing import elapsed_seconds, make_timing_event_pair, now_ns

BACKUP = TransferOperation.BACKUP
LOAD_BACK = TransferOperation.LOAD_BACK


class _Op(NamedTuple):
    src: Value
    dst: Value
    node_id: int


class KvWaiter(NamedTuple):
    """A request waiting for a load back: when it started to need the KV, and its span (or None)."""

    needed: Any  # a timing event, of the same kind as the acks' (see CacheController.mark_needed)
    request_span: Span | None = None


class _Ack(NamedTuple):
    start: Any
    finish: Any
    source: TimingSource
    node_ids: list[int]
    tokens_by_pool: dict[str, int]
    num_bytes: int
    bytes_by_pool: dict[str, int]
    merged_ops: int
    submit_ns: int
    waiter: KvWaiter | None = None
    links: tuple[SpanContext, ...] = ()


class CopyStats:
    """Ground truth counted where the copies happen: slots and bytes of the tensors actually copied."""

    def __init__(self) -> None:
        self.slots: collections.Counter[tuple[str, str]] = collections.Counter()  # (operation, pool)
        self.bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.transfers: collections.Counter[str] = collections.Counter()


class CacheController:
    """Merged D<->H transfers on dedicated streams, acknowledged in FIFO order through the telemetry core."""

    def __init__(
        self,
        device: PoolGroup,
        host: PoolGroup,
        telemetry: HiCacheTelemetry,
        *,
        write_policy: str | None = None,
        io_backend: str = "direct",
    ) -> None:
        self.device, self.host, self.telemetry = device, host, telemetry
        self.write_policy, self.io_backend = write_policy, io_backend
        self.device_type = device.device.type
        self._cuda = self.device_type == "cuda"
        self.d2h_stream = torch.cuda.Stream() if self._cuda else None
        self.h2d_stream = torch.cuda.Stream() if self._cuda else None
        self.write_queue: list[_Op] = []
        self.load_queue: list[_Op] = []
        self.ack_write_queue: collections.deque[_Ack] = collections.deque()
        self.ack_load_queue: collections.deque[_Ack] = collections.deque()
        self.stats = CopyStats()
        self._layout = self._count_layout()

    # ------------------------------------------------------------------ queueing
    def write(self, device_value: Value, node_id: int) -> Value | None:
        """Host slots for a D->H backup of ``device_value``, queued; None (and a failure record) if the host is full."""
        host_value, _ = self.host.alloc(self._token_pages(device_value), self._has_state(device_value))
        if host_value is None:
            self._fail(BACKUP, "host_pool_full", device_value, self.device)
            return None
        self.write_queue.append(_Op(device_value, host_value, node_id))
        return host_value

    def load(self, host_value: Value, node_id: int) -> Value | None:
        """Device slots for an H->D load of ``host_value``, queued; None (and a failure record) if it is full."""
        device_value, _ = self.device.alloc(self._token_pages(host_value), self._has_state(host_value))
        if device_value is None:
            self._fail(LOAD_BACK, "device_pool_full", host_value, self.host)
            return None
        self.load_queue.append(_Op(host_value, device_value, node_id))
        return device_value

    def cancel_loads(self, count: int) -> None:
        """Take back the last ``count`` queued loads, not yet issued (their device slots are the caller's to free)."""
        if count > 0:
            del self.load_queue[-count:]

    def start_writing(self) -> None:
        if self.write_queue:
            ops, self.write_queue = self.write_queue, []
            self.ack_write_queue.append(self._submit(BACKUP, ops, self.device, self.host, self.d2h_stream))

    def start_loading(self, waiter: KvWaiter | None = None) -> None:
        """Issue every queued load as one merged transfer; ``waiter``: the request whose prefill needs them."""
        if self.load_queue:
            ops, self.load_queue = self.load_queue, []
            ack = self._submit(LOAD_BACK, ops, self.host, self.device, self.h2d_stream)
            if waiter is not None:
                ack = ack._replace(waiter=waiter, links=span_links(waiter.request_span))
            self.ack_load_queue.append(ack)

    def mark_needed(self) -> Any:
        """An event recorded now where the forward runs (the current CUDA stream; the host clock on a CPU), of the
        same kind as the acks' timing events, so a load's finish can be timed against it (:class:`KvWaiter`)."""
        needed, _, _ = make_timing_event_pair(self.device_type)
        needed.record()
        return needed

    # ------------------------------------------------------------------ completion (scheduler hot path)
    def poll_writes(self) -> list[int]:
        """Node ids of every leading write ack already complete; each ack is reported once."""
        return self._poll(self.ack_write_queue, BACKUP)

    def poll_loads(self) -> list[int]:
        return self._poll(self.ack_load_queue, LOAD_BACK)

    def wait_writes(self) -> list[int]:
        """Blocking: submit pending writes and wait for every write ack (write_back's backup inside eviction)."""
        self.start_writing()
        for ack in self.ack_write_queue:
            ack.finish.synchronize()
        return self._poll(self.ack_write_queue, BACKUP)

    def wait_loads(self) -> list[int]:
        self.start_loading()
        for ack in self.ack_load_queue:
            ack.finish.synchronize()
        return self._poll(self.ack_load_queue, LOAD_BACK)

    def fence_loads(self) -> None:
        """Make the compute stream wait for issued loads (device-side, no host synchronisation)."""
        if self._cuda and self.h2d_stream is not None:
            torch.cuda.current_stream().wait_stream(self.h2d_stream)

    def _poll(self, queue: collections.deque[_Ack], op: TransferOperation) -> list[int]:
        done: list[int] = []
        record_transfer = self.telemetry.record_transfer
        while queue and queue[0].finish.query():
            ack = queue.popleft()
            done.extend(ack.node_ids)
            if ack.waiter is not None:
                # From when the request needed the KV to the copy's finish; None (no wait) if it finished first.
                wait = elapsed_seconds(ack.waiter.needed, ack.finish)
                if wait:
                    self.telemetry.record_kv_wait(KvWait(Tier.HOST, wait, now_ns()), ack.waiter.request_span)
            record_transfer(
                TransferRecord(
                    operation=op,
                    tokens_by_pool=ack.tokens_by_pool,
                    num_bytes=ack.num_bytes,
                    submit_time_ns=ack.submit_ns,
                    complete_time_ns=now_ns(),
                    copy_duration_s=elapsed_seconds(ack.start, ack.finish),
                    timing_source=ack.source,
                    merged_ops=ack.merged_ops,
                    node_count=len(ack.node_ids),
                    bytes_by_pool=ack.bytes_by_pool,
                    write_policy=self.write_policy,
                    io_backend=self.io_backend,
                    links=ack.links,
                )
            )
        return done

    # ------------------------------------------------------------------ issuing
    def _submit(self, op: TransferOperation, ops: list[_Op], src: PoolGroup, dst: PoolGroup, stream: Any) -> _Ack:
        # Merge: one page list per pool over all ops, so the whole flush is one transfer and one ack.
        src_pages: dict[str, list[int]] = {}
        dst_pages: dict[str, list[int]] = {}
        for o in ops:
            for name, pages in o.src.items():
                src_pages.setdefault(name, []).extend(pages)
                dst_pages.setdefault(name, []).extend(o.dst[name])
        tokens, bytes_by_pool = self._count(src, src_pages)
        start, finish, source = make_timing_event_pair(self.device_type)
        submit_ns = now_ns()
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            if stream is not None:  # the copy must see KV the compute stream wrote, and land before reuse
                stream.wait_stream(torch.cuda.current_stream())
            start.record()
            self._copy_loop(op, src, dst, src_pages, dst_pages)
            finish.record()
        self.stats.transfers[op.value] += 1
        return _Ack(
            start,
            finish,
            source,
            [o.node_id for o in ops],
            tokens,
            sum(bytes_by_pool.values()),
            bytes_by_pool,
            len(ops),
            submit_ns,
        )

    def _copy_loop(
        self,
        op: TransferOperation,
        src: PoolGroup,
        dst: PoolGroup,
        src_pages: Mapping[str, list[int]],
        dst_pages: Mapping[str, list[int]],
    ) -> None:
        stats_slots, stats_bytes, non_blocking = self.stats.slots, self.stats.bytes, self._cuda
        jobs = [(name, name) for name in src_pages]
        jobs += [(car, owner) for car, owner in src.sidecars if owner in src_pages]
        for name, index_pool in jobs:
            s_buf, d_buf = src.pools[name].buffer, dst.pools[name].buffer
            size = src.pools[name].page_size
            # Coalesce runs of pages consecutive on both sides into one strided copy.
            for s0, d0, n in _runs(src_pages[index_pool], dst_pages[index_pool]):
                out = d_buf[:, d0 * size : (d0 + n) * size]
                out.copy_(s_buf[:, s0 * size : (s0 + n) * size], non_blocking=non_blocking)
                stats_slots[(op.value, name)] += n * size
                stats_bytes[(op.value, name)] += out.numel() * out.element_size()

    # ------------------------------------------------------------------ counting
    def _count_layout(self) -> tuple[dict[str, int], dict[str, list[str]]]:
        per_slot = {name: p.spec.bytes_per_slot for name, p in self.host.pools.items()}
        riders: dict[str, list[str]] = {}
        for car, owner in self.host.sidecars:
            riders.setdefault(owner, []).append(car)
        return per_slot, riders

    def _count(self, group: PoolGroup, pages: Mapping[str, list[int]]) -> tuple[dict[str, int], dict[str, int]]:
        """SGLang's rule: tokens per owning pool; bytes per pool, sidecars sized by the slots of the pool they ride."""
        per_slot, riders = self._layout
        tokens: dict[str, int] = {}
        bytes_by_pool: dict[str, int] = {}
        for name, p in pages.items():
            slots = len(p) * group.pools[name].page_size
            tokens[name] = slots
            bytes_by_pool[name] = slots * per_slot[name]
            for car in riders.get(name, ()):
                bytes_by_pool[car] = slots * per_slot[car]
        return tokens, bytes_by_pool

    def bytes_of(self, value: Mapping[str, list[int]]) -> int:
        """Bytes a transfer of ``value`` (a node's pages on either tier) moves: what its backup wrote."""
        return sum(self._count(self.host, value)[1].values())

    def _token_pages(self, value: Mapping[str, list[int]]) -> int:
        return len(value.get(self.device.anchor, ()))

    def _has_state(self, value: Mapping[str, list[int]]) -> bool:
        return any(self.device.pools[name].spec.per_node for name in value)

    def _fail(self, op: TransferOperation, error: str, value: Value, group: PoolGroup) -> None:
        tokens = {name: len(pages) * group.pools[name].page_size for name, pages in value.items()}
        self.telemetry.record_failure(
            TransferFailure(operation=op, error_type=error, tokens_by_pool=tokens, time_ns=now_ns())
        )


def span_links(span: Span | None) -> tuple[SpanContext, ...]:
    """The link to ``span`` a transfer that served its request carries (none for no span or an invalid one)."""
    if span is None:
        return ()
    context = span.get_span_context()
    return (context,) if context.is_valid else ()


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs of pages consecutive on both sides."""
    out: list[tuple[int, int, int]] = []
    if not src:
        return out
    s0, d0, n = src[0], dst[0], 1
    for s, d in zip(src[1:], dst[1:], strict=True):
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            out.append((s0, d0, n))
            s0, d0, n = s, d, 1
    out.append((s0, d0, n))
    return out
