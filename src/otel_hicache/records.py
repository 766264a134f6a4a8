"""Immutable records: what a producer hands to :class:`~otel_hicache.telemetry.HiCacheTelemetry`.

A record is a snapshot taken when the producer already knows the facts (an ack is complete, a drop happened), so
spans and metrics are derived from the record alone, never from live cache state. Records are ``NamedTuple`` s:
cheap to build on the scheduler thread. The mappings they hold are owned by the record: do not mutate them after
handing the record over.

All times are epoch nanoseconds on :data:`otel_hicache.timing.ANCHOR` (use :func:`otel_hicache.timing.now_ns`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from opentelemetry.trace import SpanContext

from otel_hicache.semconv import DropReason, PrefillMode, Tier, TimingSource, TransferOperation


class TransferRecord(NamedTuple):
    """One completed merged transfer (one ``HiCacheAck`` in SGLang).

    ``submit_time_ns`` is when the merged op was issued to the copy stream, ``complete_time_ns`` when its
    completion was observed (the ack polled complete); the span covers that interval. ``copy_duration_s`` is the
    copy time measured around the copy loop (device events or host clock), or ``None`` when timing is unavailable:
    then no duration is recorded rather than a wrong one.
    """

    operation: TransferOperation
    tokens_by_pool: Mapping[str, int]  # logical tokens; sidecars reusing another pool's indices excluded
    num_bytes: int  # all bytes moved, sidecars and draft piggyback included; 0 with tokens: not known (no span attr)
    submit_time_ns: int
    complete_time_ns: int
    copy_duration_s: float | None = None
    timing_source: TimingSource = TimingSource.NONE
    merged_ops: int = 1
    node_count: int = 0
    bytes_by_pool: Mapping[str, int] | None = None  # per-pool split when the producer knows it
    write_policy: str | None = None
    io_backend: str | None = None
    links: tuple[SpanContext, ...] = ()  # request spans this transfer served


class TransferFailure(NamedTuple):
    """A transfer that could not be issued or did not complete (pool full, storage write failed, ...)."""

    operation: TransferOperation
    error_type: str  # one of semconv.TRANSFER_ERRORS, else reported as _OTHER
    tokens_by_pool: Mapping[str, int]
    time_ns: int


class DropRecord(NamedTuple):
    """Device KV destroyed without a host copy."""

    reason: DropReason
    tokens_by_pool: Mapping[str, int]
    time_ns: int


class EvictedEntry(NamedTuple):
    """One entry (a radix node, a block, a page run) an eviction pass removed from a tier: what says whether the tier
    is the right size, and which moved KV was wasted.

    ``idle_s``: seconds since the entry was last used (hit or written) in that tier. ``reused``: whether it served any
    hit while in that tier. ``unread_bytes``: bytes a transfer wrote into that tier for this entry that nothing read
    back before the eviction, and ``written_by`` that transfer (by default ``backup`` for the host tier,
    ``storage_backup`` for storage, ``load_back`` for the device). None: the producer does not know.
    """

    tokens: int
    idle_s: float | None = None
    reused: bool | None = None
    unread_bytes: int = 0
    written_by: TransferOperation | None = None


class EvictionRecord(NamedTuple):
    """One eviction pass on a tier: token slots freed and its wall-clock duration, optionally per entry
    (``entries``; their tokens add up to at most ``num_tokens``, the rest counts as entries of unknown reuse)."""

    tier: Tier
    num_tokens: int
    duration_s: float
    time_ns: int
    entries: Sequence[EvictedEntry] = ()


class KvWait(NamedTuple):
    """How long one request's prefill waited for its KV to arrive from one tier: ``host`` (a load back before the
    forward that needs it) or ``storage`` (a prefetch, until the request was released). One per request and tier."""

    tier: Tier
    wait_s: float
    time_ns: int


class PrefixSplit(NamedTuple):
    """Where the tokens of one admitted prefill came from."""

    input_tokens: int  # computed (not cached)
    device_hit: int
    host_hit: int
    storage_hit: int

    def by_mode(self) -> dict[PrefillMode, int]:
        return {
            PrefillMode.INPUT: self.input_tokens,
            PrefillMode.DEVICE_HIT: self.device_hit,
            PrefillMode.HOST_HIT: self.host_hit,
            PrefillMode.STORAGE_HIT: self.storage_hit,
        }


class PoolUsage(NamedTuple):
    """Occupancy of one pool on one tier, in token slots (state slots for mamba)."""

    tier: Tier
    pool: str
    used: int
    limit: int
