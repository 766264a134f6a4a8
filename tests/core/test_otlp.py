"""Round trip through the real OTLP exporters (gRPC and HTTP/protobuf) into an in-process OTLP receiver."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.trace import SpanContext, TraceFlags

from otel_hicache import semconv as sc
from otel_hicache.records import DropRecord, PrefixSplit, TransferRecord
from otel_hicache.sdk import TelemetrySetup, configure
from otel_hicache.semconv import DropReason, TimingSource, TransferOperation
from otel_hicache.testing.otlp_receiver import OtlpReceiver, attributes

T0 = 1_790_000_000_000_000_000
REQUEST = SpanContext(0xABCDEF, 0x1234, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
RECORDS = [
    TransferRecord(
        TransferOperation.BACKUP,
        {"kv": 128, "swa": 32},
        655360,
        T0,
        T0 + 4_000_000,
        0.0031,
        TimingSource.CUDA_EVENT,
        merged_ops=5,
        node_count=4,
        links=(REQUEST,),
    ),
    TransferRecord(
        TransferOperation.LOAD_BACK,
        {"kv": 64},
        262144,
        T0 + 10,
        T0 + 900_000,
        0.0004,
        TimingSource.CUDA_EVENT,
        merged_ops=1,
        node_count=2,
    ),
    TransferRecord(
        TransferOperation.STORAGE_BACKUP, {"kv": 128}, 524288, T0 + 20, T0 + 30_000_000, 0.025, TimingSource.HOST_CLOCK
    ),
]


@pytest.fixture(params=["grpc", "http/protobuf"])
def exported(request: pytest.FixtureRequest) -> Iterator[tuple[OtlpReceiver, TelemetrySetup]]:
    with OtlpReceiver() as rx:
        endpoint = rx.grpc_endpoint if request.param == "grpc" else rx.http_endpoint
        setup = configure(env={}, endpoint=endpoint, protocol=request.param, ranks={"tp": 3})
        for record in RECORDS:
            setup.telemetry.record_transfer(record)
        setup.telemetry.record_drop(DropRecord(DropReason.HOST_PRESSURE, {"kv": 48}, T0))
        setup.telemetry.record_prefix_split(PrefixSplit(100, 60, 30, 10))
        setup.force_flush()
        yield rx, setup
        setup.shutdown()


def test_spans_arrive_with_the_records_timestamps_attributes_and_links(
    exported: tuple[OtlpReceiver, TelemetrySetup],
) -> None:
    rx, _ = exported
    spans = {span.name: span for span in rx.spans()}
    assert set(spans) == {"hicache.backup", "hicache.load_back", "hicache.storage_backup"}
    for record in RECORDS:
        span = spans[f"hicache.{record.operation.value}"]
        assert span.start_time_unix_nano == record.submit_time_ns
        assert span.end_time_unix_nano == record.complete_time_ns
        got = attributes(span.attributes)
        assert got["hicache.transfer.token_count"] == sum(record.tokens_by_pool.values())
        assert got["hicache.transfer.byte_count"] == record.num_bytes
        assert got["hicache.transfer.copy_duration"] == pytest.approx(record.copy_duration_s)
        assert got["hicache.timing.source"] == record.timing_source.value
        for pool, n in record.tokens_by_pool.items():
            assert got[f"hicache.transfer.tokens.{pool}"] == n
    backup = spans["hicache.backup"]
    assert [(int.from_bytes(link.trace_id, "big"), int.from_bytes(link.span_id, "big")) for link in backup.links] == [
        (REQUEST.trace_id, REQUEST.span_id)
    ]
    resource = attributes(rx.trace_requests[0].resource_spans[0].resource.attributes)
    assert resource["service.name"] == "otel-hicache" and resource[sc.RESOURCE_TP_RANK] == 3


def _sum_points(rx: OtlpReceiver, name: str) -> dict[frozenset, int]:
    metric = rx.latest_metric(name)
    assert metric is not None, name
    assert metric.sum.is_monotonic and metric.sum.aggregation_temporality == 2  # cumulative
    return {frozenset(attributes(p.attributes).items()): p.as_int for p in metric.sum.data_points}


def test_metric_points_equal_what_the_records_said(exported: tuple[OtlpReceiver, TelemetrySetup]) -> None:
    rx, _ = exported
    tokens = _sum_points(rx, sc.METRIC_TRANSFER_TOKENS)
    key = lambda op, pool: frozenset({sc.ATTR_OPERATION: op, sc.ATTR_POOL: pool}.items())  # noqa: E731
    assert tokens[key("backup", "kv")] == 128
    assert tokens[key("backup", "swa")] == 32
    assert tokens[key("load_back", "kv")] == 64
    assert tokens[key("storage_backup", "kv")] == 128
    assert tokens[key("storage_prefetch", "kv")] == 0  # pre-seeded
    size = _sum_points(rx, sc.METRIC_TRANSFER_SIZE)
    assert size[frozenset({sc.ATTR_OPERATION: "backup", sc.ATTR_TIMING_SOURCE: "cuda_event"}.items())] == 655360
    drops = _sum_points(rx, sc.METRIC_DROPPED_TOKENS)
    assert drops[frozenset({sc.ATTR_DROP_REASON: "host_pressure", sc.ATTR_POOL: "kv"}.items())] == 48
    prefill = _sum_points(rx, sc.METRIC_PREFILL_TOKENS)
    assert {dict(k)[sc.ATTR_PREFILL_MODE]: v for k, v in prefill.items()} == {
        "input": 100,
        "device_hit": 60,
        "host_hit": 30,
        "storage_hit": 10,
    }

    metric = rx.latest_metric(sc.METRIC_TRANSFER_DURATION)
    assert metric is not None
    histogram = metric.histogram
    points = {attributes(p.attributes)[sc.ATTR_OPERATION]: p for p in histogram.data_points}
    assert tuple(points["backup"].explicit_bounds) == sc.TRANSFER_DURATION_BUCKETS
    for record in RECORDS:
        point = points[record.operation.value]
        assert record.copy_duration_s is not None
        assert point.count == 1 and point.sum == pytest.approx(record.copy_duration_s)
        bucket = next(i for i, bound in enumerate(sc.TRANSFER_DURATION_BUCKETS) if record.copy_duration_s <= bound)
        assert list(point.bucket_counts) == [int(i == bucket) for i in range(len(sc.TRANSFER_DURATION_BUCKETS) + 1)]
        assert attributes(point.attributes)[sc.ATTR_TIMING_SOURCE] == record.timing_source.value


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_standard_environment_drives_endpoint_protocol_headers_and_sampler(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with OtlpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.grpc_endpoint if protocol == "grpc" else rx.http_endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=hicache-team,authorization=Bearer%20t0ken")
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "sglang-prefill-0")
        setup = configure()
        assert setup.mode == "otlp"
        setup.telemetry.record_transfer(RECORDS[0])
        setup.force_flush()
        setup.shutdown()
        assert rx.spans() == []  # the sampler said no spans ...
        assert (
            _sum_points(rx, sc.METRIC_TRANSFER_TOKENS)[
                frozenset({sc.ATTR_OPERATION: "backup", sc.ATTR_POOL: "kv"}.items())
            ]
            == 128
        )  # ... and the metrics are exact anyway
        assert all(h.get("x-tenant") == "hicache-team" for h in rx.headers)
        assert all(h.get("authorization") == "Bearer t0ken" for h in rx.headers)
        resource = attributes(rx.metric_requests[0].resource_metrics[0].resource.attributes)
        assert resource["service.name"] == "sglang-prefill-0"
