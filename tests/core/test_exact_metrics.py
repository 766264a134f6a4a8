"""Every metric is exact in the host's shared memory: a fault costs spans, each one counted, never a metric point.

Over OTLP into the in-process receiver, with the real export process and the default 60 s metric interval:

* the export process SIGKILLed while histogram values it has not exported are recorded, and then eight times in a
  row: every histogram's exported count, sum and bucket counts equal what was recorded (was: 1,000 of 2,000 KV waits,
  ages and eviction durations; 85 of 95 after eight kills);
* a collector down, a black hole and an erroring collector, for ``OTEL_HICACHE_FAULT_S`` seconds each (default 60, the
  three side by side, one telemetry each) at 500 transfers and 500 KV waits a second: after recovery every cumulative
  metric - counters and histograms - equals what was recorded, and every transfer is a span received or a counted
  drop (was: 8,326 of 16,000 waits with the collector down, 6,589 of 16,000 with a black hole).

The expected histograms are computed here from what was recorded, by the SDK's explicit-bucket rule (bucket ``i`` holds
``bounds[i-1] < v <= bounds[i]``); sums are float64 additions in recording order, so they compare exactly.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import grpc
import pytest

from otel_hicache import semconv as sc
from otel_hicache.records import EvictedEntry, EvictionRecord, KvWait, TransferRecord
from otel_hicache.sdk import TelemetrySetup, configure
from otel_hicache.semconv import Tier, TimingSource, TransferOperation
from otel_hicache.telemetry import HiCacheTelemetry
from otel_hicache.testing.otlp_receiver import OtlpReceiver, attributes
from tests.core.support import spans_by_pid

FAULT_S = float(os.environ.get("OTEL_HICACHE_FAULT_S", "60"))
#: Records of each kind per second while a collector is at fault (the issue's rate).
RATE = 500
#: The most a dead exporter stays unreplaced: it waits out the host's back-off for launches that die young (0.5 s,
#: doubling, at most 30 s: eight kills in a row reach it) and imports the SDK (seconds on a loaded machine).
REPLACED_WITHIN_S = 45.0
HISTOGRAMS = {spec.name: spec.buckets or () for spec in sc.INSTRUMENTS if spec.kind == "histogram"}
Series = tuple[str, frozenset[tuple[str, Any]]]


class Recorded:
    """What a test recorded, as a collector must report it: each histogram series' bucket counts and sum."""

    def __init__(self) -> None:
        self.histograms: dict[Series, tuple[list[int], float]] = {}
        self.transfers = 0

    def add(self, name: str, attrs: dict[str, Any], values: list[float]) -> None:
        """The values of one record call (the host adds their sum in one go)."""
        bounds = HISTOGRAMS[name]
        counts, total = self.histograms.get((name, frozenset(attrs.items())), ([0] * (len(bounds) + 1), 0.0))
        for value in values:
            counts[bisect_left(bounds, value)] += 1
        self.histograms[(name, frozenset(attrs.items()))] = (counts, total + sum(values))

    def transfer(self, telemetry: HiCacheTelemetry, rng: random.Random) -> None:
        seconds = rng.choice((0.00007, 0.0003, 0.004, 0.02, 0.3, 2.0))
        telemetry.record_transfer(
            TransferRecord(TransferOperation.BACKUP, {"kv": 4}, 256, 1, 2, seconds, TimingSource.HOST_CLOCK)
        )
        self.add(
            sc.METRIC_TRANSFER_DURATION, {sc.ATTR_OPERATION: "backup", sc.ATTR_TIMING_SOURCE: "host_clock"}, [seconds]
        )
        self.transfers += 1

    def kv_wait(self, telemetry: HiCacheTelemetry, rng: random.Random) -> None:
        tier, seconds = rng.choice((Tier.HOST, Tier.STORAGE)), rng.uniform(0.00005, 3.0)
        telemetry.record_kv_wait(KvWait(tier, seconds, 1))
        self.add(sc.METRIC_REQUEST_KV_WAIT, {sc.ATTR_TIER: tier.value}, [seconds])

    def eviction(self, telemetry: HiCacheTelemetry, rng: random.Random) -> None:
        ages = [rng.uniform(0.01, 5000.0) for _ in range(rng.randrange(0, 6))]
        seconds = rng.uniform(0.00005, 0.2)
        entries = [EvictedEntry(2, idle_s=age) for age in ages]
        telemetry.record_eviction(EvictionRecord(Tier.HOST, 16, seconds, 1, entries))
        self.add(sc.METRIC_EVICTION_DURATION, {sc.ATTR_TIER: "host"}, [seconds])
        if ages:
            self.add(sc.METRIC_EVICTION_AGE, {sc.ATTR_TIER: "host"}, ages)


def histograms_received(rx: OtlpReceiver) -> dict[Series, tuple[list[int], float]]:
    """The latest cumulative point of every histogram series the receiver got."""
    out = {}
    for name in HISTOGRAMS:
        metric = rx.latest_metric(name)
        for point in metric.histogram.data_points if metric is not None else ():
            assert list(point.explicit_bounds) == list(HISTOGRAMS[name])
            assert point.count == sum(point.bucket_counts)
            out[(name, frozenset(attributes(point.attributes).items()))] = (list(point.bucket_counts), point.sum)
    return out


def counters_received(rx: OtlpReceiver, names: set[str]) -> dict[Series, int]:
    out = {}
    for name in names:
        metric = rx.latest_metric(name)
        for point in metric.sum.data_points if metric is not None else ():
            out[(name, frozenset(attributes(point.attributes).items()))] = point.as_int
    return out


def counters_recorded(telemetry: HiCacheTelemetry) -> dict[Series, int]:
    """The host's exact counters (its shared table), keyed as the receiver's."""
    layout = telemetry._tally.layout  # the attribute names of each slot key
    return {
        (name, frozenset(layout.attributes(name, key).items())): value
        for name, series in telemetry.snapshot().items()
        for key, value in series.items()
    }


def exported_pid(telemetry: HiCacheTelemetry, other_than: int | None = None) -> int:
    """The pid of the export process that attached (other than ``other_than``)."""
    deadline = time.monotonic() + REPLACED_WITHIN_S
    while telemetry.export_pid in (None, other_than):
        assert time.monotonic() < deadline, "no export process attached"
        time.sleep(0.05)
    pid = telemetry.export_pid
    assert pid is not None
    return pid


def exact_after_flush(setup: TelemetrySetup, rx: OtlpReceiver, recorded: Recorded, timeout_s: float = 60) -> None:
    """Flush (the metrics are exported then, not at the 60 s interval) until the receiver's histograms are exact."""

    def arrived() -> bool:
        setup.force_flush(timeout_s=5)
        return histograms_received(rx) == recorded.histograms

    assert rx.wait_for(arrived, timeout_s), (histograms_received(rx), recorded.histograms)


def test_histograms_survive_a_killed_export_process_and_eight_kills_in_a_row() -> None:
    rng = random.Random(27)
    with OtlpReceiver() as rx:
        setup = configure(env={}, endpoint=rx.grpc_endpoint, protocol="grpc")  # the default 60 s metric interval
        telemetry, recorded = setup.telemetry, Recorded()

        def burst(n: int) -> None:
            for _ in range(n):
                recorded.transfer(telemetry, rng)
                recorded.kv_wait(telemetry, rng)
                recorded.eviction(telemetry, rng)

        burst(1000)
        first = exported_pid(telemetry)
        os.kill(first, signal.SIGKILL)  # nothing of it exported yet: its SDK never held a metric
        assert not rx.metric_requests
        killed = exported_pid(telemetry, other_than=first)
        burst(1000)
        exact_after_flush(setup, rx, recorded)

        for _ in range(7):  # eight in all, each with values recorded since its predecessor died
            burst(20)
            os.kill(killed, signal.SIGKILL)
            burst(20)
            killed = exported_pid(telemetry, other_than=killed)
        exact_after_flush(setup, rx, recorded)
        setup.shutdown()


@contextlib.contextmanager
def _down(rx: OtlpReceiver) -> Iterator[None]:
    rx.stop()
    try:
        yield
    finally:
        rx.start()  # on the same ports


@contextlib.contextmanager
def _erroring(rx: OtlpReceiver) -> Iterator[None]:
    rx.fail(grpc.StatusCode.INTERNAL)  # not retryable: every export fails at once
    try:
        yield
    finally:
        rx.fail(None)


FAULTS: dict[str, Callable[[OtlpReceiver], AbstractContextManager[None]]] = {
    "down": _down,
    "black hole": OtlpReceiver.black_hole,
    "erroring": _erroring,
}


@pytest.fixture
def hosts() -> Iterator[dict[str, tuple[OtlpReceiver, TelemetrySetup]]]:
    """One receiver and one telemetry per fault, exporting over gRPC from its own export process."""
    made: dict[str, tuple[OtlpReceiver, TelemetrySetup]] = {}
    try:
        for fault in FAULTS:
            rx = OtlpReceiver().start()
            made[fault] = (rx, configure(env={}, endpoint=rx.grpc_endpoint, protocol="grpc"))
        yield made
    finally:
        for rx, setup in made.values():
            setup.shutdown(timeout_s=2)
            rx.stop()


def test_after_a_collector_down_a_black_hole_or_an_erroring_collector_every_metric_is_exact_and_spans_add_up(
    hosts: dict[str, tuple[OtlpReceiver, TelemetrySetup]],
) -> None:
    rng = random.Random(28)
    recorded = {fault: Recorded() for fault in hosts}
    stop = threading.Event()

    def record_at_rate() -> None:
        """``RATE`` transfers and ``RATE`` KV waits a second into each telemetry, in steps of 10 ms."""
        step = 0
        start = time.monotonic()
        while not stop.is_set():
            for fault, (_, setup) in hosts.items():
                for _ in range(RATE // 100):
                    recorded[fault].transfer(setup.telemetry, rng)
                    recorded[fault].kv_wait(setup.telemetry, rng)
            step += 1
            time.sleep(max(0.0, start + step / 100 - time.monotonic()))

    for _, setup in hosts.values():
        exported_pid(setup.telemetry)
    producer = threading.Thread(target=record_at_rate, name="test-producer")
    producer.start()
    try:
        time.sleep(2)  # healthy first: spans and metrics flow
        with contextlib.ExitStack() as faults:
            for fault, (rx, _) in hosts.items():
                faults.enter_context(FAULTS[fault](rx))
            time.sleep(FAULT_S)  # the faults last this long, the records flowing
        time.sleep(2)  # recovered, still recording
    finally:
        stop.set()
        producer.join()

    for fault, (rx, setup) in hosts.items():
        assert recorded[fault].transfers >= RATE * FAULT_S * 0.9, (fault, recorded[fault].transfers)  # the rate held
        exact_after_flush(setup, rx, recorded[fault], timeout_s=120)
        assert setup.telemetry.flush(30), fault  # every span sent or counted lost, the counters exported
        expected = counters_recorded(setup.telemetry)
        assert counters_received(rx, {name for name, _ in expected}) == expected, fault
        dropped = setup.telemetry.snapshot()[sc.METRIC_RECORDS_DROPPED][("transfer",)]
        assert dropped > 0, fault  # the fault cost spans ...
        spans = spans_by_pid(rx).get(os.getpid(), 0)
        assert spans + dropped == recorded[fault].transfers, (fault, spans, dropped)  # ... each one counted
