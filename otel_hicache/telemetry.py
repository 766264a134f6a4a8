"""``HiCacheTelemetry``: the one sink every producer reports through.

From each record it derives both the metric points and the span, so traces and metrics cannot disagree.

What the host process pays (the scheduler thread is latency-critical, and every thread of its process shares its GIL):

* On the calling thread a record is **validated** (:mod:`otel_hicache._internal.validation`: each field read once), its
  counts are added to the **exact counter table** (:mod:`otel_hicache._internal.accumulation`) and the record is packed
  into a bounded **ring** (:mod:`otel_hicache._internal.channel`): a few microseconds, no SDK call, no device sync,
  never a wait.
* Spans, histogram points, OTLP encoding and export happen in the **export process**
  (:mod:`otel_hicache._internal.export_process`) when exporting over OTLP: the host has no thread doing that work. The
  table and the ring live in memory the export process maps, so what the host counted is exported even after a SIGKILL.
  In-process (the embedded default, or providers handed to this class), a consumer thread does the same work in slices
  of ~50 us (``SLICE_NS``), pausing between them so the scheduler thread gets the GIL back.
* :meth:`HiCacheTelemetry.record_transfer_deferred` only appends ``(build, payload)`` to a bounded queue, and a
  producer's own :meth:`HiCacheTelemetry.deferred_queue` (:mod:`otel_hicache._internal.deferred`) takes an entry with
  two C calls; a host thread builds and counts the records in short slices (an adapter's build reports with
  :meth:`HiCacheTelemetry.record_transfer_at`: no record object, the values its :meth:`~HiCacheTelemetry.transfer_site`
  shares checked once). Past the bound the oldest is shed and counted
  (``otel_hicache.records.rejected{problem=queue_full}``), never built on the caller's thread; a hung ``build`` delays
  only that thread.
* Nothing raises into the caller: a malformed record is refused whole with a one-time warning and counted in
  ``otel_hicache.records.rejected``; a correction (an unknown pool counted as ``other``, a bad link left out) is
  counted in ``otel_hicache.records.normalized``; a span that cannot be queued is counted in
  ``otel_hicache.records.dropped`` while its counters stay exact.
* ``fork``: a child starts from zero, as its own process (its own table, ring and exporter, its own
  ``process.pid``); the parent stays exact; no lock is inherited held.
* Over OTLP the export process exists from the telemetry's construction on (``configure()``), and a host thread looks
  after it about once a second (``TEND_INTERVAL_S``; also at :meth:`~HiCacheTelemetry.flush` and shutdown): it relays
  the exporter's log lines and replaces an exporter that died. What cannot be had - a thread, a process, file
  descriptors, shared memory - never raises into the caller: the telemetry counts on (in private memory until shared
  memory can be had, then moved there), logs once and tries again with back-off.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from opentelemetry import metrics, trace
from opentelemetry.trace import Span, SpanContext

from otel_hicache import semconv as sc
from otel_hicache._internal import validation
from otel_hicache._internal.accumulation import Layout
from otel_hicache._internal.channel import EXPORTER_PID, HEADER_INTS, Channel, Record
from otel_hicache._internal.deferred import Build, DeferredQueue
from otel_hicache._internal.emitter import Emitter
from otel_hicache._internal.validation import Rejected
from otel_hicache.records import (
    DropRecord,
    EvictionRecord,
    KvWait,
    PoolUsage,
    PrefixSplit,
    TransferFailure,
    TransferRecord,
)
from otel_hicache.semconv import Problem, RecordKind, Tier, TimingSource, TransferOperation

_log = logging.getLogger(__name__)

#: How long a host thread works before pausing so the scheduler thread can take the GIL (the record in hand is
#: finished first: a round that starts cold lasts about twice this).
SLICE_NS = 50_000
#: Deferred records waiting, as a share of ``max_queue``, past which a round works twice as long: a scheduler thread
#: that seldom releases the GIL hands it over once per switch interval (5 ms), and shedding is worse than a longer
#: round.
BACKLOG_SHARE = 0.25
#: The pause; long enough for a thread waiting on the GIL to be woken and take it.
PAUSE_S = 0.0002
#: How often the host thread looks for deferred records to build. Every wake costs the scheduler thread (a hand-over
#: of the GIL, caches both threads find cold), so fewer wakes with more records each cost it less; what a SIGKILL
#: loses is at most one tick of consumed acks (``benchmarks sigkill``).
DEFERRED_TICK_S = 0.05
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
_T = TypeVar("_T")


class Consumer(Protocol):
    """Where the ring's records become spans: a thread of this process, or the export process."""

    def tend(self, channel: Channel, now: bool = False) -> None: ...  # look after it (start it, replace it if dead)
    def drain(self, budget_ns: int) -> bool: ...  # host thread's share of the work; True if more is waiting
    def flush(self, timeout_s: float) -> bool: ...
    def close(self, channel: Channel, timeout_s: float) -> bool: ...
    def before_fork(self) -> bool: ...  # hold what a forked child must not inherit mid-use; True if held
    def after_fork_in_parent(self, held: bool) -> None: ...
    def after_fork_in_child(self, channel: Channel) -> Consumer: ...


class HiCacheTelemetry:
    """Turns records into OTel spans and metrics.

    Args:
        tracer_provider, meter_provider: where spans and metrics go, in this process; the global providers by default.
        pools: pools whose series are pre-seeded at 0 (SGLang pre-seeds ``kv``).
        extra_pools: pool names accepted besides :data:`otel_hicache.semconv.POOLS` (an engine's own pool kinds; at
            most :data:`~otel_hicache.semconv.MAX_EXTRA_POOLS`). Any other name is counted as ``other``.
        max_queue: records awaiting their span (ring slots), and deferred records awaiting their build.
        flush_interval_s: how often queued records are turned into spans in this process.
        spans: create one span per merged transfer (metrics are unaffected either way).
        token_metrics: report the instruments counted in tokens; ``False`` on all but one rank of a tensor-parallel
            group, where token flows are logical (the same on every rank) and a sum across ranks would multiply them.
        consumer: a factory for another consumer of the ring (``configure()`` passes the export process), started
            here: the telemetry's shared memory and its consumer exist when the constructor returns.
    """

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        *,
        pools: Iterable[str] = (sc.DEFAULT_POOL,),
        extra_pools: Iterable[str] = (),
        max_queue: int = 8192,
        flush_interval_s: float = 0.2,
        spans: bool = True,
        token_metrics: bool = True,
        consumer: Callable[[Channel], Consumer] | None = None,
    ) -> None:
        if max_queue < 1 or not flush_interval_s > 0:
            raise ValueError("max_queue must be >= 1 and flush_interval_s > 0")
        extra = [str(p) for p in extra_pools if p not in sc.POOLS and p != sc.OTHER_POOL]
        if len(extra) > sc.MAX_EXTRA_POOLS:
            raise ValueError(f"extra_pools: at most {sc.MAX_EXTRA_POOLS} names (each is a series of every metric)")
        self._known = {pool: pool for pool in sc.POOLS | set(extra)}
        seeds = [validation.pool_name(p, self._known, []) for p in pools]
        self._layout = Layout([*sorted(self._known), sc.OTHER_POOL], seeds, HEADER_INTS)
        self._max_queue = max_queue
        self._interval_s = flush_interval_s
        self._warned: set[tuple[str, str]] = set()
        self._pool_sources: list[PoolSource] = []
        self._engine_checks: list[EngineCheck] = []
        self._checking = threading.Lock()  # one run of the engine checks at a time; a check may call snapshot()
        self._pools_reported = False  # the gauges hold a reading (cleared once the last source is gone)
        # record_transfer_deferred's queue first, then the producers' own (deferred_queue())
        self._deferred = DeferredQueue(_build_deferred_call, max_queue)
        self._queues: list[DeferredQueue] = [self._deferred]
        self._building = False
        self._closed = False
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()  # the counter table and the ring's producer side
        self._starting = threading.Lock()  # one thread starts the consumer; the others go on
        self._wake = threading.Event()
        self._shared = consumer is not None  # the export process maps the channel
        self._channel = self._new_channel()
        self._bind(self._channel)
        if consumer is None:
            before_collect = weakref.WeakMethod(self._before_collect)  # the provider must not keep us alive
            self._consumer: Consumer = InProcessConsumer(
                self._channel, tracer_provider, meter_provider, spans=spans, token_metrics=token_metrics,
                before_collect=lambda: (before_collect() or _nothing)(),
            )  # fmt: skip
        else:
            self._consumer = consumer(self._channel)
        self._consumer_started = False  # consumer tended and host thread running
        self._next_start_attempt = 0.0
        self._fast = not self._shared  # the host thread ticks every DEFERRED_TICK_S (else TEND_INTERVAL_S)
        self._fast_ready = False  # ... and it runs
        _LIVE.add(self)
        if self._shared:
            self._start()

    def _new_channel(self) -> Channel:
        """Shared memory for the export process, or (none to be had: no fds, no memfd) private memory for now."""
        if self._shared:
            try:
                return Channel(self._layout, self._max_queue, shared=True)
            except OSError as exc:
                self._warn_export(
                    "no_shared_memory",
                    f"no shared memory for the export process now ({exc!r}); counting in private memory, retrying",
                )
        return Channel(self._layout, self._max_queue, shared=False)

    def _bind(self, channel: Channel) -> None:
        """Cache what the hot path indexes (slot tables, the int64 view) for ``channel``."""
        slots = self._layout.slots
        self._ints = channel.ints
        # per operation (and timing source): the hot path looks a slot up by pool alone
        tokens, sizes = slots[sc.METRIC_TRANSFER_TOKENS], slots[sc.METRIC_TRANSFER_SIZE]
        self._token_slots = {op: {pool: tokens[op, pool] for pool in self._layout.pools} for op in sc.TransferOperation}
        self._size_slots = {
            (op, source): {pool: sizes[op, pool, source] for pool in (None, *self._layout.pools)}
            for op in sc.TransferOperation for source in sc.TimingSource
        }  # fmt: skip
        self._failure_slot = slots[sc.METRIC_TRANSFER_FAILURES]
        self._drop_slot = slots[sc.METRIC_DROPPED_TOKENS]
        self._evicted_slot = slots[sc.METRIC_EVICTION_TOKENS]
        self._wasted_slot = slots[sc.METRIC_WASTED_SIZE]
        self._mismatch_slot = slots[sc.METRIC_ENGINE_MISMATCH]
        self._prefill_slot = slots[sc.METRIC_PREFILL_TOKENS]
        self._rejected_slot = slots[sc.METRIC_RECORDS_REJECTED]
        self._normalized_slot = slots[sc.METRIC_RECORDS_NORMALIZED]
        self._dropped_slot = slots[sc.METRIC_RECORDS_DROPPED]

    # ------------------------------------------------------------------ producer API (hot path)
    def record_transfer(self, record: TransferRecord) -> None:
        """Count one completed merged transfer and queue its span. Never raises, never waits."""
        try:
            checked = validation.transfer(record, self._known)
        except Exception as exc:
            self._refuse(RecordKind.TRANSFER, exc)
            return
        self._count_transfer(checked)

    def transfer_site(
        self,
        operation: TransferOperation,
        *,
        timing_source: TimingSource = TimingSource.NONE,
        write_policy: str | None = None,
        io_backend: str | None = None,
    ) -> validation.Site:
        """What every transfer reported from one place of an adapter shares, checked once, for
        :meth:`record_transfer_at`. ``timing_source``: how that place measures copy durations. Raises ValueError for
        an unknown operation or timing source (a programming error, found when the adapter is set up)."""
        try:
            return validation.site(operation, timing_source, write_policy, io_backend)
        except Rejected as rejected:
            raise ValueError(f"transfer_site: {rejected.problem.value}: {operation!r}, {timing_source!r}") from None
        except Exception as exc:  # a label that cannot be read as a string
            raise ValueError(f"transfer_site: unreadable write_policy or io_backend ({exc!r})") from None

    def record_transfer_at(
        self,
        site: validation.Site,
        tokens_by_pool: Mapping[str, int],
        num_bytes: int,
        submit_time_ns: int,
        complete_time_ns: int,
        copy_duration_s: float | None = None,
        merged_ops: int = 1,
        node_count: int = 0,
        links: Sequence[SpanContext] = (),
    ) -> None:
        """:meth:`record_transfer` of ``TransferRecord(site's operation, tokens_by_pool, ...)`` (no per-pool bytes)
        without the record: the site's values are not checked again. For an adapter's record builder on the host
        thread (SGLang's consumed acks). Never raises, never waits."""
        try:
            checked = validation.transfer_at(
                site, self._known, tokens_by_pool, num_bytes, submit_time_ns, complete_time_ns, copy_duration_s,
                merged_ops, node_count, links,
            )  # fmt: skip
        except Exception as exc:
            self._refuse(RecordKind.TRANSFER, exc)
            return
        self._count_transfer(checked)

    def _count_transfer(self, t: validation.Transfer) -> None:
        by_pool, corrections = t.bytes_by_pool, t.corrections
        token_slots, size_slots = self._token_slots[t.operation], self._size_slots[t.operation, t.timing_source]
        # the common case without a comprehension (in 3.11 one more Python frame per transfer)
        adds = [(size_slots[None], t.num_bytes)] if by_pool is None else [(size_slots[p], n) for p, n in by_pool]
        for pool, n in t.tokens:
            adds.append((token_slots[pool], n))
        with self._lock:
            counted = self._apply(adds)
            if counted:
                try:  # a slot is published only once whole: a failure leaves the ring as it was
                    queued = not self._closed and self._channel.put_transfer(t)
                except Exception:
                    queued = False
                if not queued or corrections:
                    self._count_span_loss_and_corrections(queued, corrections)
        if not counted:
            self._reject(RecordKind.TRANSFER, Problem.ABSURD_COUNT)
            return
        if not self._consumer_started:
            self._start()
        if corrections or not queued:
            self._warn_transfer(corrections, queued)

    def _count_span_loss_and_corrections(self, queued: bool, corrections: tuple[Problem, ...]) -> None:
        ints = self._ints  # under the lock
        if not queued:
            ints[self._dropped_slot[(RecordKind.TRANSFER,)]] += 1
        for problem in corrections:
            ints[self._normalized_slot[RecordKind.TRANSFER, problem]] += 1

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

    def _warn_transfer(self, corrections: tuple[Problem, ...], queued: bool) -> None:
        for problem in corrections:
            self._warn_once(RecordKind.TRANSFER, problem, "record corrected and counted")
        if not queued:
            self._span_lost(RecordKind.TRANSFER)

    def _span_lost(self, kind: RecordKind) -> None:
        """A record counted but not queued for its span: say so once."""
        self._warn_once(kind, "not_queued", "span queue full (or telemetry shut down); spans are dropped and counted")

    def record_transfer_deferred(self, build: Build, payload: Any) -> None:
        """Hand over the makings of a transfer record; ``build(payload)`` runs later, off the calling thread.

        For hot paths (an engine's ack loop): the calling thread only appends ``(build, payload)`` to a bounded
        queue. A host thread builds the record and counts it, in short slices; :meth:`snapshot`, :meth:`flush` and
        every in-process collection wait (bounded) for what is queued to be counted first. ``payload`` must not
        change after the call (an SGLang ``HiCacheAck`` is immutable). ``build`` returns the record, or None when
        there is nothing to report; one that raises or returns something else is counted in
        ``otel_hicache.records.rejected``. Past ``max_queue`` unbuilt records the oldest is shed and counted, never
        built here. Never raises, never waits. The tightest paths use :meth:`deferred_queue` instead.
        """
        if self._closed:
            self._reject(RecordKind.TRANSFER, Problem.QUEUE_FULL)
            return
        self._deferred.put_numbered(build, payload)  # any thread may call this
        if not self._fast_ready:
            self._want_fast()

    def deferred_queue(self, build: Build) -> DeferredQueue:
        """A queue of this producer's own for the tightest hot paths (SGLang's ack queues): the producer appends
        ``(next(queue.seq), ...)`` with ``queue.put``, two C calls and no Python frame; the host thread builds each
        entry with ``build(entry)`` (a record, or None) as :meth:`record_transfer_deferred` does. At most
        ``max_queue`` unbuilt entries; shed ones are counted. ``queue.close()`` when the producer is done. Never
        raises."""
        queue = DeferredQueue(build, self._max_queue)
        self._queues.append(queue)
        self._want_fast()
        return queue

    def record_failure(self, failure: TransferFailure) -> None:
        """Count a transfer that could not be issued or completed. Never raises."""
        checked = self._checked(RecordKind.FAILURE, validation.failure, failure)
        if checked is not None:
            self._add([(self._failure_slot[checked], 1)])

    def record_drop(self, drop: DropRecord) -> None:
        """Count device KV destroyed without a host copy. Never raises."""
        corrections: list[Problem] = []
        checked = self._checked(RecordKind.DROP, validation.drop, drop, self._known, corrections)
        if checked is None:
            return
        adds = [(self._drop_slot[(checked.reason, pool)], n) for pool, n in checked.tokens]
        self._add(adds + [(self._normalized_slot[(RecordKind.DROP, p)], 1) for p in corrections])
        for problem in corrections:
            self._warn_once(RecordKind.DROP, problem, "record corrected and counted")

    def record_eviction(self, eviction: EvictionRecord) -> None:
        """Count one eviction pass (per entry, when it has entries: reuse, age, wasted bytes) and queue its duration
        and ages. Never raises."""
        checked = self._checked(RecordKind.EVICTION, validation.eviction, eviction)
        if checked is None:
            return
        tier, entries = checked.tier, checked.entries
        by_reuse: dict[bool | None, int] = {}
        adds: list[tuple[int, int]] = []
        for entry in entries:
            by_reuse[entry.reused] = by_reuse.get(entry.reused, 0) + entry.tokens
            if entry.unread_bytes:
                adds.append((self._wasted_slot[(entry.written_by,)], entry.unread_bytes))
        unknown = checked.tokens - sum(by_reuse.values())  # tokens of the pass no entry accounts for
        if unknown or not by_reuse:
            by_reuse[None] = by_reuse.get(None, 0) + unknown
        adds += [(self._evicted_slot[(tier, reused)], n) for reused, n in by_reuse.items()]
        ages = [entry.idle_s for entry in entries if entry.idle_s is not None]
        with self._lock:
            if not self._apply(adds):
                queued = None
            else:
                time_ns = checked.time_ns
                queued = self._put_points(sc.METRIC_EVICTION_DURATION, tier, [checked.duration_s], time_ns, None)
                if ages and queued:
                    queued = self._put_points(sc.METRIC_EVICTION_AGE, tier, ages, time_ns, None)
                if not queued:
                    self._ints[self._dropped_slot[(RecordKind.EVICTION,)]] += 1
        if queued is None:
            self._reject(RecordKind.EVICTION, Problem.ABSURD_COUNT)
            return
        self._queued(RecordKind.EVICTION, queued)

    def record_kv_wait(self, wait: KvWait, request_span: Span | None = None) -> None:
        """Queue how long one request's prefill waited for its KV from one tier (``hicache.request.kv_wait``); put it
        on ``request_span`` (``hicache.kv_wait.<tier>``, seconds) when given, whose trace the histogram's exemplar
        then links to. Never raises."""
        checked = self._checked(RecordKind.KV_WAIT, validation.kv_wait, wait)
        if checked is None:
            return
        context = None
        if request_span is not None:
            try:
                context = validation.link(request_span.get_span_context())
                if request_span.is_recording():
                    request_span.set_attribute(f"{sc.ATTR_KV_WAIT}.{checked.tier.value}", checked.seconds)
            except Exception:
                _log.debug("otel_hicache: reading or annotating a request span failed", exc_info=True)
        with self._lock:
            queued = self._put_points(
                sc.METRIC_REQUEST_KV_WAIT, checked.tier, [checked.seconds], checked.time_ns, context
            )
            if not queued:
                self._ints[self._dropped_slot[(RecordKind.KV_WAIT,)]] += 1
        self._queued(RecordKind.KV_WAIT, queued)

    def _put_points(
        self, name: str, tier: Tier, values: list[float], time_ns: int, context: validation.Link | None
    ) -> bool:
        """Queue histogram points (under the lock); False when they could not be queued."""
        try:  # all or nothing: a failure leaves the ring as it was
            return not self._closed and self._channel.put_points(name, tier, values, time_ns, context)
        except Exception:
            return False

    def _queued(self, kind: RecordKind, queued: bool) -> None:
        """After a record was counted: start the consumer on first use, and say once if its points were lost."""
        if not self._consumer_started:
            self._start()
        if not queued:
            self._span_lost(kind)

    def record_prefix_split(self, split: PrefixSplit, request_span: Span | None = None, *, other_hit: int = 0) -> None:
        """Count one admitted prefill by mode; put the split on ``request_span`` when given. ``other_hit``: tokens
        hit in a way otel_hicache does not know (an engine's new counter), counted as mode ``other``. Never raises."""
        counts = self._checked(RecordKind.PREFIX_SPLIT, validation.prefix_split, split, other_hit)
        if counts is None:
            return
        self._add([(self._prefill_slot[(mode,)], n) for mode, n in counts.items()])
        try:
            if request_span is not None and request_span.is_recording():
                request_span.set_attributes({f"{sc.ATTR_PREFIX_TOKENS}.{m.value}": n for m, n in counts.items()})
        except Exception:
            _log.debug("otel_hicache: setting the prefix split on a request span failed", exc_info=True)

    def add_pool_usage_source(self, source: PoolSource) -> None:
        """Register a callable read on a host thread about once a second (never on the hot path), and before each
        flush, for pool occupancy. A source that raises or returns bad entries is skipped and counted. It starts the
        export like a first record: a process whose only signal is occupancy exports it."""
        self._pool_sources.append(source)
        self._want_fast()

    def remove_pool_usage_source(self, source: PoolSource) -> None:
        if source in self._pool_sources:
            self._pool_sources.remove(source)

    def add_engine_check(self, check: EngineCheck) -> None:
        """Register an engine self-check: ``check()`` returns the names (``semconv.METRIC_*``) of our instruments
        whose totals disagree with the engine's own counters in this process; each name counts one
        ``otel_hicache.engine.mismatch`` with a one-time warning. It runs on a host thread about once a second and
        before each flush and snapshot, never on the hot path and never two at once; it may call :meth:`snapshot`.
        Our records can lag the engine's counters (deferred records, a count the engine makes after ours): the check
        reports a mismatch only when it is real. A check that raises is skipped and counted."""
        self._engine_checks.append(check)
        if self._worker is None:
            self._start_worker()

    def remove_engine_check(self, check: EngineCheck) -> None:
        if check in self._engine_checks:
            self._engine_checks.remove(check)

    # ------------------------------------------------------------------ reading and lifecycle
    @property
    def export_pid(self) -> int | None:
        """The pid of the export process reading this telemetry's memory, once it attached (None in-process)."""
        return int(self._channel.ints[EXPORTER_PID]) or None if self._shared else None

    def snapshot(self) -> dict[str, dict[tuple[Any, ...], int]]:
        """The cumulative counter values by metric name and attribute values (exact: deferred records counted)."""
        self._settle(SETTLE_TIMEOUT_S)
        self._run_engine_checks()
        with self._lock:
            return self._channel.counters.snapshot()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Count deferred records and turn every queued record into spans and histogram points (and, exporting from
        another process, export them), within ``timeout_s``. True if everything got through in time. (Pool sources
        are read by the host thread about once a second, and before each in-process collection.)"""
        deadline = time.monotonic() + timeout_s
        settled = self._settle(timeout_s)
        self._run_engine_checks()
        if not self._consumer_started:
            self._start()
        self._tend(now=True)
        return self._consumer.flush(max(0.0, deadline - time.monotonic())) and settled

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Count what is queued, hand the last records to the consumer and stop, within ``timeout_s``. A deferred
        record still unbuilt at the end is counted as shed (``queue_full``). Recording after shutdown still counts;
        spans are dropped and counted."""
        deadline = time.monotonic() + timeout_s
        self._settle(timeout_s / 2)
        self._closed = True
        self._wake.set()
        worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(max(0.0, deadline - time.monotonic()) / 2)
        self._shed_deferred()
        if self._shared and self._channel.fd is None:
            self._share()  # one more try: the last window goes out only from shared memory
        self._consumer.close(self._channel, max(0.0, deadline - time.monotonic()))
        if self._shared:
            self._release_shared_memory()
        _LIVE.discard(self)

    def _release_shared_memory(self) -> None:
        """Keep counting (records after shutdown still count) in a private copy, and let the shared memory go."""
        with self._lock:
            old, self._channel = self._channel, self._channel.private_copy()
            self._bind(self._channel)
        old.close()

    def _shed_deferred(self) -> None:
        """Count every deferred record that will never be built (the host thread has stopped)."""
        shed = sum(queue.discard() for queue in list(self._queues))
        if shed:
            self._add([(self._rejected_slot[RecordKind.TRANSFER, Problem.QUEUE_FULL], shed)])
            self._warn_once(RecordKind.TRANSFER, Problem.QUEUE_FULL, "deferred records not built before shutdown")

    # ------------------------------------------------------------------ internals
    def _checked(self, kind: RecordKind, check: Callable[..., _T], *args: Any) -> _T | None:
        """``check(*args)``, or None after counting the refusal (never raises)."""
        try:
            return check(*args)
        except Exception as exc:
            self._refuse(kind, exc)
        return None

    def _refuse(self, kind: RecordKind, exc: Exception) -> None:
        """Count a record its check refused (an unexpected error: malformed)."""
        self._reject(kind, exc.problem if isinstance(exc, Rejected) else Problem.MALFORMED)

    def _add(self, adds: list[tuple[int, int]]) -> None:
        with self._lock:
            self._apply(adds)

    def _reject(self, kind: RecordKind, problem: Problem) -> None:
        try:
            self._add([(self._rejected_slot[(kind, problem)], 1)])
            self._warn_once(kind, problem, "record rejected; nothing of it was counted")
        except Exception:  # the last line of defence: never raise into the host
            pass

    def _warn_export(self, problem: str, message: str) -> None:
        if ("export", problem) not in self._warned:
            self._warned.add(("export", problem))
            _log.warning("otel_hicache: %s (logged once)", message)

    def _warn_once(self, kind: str, problem: str, message: str) -> None:
        if (kind, problem) in self._warned:
            return
        self._warned.add((kind, problem))
        _log.warning("otel_hicache: %s record: %s (%s). Further occurrences are only counted.", kind, message, problem)

    def _start(self) -> bool:
        """Start the consumer (the export process: synchronously) and the host thread that looks after it; True once
        both run. A failure is logged once and retried at most once a second (the export process retries its own
        launches with back-off), never raised into the caller; a thread that is starting them meanwhile is not
        waited for."""
        now = time.monotonic()
        if self._consumer_started or self._closed or now < self._next_start_attempt:
            return self._consumer_started
        if not self._starting.acquire(blocking=False):
            return False
        try:
            if not self._consumer_started:
                self._tend(now=True)
                if self._start_worker():
                    self._consumer_started = True
                else:
                    self._next_start_attempt = now + RETRY_START_S
            return self._consumer_started
        finally:
            self._starting.release()

    def _start_worker(self) -> bool:
        with self._lock:
            if self._worker is not None or self._closed:
                return self._worker is not None
            # The thread holds the telemetry weakly: a telemetry dropped without shutdown() is freed, thread and all.
            worker = self._worker = threading.Thread(target=_run, args=(weakref.ref(self), self._wake), daemon=True,
                                                     name=HOST_THREAD_NAME)  # fmt: skip
        try:
            worker.start()
        except RuntimeError as exc:  # can't start new thread (RLIMIT_NPROC, ...)
            with self._lock:
                self._worker = None
            self._warn_export("no_thread", f"no host thread can be started now ({exc}); retrying")
            return False
        return True

    def _want_fast(self) -> None:
        """Deferred records or pool sources: the host thread ticks every DEFERRED_TICK_S from now on."""
        self._fast = True
        if self._start():
            self._fast_ready = True
            self._wake.set()

    def _tend(self, now: bool = False) -> None:
        """Look after the consumer (host thread, flush, start): move into shared memory once it can be had, relay the
        export process's lines, replace it if it died (``now``: whatever its back-off says)."""
        if self._closed:
            return
        if self._shared and self._channel.fd is None:
            self._share()
        self._consumer.tend(self._channel, now)

    def _share(self) -> None:
        """Move the counters and the ring into shared memory (they started in private memory: none could be had)."""
        with self._lock:
            try:
                shared = self._channel.shared_copy()
            except OSError:
                return  # still none: the next tend tries again
            old, self._channel = self._channel, shared
            self._bind(shared)
        old.close()

    def _work(self, state: dict[str, float]) -> bool:
        """One round of the host thread: builds deferred records, reads pool sources, and (in-process) emits spans,
        each in slices of at most SLICE_NS. True when more is waiting (the thread pauses, then comes back)."""
        backlog = sum(len(queue) for queue in self._queues) > self._max_queue * BACKLOG_SHARE
        busy = self._build_deferred(2 * SLICE_NS if backlog else SLICE_NS)
        now = time.monotonic()
        if (self._pool_sources or self._engine_checks) and now >= state["pools"]:
            state["pools"] = now + POOL_INTERVAL_S
            self._read_pools()
            self._run_engine_checks()
            busy = True
        if self._shared:  # the export process drains the ring itself
            if now >= state["tend"]:
                state["tend"] = now + TEND_INTERVAL_S
                self._tend()
        elif self._consumer_started and (now >= state["drain"] or self._channel.pending() > self._max_queue // 2):
            if not self._consumer.drain(SLICE_NS):
                state["drain"] = now + self._interval_s  # drained: back in one flush interval
            busy = True
        return busy

    def _build_deferred(self, budget_ns: int) -> bool:
        """Build and count deferred records, each queue oldest first, for at most ``budget_ns``. True if some
        remain. Only the host thread takes from the queues."""
        end = time.perf_counter_ns() + budget_ns
        for queue in list(self._queues):
            while queue:
                self._building = True
                try:
                    shed, entry = queue.take()
                    if shed:
                        self._add([(self._rejected_slot[RecordKind.TRANSFER, Problem.QUEUE_FULL], shed)])
                        self._warn_once(RecordKind.TRANSFER, Problem.QUEUE_FULL, "deferred records shed")
                    try:
                        record = queue.build(entry)
                    except Exception:
                        self._reject(RecordKind.TRANSFER, Problem.BUILD_FAILED)
                        continue
                    if record is not None:
                        self.record_transfer(record)  # not a record: refused as malformed
                finally:
                    self._building = False
                if time.perf_counter_ns() >= end:
                    return any(self._queues)
            if queue.closed and not queue:
                self._queues.remove(queue)
        return False

    def _unbuilt(self) -> bool:
        return self._building or any(self._queues)

    def _settle(self, timeout_s: float) -> bool:
        """Wait (bounded) until every deferred record has been built and counted by the host thread."""
        if self._closed:  # no host thread builds any more: what producers put since shutdown is shed, and counted
            self._shed_deferred()
        if not self._unbuilt():
            return True
        if self._worker is None or threading.current_thread() is self._worker:
            return False
        deadline = time.monotonic() + timeout_s
        while self._unbuilt():
            if time.monotonic() >= deadline:
                return False
            self._wake.set()
            time.sleep(0.001)
        return True

    def _before_collect(self) -> None:
        self._settle(SETTLE_TIMEOUT_S / 2)
        self._read_pools()
        self._run_engine_checks()

    def _run_engine_checks(self) -> None:
        """Run every engine check (outside the telemetry's lock) and count what they report."""
        if not self._engine_checks or not self._checking.acquire(blocking=False):
            return  # none, or running on another thread (or a check called snapshot())
        try:
            for check in list(self._engine_checks):
                try:
                    names = list(check())
                except Exception:
                    self._reject(RecordKind.ENGINE_CHECK, Problem.SOURCE_FAILED)
                    continue
                for name in names:
                    slot = self._mismatch_slot.get((name,)) if type(name) is str else None  # plain strings only
                    if slot is None:
                        self._reject(RecordKind.ENGINE_CHECK, Problem.MALFORMED)
                        continue
                    self._add([(slot, 1)])
                    if ("mismatch", name) not in self._warned:
                        self._warned.add(("mismatch", name))
                        _log.warning(
                            "otel_hicache: %s disagrees with the engine's own counter in this process (an engine "
                            "change the adapter does not know?); counted in %s.",
                            name,
                            sc.METRIC_ENGINE_MISMATCH,
                        )
        finally:
            self._checking.release()

    def _read_pools(self) -> None:
        """Read every pool source (outside the lock: a source may be slow) and replace the gauges at once."""
        if not self._pool_sources and not self._pools_reported:
            return
        readings: dict[tuple[str, str], tuple[int, int]] = {}
        failures: list[tuple[int, int]] = []
        corrections: list[Problem] = []
        for source in list(self._pool_sources):
            try:
                usages = validation.pool_usages(source(), self._known, corrections)
            except Rejected as rejected:
                failures.append((self._rejected_slot[(RecordKind.POOL_USAGE, rejected.problem)], 1))
                self._warn_once(RecordKind.POOL_USAGE, rejected.problem, "pool-usage source skipped")
                continue
            except Exception:
                failures.append((self._rejected_slot[(RecordKind.POOL_USAGE, Problem.SOURCE_FAILED)], 1))
                self._warn_once(RecordKind.POOL_USAGE, Problem.SOURCE_FAILED, "pool-usage source skipped")
                continue
            for usage in usages:
                used, limit = readings.get((usage.tier.value, usage.pool), (0, 0))
                readings[(usage.tier.value, usage.pool)] = (used + usage.used, limit + usage.limit)
        failures += [(self._normalized_slot[(RecordKind.POOL_USAGE, p)], 1) for p in corrections]
        self._pools_reported = bool(readings)
        with self._lock:
            self._channel.counters.set_pools(readings)
            for slot, n in failures:
                self._ints[slot] += n

    # ------------------------------------------------------------------ fork
    def _before_fork(self) -> tuple[bool, bool]:
        """Hold the consumer (no span half-emitted in the SDK) and the producer lock (no half-written slot or counter)
        across fork. Bounded: a fork from inside our own code proceeds after a second."""
        consumer = self._consumer.before_fork()
        return consumer, self._lock.acquire(timeout=1.0)

    def _after_fork_in_parent(self, held: tuple[bool, bool]) -> None:
        if held[1]:
            self._lock.release()
        self._consumer.after_fork_in_parent(held[0])

    def _after_fork_in_child(self) -> None:
        """Start from zero, as a new process: new lock, table and ring, no threads; the parent's are untouched."""
        self._lock = threading.Lock()
        self._starting = threading.Lock()
        self._wake = threading.Event()
        self._checking = threading.Lock()
        self._worker = None
        self._fast_ready = False
        self._building = False
        for queue in self._queues:
            queue.discard()  # the parent's entries: built and counted by the parent
        self._consumer_started = False
        self._next_start_attempt = 0.0
        if not self._shared:  # a private mapping: the child's own copy
            self._channel.reset()
        else:  # the parent's shared memory: never written by the child
            self._channel.close()
            self._channel = self._new_channel()
            self._bind(self._channel)
        self._consumer = self._consumer.after_fork_in_child(self._channel)
        if self._pool_sources or self._engine_checks or len(self._queues) > 1:  # nothing else would start it
            self._fast_ready = self._start_worker()  # its first tend launches the child's exporter


class InProcessConsumer:
    """Consumes the ring on threads of this process: the host thread in slices, ``flush`` on the caller's."""

    def __init__(
        self,
        channel: Channel,
        tracer_provider: trace.TracerProvider | None,
        meter_provider: metrics.MeterProvider | None,
        *,
        spans: bool,
        token_metrics: bool,
        before_collect: Callable[[], None],
    ) -> None:
        self._channel = channel
        self._emitter = Emitter(channel.counters, tracer_provider, meter_provider, spans=spans,
                                token_metrics=token_metrics, before_collect=before_collect)  # fmt: skip
        self._emit_lock = threading.Lock()  # one consumer at a time: the ring has a single consumer side

    def tend(self, channel: Channel, now: bool = False) -> None:
        return None  # this process is alive by definition

    def drain(self, budget_ns: int) -> bool:
        if not self._channel.pending() or not self._emit_lock.acquire(blocking=False):
            return False
        try:
            end = time.perf_counter_ns() + budget_ns
            while time.perf_counter_ns() < end:
                records = self._channel.take(4)
                if not records:
                    return False
                self._emit(records)
            return self._channel.pending() > 0
        finally:
            self._emit_lock.release()

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        if not self._emit_lock.acquire(timeout=timeout_s):
            return False
        try:
            while time.monotonic() < deadline:
                records = self._channel.take(64)
                if not records:
                    return True
                self._emit(records)
        finally:
            self._emit_lock.release()
        return not self._channel.pending()

    def close(self, channel: Channel, timeout_s: float) -> bool:
        return self.flush(timeout_s)

    def before_fork(self) -> bool:
        return self._emit_lock.acquire(timeout=1.0)

    def after_fork_in_parent(self, held: bool) -> None:
        if held:
            self._emit_lock.release()

    def after_fork_in_child(self, channel: Channel) -> Consumer:
        self._emit_lock = threading.Lock()  # the channel was reset in place: the emitter reads the child's counts
        return self

    def _emit(self, records: list[Record]) -> None:
        for record in records:
            try:
                self._emitter.emit(record)
            except Exception:
                _log.debug("otel_hicache: emitting a record failed", exc_info=True)
        self._channel.settle()


def _nothing() -> None:
    return None


def _build_deferred_call(entry: tuple[int, Callable[[Any], TransferRecord | None], Any]) -> TransferRecord | None:
    """record_transfer_deferred's entries: ``(seq, build, payload)``."""
    return entry[1](entry[2])


def _run(ref: weakref.ref[HiCacheTelemetry], wake: threading.Event) -> None:
    """The host thread's loop; it pauses PAUSE_S after a busy round so the scheduler thread gets the GIL back."""
    state = {"pools": 0.0, "drain": 0.0, "tend": 0.0}
    busy, tick = False, DEFERRED_TICK_S
    while True:
        if busy:
            time.sleep(PAUSE_S)
        else:
            wake.wait(tick)
            wake.clear()
        telemetry = ref()
        if telemetry is None or telemetry._closed or telemetry._wake is not wake:  # gone, shut down, or forked
            return
        tick = min(telemetry._interval_s, DEFERRED_TICK_S) if telemetry._fast else TEND_INTERVAL_S
        busy = telemetry._work(state)
        del telemetry


# ---------------------------------------------------------------------- process-wide hooks (weak: no instance leaks)
_LIVE: weakref.WeakSet[HiCacheTelemetry] = weakref.WeakSet()
_HELD: list[tuple[HiCacheTelemetry, tuple[bool, bool]]] = []


def _before_fork() -> None:
    _HELD[:] = [(t, t._before_fork()) for t in list(_LIVE)]


def _after_fork_in_parent() -> None:
    for telemetry, held in _HELD:
        telemetry._after_fork_in_parent(held)
    _HELD.clear()


def _after_fork_in_child() -> None:
    held = list(_HELD)
    _HELD.clear()
    for telemetry, _ in held:
        try:
            telemetry._after_fork_in_child()
        except Exception:
            _log.debug("otel_hicache: resetting telemetry in a forked child failed", exc_info=True)


def _flush_at_exit() -> None:
    """Count deferred records before the interpreter stops the host thread: half a second in all, however many."""
    deadline = time.monotonic() + 0.5
    for telemetry in list(_LIVE):
        telemetry._settle(max(0.0, deadline - time.monotonic()))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
atexit.register(_flush_at_exit)
