"""The otel_hicache vocabulary: every metric name, unit, attribute key, closed value set and bucket list.

Engine-neutral: nothing else in the core spells a name, and an engine's own names (its pool names, how its metrics
map onto ours) live in its integration, e.g. :mod:`otel_hicache.integrations.sglang.semconv`. Attribute values are
closed sets, so the number of series is bounded by ``operations x pools x reasons`` whatever a producer sends: an
unknown pool name is reported as ``other`` (see :data:`POOLS`).
"""

from __future__ import annotations

from enum import Enum
from typing import Final, NamedTuple


class _StrEnum(str, Enum):
    def __str__(self) -> str:
        return str(self.value)


# --------------------------------------------------------------------------- closed value sets
class TransferOperation(_StrEnum):
    """Direction of a merged transfer between tiers."""

    BACKUP = "backup"  # L1 device -> L2 host (D->H)
    LOAD_BACK = "load_back"  # L2 host -> L1 device (H->D)
    STORAGE_BACKUP = "storage_backup"  # L2 host -> L3 storage
    STORAGE_PREFETCH = "storage_prefetch"  # L3 storage -> L2 host


class Tier(_StrEnum):
    DEVICE = "device"  # L1
    HOST = "host"  # L2
    STORAGE = "storage"  # L3


class DropReason(_StrEnum):
    """Why device KV was destroyed with no host copy (SGLang's definitions)."""

    HOST_PRESSURE = "host_pressure"  # write_back: the host pool could not take the backup
    WRITE_THROUGH_UNBACKED_EVICTION = "write_through_unbacked_eviction"  # write_through: evicted before backed up
    OTHER = "other"  # a reason the producer names and we do not know (counted, and noted in records.normalized)


class PrefillMode(_StrEnum):
    """How a prefill token was obtained: computed (input) or hit in one of the tiers."""

    INPUT = "input"
    DEVICE_HIT = "device_hit"
    HOST_HIT = "host_hit"
    STORAGE_HIT = "storage_hit"
    OTHER = "other"  # a hit of a kind we do not know (an engine's new counter): counted, never lost


class TimingSource(_StrEnum):
    """Where a transfer's copy duration came from."""

    CUDA_EVENT = "cuda_event"  # torch.cuda.Event pair on the transfer stream
    HOST_CLOCK = "host_clock"  # monotonic host clock around a synchronous copy
    NONE = "none"  # timing unavailable: no duration recorded


class WritePolicy(_StrEnum):
    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


class SlotState(_StrEnum):
    USED = "used"
    FREE = "free"


#: Engine-neutral pool kinds: full-attention KV, sliding-window KV, recurrent (mamba / SSM) state, the sparse-attention
#: indexer and the speculative-decoding draft model's KV. An engine adapter declares its own pool names on top
#: (``HiCacheTelemetry(extra_pools=...)``; SGLang's are in :mod:`otel_hicache.integrations.sglang.semconv`). Any other
#: name a producer reports is counted as ``other``, with a one-time warning and a self-metric.
POOLS: Final[frozenset[str]] = frozenset({"kv", "swa", "mamba", "indexer", "draft"})
OTHER_POOL: Final = "other"
DEFAULT_POOL: Final = "kv"

#: ``error.type`` values for failed transfers. Anything else is reported as ``_OTHER`` (OTel convention).
TRANSFER_ERRORS: Final[frozenset[str]] = frozenset(
    {
        "host_pool_full",
        "device_pool_full",
        "storage_write_failed",
        "storage_read_failed",
        "storage_queue_full",
        "cancelled",
        "copy_failed",
    }
)
OTHER_ERROR: Final = "_OTHER"


#: What kind of record a self-metric point is about (``otel_hicache.record.kind``).
class RecordKind(_StrEnum):
    TRANSFER = "transfer"
    FAILURE = "failure"
    DROP = "drop"
    EVICTION = "eviction"
    PREFIX_SPLIT = "prefix_split"
    POOL_USAGE = "pool_usage"
    KV_WAIT = "kv_wait"
    ENGINE_CHECK = "engine_check"
    CAPACITY = "capacity"  # a request's prefix lookup handed to the capacity estimator (otel_hicache.capacity)


class Problem(_StrEnum):
    """Why a record was refused (``otel_hicache.records.rejected``) or corrected (``...records.normalized``)."""

    # refused: nothing of the record was counted
    MALFORMED = "malformed"  # not a record of that kind, or reading it raised
    UNKNOWN_OPERATION = "unknown_operation"
    UNKNOWN_TIER = "unknown_tier"
    UNKNOWN_TIMING_SOURCE = "unknown_timing_source"  # or a duration whose source says "none"
    BAD_COUNT = "bad_count"  # not an integer
    NEGATIVE_COUNT = "negative_count"
    ABSURD_COUNT = "absurd_count"
    BYTES_MISMATCH = "bytes_mismatch"  # bytes per pool do not add up to the total
    BAD_DURATION = "bad_duration"
    END_BEFORE_START = "end_before_start"
    ENTRIES_EXCEED_TOTAL = "entries_exceed_total"  # an eviction's entries hold more tokens than the pass freed
    TOO_MANY_ENTRIES = "too_many_entries"  # an eviction record details more entries than MAX_EVICTION_ENTRIES
    BUILD_FAILED = "build_failed"  # a deferred record's builder raised or returned no record
    QUEUE_FULL = "queue_full"  # a deferred record could not be queued: shed, never built
    SOURCE_FAILED = "source_failed"  # a pool-usage source or an engine check raised
    # corrected: the record was counted
    UNKNOWN_POOL = "unknown_pool"  # reported as pool "other"
    UNKNOWN_REASON = "unknown_reason"  # a drop reason we do not know: reported as reason "other"
    BAD_LINK = "bad_link"  # a link that is not a valid SpanContext was left out
    LINKS_TRUNCATED = "links_truncated"  # more links than a span keeps (MAX_LINKS)
    BAD_ATTRIBUTE = "bad_attribute"  # a write policy or io backend that is not a string was left out


#: Links a transfer span keeps; more are left out and counted (``links_truncated``).
MAX_LINKS: Final = 8
#: Entries one eviction record may detail (its tokens count whole; a producer with more entries reports its first ones,
#: the rest as tokens of unknown reuse). A record with more is refused (``too_many_entries``): the bound keeps the
#: caller's work per record under 1 ms.
MAX_EVICTION_ENTRIES: Final = 1024
#: Pool names a producer may add to :data:`POOLS` (``HiCacheTelemetry(extra_pools=...)``): a bound on cardinality.
MAX_EXTRA_POOLS: Final = 64

# --------------------------------------------------------------------------- attribute keys
ATTR_OPERATION: Final = "hicache.operation"
ATTR_POOL: Final = "hicache.pool"
ATTR_TIER: Final = "hicache.tier"
ATTR_DROP_REASON: Final = "hicache.drop.reason"
ATTR_PREFILL_MODE: Final = "hicache.prefill.mode"
#: Whether a token slot of a pool is used or free (``hicache.pool.usage``).
#: Whether a token slot of a pool is used or free (``hicache.pool.usage``).
ATTR_SLOT_STATE: Final = "hicache.slot.state"
ATTR_ERROR_TYPE: Final = "error.type"
ATTR_TIMING_SOURCE: Final = "hicache.timing.source"
#: Whether an evicted entry served any hit while in the tier it was evicted from (a boolean; absent: unknown).
ATTR_EVICTION_REUSED: Final = "hicache.eviction.reused"

#: The size factor of a tier in ``hicache.capacity.hit_ratio``: one of :data:`CAPACITY_FACTORS`.
ATTR_CAPACITY_FACTOR: Final = "hicache.capacity.factor"

#: What-if sizes of a tier, as a factor of its capacity today (``inf``: unbounded, the ceiling), and their values.
CAPACITY_FACTORS: Final[tuple[str, ...]] = ("0.25", "0.5", "1", "2", "4", "8", "inf")
CAPACITY_FACTOR_VALUES: Final[dict[str, float]] = {f: float(f) for f in CAPACITY_FACTORS}

# span-only attributes
ATTR_TOKENS: Final = "hicache.transfer.token_count"  # total logical tokens
ATTR_BYTES: Final = "hicache.transfer.byte_count"  # total bytes
#: Per pool, as templates: f"{ATTR_POOL_TOKENS}.{pool}" (logical tokens), f"{ATTR_POOL_BYTES}.{pool}" (bytes, where the
#: producer knows them). No name is also a namespace: the totals have names of their own.
ATTR_POOL_TOKENS: Final = "hicache.transfer.tokens"
ATTR_POOL_BYTES: Final = "hicache.transfer.bytes"
ATTR_MERGED_OPS: Final = "hicache.transfer.merged_ops"
ATTR_NODES: Final = "hicache.transfer.nodes"
ATTR_COPY_DURATION: Final = "hicache.transfer.copy_duration"  # seconds, device-measured copy time
ATTR_WRITE_POLICY: Final = "hicache.write_policy"
ATTR_IO_BACKEND: Final = "hicache.io_backend"
ATTR_PREFIX_TOKENS: Final = "hicache.prefix.tokens"  # per mode on request spans: f"{ATTR_PREFIX_TOKENS}.{mode}"
#: Seconds a request waited for its KV, per tier, on request spans: f"{ATTR_KV_WAIT}.{tier}".
ATTR_KV_WAIT: Final = "hicache.kv_wait"

# resource attributes (ranks go on the Resource, never on a metric point)
RESOURCE_TP_RANK: Final = "hicache.rank.tp"
RESOURCE_PP_RANK: Final = "hicache.rank.pp"
RESOURCE_DP_RANK: Final = "hicache.rank.dp"
#: The rank inside the attention tensor-parallel group (SGLang's ``attn_tp_rank``; equals the TP rank without attention
#: data or context parallelism).
RESOURCE_ATTN_TP_RANK: Final = "hicache.rank.attn_tp"
#: Which engine produced the telemetry (a Resource attribute, so one dashboard and one set of rules serve every engine).
RESOURCE_ENGINE: Final = "hicache.engine"


class Engine(_StrEnum):
    """Values of :data:`RESOURCE_ENGINE`, set by each adapter through ``configure(resource_attributes=...)``."""

    SGLANG = "sglang"
    VLLM = "vllm"
    REFERENCE = "reference"  # otel_hicache's own reference cache (otel_hicache.cache, the CLI demo)


# self-telemetry attributes
ATTR_RECORD_KIND: Final = "otel_hicache.record.kind"
ATTR_PROBLEM: Final = "otel_hicache.problem"
ATTR_INSTRUMENT: Final = "otel_hicache.instrument"  # one of our instrument names (INSTRUMENTS)

# --------------------------------------------------------------------------- instruments
METRIC_TRANSFER_TOKENS: Final = "hicache.transfer.tokens"
METRIC_TRANSFER_SIZE: Final = "hicache.transfer.size"
METRIC_TRANSFER_DURATION: Final = "hicache.transfer.duration"
METRIC_TRANSFER_FAILURES: Final = "hicache.transfer.failures"
METRIC_DROPPED_TOKENS: Final = "hicache.dropped.tokens"
METRIC_EVICTION_TOKENS: Final = "hicache.eviction.tokens"
METRIC_EVICTION_DURATION: Final = "hicache.eviction.duration"
METRIC_EVICTION_AGE: Final = "hicache.eviction.age"
METRIC_WASTED_SIZE: Final = "hicache.wasted.size"
METRIC_REQUEST_KV_WAIT: Final = "hicache.request.kv_wait"
METRIC_PREFILL_TOKENS: Final = "hicache.prefill.tokens"
METRIC_POOL_USAGE: Final = "hicache.pool.usage"
METRIC_POOL_LIMIT: Final = "hicache.pool.limit"
METRIC_CAPACITY_HIT_RATIO: Final = "hicache.capacity.hit_ratio"
METRIC_CAPACITY_TOKENS: Final = "hicache.capacity.tokens"
METRIC_CAPACITY_LOOKUPS: Final = "hicache.capacity.lookups"
METRIC_CAPACITY_SAMPLED_PAGES: Final = "hicache.capacity.sampled_pages"
METRIC_RECORDS_REJECTED: Final = "otel_hicache.records.rejected"
METRIC_RECORDS_NORMALIZED: Final = "otel_hicache.records.normalized"
METRIC_RECORDS_DROPPED: Final = "otel_hicache.records.dropped"
METRIC_ENGINE_MISMATCH: Final = "otel_hicache.engine.mismatch"

UNIT_TOKEN: Final = "{token}"
UNIT_BYTE: Final = "By"
UNIT_SECOND: Final = "s"
UNIT_TRANSFER: Final = "{transfer}"
UNIT_RECORD: Final = "{record}"
UNIT_MISMATCH: Final = "{mismatch}"
UNIT_RATIO: Final = "1"
UNIT_LOOKUP: Final = "{lookup}"
UNIT_PAGE: Final = "{page}"

#: Transfer copy durations: ~100 us (a small H->D load back) up to 60 s (a blocking write-back backup).
TRANSFER_DURATION_BUCKETS: Final[tuple[float, ...]] = (  # unformatted: a row of numbers, not one a line
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
#: Eviction passes (wall clock, includes blocking write-back copies).
EVICTION_DURATION_BUCKETS: Final[tuple[float, ...]] = (  # unformatted: a row of numbers, not one a line
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

#: How long a request's prefill waited for its KV to arrive from a tier: a fast load back to a slow L3 prefetch.
KV_WAIT_BUCKETS: Final[tuple[float, ...]] = TRANSFER_DURATION_BUCKETS
#: Time since an evicted entry was last used: a tier that evicts entries seconds after their last use is too small.
EVICTION_AGE_BUCKETS: Final[tuple[float, ...]] = (  # unformatted: a row of numbers, not one a line
    0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0,
)  # fmt: skip


class Feed(_StrEnum):
    """What an instrument's points are made of (the emitter reads each instrument the way its row says)."""

    COUNTERS = "counters"  # an observable counter over the exact slot table (one slot per series)
    TRANSFERS = "transfers"  # each timed transfer's copy duration, by operation and timing source, into the table
    POINTS = "points"  # values a producer call adds to the table (Tally.observe), by the row's attributes
    POOL_USAGE = "pool_usage"  # the last pool reading: used and free slots
    POOL_LIMIT = "pool_limit"  # the last pool reading: capacity
    CAPACITY = "capacity"  # the capacity estimator's last curve per tier (otel_hicache.capacity)
    CAPACITY_WARMTH = "capacity_warmth"  # what that curve rests on: its capacity, lookups (decayed), sampled pages


#: In a row's ``seeds``: the pools a telemetry pre-seeds (``HiCacheTelemetry(pools=...)``; SGLang pre-seeds ``kv``).
SEED_POOLS: Final[tuple[str, ...]] = ("<the telemetry's seeded pools>",)


class InstrumentSpec(NamedTuple):
    """One instrument: everything the pipeline needs to count, export and seed it.

    ``kind`` is what the sink creates: ``counter`` (an observable counter reading exact accumulators),
    ``histogram``, ``observable_up_down_counter`` (pool occupancy gauges) or ``observable_gauge`` (a value that is
    not a sum: the capacity curve); ``feed`` what its points are made of;
    ``attributes`` its closed attribute keys, in the order of a series' key; ``optional`` those a producer may leave
    out (the series then has no such attribute); ``buckets`` a histogram's boundaries; ``seeds``, per attribute, the
    values whose series are reported at 0 before anything happened (as SGLang pre-seeds its own, so ``rate()``
    works from the start; None: absent, :data:`SEED_POOLS`: the telemetry's seeded pools), or ``()``: none seeded.
    A new instrument is a row here plus the producer call that feeds it.
    """

    name: str
    kind: str
    unit: str
    description: str
    attributes: tuple[str, ...]
    buckets: tuple[float, ...] | None = None
    feed: Feed = Feed.COUNTERS
    optional: tuple[str, ...] = ()
    seeds: tuple[tuple[object, ...], ...] = ()


_KNOWN_REASONS = tuple(reason for reason in DropReason if reason is not DropReason.OTHER)
_KNOWN_MODES = tuple(mode for mode in PrefillMode if mode is not PrefillMode.OTHER)

INSTRUMENTS: Final[tuple[InstrumentSpec, ...]] = (
    InstrumentSpec(
        METRIC_TRANSFER_TOKENS,
        "counter",
        UNIT_TOKEN,
        "Logical tokens moved by completed merged transfers, by operation and pool. Sidecar transfers that reuse "
        "another pool's indices are not counted.",
        (ATTR_OPERATION, ATTR_POOL),
        seeds=(tuple(TransferOperation), SEED_POOLS),
    ),
    InstrumentSpec(
        METRIC_TRANSFER_SIZE,
        "counter",
        UNIT_BYTE,
        "Bytes moved by completed merged transfers, sidecar and draft piggyback included, by how the copy was timed "
        "(none: untimed). hicache.pool is present only where the producer reports bytes per pool (SGLang reports one "
        "total per ack). Bandwidth = bytes of one timing source / the duration sum of the same source.",
        (ATTR_OPERATION, ATTR_POOL, ATTR_TIMING_SOURCE),
        optional=(ATTR_POOL,),
        seeds=(tuple(TransferOperation), (None,), tuple(TimingSource)),
    ),
    InstrumentSpec(
        METRIC_TRANSFER_DURATION,
        "histogram",
        UNIT_SECOND,
        "Copy time of a merged transfer, measured on the device (CUDA events) or by the host clock around a "
        "synchronous copy. Transfers without timing record nothing here.",
        (ATTR_OPERATION, ATTR_TIMING_SOURCE),
        TRANSFER_DURATION_BUCKETS,
        feed=Feed.TRANSFERS,
    ),
    InstrumentSpec(
        METRIC_TRANSFER_FAILURES,
        "counter",
        UNIT_TRANSFER,
        "Transfers that could not be issued or completed.",
        (ATTR_OPERATION, ATTR_ERROR_TYPE),
    ),
    InstrumentSpec(
        METRIC_DROPPED_TOKENS,
        "counter",
        UNIT_TOKEN,
        "Device KV tokens destroyed without a host copy.",
        (ATTR_DROP_REASON, ATTR_POOL),
        seeds=(_KNOWN_REASONS, SEED_POOLS),  # "other" appears only when a producer names a reason we do not know
    ),
    InstrumentSpec(
        METRIC_EVICTION_TOKENS,
        "counter",
        UNIT_TOKEN,
        "Token slots freed by eviction, backed up or not; hicache.eviction.reused says whether the evicted entries "
        "served any hit while in that tier (absent where the producer does not know).",
        (ATTR_TIER, ATTR_EVICTION_REUSED),
        optional=(ATTR_EVICTION_REUSED,),
        seeds=((Tier.DEVICE, Tier.HOST), (None, True, False)),
    ),
    InstrumentSpec(
        METRIC_EVICTION_DURATION,
        "histogram",
        UNIT_SECOND,
        "Wall-clock time of an eviction pass, blocking write-back copies included.",
        (ATTR_TIER,),
        EVICTION_DURATION_BUCKETS,
        feed=Feed.POINTS,
    ),
    InstrumentSpec(
        METRIC_EVICTION_AGE,
        "histogram",
        UNIT_SECOND,
        "Time since an evicted entry was last used (hit or written) in the tier it was evicted from, one point per "
        "entry: short ages mean the tier is too small for the reuse distance.",
        (ATTR_TIER,),
        EVICTION_AGE_BUCKETS,
        feed=Feed.POINTS,
    ),
    InstrumentSpec(
        METRIC_WASTED_SIZE,
        "counter",
        UNIT_BYTE,
        "Bytes a transfer wrote into a tier that were evicted from it without ever being read back, by the operation "
        "that wrote them (backup and storage_prefetch: into host memory; storage_backup: into storage; load_back: "
        "into device memory).",
        (ATTR_OPERATION,),
        seeds=((TransferOperation.BACKUP, TransferOperation.STORAGE_BACKUP),),
    ),
    InstrumentSpec(
        METRIC_REQUEST_KV_WAIT,
        "histogram",
        UNIT_SECOND,
        "How long a request's prefill waited for its KV to arrive from a tier (host: load back before the forward "
        "that needs it; storage: prefetch until the request is released). Requests that waited for nothing record "
        "nothing.",
        (ATTR_TIER,),
        KV_WAIT_BUCKETS,
        feed=Feed.POINTS,
    ),
    InstrumentSpec(
        METRIC_PREFILL_TOKENS,
        "counter",
        UNIT_TOKEN,
        "Prefill tokens by how they were obtained: computed (input) or hit in a tier.",
        (ATTR_PREFILL_MODE,),
        seeds=(_KNOWN_MODES,),  # "other" appears only when a producer reports hits of a kind we do not know
    ),
    InstrumentSpec(
        METRIC_POOL_USAGE,
        "observable_up_down_counter",
        UNIT_TOKEN,
        "Token slots of a pool in use or free, per tier.",
        (ATTR_TIER, ATTR_POOL, ATTR_SLOT_STATE),
        feed=Feed.POOL_USAGE,
    ),
    InstrumentSpec(
        METRIC_POOL_LIMIT,
        "observable_up_down_counter",
        UNIT_TOKEN,
        "Capacity of a pool in token slots, per tier.",
        (ATTR_TIER, ATTR_POOL),
        feed=Feed.POOL_LIMIT,
    ),
    InstrumentSpec(
        METRIC_CAPACITY_HIT_RATIO,
        "observable_gauge",
        UNIT_RATIO,
        "Predicted share of prompt tokens served by this tier or a faster one if this tier held "
        "hicache.capacity.factor times its capacity today, the other tiers unchanged (1: the model at today's size; "
        "inf: the ceiling, all but first-time tokens), from sampled reuse distances of the prefix lookups.",
        (ATTR_TIER, ATTR_CAPACITY_FACTOR),
        feed=Feed.CAPACITY,
    ),
    InstrumentSpec(
        METRIC_CAPACITY_TOKENS,
        "observable_gauge",
        UNIT_TOKEN,
        "The tier's capacity today in tokens, which the capacity curve's factors multiply.",
        (ATTR_TIER,),
        feed=Feed.CAPACITY_WARMTH,
    ),
    InstrumentSpec(
        METRIC_CAPACITY_LOOKUPS,
        "observable_gauge",
        UNIT_LOOKUP,
        "Prefix lookups behind the tier's capacity curve, halved every 10,000 (how warm the curve is).",
        (ATTR_TIER,),
        feed=Feed.CAPACITY_WARMTH,
    ),
    InstrumentSpec(
        METRIC_CAPACITY_SAMPLED_PAGES,
        "observable_gauge",
        UNIT_PAGE,
        "Pages the capacity estimator behind the tier's curve samples now (at most 8,192).",
        (ATTR_TIER,),
        feed=Feed.CAPACITY_WARMTH,
    ),
    InstrumentSpec(
        METRIC_RECORDS_REJECTED,
        "counter",
        UNIT_RECORD,
        "Records otel_hicache refused (malformed); nothing of them was counted.",
        (ATTR_RECORD_KIND, ATTR_PROBLEM),
    ),
    InstrumentSpec(
        METRIC_RECORDS_NORMALIZED,
        "counter",
        UNIT_RECORD,
        "Records counted after a correction (an unknown pool reported as other).",
        (ATTR_RECORD_KIND, ATTR_PROBLEM),
    ),
    InstrumentSpec(
        METRIC_RECORDS_DROPPED,
        "counter",
        UNIT_RECORD,
        "Transfers whose span was lost (the export ring was full, or the telemetry was shut down), and spans whose "
        "export failed; every metric of theirs is still exact.",
        (ATTR_RECORD_KIND,),
    ),
    InstrumentSpec(
        METRIC_ENGINE_MISMATCH,
        "counter",
        UNIT_MISMATCH,
        "Self-checks in which an instrument's total disagreed with the engine's own counter in the same process (an "
        "adapter that undercounts after an engine change).",
        (ATTR_INSTRUMENT,),
    ),
)

# --------------------------------------------------------------------------- spans
SPAN_NAMES: Final[dict[TransferOperation, str]] = {op: f"hicache.{op.value}" for op in TransferOperation}
INSTRUMENTATION_SCOPE: Final = "otel_hicache"
