"""``HiCacheTelemetry``: the one sink every producer reports through.

From each record it derives both the metric points and the span, so traces and metrics cannot disagree. The class is a
facade over the pipeline's parts in :mod:`otel_hicache._internal`: validation, counting and refusals
(:mod:`~otel_hicache._internal.host.counting`), the host-side worker and its thread
(:mod:`~otel_hicache._internal.host.worker`) and the consumers of the ring
(:mod:`~otel_hicache._internal.host.consumers`). The types an adapter holds are named here: :class:`DeferredQueue`,
:class:`TransferSite`, :data:`Build`, :data:`PoolSource`, :data:`EngineCheck`, :data:`MismatchHandler`.

What the host process pays (the scheduler thread is latency-critical, and every thread of its process shares its GIL):

* On the calling thread a record is **validated** (each field read once), its counts and histogram values are added
  to the **exact table** (:mod:`otel_hicache._internal.shared.accumulation`: counters, bucket counts and sums) and a
  transfer is packed into a bounded **ring** for its span (:mod:`otel_hicache._internal.shared.channel`): a few
  microseconds, no SDK call, no device sync, never a wait.
* Spans, OTLP encoding and export happen in the **export process**
  (:mod:`otel_hicache._internal.export.handle`) when exporting over OTLP: the host has no thread doing that work. The
  table and the ring live in memory the export process maps, so what the host counted is exported even after a SIGKILL.
  In-process (the embedded default, or providers handed to this class), a consumer thread does the same work in slices
  of ~50 us, pausing between them so the scheduler thread gets the GIL back.
* :meth:`HiCacheTelemetry.record_transfer_deferred` only appends ``(build, payload)`` to a bounded queue, and a
  producer's own :meth:`HiCacheTelemetry.deferred_queue` (a :class:`DeferredQueue`) takes an entry with two C calls; a
  host thread builds and counts the records in short slices (an adapter's build reports with
  :meth:`HiCacheTelemetry.record_transfer_at`: no record object, the values its :meth:`~HiCacheTelemetry.transfer_site`
  shares checked once). Past the bound the oldest is shed and counted
  (``otel_hicache.records.rejected{problem=queue_full}``), never built on the caller's thread; a hung ``build`` delays
  only that thread.
* :meth:`HiCacheTelemetry.capacity_feed` hands a producer the same kind of queue for its prefix lookups: the page keys
  are computed and the capacity estimator (:mod:`otel_hicache.capacity`) runs on the host thread; exporting over
  OTLP, lookups given as token ids (``put_ids``) go to the export process instead, through the id ring in shared
  memory, and the estimator runs there.
* Nothing raises into the caller: a malformed record is refused whole with a one-time warning and counted in
  ``otel_hicache.records.rejected``; a correction (an unknown pool counted as ``other``, a bad link left out) is
  counted in ``otel_hicache.records.normalized``; a span that cannot be queued is counted in
  ``otel_hicache.records.dropped`` while its counters stay exact.
* ``fork``: a child starts from zero, as its own process (its own table, ring and exporter, its own
  ``process.pid``); the parent stays exact; no lock is inherited held.
* Over OTLP the export process exists from the telemetry's construction on (``configure()``), and a host thread looks
  after it about once a second (also at :meth:`~HiCacheTelemetry.flush` and shutdown): it relays the exporter's log
  lines and replaces an exporter that died. What cannot be had - a thread, a process, file
  descriptors, shared memory - never raises into the caller: the telemetry counts on (in private memory until shared
  memory can be had, then moved there), logs once and tries again with back-off.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from opentelemetry import metrics, trace
from opentelemetry.trace import Span, SpanContext

from otel_hicache import semconv as sc
from otel_hicache._internal.host import pacing, validation
from otel_hicache._internal.host.consumers import Consumer, InProcessConsumer
from otel_hicache._internal.host.counting import Tally
from otel_hicache._internal.host.deferred import Build, DeferredQueue
from otel_hicache._internal.host.validation import Rejected
from otel_hicache._internal.host.validation import Site as TransferSite
from otel_hicache._internal.host.worker import EngineCheck, HostWorker, MismatchHandler, PoolSource, weakly
from otel_hicache._internal.shared.accumulation import Layout
from otel_hicache._internal.shared.channel import EXPORT_DROPPED, EXPORTER_PID, HEADER_INTS, SPANS_EXPORTED, Channel
from otel_hicache.capacity import MAX_SAMPLED_KEYS, CapacityFeed, Keys, TierCapacity
from otel_hicache.records import (
    DropRecord,
    EvictionRecord,
    KvWait,
    PoolUsage,
    PrefixSplit,
    TransferFailure,
    TransferRecord,
)
from otel_hicache.semconv import Problem, RecordKind, TimingSource, TransferOperation

__all__ = [
    "Build",
    "CapacityFeed",
    "Consumer",
    "DeferredQueue",
    "EngineCheck",
    "HiCacheTelemetry",
    "MismatchHandler",
    "PoolSource",
    "PoolUsage",
    "SpanDelivery",
    "TierCapacity",
    "TransferSite",
]

_log = logging.getLogger(__name__)


class SpanDelivery(NamedTuple):
    """Spans the export process sent: ``exported``, taken by every span exporter (delivered); ``failed``, refused by
    one or not sent (the collector unreachable, erroring or too slow): dropped and counted in
    ``otel_hicache.records.dropped``."""

    exported: int
    failed: int


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
        self._tally = Tally(Layout([*sorted(self._known), sc.OTHER_POOL], seeds, HEADER_INTS), self._known)
        self._host = host = HostWorker(
            self._tally,
            weakly(self.record_transfer),
            max_queue=max_queue,
            interval_s=flush_interval_s,
            shared=consumer is not None,
        )
        if consumer is None:  # the provider must not keep us alive: weakly
            consumer = functools.partial(
                InProcessConsumer,
                tracer_provider=tracer_provider,
                spans=spans,
                meter_provider=meter_provider,
                token_metrics=token_metrics,
                before_collect=weakly(host.before_collect),
            )
        host.attach(consumer(host.channel))

    # ------------------------------------------------------------------ producer API (hot path)
    def record_transfer(self, record: TransferRecord) -> None:
        """Count one completed merged transfer and queue its span. Never raises, never waits."""
        try:
            checked = validation.transfer(record, self._known)
        except Exception as exc:
            self._tally.refuse(RecordKind.TRANSFER, exc)
            return
        self._tally.transfer(checked)
        if not self._host.started:
            self._host.start()

    def transfer_site(
        self,
        operation: TransferOperation,
        *,
        timing_source: TimingSource = TimingSource.NONE,
        write_policy: str | None = None,
        io_backend: str | None = None,
    ) -> TransferSite:
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
        site: TransferSite,
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
                site,
                self._known,
                tokens_by_pool,
                num_bytes,
                submit_time_ns,
                complete_time_ns,
                copy_duration_s,
                merged_ops,
                node_count,
                links,
            )
        except Exception as exc:
            self._tally.refuse(RecordKind.TRANSFER, exc)
            return
        self._tally.transfer(checked)
        if not self._host.started:
            self._host.start()

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
        if self._tally.closed:
            self._tally.reject(RecordKind.TRANSFER, Problem.QUEUE_FULL)
            return
        self._host.deferred.put_numbered(build, payload)  # any thread may call this
        if not self._host.fast_ready:
            self._host.want_fast()

    def deferred_queue(
        self, build: Build, *, batched: bool = False, kind: RecordKind = RecordKind.TRANSFER, patient: bool = False
    ) -> DeferredQueue:
        """A queue of this producer's own for the tightest hot paths (SGLang's ack queues): the producer appends
        ``(next(queue.seq), ...)`` with ``queue.put``, two C calls and no Python frame; the host thread builds each
        entry with ``build(entry)`` (a record, or None) as :meth:`record_transfer_deferred` does. ``batched``:
        ``build(entries)`` gets the entries waiting, oldest first, a batch at a time, and reports what it makes itself
        (entries that only add to counters, summed there: :meth:`record_prefix_splits`); it reports them all or raises
        before it reports any. At most ``max_queue`` unbuilt entries; shed ones are counted as records of ``kind``
        (a batch whose build raises: each of its entries). ``patient``: its entries make no span and only add to
        counts, which every read of the counters waits for: the host thread may take them four times a second
        instead of twenty (a producer that is its process's only deferred work then wakes it less). ``queue.close()``
        when the producer is done. Never raises."""
        return self._host.new_queue(build, kind, batched, patient)

    def capacity_feed(
        self,
        page_tokens: int,
        tiers: Iterable[TierCapacity],
        keys: Keys | None = None,
        *,
        max_keys: int = MAX_SAMPLED_KEYS,
    ) -> CapacityFeed:
        """The process's capacity estimator (``hicache.capacity.hit_ratio``): per admitted request the producer puts
        ``(next(feed.seq), payload, prompt_tokens)``; ``keys(payload)`` (default: the payload) gives the page keys on
        the host thread. The contract is :mod:`otel_hicache.capacity`'s. One per telemetry (a process's cache): a new
        one replaces the last, which is closed. ValueError for ``page_tokens < 1`` or ``tiers`` not fastest first."""
        feed = CapacityFeed(
            page_tokens,
            tiers,
            keys,
            lambda build: self._host.new_queue(build, RecordKind.CAPACITY, patient=True),
            max_keys=max_keys,
            pace=pacing.pace,  # a long lookup keeps to the host thread's rounds
            ids=self._host.put_ids if self._host.shared else None,  # over OTLP: token ids to the export process
        )
        previous, self._host.capacity = self._host.capacity, feed
        if previous is not None:
            previous.close()
        return feed

    def record_failure(self, failure: TransferFailure) -> None:
        """Count a transfer that could not be issued or completed. Never raises."""
        checked = self._tally.checked(RecordKind.FAILURE, validation.failure, failure)
        if checked is not None:
            self._tally.failure(checked)

    def record_drop(self, drop: DropRecord) -> None:
        """Count device KV destroyed without a host copy. Never raises."""
        corrections: list[Problem] = []
        checked = self._tally.checked(RecordKind.DROP, validation.drop, drop, self._known, corrections)
        if checked is not None:
            self._tally.drop(checked, corrections)

    def record_eviction(self, eviction: EvictionRecord) -> None:
        """Count one eviction pass: its tokens, and per entry, when it has entries (at most
        :data:`~otel_hicache.semconv.MAX_EVICTION_ENTRIES`), reuse, age and wasted bytes; its duration. Never raises."""
        checked = self._tally.checked(RecordKind.EVICTION, validation.eviction, eviction)
        if checked is not None:
            self._tally.eviction(checked)
            if not self._host.started:
                self._host.start()

    def record_kv_wait(self, wait: KvWait, request_span: Span | None = None) -> None:
        """Count how long one request's prefill waited for its KV from one tier (``hicache.request.kv_wait``); put it
        on ``request_span`` (``hicache.kv_wait.<tier>``, seconds) when given. Never raises."""
        checked = self._tally.checked(RecordKind.KV_WAIT, validation.kv_wait, wait)
        if checked is None:
            return
        self._tally.kv_wait(checked)
        if request_span is not None:
            try:
                if request_span.is_recording():
                    request_span.set_attribute(f"{sc.ATTR_KV_WAIT}.{checked.tier.value}", checked.seconds)
            except Exception:
                _log.debug("otel_hicache: annotating a request span failed", exc_info=True)
        if not self._host.started:
            self._host.start()

    def record_prefix_split(
        self, split: PrefixSplit, request_span: Span | None = None, *, other_hit: int = 0, counted: bool = False
    ) -> None:
        """Count one admitted prefill by mode; put the split on ``request_span`` when given. ``other_hit``: tokens
        hit in a way otel_hicache does not know (an engine's new counter), counted as mode ``other``. ``counted``:
        the split is counted elsewhere (an engine that counts a batch's admissions at once): only put it on the span.
        Never raises."""
        counts = self._tally.checked(RecordKind.PREFIX_SPLIT, validation.prefix_split, split, other_hit)
        if counts is None:
            return
        if not counted:
            self._tally.prefill(counts)
        try:
            if request_span is not None and request_span.is_recording():
                request_span.set_attributes({f"{sc.ATTR_PREFIX_TOKENS}.{m.value}": n for m, n in counts.items()})
        except Exception:
            _log.debug("otel_hicache: setting the prefix split on a request span failed", exc_info=True)

    def record_prefix_splits(self, rows: Iterable[tuple[int, int, int, int, int]]) -> None:
        """Count many admitted prefills at once, each row ``(input, device hit, host hit, storage hit, other hit)``
        tokens: what an engine that counts each prefill batch from its own counters queued since the host thread's
        last round (a batched :meth:`deferred_queue`). Rows of five plain in-range ints are summed and counted as
        one; any other row alone, as :meth:`record_prefix_split` counts it (checked, corrected or refused). Never
        raises."""
        found = validation.prefix_rows(rows)
        if found.sums:
            self._tally.prefill(found.sums, found.summed)
        for row in found.odd:
            try:
                split, other = validation.prefix_row(row)
            except Exception as exc:
                self._tally.refuse(RecordKind.PREFIX_SPLIT, exc)
                continue
            self.record_prefix_split(split, other_hit=other)
        if found.broken:  # rows that could not be read to their end: what they yielded is counted above
            self._tally.reject(RecordKind.PREFIX_SPLIT, Problem.MALFORMED)

    def add_pool_usage_source(self, source: PoolSource) -> None:
        """Register a callable read on a host thread about once a second (never on the hot path), and before each
        flush, for pool occupancy. A source that raises or returns bad entries is skipped and counted. It starts the
        export like a first record: a process whose only signal is occupancy exports it."""
        self._host.add_pool_source(source)

    def remove_pool_usage_source(self, source: PoolSource) -> None:
        self._host.remove_pool_source(source)

    def add_engine_check(self, check: EngineCheck, on_mismatch: MismatchHandler | None = None) -> None:
        """Register an engine self-check: ``check()`` returns the names (``semconv.METRIC_*``) of our instruments
        whose totals disagree with the engine's own counters in this process; each name counts one
        ``otel_hicache.engine.mismatch`` with a one-time warning. It runs on a host thread about once a second and
        before each flush and snapshot, never on the hot path and never two at once; it may call :meth:`snapshot`.
        Our records can lag the engine's counters (deferred records, a count the engine makes after ours): the check
        reports a mismatch only when it is real. A check that raises is skipped and counted. ``on_mismatch(names)``,
        if given, is called with what the check reported, once it is counted (on that host thread; it must not raise):
        an adapter's off switch; returning True ends the check."""
        self._host.add_engine_check(check, on_mismatch)

    def remove_engine_check(self, check: EngineCheck) -> None:
        self._host.remove_engine_check(check)

    # ------------------------------------------------------------------ reading and lifecycle
    @property
    def export_pid(self) -> int | None:
        """The pid of the export process reading this telemetry's memory, once it attached (None in-process)."""
        return int(self._host.channel.ints[EXPORTER_PID]) or None if self._host.shared else None

    def span_delivery(self) -> SpanDelivery | None:
        """What the export process did with the spans it built so far (None in-process, where this telemetry sends
        nothing itself). Spans shed before it (the queue full) are in ``otel_hicache.records.dropped`` alone."""
        if not self._host.shared:
            return None
        ints = self._host.channel.ints
        return SpanDelivery(exported=int(ints[SPANS_EXPORTED]), failed=int(ints[EXPORT_DROPPED]))

    def snapshot(self) -> dict[str, dict[tuple[Any, ...], int]]:
        """The cumulative counter values by metric name and attribute values (exact: deferred records counted)."""
        self._host.settle()
        self._host.run_engine_checks()
        return self._tally.snapshot()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Count deferred records (the host thread builds them without its pauses meanwhile) and turn every queued
        transfer into its span (and, exporting from another process, export the spans and the metrics), within
        ``timeout_s``. True if everything got through in time. (Pool sources are read by the host thread about once a
        second, and before each in-process collection.)"""
        return self._host.flush(timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Count what is queued, hand the last records to the consumer and stop, within ``timeout_s``. A deferred
        record still unbuilt at the end is counted as shed (``queue_full``). Recording after shutdown still counts;
        spans are dropped and counted."""
        self._host.close(timeout_s)
