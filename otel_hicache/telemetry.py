"""``HiCacheTelemetry``: the one sink every producer reports through.

From each record it derives both the metric points and the span, so traces and metrics cannot disagree.

Cost model (the scheduler thread is latency-critical):

* On the calling thread a record is validated, its counts are added to plain integer accumulators under one lock,
  and the record is appended to a bounded queue. No SDK call, no allocation beyond the queue slot, no device sync.
* Counters are *observable* instruments whose callbacks read the accumulators at collection time, so they are
  exact whatever the trace sampler decides and whatever happens to the queue.
* Tighter still, :meth:`HiCacheTelemetry.record_transfer_deferred` only appends ``(build, payload)`` on the calling
  thread; building and counting the record happen on the worker, and every collection settles what is pending
  first, so counters are exact whenever they are read. The SGLang instrumentor uses it for each consumed ack.
* A background worker drains the queue: it records histogram points (inside the span's context, so exemplars link
  to the trace) and creates one span per merged transfer with the record's explicit timestamps.
* Nothing raises into the caller: a malformed record is refused with a one-time warning and counted in
  ``otel_hicache.records.rejected``; an unknown pool is counted as ``other`` (``otel_hicache.records.normalized``);
  a full queue loses the span and histogram point only (``otel_hicache.records.dropped``).
"""

from __future__ import annotations

import collections
import logging
import math
import operator
import os
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Link, Span

from otel_hicache import semconv as sc
from otel_hicache.records import (
    DropRecord,
    EvictionRecord,
    PoolUsage,
    PrefixSplit,
    TransferFailure,
    TransferRecord,
)
from otel_hicache.semconv import DropReason, PrefillMode, Tier, TimingSource, TransferOperation

_log = logging.getLogger(__name__)

#: Anything above these is a corrupted record, not a transfer (2**40 tokens, 1 PiB, one day).
MAX_TOKENS = 1 << 40
MAX_BYTES = 1 << 50
MAX_DURATION_S = 86_400.0

_OPERATIONS: dict[str, TransferOperation] = {op.value: op for op in TransferOperation}
_REASONS: dict[str, DropReason] = {r.value: r for r in DropReason}
_TIERS: dict[str, Tier] = {t.value: t for t in Tier}
_Key = Hashable
Record = TransferRecord | EvictionRecord  # what the worker turns into spans and histogram points


class _Reject(Exception):
    """A record is malformed; the message is the problem's closed name."""


def _count(value: Any) -> int:
    """A token or byte count as int, or _Reject for anything that is not a sane non-negative integer."""
    if type(value) is not int:
        if isinstance(value, bool) or value is None:
            raise _Reject("bad_count")
        try:
            value = operator.index(value)
        except TypeError:
            raise _Reject("bad_count") from None
    if value < 0:
        raise _Reject("negative_count")
    return value


def _duration(value: Any) -> float:
    if value is None or isinstance(value, bool):
        raise _Reject("bad_duration")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise _Reject("bad_duration") from None
    if not (0.0 <= value <= MAX_DURATION_S):  # also catches NaN
        raise _Reject("bad_duration")
    return value


class _Accumulator:
    """Plain integer sums per attribute key, read by an observable instrument's callback."""

    __slots__ = ("_attributes", "_settle", "_to_attributes", "values")

    def __init__(
        self,
        to_attributes: Callable[[Any], dict[str, str]],
        settle: Callable[[], None],
        seed: Iterable[_Key] = (),
    ) -> None:
        self.values: dict[_Key, int] = dict.fromkeys(seed, 0)
        self._attributes: dict[_Key, dict[str, str]] = {}
        self._to_attributes = to_attributes
        self._settle = settle  # counts deferred records first, so a collection is always exact

    def observe(self, _options: CallbackOptions) -> list[Observation]:
        self._settle()
        out = []
        for key, value in list(self.values.items()):
            attrs = self._attributes.get(key)
            if attrs is None:
                attrs = self._attributes[key] = self._to_attributes(key)
            out.append(Observation(value, attrs))
        return out


class HiCacheTelemetry:
    """Turns records into OTel spans and metrics.

    Args:
        tracer_provider, meter_provider: where spans and metrics go; the global providers by default.
        pools: pools whose series are pre-seeded at 0 (SGLang pre-seeds ``kv``).
        max_queue: records awaiting span/histogram work; beyond it those parts are dropped and counted.
        flush_interval_s: how often the background worker drains the queue.
        spans: create one span per merged transfer (metrics are unaffected either way).
    """

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        *,
        pools: Iterable[str] = (sc.DEFAULT_POOL,),
        extra_pools: Iterable[str] = (),
        max_queue: int = 65_536,
        flush_interval_s: float = 0.2,
        spans: bool = True,
    ) -> None:
        from otel_hicache import __version__

        if max_queue < 1 or flush_interval_s <= 0:
            raise ValueError("max_queue must be >= 1 and flush_interval_s > 0")
        self._tracer = trace.get_tracer(sc.INSTRUMENTATION_SCOPE, __version__, tracer_provider)
        meter = metrics.get_meter(sc.INSTRUMENTATION_SCOPE, __version__, meter_provider)
        self._known_pools = sc.POOLS | frozenset(extra_pools)  # placeholder: the lead's core bounds and validates it
        self._spans = spans
        self._max_queue = max_queue
        self._flush_interval_s = flush_interval_s
        self._lock = threading.Lock()
        self._warned: set[tuple[str, str]] = set()
        self._pool_sources: list[Callable[[], Iterable[PoolUsage]]] = []

        seeded_pools = [self._pool_name(p, "config") for p in pools]
        op_pool = [(op, p) for op in TransferOperation for p in seeded_pools]
        self._deferred: collections.deque[tuple[Callable[[Any], TransferRecord], Any]] = collections.deque()
        self._settle_lock = threading.RLock()
        settle = self._settle
        self._tokens = _Accumulator(lambda k: {sc.ATTR_OPERATION: k[0].value, sc.ATTR_POOL: k[1]}, settle, op_pool)
        self._bytes = _Accumulator(_size_attributes, settle, op_pool)
        self._failures = _Accumulator(lambda k: {sc.ATTR_OPERATION: k[0].value, sc.ATTR_ERROR_TYPE: k[1]}, settle)
        self._dropped = _Accumulator(
            lambda k: {sc.ATTR_DROP_REASON: k[0].value, sc.ATTR_POOL: k[1]},
            settle,
            [(r, p) for r in DropReason for p in seeded_pools],
        )
        self._evicted = _Accumulator(lambda k: {sc.ATTR_TIER: k.value}, settle, (Tier.DEVICE, Tier.HOST))
        self._prefill = _Accumulator(lambda k: {sc.ATTR_PREFILL_MODE: k.value}, settle, PrefillMode)
        self_attrs = lambda k: {sc.ATTR_RECORD_KIND: k[0], sc.ATTR_PROBLEM: k[1]}  # noqa: E731
        self._rejected = _Accumulator(self_attrs, settle)
        self._normalized = _Accumulator(self_attrs, settle)
        self._queue_dropped = _Accumulator(lambda k: {sc.ATTR_RECORD_KIND: k}, settle)

        specs = {s.name: s for s in sc.INSTRUMENTS}
        for name, acc in (
            (sc.METRIC_TRANSFER_TOKENS, self._tokens),
            (sc.METRIC_TRANSFER_SIZE, self._bytes),
            (sc.METRIC_TRANSFER_FAILURES, self._failures),
            (sc.METRIC_DROPPED_TOKENS, self._dropped),
            (sc.METRIC_EVICTION_TOKENS, self._evicted),
            (sc.METRIC_PREFILL_TOKENS, self._prefill),
            (sc.METRIC_RECORDS_REJECTED, self._rejected),
            (sc.METRIC_RECORDS_NORMALIZED, self._normalized),
            (sc.METRIC_RECORDS_DROPPED, self._queue_dropped),
        ):
            spec = specs[name]
            meter.create_observable_counter(name, callbacks=[acc.observe], unit=spec.unit, description=spec.description)
        for name, callback in (
            (sc.METRIC_POOL_USAGE, self._observe_usage),
            (sc.METRIC_POOL_LIMIT, self._observe_limit),
        ):
            spec = specs[name]
            meter.create_observable_up_down_counter(
                name, callbacks=[callback], unit=spec.unit, description=spec.description
            )
        self._transfer_duration = meter.create_histogram(
            sc.METRIC_TRANSFER_DURATION,
            unit=sc.UNIT_SECOND,
            description=specs[sc.METRIC_TRANSFER_DURATION].description,
            explicit_bucket_boundaries_advisory=sc.TRANSFER_DURATION_BUCKETS,
        )
        self._eviction_duration = meter.create_histogram(
            sc.METRIC_EVICTION_DURATION,
            unit=sc.UNIT_SECOND,
            description=specs[sc.METRIC_EVICTION_DURATION].description,
            explicit_bucket_boundaries_advisory=sc.EVICTION_DURATION_BUCKETS,
        )

        self._queue: collections.deque[Record] = collections.deque()
        self._wake = threading.Event()
        self._drain_lock = threading.Lock()
        self._stopped = False
        self._worker: threading.Thread | None = None
        if hasattr(os, "register_at_fork"):  # a forked child has no worker thread: start one on first use
            os.register_at_fork(after_in_child=self._after_fork)

    # ------------------------------------------------------------------ producer API (hot path)
    def record_transfer(self, record: TransferRecord) -> None:
        """Count one completed merged transfer and queue its span. Never raises."""
        try:
            op = _OPERATIONS.get(record.operation)
            if op is None:
                raise _Reject("unknown_operation")
            # Fast checks for the common, well-formed record; anything unusual takes the careful path.
            tokens = self._checked_counts(record.tokens_by_pool, MAX_TOKENS)
            num_bytes = record.num_bytes
            if type(num_bytes) is not int or not 0 <= num_bytes <= MAX_BYTES:
                num_bytes = _count(num_bytes)
                if num_bytes > MAX_BYTES:
                    raise _Reject("absurd_count")
            pool_bytes = record.bytes_by_pool
            if pool_bytes is not None:
                pool_bytes = self._checked_counts(pool_bytes, MAX_BYTES)
                if sum(pool_bytes.values()) != num_bytes:
                    raise _Reject("bytes_mismatch")
            duration = record.copy_duration_s
            if duration is not None and not (type(duration) is float and 0.0 <= duration <= MAX_DURATION_S):
                _duration(duration)
            start, end = record.submit_time_ns, record.complete_time_ns
            if type(start) is not int or type(end) is not int or not 0 <= start <= end:
                if _count(end) < _count(start):
                    raise _Reject("end_before_start")
            with self._lock:
                acc = self._tokens.values
                for pool, n in tokens.items():
                    acc[(op, pool)] = acc.get((op, pool), 0) + n
                acc = self._bytes.values
                if pool_bytes is None:
                    acc[(op, None)] = acc.get((op, None), 0) + num_bytes
                else:
                    for pool, n in pool_bytes.items():
                        acc[(op, pool)] = acc.get((op, pool), 0) + n
            if tokens is not record.tokens_by_pool or pool_bytes is not record.bytes_by_pool:
                record = record._replace(tokens_by_pool=tokens, bytes_by_pool=pool_bytes)  # span shows what we counted
            queue = self._queue
            if len(queue) < self._max_queue and not self._stopped and self._worker is not None:
                queue.append(record)
                if not len(queue) & 1023:  # a burst: wake the worker early, once per 1024 records
                    self._wake.set()
            else:
                self._enqueue(record, "transfer")
        except _Reject as problem:
            self._reject("transfer", str(problem))
        except Exception:
            self._reject("transfer", "malformed")

    def record_transfer_deferred(self, build: Callable[[Any], TransferRecord], payload: Any) -> None:
        """Hand over the makings of a transfer record; ``build(payload)`` runs later, off the calling thread.

        For the tightest hot paths (an engine's ack loop): the calling thread only appends ``(build, payload)`` to
        a queue. The worker builds the record and counts it; every metric collection, :meth:`snapshot` and
        :meth:`flush` settle the queue first, so counters read anywhere are exact. ``payload`` must not change
        after the call (an SGLang ``HiCacheAck`` is immutable). A ``build`` that raises or returns something that
        is not a record is counted in ``otel_hicache.records.rejected``. Never raises.
        """
        deferred = self._deferred
        deferred.append((build, payload))
        if self._worker is None:
            self._start_worker()
        elif len(deferred) >= self._max_queue:  # the worker is far behind: count on this thread, lose nothing
            self._settle()

    def record_failure(self, failure: TransferFailure) -> None:
        """Count a transfer that could not be issued or completed. Never raises."""
        try:
            op = _OPERATIONS.get(failure.operation)
            if op is None:
                raise _Reject("unknown_operation")
            error = failure.error_type if failure.error_type in sc.TRANSFER_ERRORS else sc.OTHER_ERROR
            with self._lock:
                acc = self._failures.values
                acc[(op, error)] = acc.get((op, error), 0) + 1
        except _Reject as problem:
            self._reject("failure", str(problem))
        except Exception:
            self._reject("failure", "malformed")

    def record_drop(self, drop: DropRecord) -> None:
        """Count device KV destroyed without a host copy. Never raises."""
        try:
            reason = _REASONS.get(drop.reason)
            if reason is None:
                raise _Reject("unknown_reason")
            tokens = self._checked_counts(drop.tokens_by_pool, MAX_TOKENS, "drop")
            with self._lock:
                acc = self._dropped.values
                for pool, n in tokens.items():
                    acc[(reason, pool)] = acc.get((reason, pool), 0) + n
        except _Reject as problem:
            self._reject("drop", str(problem))
        except Exception:
            self._reject("drop", "malformed")

    def record_eviction(self, eviction: EvictionRecord) -> None:
        """Count one eviction pass and queue its duration. Never raises."""
        try:
            tier = _TIERS.get(eviction.tier)
            if tier is None:
                raise _Reject("unknown_tier")
            n = _count(eviction.num_tokens)
            if n > MAX_TOKENS:
                raise _Reject("absurd_count")
            _duration(eviction.duration_s)
            with self._lock:
                self._evicted.values[tier] = self._evicted.values.get(tier, 0) + n
            self._enqueue(eviction, "eviction")
        except _Reject as problem:
            self._reject("eviction", str(problem))
        except Exception:
            self._reject("eviction", "malformed")

    def record_prefix_split(self, split: PrefixSplit, request_span: Span | None = None) -> None:
        """Count one admitted prefill by mode; put the split on ``request_span`` when given. Never raises."""
        try:
            counts = [_count(v) for v in split]
            if max(counts) > MAX_TOKENS:
                raise _Reject("absurd_count")
            with self._lock:
                acc = self._prefill.values
                for mode, n in zip(PrefillMode, counts, strict=False):
                    acc[mode] += n
            if request_span is not None and request_span.is_recording():
                request_span.set_attributes(
                    {f"{sc.ATTR_PREFIX_TOKENS}.{mode.value}": n for mode, n in zip(PrefillMode, counts, strict=False)}
                )
        except _Reject as problem:
            self._reject("prefix_split", str(problem))
        except Exception:
            self._reject("prefix_split", "malformed")

    def add_pool_usage_source(self, source: Callable[[], Iterable[PoolUsage]]) -> None:
        """Register a callable read at each metric collection (never on the hot path) for pool occupancy."""
        self._pool_sources.append(source)

    def remove_pool_usage_source(self, source: Callable[[], Iterable[PoolUsage]]) -> None:
        if source in self._pool_sources:
            self._pool_sources.remove(source)

    # ------------------------------------------------------------------ lifecycle
    def flush(self, timeout_s: float = 5.0) -> bool:
        """Create every queued span and histogram point now (on the calling thread). True if the queue emptied."""
        self._settle()
        if not self._drain_lock.acquire(timeout=timeout_s):
            return False
        try:
            self._drain()
        finally:
            self._drain_lock.release()
        return not self._queue

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the worker after draining the queue. Recording after shutdown still counts, spans are dropped."""
        self._stopped = True
        self._wake.set()
        worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout_s)
        self.flush(timeout_s)

    def snapshot(self) -> dict[str, dict[tuple[Any, ...], int]]:
        """The cumulative counter values by metric name and attribute values (a consistent, cheap copy)."""
        self._settle()
        with self._lock:
            return {
                name: {_key_tuple(k): v for k, v in acc.values.items()}
                for name, acc in (
                    (sc.METRIC_TRANSFER_TOKENS, self._tokens),
                    (sc.METRIC_TRANSFER_SIZE, self._bytes),
                    (sc.METRIC_TRANSFER_FAILURES, self._failures),
                    (sc.METRIC_DROPPED_TOKENS, self._dropped),
                    (sc.METRIC_EVICTION_TOKENS, self._evicted),
                    (sc.METRIC_PREFILL_TOKENS, self._prefill),
                    (sc.METRIC_RECORDS_REJECTED, self._rejected),
                    (sc.METRIC_RECORDS_NORMALIZED, self._normalized),
                    (sc.METRIC_RECORDS_DROPPED, self._queue_dropped),
                )
            }

    # ------------------------------------------------------------------ internals
    def _pool_name(self, pool: Any, kind: str) -> str:
        if pool in self._known_pools:
            return str(pool)
        key = (kind, "unknown_pool")
        with self._lock:
            self._normalized.values[key] = self._normalized.values.get(key, 0) + 1
        self._warn_once(kind, "unknown_pool", f"pool {str(pool)[:64]!r} is not a known pool; counted as 'other'")
        return sc.OTHER_POOL

    def _checked_counts(self, by_pool: Mapping[str, int], limit: int, kind: str = "transfer") -> Mapping[str, int]:
        """``by_pool`` itself when every pool is known and every count sane (no allocation); else a normalized copy
        (unknown pools summed under ``other``, integer-like counts as int) or _Reject."""
        for pool, n in by_pool.items():
            if type(n) is not int or not 0 <= n <= limit or pool not in self._known_pools:
                break
        else:
            return by_pool
        out: dict[str, int] = {}
        for pool, n in by_pool.items():
            n = _count(n)
            if n > limit:
                raise _Reject("absurd_count")
            if pool not in self._known_pools:
                pool = self._pool_name(pool, kind)
            out[pool] = out.get(pool, 0) + n
        return out

    def _enqueue(self, record: Record, kind: str) -> None:
        queue = self._queue
        if self._stopped or len(queue) >= self._max_queue:
            with self._lock:
                self._queue_dropped.values[kind] = self._queue_dropped.values.get(kind, 0) + 1
            self._warn_once(kind, "queue_full", "span queue full or telemetry shut down; spans are being dropped")
            return
        queue.append(record)
        if self._worker is None:
            self._start_worker()
        elif not len(queue) & 1023:
            self._wake.set()

    def _reject(self, kind: str, problem: str) -> None:
        try:
            key = (kind, problem)
            with self._lock:
                self._rejected.values[key] = self._rejected.values.get(key, 0) + 1
            self._warn_once(kind, problem, "record rejected; nothing of it was counted")
        except Exception:  # the last line of defence: never raise into the host
            pass

    def _warn_once(self, kind: str, problem: str, message: str) -> None:
        if (kind, problem) in self._warned:
            return
        self._warned.add((kind, problem))
        _log.warning("otel_hicache: %s record: %s (%s). Further occurrences are only counted.", kind, message, problem)

    def _start_worker(self) -> None:
        with self._lock:
            if self._worker is not None:
                return
            self._worker = threading.Thread(target=self._run, name="otel-hicache-telemetry", daemon=True)
            self._worker.start()

    def _after_fork(self) -> None:
        self._worker = None
        self._lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self._settle_lock = threading.RLock()
        self._wake = threading.Event()
        self._queue.clear()
        self._deferred.clear()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self._flush_interval_s)
            self._wake.clear()
            self._settle()
            with self._drain_lock:
                self._drain()

    def _settle(self) -> None:
        """Build and count every deferred record, oldest first (any thread; one at a time)."""
        deferred = self._deferred
        if not deferred:
            return
        with self._settle_lock:
            while deferred:
                build, payload = deferred.popleft()
                try:
                    record = build(payload)
                except Exception:
                    self._reject("transfer", "build_failed")
                    continue
                self.record_transfer(record)

    def _drain(self) -> None:
        queue = self._queue
        while queue:
            record = queue.popleft()
            try:
                if isinstance(record, TransferRecord):
                    self._emit_transfer(record)
                else:
                    self._eviction_duration.record(record.duration_s, {sc.ATTR_TIER: _TIERS[record.tier].value})
            except Exception:
                _log.debug("otel_hicache: emitting a record failed", exc_info=True)

    def _emit_transfer(self, record: TransferRecord) -> None:
        op = _OPERATIONS[record.operation]
        duration = record.copy_duration_s
        source = TimingSource(record.timing_source) if duration is not None else TimingSource.NONE
        span: Span | None = None
        if self._spans:
            span = self._tracer.start_span(
                sc.SPAN_NAMES[op],
                kind=trace.SpanKind.INTERNAL,
                start_time=record.submit_time_ns,
                links=[Link(ctx) for ctx in record.links],
                attributes=transfer_span_attributes(record, op, source),
                context=trace.set_span_in_context(trace.INVALID_SPAN),  # a transfer is a root, not a request child
            )
        if duration is not None:
            attrs = {sc.ATTR_OPERATION: op.value, sc.ATTR_TIMING_SOURCE: source.value}
            if span is not None and span.is_recording():
                with trace.use_span(span, end_on_exit=False):  # exemplars carry the transfer's trace id
                    self._transfer_duration.record(float(duration), attrs)
            else:
                self._transfer_duration.record(float(duration), attrs)
        if span is not None:
            span.end(end_time=record.complete_time_ns)

    def _observe_usage(self, _options: CallbackOptions) -> list[Observation]:
        out = []
        for usage in self._read_pools():
            base = {sc.ATTR_TIER: _TIERS[usage.tier].value, sc.ATTR_POOL: usage.pool}
            out.append(Observation(usage.used, {**base, sc.ATTR_POOL_STATE: sc.PoolState.USED.value}))
            out.append(Observation(usage.limit - usage.used, {**base, sc.ATTR_POOL_STATE: sc.PoolState.FREE.value}))
        return out

    def _observe_limit(self, _options: CallbackOptions) -> list[Observation]:
        return [
            Observation(u.limit, {sc.ATTR_TIER: _TIERS[u.tier].value, sc.ATTR_POOL: u.pool}) for u in self._read_pools()
        ]

    def _read_pools(self) -> list[PoolUsage]:
        out = []
        for source in list(self._pool_sources):
            try:
                for usage in source():
                    out.append(usage._replace(pool=self._pool_name(usage.pool, "pool_usage")))
            except Exception:
                self._reject("pool_usage", "source_failed")
        return out


def _size_attributes(key: tuple[TransferOperation, str | None]) -> dict[str, str]:
    op, pool = key
    return {sc.ATTR_OPERATION: op.value} if pool is None else {sc.ATTR_OPERATION: op.value, sc.ATTR_POOL: pool}


def _key_tuple(key: Any) -> tuple[Any, ...]:
    parts = key if isinstance(key, tuple) else (key,)
    return tuple(p.value if isinstance(p, sc._StrEnum) else p for p in parts)


def transfer_span_attributes(record: TransferRecord, op: TransferOperation, source: TimingSource) -> dict[str, Any]:
    """The attributes of a transfer span: totals, per-pool tokens and bytes, counts, timing."""
    attrs: dict[str, Any] = {
        sc.ATTR_OPERATION: op.value,
        sc.ATTR_TOKENS: sum(record.tokens_by_pool.values()),
        sc.ATTR_BYTES: record.num_bytes,
        sc.ATTR_MERGED_OPS: record.merged_ops,
        sc.ATTR_NODES: record.node_count,
        sc.ATTR_TIMING_SOURCE: source.value,
    }
    for pool, n in record.tokens_by_pool.items():
        attrs[f"{sc.ATTR_TOKENS}.{pool}"] = n
    if record.bytes_by_pool is not None:
        for pool, n in record.bytes_by_pool.items():
            attrs[f"{sc.ATTR_BYTES}.{pool}"] = n
    if record.copy_duration_s is not None and not math.isnan(record.copy_duration_s):
        attrs[sc.ATTR_COPY_DURATION] = float(record.copy_duration_s)
    if record.write_policy is not None:
        attrs[sc.ATTR_WRITE_POLICY] = str(record.write_policy)
    if record.io_backend is not None:
        attrs[sc.ATTR_IO_BACKEND] = str(record.io_backend)
    return attrs
