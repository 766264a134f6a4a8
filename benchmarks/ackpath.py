"""A synthetic ack path that mirrors SGLang 0.5.23's ``writing_check`` / ``loading_check``, and the reporters the
benchmarks compare on it.

The controller keeps the same structures and does the same per-ack work as ``UnifiedRadixCache``: a FIFO list of
``HiCacheAck``-shaped acks, ``pop(0)``, ``finish_event.synchronize()`` on an event already complete, release of the
nodes the ack served (pop from the ongoing map, lock count down), then the metrics report. Only the report differs:

* ``none``: no metrics collector (``_log_write_ack_metrics`` returns at once), the uninstrumented path;
* ``prometheus_client``: SGLang's ``RadixCacheMetricsCollector`` calls, verbatim, on prometheus_client with the base
  labels ``cache_type, tp_rank, pp_rank, dp_rank`` (the baseline users have today);
* ``naive_otel``: a synchronous OTel SDK path, one span plus counters and a histogram per ack;
* ``otel_hicache``: build a :class:`~otel_hicache.records.TransferRecord` and call
  :meth:`~otel_hicache.telemetry.HiCacheTelemetry.record_transfer` (spans on);
* ``otel_hicache_deferred``: as the SGLang adapter reports, on the adapter's own ack queues: the submission is noted as
  the ack is appended, the ack put on a queue of the reporter's own as it is popped
  (:meth:`~otel_hicache.telemetry.HiCacheTelemetry.deferred_queue`); the telemetry's host thread reports it with
  :meth:`~otel_hicache.telemetry.HiCacheTelemetry.record_transfer_at`.

A measuring device of the synthetic SGLang ack path and the reporters compared on it, used by hotpath, loop, soak
and sglang.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, NamedTuple

from opentelemetry import trace
from opentelemetry.metrics import MeterProvider
from opentelemetry.trace import TracerProvider

from otel_hicache import semconv as sc
from otel_hicache.records import TransferRecord
from otel_hicache.semconv import TimingSource, TransferOperation
from otel_hicache.telemetry import HiCacheTelemetry
from otel_hicache.timing import elapsed_seconds, make_timing_event_pair, now_ns

BACKUP = TransferOperation.BACKUP
LOAD_BACK = TransferOperation.LOAD_BACK
#: The naive path's instruments: our names under a prefix, so they never collide with the real ones.
NAIVE_PREFIX = "benchmarks.naive."
SGLANG_BASE_LABELS: dict[str, Any] = {"cache_type": "unified_radix", "tp_rank": 0, "pp_rank": 0, "dp_rank": 0}


class Ack(NamedTuple):
    """Field for field SGLang's ``HiCacheAck``, plus the submit time our controllers carry on the ack."""

    start_event: Any
    finish_event: Any
    node_ids: list[int]
    num_tokens: int = 0
    timing_enabled: bool = False
    num_tokens_by_pool: dict[str, int] | None = None
    num_bytes: int = 0
    submit_time_ns: int = 0


class EventPool:
    """Completed, timed event pairs to put on acks (reused round-robin: the ack path only reads them).

    On CUDA each pair is recorded on a side stream around a real device->pinned-host copy and synchronised once
    here, so ``query()`` is True on the hot path and ``elapsed_time`` reads a real device duration.
    """

    def __init__(self, device: str = "cpu", size: int = 64) -> None:
        self.pairs: list[tuple[Any, Any, bool, TimingSource]] = []
        self.source = TimingSource.HOST_CLOCK
        if device == "cuda":
            import torch

            stream = torch.cuda.Stream()
            src = torch.randn(64, 4096, device="cuda")
            dst = torch.empty(64, 4096, pin_memory=True)
            with torch.cuda.stream(stream):
                for _ in range(size):
                    start, finish, source = make_timing_event_pair("cuda")
                    start.record(stream)
                    dst.copy_(src, non_blocking=True)
                    finish.record(stream)
                    self.pairs.append((start, finish, True, source))
            stream.synchronize()
            self.source = TimingSource.CUDA_EVENT
        else:
            for _ in range(size):
                start, finish, source = make_timing_event_pair("cpu")
                start.record()
                finish.record()
                self.pairs.append((start, finish, True, source))
        self._next = 0

    def take(self) -> tuple[Any, Any, bool]:
        start, finish, timed, _ = self.pairs[self._next]
        self._next = (self._next + 1) % len(self.pairs)
        return start, finish, timed


class _Node:
    __slots__ = ("lock_ref",)

    def __init__(self) -> None:
        self.lock_ref = 1


class Reporter:
    """The metrics collector slot of the ack path; ``None`` collector = uninstrumented."""

    name = "none"

    def write_ack(self, ack: Ack) -> None:
        pass

    def load_ack(self, ack: Ack) -> None:
        pass

    def flush(self) -> None:
        pass

    def adopt(self, path: SyntheticAckPath) -> None:
        """Called once the path is built: a reporter that reports from the ack queues themselves (as the SGLang
        adapter does) takes them over here."""


class SyntheticAckPath:
    """The scheduler-side half of a HiCache controller: ack queues, node locks, completion checks."""

    def __init__(self, reporter: Reporter | None, events: EventPool | None = None) -> None:
        self.metrics_collector = reporter
        self.events = events
        self.ack_write_queue: list[Ack] = []
        self.ack_load_queue: list[Ack] = []
        self.ongoing_write_through: dict[int, _Node] = {}
        self.ongoing_load_back: dict[int, _Node] = {}
        self._next_node = 0
        if reporter is not None:
            reporter.adopt(self)

    def submit(
        self,
        op: TransferOperation,
        tokens_by_pool: dict[str, int],
        num_bytes: int,
        nodes: int = 2,
        events: tuple[Any, Any, bool] | None = None,
    ) -> Ack:
        """Queue one merged transfer's ack (the copy itself is the caller's; see ``loop`` and ``transfer``)."""
        node_ids = list(range(self._next_node, self._next_node + nodes))
        self._next_node += nodes
        ongoing = self.ongoing_write_through if op is BACKUP else self.ongoing_load_back
        for node_id in node_ids:
            ongoing[node_id] = _Node()
        if events is None:
            assert self.events is not None, "submit() needs events= or an EventPool"
            events = self.events.take()
        start, finish, timed = events
        ack = Ack(start, finish, node_ids, sum(tokens_by_pool.values()), timed, tokens_by_pool, num_bytes, now_ns())
        (self.ack_write_queue if op is BACKUP else self.ack_load_queue).append(ack)
        return ack

    @staticmethod
    def count_ready_acks(ack_queue: list[Ack]) -> int:
        ready = 0
        for ack in ack_queue:
            if not ack.finish_event.query():
                break
            ready += 1
        return ready

    def check_events(self) -> int:
        """``check_hicache_events`` on one rank: the leading completed acks of each queue are processed."""
        writes = self.count_ready_acks(self.ack_write_queue)
        loads = self.count_ready_acks(self.ack_load_queue)
        self.writing_check(writes)
        self.loading_check(loads)
        return writes + loads

    def writing_check(self, finish_count: int) -> None:
        while finish_count > 0:
            ack = self.ack_write_queue.pop(0)
            ack.finish_event.synchronize()
            for ack_id in ack.node_ids:
                node = self.ongoing_write_through.pop(ack_id)
                node.lock_ref -= 1
            self._log_write_ack_metrics(ack)
            finish_count -= 1

    def loading_check(self, finish_count: int) -> None:
        while finish_count > 0:
            ack = self.ack_load_queue.pop(0)
            ack.finish_event.synchronize()
            for ack_id in ack.node_ids:
                node = self.ongoing_load_back.pop(ack_id)
                node.lock_ref -= 1
            if self.metrics_collector is not None:
                self.metrics_collector.load_ack(ack)
            finish_count -= 1

    def _log_write_ack_metrics(self, ack: Ack) -> None:
        if self.metrics_collector is None:
            return
        self.metrics_collector.write_ack(ack)


class PrometheusReporter(Reporter):
    """SGLang's ``RadixCacheMetricsCollector`` HiCache series and ack reporting, on prometheus_client."""

    name = "prometheus_client"

    def __init__(self, labels: Mapping[str, Any] = SGLANG_BASE_LABELS) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.labels = dict(labels)
        names = list(self.labels)
        reg = self.registry
        self.backup_num_tokens = Counter(
            "sglang:hicache_backup_tokens_total", "backup tokens", [*names, "pool"], registry=reg
        )
        self.backup_num_bytes = Counter("sglang:hicache_backup_bytes_total", "backup bytes", names, registry=reg)
        self.backup_duration_seconds = Histogram(
            "sglang:hicache_backup_duration_seconds",
            "backup duration",
            names,
            registry=reg,
            buckets=[0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0],
        )
        self.load_back_num_tokens = Counter(
            "sglang:load_back_tokens_total", "load back tokens", [*names, "pool"], registry=reg
        )
        self.load_back_num_bytes = Counter("sglang:load_back_bytes_total", "load back bytes", names, registry=reg)
        self.load_back_duration_seconds = Histogram(  # unformatted: SGLang's buckets as rows of numbers
            "sglang:load_back_duration_seconds", "load back duration", names, registry=reg,
            buckets=[0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.02, 0.03, 0.04, 0.05,
                     0.1, 0.2, 0.5, 1.0],
        )  # fmt: skip

    # RadixCacheMetricsCollector's methods, verbatim
    def increment_backup_num_tokens(self, num_tokens: int, pool: str) -> None:
        self.backup_num_tokens.labels(**self.labels, pool=pool).inc(num_tokens)

    def increment_backup_num_bytes(self, num_bytes: int) -> None:
        self.backup_num_bytes.labels(**self.labels).inc(num_bytes)

    def observe_backup_duration(self, duration_seconds: float) -> None:
        self.backup_duration_seconds.labels(**self.labels).observe(duration_seconds)

    def increment_load_back_num_tokens(self, num_tokens: int, pool: str) -> None:
        self.load_back_num_tokens.labels(**self.labels, pool=pool).inc(num_tokens)

    def increment_load_back_num_bytes(self, num_bytes: int) -> None:
        self.load_back_num_bytes.labels(**self.labels).inc(num_bytes)

    def observe_load_back_duration(self, duration_seconds: float) -> None:
        self.load_back_duration_seconds.labels(**self.labels).observe(duration_seconds)

    # UnifiedRadixCache._log_write_ack_metrics and the tail of loading_check, verbatim
    def write_ack(self, ack: Ack) -> None:
        for pool, num_tokens in (ack.num_tokens_by_pool or {}).items():
            if num_tokens > 0:
                self.increment_backup_num_tokens(num_tokens=num_tokens, pool=pool)
        if ack.num_bytes > 0:
            self.increment_backup_num_bytes(ack.num_bytes)
        if ack.timing_enabled:
            duration_ms = ack.start_event.elapsed_time(ack.finish_event)
            self.observe_backup_duration(duration_ms / 1000.0)

    def load_ack(self, ack: Ack) -> None:
        for pool, num_tokens in (ack.num_tokens_by_pool or {}).items():
            if num_tokens > 0:
                self.increment_load_back_num_tokens(num_tokens=num_tokens, pool=pool)
        if ack.num_bytes > 0:
            self.increment_load_back_num_bytes(ack.num_bytes)
        if ack.timing_enabled:
            duration_ms = ack.start_event.elapsed_time(ack.finish_event)
            self.observe_load_back_duration(duration_ms / 1000.0)

    def total(self, op: TransferOperation, what: str) -> float:
        """A counter's value summed over labels (for ground-truth checks)."""
        metric = {
            (BACKUP, "tokens"): "sglang:hicache_backup_tokens",
            (BACKUP, "bytes"): "sglang:hicache_backup_bytes",
            (LOAD_BACK, "tokens"): "sglang:load_back_tokens",
            (LOAD_BACK, "bytes"): "sglang:load_back_bytes",
        }[(op, what)]
        total = 0.0
        for family in self.registry.collect():
            if family.name == metric:
                total += sum(s.value for s in family.samples if s.name.endswith("_total"))
        return total


class NaiveOtelReporter(Reporter):
    """What a straightforward OTel port does: per ack, synchronously, one span, counter adds, a histogram record."""

    name = "naive_otel"

    def __init__(self, tracer_provider: TracerProvider, meter_provider: MeterProvider, flush: Any = None) -> None:
        self._tracer = trace.get_tracer("benchmarks.naive_otel", tracer_provider=tracer_provider)
        meter = meter_provider.get_meter("benchmarks.naive_otel")
        self._tokens = meter.create_counter(NAIVE_PREFIX + sc.METRIC_TRANSFER_TOKENS, unit=sc.UNIT_TOKEN)
        self._bytes = meter.create_counter(NAIVE_PREFIX + sc.METRIC_TRANSFER_SIZE, unit=sc.UNIT_BYTE)
        self._duration = meter.create_histogram(
            NAIVE_PREFIX + sc.METRIC_TRANSFER_DURATION,
            unit=sc.UNIT_SECOND,
            explicit_bucket_boundaries_advisory=sc.TRANSFER_DURATION_BUCKETS,
        )
        self._flush = flush

    def _report(self, op: TransferOperation, ack: Ack) -> None:
        duration = elapsed_seconds(ack.start_event, ack.finish_event, ack.timing_enabled)
        by_pool = ack.num_tokens_by_pool or {}
        span = self._tracer.start_span(
            sc.SPAN_NAMES[op],
            start_time=getattr(ack, "submit_time_ns", None),  # SGLang's own HiCacheAck has none: span starts now
            attributes={
                sc.ATTR_OPERATION: op.value,
                sc.ATTR_TOKENS: ack.num_tokens,
                sc.ATTR_BYTES: ack.num_bytes,
                sc.ATTR_NODES: len(ack.node_ids),
                **{f"{sc.ATTR_POOL_TOKENS}.{p}": n for p, n in by_pool.items()},
            },
        )
        for pool, n in by_pool.items():
            if n > 0:
                self._tokens.add(n, {sc.ATTR_OPERATION: op.value, sc.ATTR_POOL: pool})
        if ack.num_bytes > 0:
            self._bytes.add(ack.num_bytes, {sc.ATTR_OPERATION: op.value})
        if duration is not None:
            self._duration.record(duration, {sc.ATTR_OPERATION: op.value})
        span.end(end_time=now_ns())

    def write_ack(self, ack: Ack) -> None:
        self._report(BACKUP, ack)

    def load_ack(self, ack: Ack) -> None:
        self._report(LOAD_BACK, ack)

    def flush(self) -> None:
        if self._flush is not None:
            self._flush()


class OtelHiCacheReporter(Reporter):
    """The otel_hicache path: a TransferRecord from the ack, then ``record_transfer`` (spans on)."""

    name = "otel_hicache"

    def __init__(self, telemetry: HiCacheTelemetry, source: TimingSource, flush: Any = None) -> None:
        self.telemetry = telemetry
        self._source = source
        self._flush = flush

    def _report(self, op: TransferOperation, ack: Ack) -> None:
        self.telemetry.record_transfer(self._record((op, ack, now_ns())))

    def _record(self, payload: tuple[TransferOperation, Ack, int]) -> TransferRecord:
        op, ack, complete_ns = payload
        duration = elapsed_seconds(ack.start_event, ack.finish_event, ack.timing_enabled)
        return TransferRecord(
            op,
            ack.num_tokens_by_pool or {},
            ack.num_bytes,
            ack.submit_time_ns,
            complete_ns,
            duration,
            self._source if duration is not None else TimingSource.NONE,
            1,
            len(ack.node_ids),
        )

    def write_ack(self, ack: Ack) -> None:
        self._report(BACKUP, ack)

    def load_ack(self, ack: Ack) -> None:
        self._report(LOAD_BACK, ack)

    def flush(self) -> None:
        if self._flush is not None:
            self._flush()
        else:
            self.telemetry.flush()


class DeferredOtelHiCacheReporter(OtelHiCacheReporter):
    """The otel_hicache path as the SGLang adapter reports, with the adapter's own ack queues
    (:class:`~otel_hicache.integrations.sglang.ack_queues.AckQueue`): appending an ack notes its submission (one clock
    read and one dictionary entry), popping it puts one entry on a queue of the reporter's own
    (:meth:`~otel_hicache.telemetry.HiCacheTelemetry.deferred_queue`: two C calls); the telemetry's host thread reports
    it with ``record_transfer_at`` (no record object)."""

    name = "otel_hicache_deferred"

    def adopt(self, path: SyntheticAckPath) -> None:
        from otel_hicache.integrations.sglang.ack_queues import LOAD, WRITE, AckQueue, AckReporter

        for direction, name in ((WRITE, "ack_write_queue"), (LOAD, "ack_load_queue")):
            reporter = AckReporter(self.telemetry, _CONTROLLER, direction, {}, _no_sample)
            queue = AckQueue(getattr(path, name))
            queue.attach(reporter, self.telemetry.deferred_queue(reporter.record))  # closed when the path goes
            setattr(path, name, queue)

    def write_ack(self, ack: Ack) -> None:
        pass  # reported as it left its queue

    def load_ack(self, ack: Ack) -> None:
        pass


#: What the adapter reads of SGLang's controller when it adopts a queue.
_CONTROLLER = SimpleNamespace(write_policy="write_through", io_backend="direct")


def _no_sample() -> None:
    """The adapter's access clock (eviction ages): nothing to sample in a synthetic path."""
