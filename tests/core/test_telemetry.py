"""HiCacheTelemetry: every record becomes exact metric points and, for transfers, exactly one span."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import Gauge, Histogram, InMemoryMetricReader, Sum
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanContext, TraceFlags

from otel_hicache import semconv as sc
from otel_hicache._internal.emit.emitter import Emitter
from otel_hicache._internal.host import validation
from otel_hicache._internal.shared.accumulation import Layout
from otel_hicache._internal.shared.channel import HEADER_INTS, Channel
from otel_hicache.capacity import TierCapacity
from otel_hicache.records import (
    DropRecord,
    EvictedEntry,
    EvictionRecord,
    KvWait,
    PoolUsage,
    PrefixSplit,
    TransferFailure,
    TransferRecord,
)
from otel_hicache.semconv import DropReason, PrefillMode, Tier, TimingSource, TransferOperation
from otel_hicache.testing.sdk import Sdk, attributes_of, make_sdk

T0 = 1_700_000_000_000_000_000


def backup(tokens: dict[str, int] | None = None, num_bytes: int = 4096, **kw: object) -> TransferRecord:
    fields: dict[str, object] = {
        "operation": TransferOperation.BACKUP,
        "tokens_by_pool": tokens if tokens is not None else {"kv": 16},
        "num_bytes": num_bytes,
        "submit_time_ns": T0,
        "complete_time_ns": T0 + 3_000_000,
        "copy_duration_s": 0.002,
        "timing_source": TimingSource.CUDA_EVENT,
        "merged_ops": 4,
        "node_count": 3,
    }
    fields.update(kw)
    return TransferRecord(**fields)  # type: ignore[arg-type]


def op_pool(op: str, pool: str) -> dict[str, str]:
    return {sc.ATTR_OPERATION: op, sc.ATTR_POOL: pool}


def _reader_points(sdk: Sdk, name: str) -> dict[frozenset[tuple[str, Any]], Any]:
    """The points of ``name`` a collection of the reader returns now, with no flush first."""
    data = sdk.reader.get_metrics_data()
    return {
        frozenset(attributes_of(point).items()): point
        for rm in (data.resource_metrics if data else ())
        for scope in rm.scope_metrics
        for metric in scope.metrics
        if metric.name == name
        for point in getattr(metric.data, "data_points", ())
    }


class TestMetricPoints:
    def test_every_instrument_has_its_name_unit_and_kind(self, sdk: Sdk) -> None:
        sdk.telemetry.record_transfer(backup())
        sdk.telemetry.record_eviction(EvictionRecord(Tier.DEVICE, 8, 0.01, T0, [EvictedEntry(8, idle_s=3.0)]))
        sdk.telemetry.record_kv_wait(KvWait(Tier.HOST, 0.002, T0))
        sdk.telemetry.record_failure(TransferFailure(TransferOperation.LOAD_BACK, "device_pool_full", {"kv": 4}, T0))
        sdk.telemetry.add_pool_usage_source(lambda: [PoolUsage(Tier.HOST, "kv", 10, 100)])
        sdk.telemetry.record_transfer(backup(tokens={"bogus": 1}))  # normalized
        sdk.telemetry.record_transfer(backup(num_bytes=-1))  # rejected
        feed = sdk.telemetry.capacity_feed(16, [TierCapacity(Tier.DEVICE, 64)])
        feed.put((next(feed.seq), ["page"], 16))
        metrics = sdk.metrics()
        expected_kind = {
            "counter": Sum,
            "histogram": Histogram,
            "observable_up_down_counter": Sum,
            "observable_gauge": Gauge,
        }
        for spec in sc.INSTRUMENTS:
            if spec.name in (sc.METRIC_RECORDS_DROPPED, sc.METRIC_ENGINE_MISMATCH):
                continue  # only appear once a record was dropped (see TestQueue) or a check failed (TestEngineChecks)
            metric = metrics[spec.name]
            assert metric.unit == spec.unit, spec.name
            assert metric.description == spec.description
            assert isinstance(metric.data, expected_kind[spec.kind]), spec.name
            if isinstance(metric.data, Sum):
                assert metric.data.is_monotonic == (spec.kind == "counter"), spec.name
            for point in getattr(metric.data, "data_points", ()):
                assert set(attributes_of(point)) <= set(spec.attributes), (spec.name, point.attributes)

    def test_known_series_are_pre_seeded_at_zero(self, sdk: Sdk) -> None:
        for op in TransferOperation:
            assert sdk.value(sc.METRIC_TRANSFER_TOKENS, op_pool(op.value, "kv")) == 0
            for source in TimingSource:  # bandwidth = bytes / duration of one timing source, from the start
                size = {sc.ATTR_OPERATION: op.value, sc.ATTR_TIMING_SOURCE: source.value}
                assert sdk.value(sc.METRIC_TRANSFER_SIZE, size) == 0
        for reason in (DropReason.HOST_PRESSURE, DropReason.WRITE_THROUGH_UNBACKED_EVICTION):
            assert sdk.value(sc.METRIC_DROPPED_TOKENS, {sc.ATTR_DROP_REASON: reason.value, sc.ATTR_POOL: "kv"}) == 0
        for mode in (PrefillMode.INPUT, PrefillMode.DEVICE_HIT, PrefillMode.HOST_HIT, PrefillMode.STORAGE_HIT):
            assert sdk.value(sc.METRIC_PREFILL_TOKENS, {sc.ATTR_PREFILL_MODE: mode.value}) == 0
        for tier in (Tier.DEVICE, Tier.HOST):
            assert sdk.value(sc.METRIC_EVICTION_TOKENS, {sc.ATTR_TIER: tier.value}) == 0
            for reused in (True, False):
                assert (
                    sdk.value(sc.METRIC_EVICTION_TOKENS, {sc.ATTR_TIER: tier.value, sc.ATTR_EVICTION_REUSED: reused})
                    == 0
                )
        for op in (TransferOperation.BACKUP, TransferOperation.STORAGE_BACKUP):
            assert sdk.value(sc.METRIC_WASTED_SIZE, {sc.ATTR_OPERATION: op.value}) == 0
        # "other" appears only when something unknown is reported
        other_reason = {sc.ATTR_DROP_REASON: "other", sc.ATTR_POOL: "kv"}
        assert sdk.value(sc.METRIC_DROPPED_TOKENS, other_reason) is None
        assert sdk.value(sc.METRIC_PREFILL_TOKENS, {sc.ATTR_PREFILL_MODE: "other"}) is None

    def test_transfer_tokens_and_bytes_add_up_per_operation_and_pool(self, sdk: Sdk) -> None:
        tel = sdk.telemetry
        tel.record_transfer(backup({"kv": 16, "mamba": 2}, 5000, bytes_by_pool={"kv": 4000, "mamba": 1000}))
        tel.record_transfer(backup({"kv": 8}, 2000, bytes_by_pool={"kv": 2000}))
        tel.record_transfer(backup({"kv": 4}, 700, operation=TransferOperation.LOAD_BACK))  # total bytes only
        tel.record_transfer(backup({"kv": 1}, 300, copy_duration_s=None))  # untimed
        timed = {sc.ATTR_TIMING_SOURCE: "cuda_event"}
        assert sdk.value(sc.METRIC_TRANSFER_TOKENS, op_pool("backup", "kv")) == 25
        assert sdk.value(sc.METRIC_TRANSFER_TOKENS, op_pool("backup", "mamba")) == 2
        assert sdk.value(sc.METRIC_TRANSFER_SIZE, {**op_pool("backup", "kv"), **timed}) == 6000
        assert sdk.value(sc.METRIC_TRANSFER_SIZE, {**op_pool("backup", "mamba"), **timed}) == 1000
        assert sdk.value(sc.METRIC_TRANSFER_TOKENS, op_pool("load_back", "kv")) == 4
        # a producer that knows only the total (SGLang's ack) gets a point without hicache.pool
        assert sdk.value(sc.METRIC_TRANSFER_SIZE, {sc.ATTR_OPERATION: "load_back", **timed}) == 700
        # bytes of untimed transfers are apart, so bandwidth (timed bytes / timed seconds) never counts them
        untimed = {sc.ATTR_OPERATION: "backup", sc.ATTR_TIMING_SOURCE: "none"}
        assert sdk.value(sc.METRIC_TRANSFER_SIZE, untimed) == 300

    def test_durations_land_in_the_explicit_buckets_by_operation_and_timing_source(self, sdk: Sdk) -> None:
        for seconds in (0.00005, 0.002, 0.002, 45.0):
            sdk.telemetry.record_transfer(backup(copy_duration_s=seconds))
        sdk.telemetry.record_transfer(backup(copy_duration_s=None, timing_source=TimingSource.NONE))
        point = sdk.points(sc.METRIC_TRANSFER_DURATION)[
            frozenset({sc.ATTR_OPERATION: "backup", sc.ATTR_TIMING_SOURCE: "cuda_event"}.items())
        ]
        assert tuple(point.explicit_bounds) == sc.TRANSFER_DURATION_BUCKETS
        assert point.count == 4  # the untimed transfer recorded no duration
        assert point.sum == pytest.approx(45.00405)
        counts = dict(zip((*point.explicit_bounds, float("inf")), point.bucket_counts, strict=True))
        assert counts[0.0001] == 1 and counts[0.0025] == 2 and counts[60.0] == 1
        assert len(sdk.points(sc.METRIC_TRANSFER_DURATION)) == 1

    def test_drops_prefill_evictions_failures_and_pool_usage(self, sdk: Sdk) -> None:
        tel = sdk.telemetry
        tel.record_drop(DropRecord(DropReason.HOST_PRESSURE, {"kv": 32}, T0))
        tel.record_drop(DropRecord(DropReason.WRITE_THROUGH_UNBACKED_EVICTION, {"kv": 5}, T0))
        tel.record_drop(DropRecord(DropReason.HOST_PRESSURE, {"kv": 1}, T0))
        tel.record_prefix_split(PrefixSplit(input_tokens=100, device_hit=50, host_hit=30, storage_hit=20))
        tel.record_prefix_split(PrefixSplit(10, 0, 0, 5))
        tel.record_eviction(EvictionRecord(Tier.DEVICE, 64, 0.004, T0))
        tel.record_eviction(EvictionRecord(Tier.HOST, 16, 0.0002, T0))
        tel.record_failure(TransferFailure(TransferOperation.BACKUP, "host_pool_full", {"kv": 8}, T0))
        tel.record_failure(TransferFailure(TransferOperation.BACKUP, "cosmic ray", {"kv": 8}, T0))
        tel.add_pool_usage_source(lambda: [PoolUsage(Tier.HOST, "kv", 300, 1000), PoolUsage(Tier.DEVICE, "kv", 5, 10)])

        drop = {sc.ATTR_POOL: "kv"}
        assert sdk.value(sc.METRIC_DROPPED_TOKENS, {**drop, sc.ATTR_DROP_REASON: "host_pressure"}) == 33
        assert (
            sdk.value(sc.METRIC_DROPPED_TOKENS, {**drop, sc.ATTR_DROP_REASON: "write_through_unbacked_eviction"}) == 5
        )
        modes = {m.value: sdk.value(sc.METRIC_PREFILL_TOKENS, {sc.ATTR_PREFILL_MODE: m.value}) for m in PrefillMode}
        assert modes == {"input": 110, "device_hit": 50, "host_hit": 30, "storage_hit": 25, "other": None}
        assert sdk.value(sc.METRIC_EVICTION_TOKENS, {sc.ATTR_TIER: "device"}) == 64
        assert sdk.value(sc.METRIC_EVICTION_TOKENS, {sc.ATTR_TIER: "host"}) == 16
        evict = sdk.points(sc.METRIC_EVICTION_DURATION)[frozenset({sc.ATTR_TIER: "device"}.items())]
        assert evict.count == 1 and evict.sum == pytest.approx(0.004)
        assert tuple(evict.explicit_bounds) == sc.EVICTION_DURATION_BUCKETS
        fail = {sc.ATTR_OPERATION: "backup"}
        assert sdk.value(sc.METRIC_TRANSFER_FAILURES, {**fail, sc.ATTR_ERROR_TYPE: "host_pool_full"}) == 1
        assert sdk.value(sc.METRIC_TRANSFER_FAILURES, {**fail, sc.ATTR_ERROR_TYPE: "_OTHER"}) == 1  # closed set
        host = {sc.ATTR_TIER: "host", sc.ATTR_POOL: "kv"}
        assert sdk.value(sc.METRIC_POOL_USAGE, {**host, sc.ATTR_SLOT_STATE: "used"}) == 300
        assert sdk.value(sc.METRIC_POOL_USAGE, {**host, sc.ATTR_SLOT_STATE: "free"}) == 700
        assert sdk.value(sc.METRIC_POOL_LIMIT, host) == 1000
        assert sdk.value(sc.METRIC_POOL_LIMIT, {sc.ATTR_TIER: "device", sc.ATTR_POOL: "kv"}) == 10

    def test_snapshot_agrees_with_the_exported_counters(self, sdk: Sdk) -> None:
        sdk.telemetry.record_transfer(backup({"kv": 7, "swa": 3}))
        snap = sdk.telemetry.snapshot()
        assert snap[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 7
        assert snap[sc.METRIC_TRANSFER_TOKENS][("backup", "swa")] == 3
        assert sdk.value(sc.METRIC_TRANSFER_TOKENS, op_pool("backup", "swa")) == 3


class TestSpans:
    def test_one_span_per_merged_transfer_with_per_pool_attributes_and_explicit_times(self, sdk: Sdk) -> None:
        sdk.telemetry.record_transfer(
            backup(
                {"kv": 16, "swa": 4},
                5000,
                bytes_by_pool={"kv": 4096, "swa": 904},
                write_policy="write_back",
                io_backend="kernel",
            )
        )
        (span,) = sdk.spans()
        assert span.name == "hicache.backup"
        assert span.kind == trace.SpanKind.INTERNAL
        assert span.start_time == T0 and span.end_time == T0 + 3_000_000
        assert span.parent is None
        assert attributes_of(span) == {
            "hicache.operation": "backup",
            "hicache.transfer.token_count": 20,
            "hicache.transfer.tokens.kv": 16,
            "hicache.transfer.tokens.swa": 4,
            "hicache.transfer.byte_count": 5000,
            "hicache.transfer.bytes.kv": 4096,
            "hicache.transfer.bytes.swa": 904,
            "hicache.transfer.merged_ops": 4,
            "hicache.transfer.nodes": 3,
            "hicache.transfer.copy_duration": 0.002,
            "hicache.timing.source": "cuda_event",
            "hicache.write_policy": "write_back",
            "hicache.io_backend": "kernel",
        }
        assert span.instrumentation_scope is not None and span.instrumentation_scope.name == sc.INSTRUMENTATION_SCOPE

    @pytest.mark.parametrize("op", list(TransferOperation))
    def test_span_name_follows_the_operation(self, sdk: Sdk, op: TransferOperation) -> None:
        sdk.telemetry.record_transfer(backup(operation=op))
        assert [s.name for s in sdk.spans()] == [f"hicache.{op.value}"]

    def test_untimed_transfer_has_no_copy_duration_and_says_so(self, sdk: Sdk) -> None:
        sdk.telemetry.record_transfer(backup(copy_duration_s=None, timing_source=TimingSource.CUDA_EVENT))
        (span,) = sdk.spans()
        assert "hicache.transfer.copy_duration" not in attributes_of(span)
        assert attributes_of(span)["hicache.timing.source"] == "none"

    def test_a_label_longer_than_a_span_keeps_is_cut_between_characters(self, sdk: Sdk) -> None:
        policy = "\u20ac" * 11  # 11 characters, 33 bytes in UTF-8: one byte past MAX_LABEL_BYTES
        sdk.telemetry.record_transfer(backup(write_policy=policy, io_backend="k" * 40))
        (span,) = sdk.spans()
        assert attributes_of(span)["hicache.write_policy"] == "\u20ac" * 10  # never half a character (U+FFFD)
        assert attributes_of(span)["hicache.io_backend"] == "k" * 32

    def test_transfer_links_to_the_request_spans_it_served(self, sdk: Sdk) -> None:
        tracer = sdk.tracer_provider.get_tracer("server")
        with tracer.start_as_current_span("request-a") as a, tracer.start_as_current_span("request-b") as b:
            contexts = (a.get_span_context(), b.get_span_context())
        sdk.telemetry.record_transfer(backup(links=contexts))
        transfer = next(s for s in sdk.spans() if s.name == "hicache.backup")
        assert [link.context for link in transfer.links] == list(contexts)

    def test_request_span_carries_the_prefix_split(self, sdk: Sdk) -> None:
        tracer = sdk.tracer_provider.get_tracer("server")
        with tracer.start_as_current_span("request") as span:
            sdk.telemetry.record_prefix_split(PrefixSplit(12, 30, 20, 10), request_span=span)
        (request,) = sdk.spans()
        assert {k: v for k, v in attributes_of(request).items() if k.startswith("hicache.")} == {
            "hicache.prefix.tokens.input": 12,
            "hicache.prefix.tokens.device_hit": 30,
            "hicache.prefix.tokens.host_hit": 20,
            "hicache.prefix.tokens.storage_hit": 10,
        }

    def test_the_span_and_the_duration_histogram_tell_the_same_copy_time(self, sdk: Sdk) -> None:
        sdk.telemetry.record_transfer(backup())
        (span,) = sdk.spans()
        (point,) = sdk.points(sc.METRIC_TRANSFER_DURATION).values()
        assert (point.count, point.sum) == (1, attributes_of(span)[sc.ATTR_COPY_DURATION])
        assert point.exemplars == []  # the histogram is the table's; a transfer's trace is its span

    def test_metrics_stay_exact_when_the_sampler_drops_every_span(self) -> None:
        sdk = make_sdk(sampler=ALWAYS_OFF)
        for _ in range(5):
            sdk.telemetry.record_transfer(backup())
        assert sdk.spans() == []
        assert sdk.value(sc.METRIC_TRANSFER_TOKENS, op_pool("backup", "kv")) == 80
        (point,) = sdk.points(sc.METRIC_TRANSFER_DURATION).values()
        assert point.count == 5

    def test_spans_off_keeps_metrics(self) -> None:
        sdk = make_sdk(spans=False)
        sdk.telemetry.record_transfer(backup())
        assert sdk.spans() == []
        assert sdk.value(sc.METRIC_TRANSFER_TOKENS, op_pool("backup", "kv")) == 16

    def test_spans_are_created_off_the_calling_thread(self, sdk: Sdk) -> None:
        sdk.telemetry.record_transfer(backup())
        assert sdk.span_exporter.get_finished_spans() == ()  # nothing yet: the worker has not drained
        assert sdk.telemetry.flush()
        assert len(sdk.span_exporter.get_finished_spans()) == 1


class TestTransferSites:
    """record_transfer_at: an adapter's transfers without a record object, the site's values checked once."""

    def test_a_transfer_at_a_site_is_the_same_span_and_points_as_its_record(self) -> None:
        with_record, at_site = make_sdk(), make_sdk()
        try:
            with_record.telemetry.record_transfer(
                backup({"kv": 16, "swa": 4}, write_policy="write_back", io_backend="kernel")
            )
            site = at_site.telemetry.transfer_site(
                TransferOperation.BACKUP,
                timing_source=TimingSource.CUDA_EVENT,
                write_policy="write_back",
                io_backend="kernel",
            )
            at_site.telemetry.record_transfer_at(site, {"kv": 16, "swa": 4}, 4096, T0, T0 + 3_000_000, 0.002, 4, 3)
            (expected,), (span,) = with_record.spans(), at_site.spans()
            assert (span.name, span.start_time, span.end_time) == (
                expected.name,
                expected.start_time,
                expected.end_time,
            )
            assert attributes_of(span) == attributes_of(expected)
            assert at_site.counters() == with_record.counters()
            durations, expected_durations = (s.points(sc.METRIC_TRANSFER_DURATION) for s in (at_site, with_record))
            assert durations.keys() == expected_durations.keys()
            assert [(p.count, p.sum, p.bucket_counts) for p in durations.values()] == [
                (p.count, p.sum, p.bucket_counts) for p in expected_durations.values()
            ]
        finally:
            with_record.shutdown()
            at_site.shutdown()

    def test_a_transfer_without_a_duration_has_no_timing_source(self, sdk: Sdk) -> None:
        site = sdk.telemetry.transfer_site(TransferOperation.LOAD_BACK, timing_source=TimingSource.CUDA_EVENT)
        sdk.telemetry.record_transfer_at(site, {"kv": 8}, 800, T0, T0 + 10)
        (span,) = sdk.spans()
        assert attributes_of(span)["hicache.timing.source"] == "none"
        assert sdk.points(sc.METRIC_TRANSFER_DURATION) == {}
        size = {sc.ATTR_OPERATION: "load_back", sc.ATTR_TIMING_SOURCE: "none"}
        assert sdk.value(sc.METRIC_TRANSFER_SIZE, size) == 800

    @pytest.mark.parametrize(
        ("values", "problem"),
        [
            (({"kv": -1}, 100, T0, T0, None), "negative_count"),
            (({"kv": 1}, "100", T0, T0, None), "bad_count"),
            (({"kv": 1}, 100, T0 + 5, T0, None), "end_before_start"),
            (({"kv": 1}, 100, T0, T0, "0.1"), "bad_duration"),
            (([("kv", 1)], 100, T0, T0, None), "malformed"),
        ],
    )
    def test_a_transfer_at_a_site_is_checked_like_a_record(self, sdk: Sdk, values: tuple, problem: str) -> None:
        site = sdk.telemetry.transfer_site(TransferOperation.BACKUP, timing_source=TimingSource.HOST_CLOCK)
        sdk.telemetry.record_transfer_at(site, *values)
        counters = sdk.counters()
        assert counters[sc.METRIC_RECORDS_REJECTED] == {("transfer", problem): 1}
        assert counters[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 0
        assert sdk.spans() == []

    def test_a_duration_at_a_site_that_cannot_time_is_refused(self, sdk: Sdk) -> None:
        site = sdk.telemetry.transfer_site(TransferOperation.BACKUP)  # timing source none
        sdk.telemetry.record_transfer_at(site, {"kv": 1}, 100, T0, T0, 0.001)
        assert sdk.counters()[sc.METRIC_RECORDS_REJECTED] == {("transfer", "unknown_timing_source"): 1}

    def test_a_site_label_that_had_to_be_corrected_is_counted_with_every_transfer(self, sdk: Sdk) -> None:
        site = sdk.telemetry.transfer_site(TransferOperation.BACKUP, write_policy=b"write_back")  # type: ignore[arg-type]
        for _ in range(3):
            sdk.telemetry.record_transfer_at(site, {"kv": 1}, 100, T0, T0)
        assert sdk.counters()[sc.METRIC_RECORDS_NORMALIZED] == {("transfer", "bad_attribute"): 3}
        assert all("hicache.write_policy" not in attributes_of(span) for span in sdk.spans())

    def test_an_unknown_operation_or_timing_source_is_refused_when_the_site_is_made(self, sdk: Sdk) -> None:
        with pytest.raises(ValueError, match="unknown_operation"):
            sdk.telemetry.transfer_site("teleport")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unknown_timing_source"):
            sdk.telemetry.transfer_site(TransferOperation.BACKUP, timing_source="sundial")  # type: ignore[arg-type]

    def test_a_site_label_that_cannot_be_read_is_refused_as_a_value_error(self, sdk: Sdk) -> None:
        class Unreadable(str):
            def __str__(self) -> str:
                raise RuntimeError("no")

        with pytest.raises(ValueError, match="unreadable"):
            sdk.telemetry.transfer_site(TransferOperation.BACKUP, write_policy=Unreadable("x" * 40))

    def test_a_site_not_made_by_the_telemetry_is_refused_never_raised(self, sdk: Sdk) -> None:
        forged = validation.Site("teleport", TimingSource.NONE, None, None, ())  # type: ignore[arg-type]
        sdk.telemetry.record_transfer_at(forged, {"kv": 1}, 100, T0, T0)
        sdk.telemetry.record_transfer_at(None, {"kv": 1}, 100, T0, T0)  # type: ignore[arg-type]
        assert sdk.counters()[sc.METRIC_RECORDS_REJECTED] == {("transfer", "malformed"): 2}

    def test_a_forged_site_label_never_runs_its_code_under_the_telemetrys_lock(self) -> None:
        sdk = make_sdk()

        class Reentrant(str):
            def __hash__(self) -> int:
                sdk.telemetry.record_failure(TransferFailure(TransferOperation.BACKUP, "host_pool_full", {"kv": 1}, T0))
                return str.__hash__(self)

        forged = validation.Site(TransferOperation.BACKUP, TimingSource.NONE, Reentrant("write_back"), None, ())
        caller = threading.Thread(
            target=sdk.telemetry.record_transfer_at, args=(forged, {"kv": 1}, 100, T0, T0), daemon=True
        )
        caller.start()
        caller.join(10)
        assert not caller.is_alive(), "a site's label read under the telemetry's lock deadlocked it"
        try:
            counters = sdk.counters()
            assert counters[sc.METRIC_RECORDS_REJECTED] == {("transfer", "malformed"): 1}
            assert counters[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 0 and sdk.spans() == []
        finally:
            sdk.shutdown()

    @pytest.mark.parametrize(
        ("write_policy", "corrections"),
        [
            (5, ()),  # not a string: site() leaves it out
            ("w" * 33, ()),  # longer than site() keeps
            (None, ("made_up",)),  # not a problem name
            (None, (sc.Problem.QUEUE_FULL,)),  # a refusal, not a correction site() can note
            (None, None),
        ],
    )
    def test_a_site_with_values_site_never_makes_is_refused_whole_never_raised(
        self, sdk: Sdk, write_policy: object, corrections: object
    ) -> None:
        forged = validation.Site(TransferOperation.BACKUP, TimingSource.NONE, write_policy, None, corrections)  # type: ignore[arg-type]
        sdk.telemetry.record_transfer_at(forged, {"kv": 1}, 100, T0, T0)
        counters = sdk.counters()
        assert counters[sc.METRIC_RECORDS_REJECTED] == {("transfer", "malformed"): 1}
        assert counters[sc.METRIC_RECORDS_NORMALIZED] == {}
        assert counters[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 0 and sdk.spans() == []


class TestNeverHarmTheHost:
    @pytest.mark.parametrize(
        ("record", "problem"),
        [
            (backup(operation="teleport"), "unknown_operation"),
            (backup({"kv": -1}), "negative_count"),
            (backup({"kv": None}), "bad_count"),  # type: ignore[dict-item]
            (backup({"kv": 2.5}), "bad_count"),  # type: ignore[dict-item]
            (backup({"kv": 1 << 41}), "absurd_count"),
            (backup(num_bytes=-5), "negative_count"),
            (backup(num_bytes=1 << 51), "absurd_count"),
            (backup(copy_duration_s=float("nan")), "bad_duration"),
            (backup(copy_duration_s=-0.1), "bad_duration"),
            (backup(copy_duration_s="fast"), "bad_duration"),
            (backup(complete_time_ns=T0 - 1), "end_before_start"),
            (backup(num_bytes=10, bytes_by_pool={"kv": 9}), "bytes_mismatch"),
            (backup(tokens_by_pool=None), "malformed"),
        ],
    )
    def test_malformed_transfer_is_rejected_and_counted_not_raised(
        self, sdk: Sdk, record: TransferRecord, problem: str
    ) -> None:
        sdk.telemetry.record_transfer(record)  # must not raise
        assert sdk.value(sc.METRIC_TRANSFER_TOKENS, op_pool("backup", "kv")) == 0
        assert sdk.spans() == []
        rejected = {sc.ATTR_RECORD_KIND: "transfer", sc.ATTR_PROBLEM: problem}
        assert sdk.value(sc.METRIC_RECORDS_REJECTED, rejected) == 1

    def test_not_a_record_at_all_is_rejected(self, sdk: Sdk) -> None:
        for method in ("record_transfer", "record_drop", "record_eviction", "record_failure", "record_prefix_split"):
            getattr(sdk.telemetry, method)(None)
        rejected = sdk.points(sc.METRIC_RECORDS_REJECTED)
        assert sum(p.value for p in rejected.values()) == 5

    def test_bad_drop_eviction_and_prefix_records_are_rejected(self, sdk: Sdk) -> None:
        sdk.telemetry.record_drop(DropRecord("bored", {"kv": 1}, T0))  # type: ignore[arg-type]
        sdk.telemetry.record_eviction(EvictionRecord("moon", 1, 0.1, T0))  # type: ignore[arg-type]
        sdk.telemetry.record_eviction(EvictionRecord(Tier.DEVICE, 1, float("inf"), T0))
        sdk.telemetry.record_prefix_split(PrefixSplit(-1, 0, 0, 0))
        problems = {
            (dict(k)[sc.ATTR_RECORD_KIND], dict(k)[sc.ATTR_PROBLEM]): p.value
            for k, p in sdk.points(sc.METRIC_RECORDS_REJECTED).items()
        }
        assert problems == {
            ("eviction", "unknown_tier"): 1,
            ("eviction", "bad_duration"): 1,
            ("prefix_split", "negative_count"): 1,
        }
        assert sdk.value(sc.METRIC_PREFILL_TOKENS, {sc.ATTR_PREFILL_MODE: "input"}) == 0

    def test_many_prefix_splits_at_once_count_their_sum_and_each_odd_row_alone(self, sdk: Sdk) -> None:
        class Index:  # an integer type of an engine's (numpy's, torch's): corrected to int, counted
            def __index__(self) -> int:
                return 4

        class Endless(tuple):  # a row that lies about itself: never unpacked
            def __getitem__(self, index: Any) -> Any:
                return itertools.count()

        def rows_then_failure() -> Iterator[Any]:
            yield (1, 0, 0, 0, 0)
            yield [2, 0, 0, 0, 0]  # a list: checked alone, counted
            raise RuntimeError("the engine's iterator broke")

        rows: list[Any] = [
            (100, 50, 30, 20, 0),
            (10, 0, 0, 5, 3),
            (-1, 0, 0, 0, 0),  # refused alone: the rows around it still count
            (Index(), 1, 0, 0, 0),
            (1, 2, 3),  # not a row
            (1, 2, 3, 4, 5, 6),  # nor this
            b"\x01\x02\x03\x04\x05",  # nor this
            (1 << 41, 0, 0, 0, 0),  # absurd: refused alone
            Endless((1, 2, 3, 4, 5)),
        ]
        sdk.telemetry.record_prefix_splits(rows)
        sdk.telemetry.record_prefix_splits(rows_then_failure())  # what it yielded counts; the failure is refused
        sdk.telemetry.record_prefix_splits(None)  # type: ignore[arg-type]
        modes = {m.value: sdk.value(sc.METRIC_PREFILL_TOKENS, {sc.ATTR_PREFILL_MODE: m.value}) for m in PrefillMode}
        assert modes == {"input": 117, "device_hit": 51, "host_hit": 30, "storage_hit": 25, "other": 3}
        problems = {
            dict(k)[sc.ATTR_PROBLEM]: p.value
            for k, p in sdk.points(sc.METRIC_RECORDS_REJECTED).items()
            if dict(k)[sc.ATTR_RECORD_KIND] == "prefix_split"
        }
        assert problems == {"negative_count": 1, "malformed": 5, "absurd_count": 1, "bad_count": 1}

    def test_a_prefill_sum_past_an_int64_counter_is_refused_whole_and_counted_per_row(self, sdk: Sdk) -> None:
        sdk.telemetry.record_prefix_split(PrefixSplit(0, 1, 0, 0))
        rows = [(0, (1 << 40), 0, 0, 0)] * ((1 << 23) + 1)  # their sum is past int64 (about 2**63)
        sdk.telemetry.record_prefix_splits(rows)
        assert sdk.value(sc.METRIC_PREFILL_TOKENS, {sc.ATTR_PREFILL_MODE: "device_hit"}) == 1
        rejected = {sc.ATTR_RECORD_KIND: "prefix_split", sc.ATTR_PROBLEM: "absurd_count"}
        assert sdk.value(sc.METRIC_RECORDS_REJECTED, rejected) == len(rows)

    def test_rejection_warns_once_per_problem(self, sdk: Sdk, caplog: pytest.LogCaptureFixture) -> None:
        with caplog.at_level(logging.WARNING, logger="otel_hicache"):
            for _ in range(50):
                sdk.telemetry.record_transfer(backup(num_bytes=-1))
        warnings = [r for r in caplog.records if "negative_count" in r.getMessage()]
        assert len(warnings) == 1
        rejected = {sc.ATTR_RECORD_KIND: "transfer", sc.ATTR_PROBLEM: "negative_count"}
        assert sdk.value(sc.METRIC_RECORDS_REJECTED, rejected) == 50

    def test_unknown_pools_collapse_into_other_so_cardinality_stays_bounded(
        self, sdk: Sdk, caplog: pytest.LogCaptureFixture
    ) -> None:
        with caplog.at_level(logging.WARNING, logger="otel_hicache"):
            for i in range(500):
                sdk.telemetry.record_transfer(backup({f"pool-{i}": 1}))
        assert sdk.value(sc.METRIC_TRANSFER_TOKENS, op_pool("backup", "other")) == 500
        pools = {dict(k)[sc.ATTR_POOL] for k in sdk.points(sc.METRIC_TRANSFER_TOKENS)}
        assert pools == {"kv", "other"}
        normalized = {sc.ATTR_RECORD_KIND: "transfer", sc.ATTR_PROBLEM: "unknown_pool"}
        assert sdk.value(sc.METRIC_RECORDS_NORMALIZED, normalized) == 500
        assert len([r for r in caplog.records if "unknown_pool" in r.getMessage()]) == 1
        spans = sdk.spans()
        assert attributes_of(spans[0])["hicache.transfer.tokens.other"] == 1
        assert not any(k.startswith("hicache.transfer.tokens.pool-") for s in spans for k in attributes_of(s))

    def test_a_failing_pool_usage_source_is_counted_and_others_still_report(self, sdk: Sdk) -> None:
        def broken() -> list[PoolUsage]:
            raise RuntimeError("pool gone")

        sdk.telemetry.add_pool_usage_source(broken)
        sdk.telemetry.add_pool_usage_source(lambda: [PoolUsage(Tier.HOST, "kv", 1, 2)])
        assert sdk.value(sc.METRIC_POOL_LIMIT, {sc.ATTR_TIER: "host", sc.ATTR_POOL: "kv"}) == 2
        rejected = {sc.ATTR_RECORD_KIND: "pool_usage", sc.ATTR_PROBLEM: "source_failed"}
        assert sdk.value(sc.METRIC_RECORDS_REJECTED, rejected) >= 1


class TestQueue:
    def test_a_full_queue_drops_spans_but_counters_stay_exact(self) -> None:
        sdk = make_sdk(max_queue=3, flush_interval_s=3600)
        for _ in range(10):
            sdk.telemetry.record_transfer(backup())
        assert sdk.value(sc.METRIC_TRANSFER_TOKENS, op_pool("backup", "kv")) == 160
        assert len(sdk.spans()) == 3
        assert sdk.value(sc.METRIC_RECORDS_DROPPED, {sc.ATTR_RECORD_KIND: "transfer"}) == 7

    def test_after_shutdown_records_still_count_and_spans_are_dropped(self, sdk: Sdk) -> None:
        sdk.telemetry.shutdown()
        sdk.telemetry.record_transfer(backup())
        assert sdk.value(sc.METRIC_TRANSFER_TOKENS, op_pool("backup", "kv")) == 16
        assert sdk.spans() == []
        assert sdk.value(sc.METRIC_RECORDS_DROPPED, {sc.ATTR_RECORD_KIND: "transfer"}) == 1

    def test_background_worker_drains_without_an_explicit_flush(self) -> None:
        sdk = make_sdk(flush_interval_s=0.01)
        sdk.telemetry.record_transfer(backup())
        import time

        deadline = time.monotonic() + 5
        while not sdk.span_exporter.get_finished_spans() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(sdk.span_exporter.get_finished_spans()) == 1
        sdk.telemetry.shutdown()


def test_invalid_constructor_arguments_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="max_queue"):
        make_sdk(max_queue=0)


def test_links_accept_remote_span_contexts(sdk: Sdk) -> None:
    remote = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    sdk.telemetry.record_transfer(backup(links=(remote,)))
    (span,) = sdk.spans()
    assert span.links[0].context.trace_id == 0x1234


class TestDeferredRecords:
    """record_transfer_deferred: the calling thread only queues; every read of the counters is still exact."""

    @staticmethod
    def build(payload: tuple[int, int]) -> TransferRecord:
        tokens, num_bytes = payload
        return backup({"kv": tokens}, num_bytes)

    def test_counters_are_exact_at_collection_without_any_flush(self) -> None:
        sdk = make_sdk(flush_interval_s=3600)  # the worker will not run before we read
        for i in range(10):
            sdk.telemetry.record_transfer_deferred(self.build, (i, 100))
        reader_value = {k: p.value for k, p in _reader_points(sdk, sc.METRIC_TRANSFER_TOKENS).items()}
        assert reader_value[frozenset(op_pool("backup", "kv").items())] == 45
        assert sdk.telemetry.snapshot()[sc.METRIC_TRANSFER_SIZE][("backup", None, "cuda_event")] == 1000
        assert len(sdk.spans()) == 10

    def test_the_calling_thread_does_not_build_the_record(self) -> None:
        import threading
        import time

        builders: list[str] = []

        def build(payload: int) -> TransferRecord:
            builders.append(threading.current_thread().name)
            return backup({"kv": payload})

        sdk = make_sdk(flush_interval_s=0.01)
        scheduler = threading.Thread(target=sdk.telemetry.record_transfer_deferred, args=(build, 3), name="scheduler")
        scheduler.start()
        scheduler.join()
        deadline = time.monotonic() + 5
        while not builders and time.monotonic() < deadline:
            time.sleep(0.005)
        assert builders == ["otel-hicache-host"]
        assert sdk.value(sc.METRIC_TRANSFER_TOKENS, op_pool("backup", "kv")) == 3
        sdk.telemetry.shutdown()

    def test_a_failing_or_bogus_builder_is_rejected_and_counted(self, sdk: Sdk) -> None:
        def explode(_: object) -> TransferRecord:
            raise KeyError("num_tokens_by_pool")

        sdk.telemetry.record_transfer_deferred(explode, None)
        sdk.telemetry.record_transfer_deferred(lambda _: "not a record", None)  # type: ignore[arg-type,return-value]
        sdk.telemetry.record_transfer_deferred(self.build, (5, 10))
        rejected = {dict(k)[sc.ATTR_PROBLEM]: p.value for k, p in sdk.points(sc.METRIC_RECORDS_REJECTED).items()}
        assert rejected == {"build_failed": 1, "malformed": 1}
        assert sdk.value(sc.METRIC_TRANSFER_TOKENS, op_pool("backup", "kv")) == 5

    def test_a_hung_build_never_blocks_the_caller_and_what_cannot_be_queued_is_shed_and_counted(self) -> None:
        import threading
        import time

        release = threading.Event()

        def hung(payload: tuple[int, int]) -> TransferRecord:
            release.wait(30)
            return self.build(payload)

        sdk = make_sdk(max_queue=4)
        sdk.telemetry.record_transfer_deferred(hung, (1, 1))
        deadline = time.monotonic() + 5
        while sdk.telemetry._host.deferred and time.monotonic() < deadline:  # the host thread took it and hangs in it
            time.sleep(0.001)
        worst = 0.0
        for _ in range(20):  # a burst far past the queue
            start = time.perf_counter()
            sdk.telemetry.record_transfer_deferred(self.build, (1, 1))
            worst = max(worst, time.perf_counter() - start)
        assert worst < 0.5  # never waited on the hung build (it would take 30 s)
        shed = {sc.ATTR_RECORD_KIND: "transfer", sc.ATTR_PROBLEM: "queue_full"}
        release.set()
        assert sdk.telemetry.flush()
        assert sdk.value(sc.METRIC_RECORDS_REJECTED, shed) == 16  # 4 queued behind the hung one, 16 shed
        assert sdk.value(sc.METRIC_TRANSFER_TOKENS, op_pool("backup", "kv")) == 1 + 4
        sdk.telemetry.shutdown()


def test_token_metrics_off_leaves_out_every_instrument_counted_in_tokens_and_keeps_the_rest() -> None:
    sdk = make_sdk(token_metrics=False)  # a tensor-parallel rank other than the one that reports token flows
    sdk.telemetry.record_transfer(backup({"kv": 16}, 4096))
    sdk.telemetry.record_prefix_split(PrefixSplit(10, 5, 0, 0))
    sdk.telemetry.add_pool_usage_source(lambda: [PoolUsage(Tier.HOST, "kv", 1, 2)])
    reported = set(sdk.metrics())
    in_tokens = {spec.name for spec in sc.INSTRUMENTS if spec.unit == sc.UNIT_TOKEN}
    assert in_tokens == {
        sc.METRIC_TRANSFER_TOKENS,
        sc.METRIC_DROPPED_TOKENS,
        sc.METRIC_EVICTION_TOKENS,
        sc.METRIC_PREFILL_TOKENS,
        sc.METRIC_POOL_USAGE,
        sc.METRIC_POOL_LIMIT,
        sc.METRIC_CAPACITY_TOKENS,
    }
    assert not reported & in_tokens
    assert {sc.METRIC_TRANSFER_SIZE, sc.METRIC_TRANSFER_DURATION} <= reported  # bytes and time are per rank
    assert (
        sdk.value(sc.METRIC_TRANSFER_SIZE, {sc.ATTR_OPERATION: "backup", sc.ATTR_TIMING_SOURCE: "cuda_event"}) == 4096
    )
    assert attributes_of(sdk.spans()[0])["hicache.transfer.tokens.kv"] == 16  # the span still says what moved
    sdk.shutdown()


@pytest.mark.parametrize("token_metrics", [True, False])
def test_each_collection_is_prepared_once_whichever_instruments_the_rank_reports(token_metrics: bool) -> None:
    """In-process, a collection first counts the deferred records and reads the pools (the emitter's
    ``before_collect``). Was: only hicache.transfer.tokens' callback did, which a rank without token metrics lacks."""
    layout = Layout([*sorted(sc.POOLS), sc.OTHER_POOL], ["kv"], HEADER_INTS)
    channel = Channel(layout, 8, shared=False)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    prepared: list[int] = []
    emitter = Emitter(
        channel.counters, None, provider, token_metrics=token_metrics, before_collect=lambda: prepared.append(1)
    )
    reader.get_metrics_data()
    reader.get_metrics_data()
    assert prepared == [1, 1]
    del emitter
    provider.shutdown()
