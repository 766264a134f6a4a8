"""A dead, slow or restarting collector never blocks or breaks the caller; totals are right after recovery."""

from __future__ import annotations

import time

import pytest

from otel_hicache import semconv as sc
from otel_hicache.records import TransferRecord
from otel_hicache.sdk import configure
from otel_hicache.semconv import TimingSource, TransferOperation
from otel_hicache.testing import free_port
from otel_hicache.testing.otlp_receiver import OtlpReceiver, attributes

#: The most one record call may take with a broken pipeline. A call that waited on an export would take the
#: exporter's timeout (2 s here) or the receiver's delay; the bound is far below those and far above scheduling noise
#: on a loaded 2-core machine, so it tests behaviour, not speed.
CALLER_BOUND_S = 0.5


def record(tokens: int = 4) -> TransferRecord:
    return TransferRecord(TransferOperation.BACKUP, {"kv": tokens}, tokens * 100, 1, 2, 0.001, TimingSource.HOST_CLOCK)


def tokens_received(rx: OtlpReceiver) -> int | None:
    metric = rx.latest_metric(sc.METRIC_TRANSFER_TOKENS)
    if metric is None:
        return None
    return sum(p.as_int for p in metric.sum.data_points if attributes(p.attributes)[sc.ATTR_OPERATION] == "backup")


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_dead_endpoint_never_blocks_the_caller_and_shutdown_is_bounded(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")
    setup = configure(endpoint=f"http://127.0.0.1:{free_port()}", protocol=protocol)
    worst = 0.0
    for _ in range(2000):
        start = time.perf_counter()
        setup.telemetry.record_transfer(record())
        worst = max(worst, time.perf_counter() - start)
    assert worst < CALLER_BOUND_S
    assert setup.telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 8000
    start = time.monotonic()
    setup.shutdown(timeout_s=2)
    assert time.monotonic() - start < 15  # exporter timeout (2 s) per signal plus joins, never unbounded


def test_slow_receiver_does_not_slow_the_caller_and_everything_arrives() -> None:
    with OtlpReceiver(delay_s=1.5) as rx:
        setup = configure(env={}, endpoint=rx.grpc_endpoint, protocol="grpc")
        worst = 0.0
        for _ in range(500):
            start = time.perf_counter()
            setup.telemetry.record_transfer(record())
            worst = max(worst, time.perf_counter() - start)
        assert worst < CALLER_BOUND_S
        setup.force_flush(timeout_s=10)
        assert rx.wait_for(lambda: tokens_received(rx) == 2000)
        assert rx.wait_for(lambda: len(rx.spans()) == 500)
        setup.shutdown()


def test_receiver_restart_cumulative_totals_recover_and_lost_spans_are_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    rx = OtlpReceiver().start()
    endpoint = rx.grpc_endpoint
    setup = configure(endpoint=endpoint, protocol="grpc")
    try:
        for _ in range(10):
            setup.telemetry.record_transfer(record())
        setup.force_flush()
        assert tokens_received(rx) == 40

        rx.stop()  # the collector goes away mid-run
        for _ in range(25):
            setup.telemetry.record_transfer(record())
        setup.force_flush(timeout_s=3)  # exports fail; the caller is unaffected
        assert setup.telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 140

        rx.start()  # same ports
        for _ in range(5):
            setup.telemetry.record_transfer(record())

        # cumulative: right again at the first export that gets through (gRPC reconnects with a backoff)
        def flushed_and_all_there() -> bool:
            setup.force_flush(timeout_s=2)
            return tokens_received(rx) == 160

        assert rx.wait_for(flushed_and_all_there, 30)

        setup.force_flush()
        exported = rx.latest_metric("otel.sdk.exporter.span.exported")
        assert exported is not None
        counts = {"ok": 0, "failed": 0}
        for p in exported.sum.data_points:
            counts["failed" if "error.type" in attributes(p.attributes) else "ok"] += p.as_int
        # every span is accounted for: delivered, or counted as failed (all 25 from the outage, and any lost
        # while gRPC reconnects)
        assert counts["failed"] >= 25
        assert len(rx.spans()) + counts["failed"] == 40
    finally:
        setup.shutdown(timeout_s=2)
        rx.stop()
