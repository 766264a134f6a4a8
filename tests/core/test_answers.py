"""The operator's answers in the core: reuse and age at eviction, wasted bytes, request KV waits, engine self-checks.

Each producer (the reference cache, the SGLang and vLLM adapters) reports these through the records below; these
tests pin down what the telemetry makes of them, in-process and across the export process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider

from otel_hicache import semconv as sc
from otel_hicache.records import DropRecord, EvictedEntry, EvictionRecord, KvWait, PrefixSplit
from otel_hicache.sdk import TelemetrySetup, configure
from otel_hicache.semconv import Tier, TransferOperation
from otel_hicache.testing.otlp_receiver import OtlpReceiver, attributes
from otel_hicache.testing.sdk import Sdk, attributes_of, make_sdk

T0 = 1_790_000_000_000_000_000
REUSED = sc.ATTR_EVICTION_REUSED


@pytest.fixture
def sdk() -> Iterator[Sdk]:
    made = make_sdk()
    yield made
    made.shutdown()


def rejected(sdk: Sdk) -> dict[tuple[str, str], int]:
    return {(kind, problem): n for (kind, problem), n in sdk.counters()[sc.METRIC_RECORDS_REJECTED].items() if n}


class TestEvictionEntries:
    def test_tokens_split_by_reuse_and_the_rest_counts_as_unknown(self, sdk: Sdk) -> None:
        entries = [EvictedEntry(32, reused=True), EvictedEntry(16, reused=False), EvictedEntry(8, reused=False)]
        sdk.telemetry.record_eviction(EvictionRecord(Tier.HOST, 64, 0.002, T0, entries))
        host = {sc.ATTR_TIER: "host"}
        assert sdk.value(sc.METRIC_EVICTION_TOKENS, {**host, REUSED: True}) == 32
        assert sdk.value(sc.METRIC_EVICTION_TOKENS, {**host, REUSED: False}) == 24
        assert sdk.value(sc.METRIC_EVICTION_TOKENS, host) == 8  # no entry accounts for them

    def test_a_pass_without_entries_is_all_of_unknown_reuse(self, sdk: Sdk) -> None:
        sdk.telemetry.record_eviction(EvictionRecord(Tier.DEVICE, 40, 0.001, T0))
        assert sdk.counters()[sc.METRIC_EVICTION_TOKENS][("device", None)] == 40
        assert sdk.counters()[sc.METRIC_EVICTION_TOKENS][("device", True)] == 0

    def test_one_age_point_per_entry_that_knows_its_idle_time(self, sdk: Sdk) -> None:
        ages = [0.05, 2.0, 2.0, 700.0]
        entries = [EvictedEntry(4, idle_s=age) for age in ages] + [EvictedEntry(4)]
        sdk.telemetry.record_eviction(EvictionRecord(Tier.DEVICE, 20, 0.001, T0, entries))
        point = sdk.points(sc.METRIC_EVICTION_AGE)[frozenset({sc.ATTR_TIER: "device"}.items())]
        assert tuple(point.explicit_bounds) == sc.EVICTION_AGE_BUCKETS
        assert point.count == 4 and point.sum == pytest.approx(sum(ages))
        counts = dict(zip((*point.explicit_bounds, float("inf")), point.bucket_counts, strict=True))
        assert counts[0.1] == 1 and counts[2.5] == 2 and counts[1800.0] == 1
        duration = sdk.points(sc.METRIC_EVICTION_DURATION)[frozenset({sc.ATTR_TIER: "device"}.items())]
        assert duration.count == 1  # the pass itself, once

    def test_the_largest_accepted_pass_counts_every_entry_and_one_more_entry_is_refused_whole(self, sdk: Sdk) -> None:
        n = sc.MAX_EVICTION_ENTRIES
        entries = [EvictedEntry(1, idle_s=float(i), reused=i % 2 == 0) for i in range(n)]
        sdk.telemetry.record_eviction(EvictionRecord(Tier.HOST, n, 0.01, T0, entries))
        point = sdk.points(sc.METRIC_EVICTION_AGE)[frozenset({sc.ATTR_TIER: "host"}.items())]
        assert point.count == n and point.sum == sum(float(i) for i in range(n))
        evicted = sdk.counters()[sc.METRIC_EVICTION_TOKENS]
        assert [evicted[("host", reused)] for reused in (True, False, None)] == [n // 2, n // 2, 0]
        too_many = [*entries, EvictedEntry(1)]
        sdk.telemetry.record_eviction(EvictionRecord(Tier.HOST, n + 1, 0.01, T0, too_many))
        assert rejected(sdk) == {("eviction", "too_many_entries"): 1}
        assert sdk.points(sc.METRIC_EVICTION_AGE)[frozenset({sc.ATTR_TIER: "host"}.items())].count == n

    def test_unread_bytes_are_wasted_by_the_operation_that_wrote_them(self, sdk: Sdk) -> None:
        host = [
            EvictedEntry(8, unread_bytes=4096),  # a backup nothing loaded back
            EvictedEntry(8, unread_bytes=1024, written_by=TransferOperation.STORAGE_PREFETCH),  # a prefetch unused
            EvictedEntry(8, reused=True),
        ]
        sdk.telemetry.record_eviction(EvictionRecord(Tier.HOST, 24, 0.001, T0, host))
        storage = [EvictedEntry(16, unread_bytes=8192)]
        sdk.telemetry.record_eviction(EvictionRecord(Tier.STORAGE, 16, 0.001, T0, storage))
        wasted = sdk.counters()[sc.METRIC_WASTED_SIZE]
        assert wasted == {("backup",): 4096, ("storage_backup",): 8192, ("storage_prefetch",): 1024}

    @pytest.mark.parametrize(
        ("entries", "problem"),
        [
            ([EvictedEntry(40), EvictedEntry(40)], "entries_exceed_total"),
            ([EvictedEntry(8, idle_s=-1.0)], "bad_duration"),
            ([EvictedEntry(8, idle_s=float("nan"))], "bad_duration"),
            ([EvictedEntry(8, reused="yes")], "malformed"),  # type: ignore[arg-type]
            ([EvictedEntry(8, unread_bytes=-5)], "negative_count"),
            ([EvictedEntry(8, written_by="teleport")], "unknown_operation"),  # type: ignore[arg-type]
            ([(8, 1.0)], "malformed"),
            ("abc", "malformed"),
        ],
    )
    def test_a_bad_entry_refuses_the_whole_pass(self, sdk: Sdk, entries: object, problem: str) -> None:
        sdk.telemetry.record_eviction(EvictionRecord(Tier.DEVICE, 64, 0.001, T0, entries))  # type: ignore[arg-type]
        assert rejected(sdk) == {("eviction", problem): 1}
        assert sum(sdk.counters()[sc.METRIC_EVICTION_TOKENS].values()) == 0
        assert sum(sdk.counters()[sc.METRIC_WASTED_SIZE].values()) == 0

    def test_numpy_booleans_are_reuse_flags(self, sdk: Sdk) -> None:
        numpy = pytest.importorskip("numpy")
        sdk.telemetry.record_eviction(EvictionRecord(Tier.HOST, 8, 0.001, T0, [EvictedEntry(8, reused=numpy.True_)]))
        assert sdk.counters()[sc.METRIC_EVICTION_TOKENS][("host", True)] == 8


class TestKvWait:
    def test_one_point_per_wait_by_tier(self, sdk: Sdk) -> None:
        for wait in (0.002, 0.004):
            sdk.telemetry.record_kv_wait(KvWait(Tier.HOST, wait, T0))
        sdk.telemetry.record_kv_wait(KvWait(Tier.STORAGE, 0.3, T0))
        points = sdk.points(sc.METRIC_REQUEST_KV_WAIT)
        host = points[frozenset({sc.ATTR_TIER: "host"}.items())]
        assert host.count == 2 and host.sum == pytest.approx(0.006)
        assert tuple(host.explicit_bounds) == sc.KV_WAIT_BUCKETS
        assert points[frozenset({sc.ATTR_TIER: "storage"}.items())].count == 1

    def test_the_device_serves_no_kv_wait(self, sdk: Sdk) -> None:
        sdk.telemetry.record_kv_wait(KvWait(Tier.DEVICE, 0.1, T0))
        sdk.telemetry.record_kv_wait(KvWait(Tier.HOST, -0.1, T0))
        sdk.telemetry.record_kv_wait("long")  # type: ignore[arg-type]
        assert rejected(sdk) == {
            ("kv_wait", "unknown_tier"): 1,
            ("kv_wait", "bad_duration"): 1,
            ("kv_wait", "malformed"): 1,
        }
        assert sc.METRIC_REQUEST_KV_WAIT not in sdk.metrics()

    def test_the_request_span_carries_the_wait(self, sdk: Sdk) -> None:
        request = sdk.tracer_provider.get_tracer("engine").start_span("request")
        sdk.telemetry.record_kv_wait(KvWait(Tier.STORAGE, 0.25, T0), request_span=request)
        request.end()
        assert attributes_of(request)["hicache.kv_wait.storage"] == 0.25
        point = sdk.points(sc.METRIC_REQUEST_KV_WAIT)[frozenset({sc.ATTR_TIER: "storage"}.items())]
        assert (point.count, point.sum) == (1, 0.25)

    def test_a_request_span_that_raises_costs_only_its_attribute(self, sdk: Sdk) -> None:
        class Broken:
            def is_recording(self) -> None:
                raise RuntimeError("broken span")

        sdk.telemetry.record_kv_wait(KvWait(Tier.HOST, 0.01, T0), request_span=Broken())  # type: ignore[arg-type]
        assert sdk.points(sc.METRIC_REQUEST_KV_WAIT)[frozenset({sc.ATTR_TIER: "host"}.items())].count == 1


class TestUnknownNamesCountedAsOther:
    def test_an_unknown_drop_reason_is_counted_as_other_every_time(self, sdk: Sdk) -> None:
        for _ in range(3):
            sdk.telemetry.record_drop(DropRecord("solar_flare", {"kv": 6}, T0))  # type: ignore[arg-type]
        counters = sdk.counters()
        assert counters[sc.METRIC_DROPPED_TOKENS][("other", "kv")] == 18
        assert counters[sc.METRIC_RECORDS_NORMALIZED][("drop", "unknown_reason")] == 3
        assert rejected(sdk) == {}

    def test_hits_of_an_unknown_kind_are_prefill_mode_other(self, sdk: Sdk) -> None:
        sdk.telemetry.record_prefix_split(PrefixSplit(10, 20, 0, 0), other_hit=7)
        sdk.telemetry.record_prefix_split(PrefixSplit(10, 20, 0, 0))
        assert sdk.value(sc.METRIC_PREFILL_TOKENS, {sc.ATTR_PREFILL_MODE: "other"}) == 7
        assert sdk.value(sc.METRIC_PREFILL_TOKENS, {sc.ATTR_PREFILL_MODE: "device_hit"}) == 40


class TestEngineChecks:
    def test_each_reported_instrument_counts_one_mismatch_with_one_warning(
        self, sdk: Sdk, caplog: pytest.LogCaptureFixture
    ) -> None:
        sdk.telemetry.add_engine_check(lambda: [sc.METRIC_TRANSFER_TOKENS])
        with caplog.at_level(logging.WARNING, logger="otel_hicache"):
            sdk.telemetry.snapshot()
            sdk.telemetry.flush()
        mismatches = sdk.counters()[sc.METRIC_ENGINE_MISMATCH]
        assert mismatches == {(sc.METRIC_TRANSFER_TOKENS,): 3}  # snapshot, flush, and the snapshot that read it
        assert sum("disagrees with the engine" in r.message for r in caplog.records) == 1

    def test_a_check_that_agrees_counts_nothing(self, sdk: Sdk) -> None:
        sdk.telemetry.add_engine_check(lambda: [])
        assert sdk.counters()[sc.METRIC_ENGINE_MISMATCH] == {}

    def test_a_failing_or_confused_check_is_counted_never_raised(self, sdk: Sdk) -> None:
        def failing() -> Iterable[str]:
            raise RuntimeError("the engine moved its counters")

        sdk.telemetry.add_engine_check(failing)
        sdk.telemetry.add_engine_check(lambda: ["no.such.instrument", 42])  # type: ignore[list-item]
        sdk.telemetry.snapshot()
        assert rejected(sdk) == {("engine_check", "source_failed"): 2, ("engine_check", "malformed"): 4}

    def test_a_check_may_read_the_snapshot_it_is_compared_with(self, sdk: Sdk) -> None:
        seen: list[int] = []

        def check() -> Iterable[str]:
            seen.append(sum(sdk.telemetry.snapshot()[sc.METRIC_EVICTION_TOKENS].values()))
            return []

        sdk.telemetry.record_eviction(EvictionRecord(Tier.DEVICE, 5, 0.001, T0))
        sdk.telemetry.add_engine_check(check)
        sdk.telemetry.snapshot()
        assert seen == [5]

    def test_checks_run_on_the_host_thread_without_any_read(self, sdk: Sdk) -> None:
        ran = threading.Event()
        caller = threading.current_thread()

        def check() -> Iterable[str]:
            if threading.current_thread() is not caller:
                ran.set()
            return []

        sdk.telemetry.add_engine_check(check)
        assert ran.wait(10)
        sdk.telemetry.remove_engine_check(check)


@pytest.fixture
def exported() -> Iterator[tuple[OtlpReceiver, TelemetrySetup]]:
    with OtlpReceiver() as rx:
        setup = configure(env={}, endpoint=rx.grpc_endpoint)
        yield rx, setup
        setup.shutdown()


def test_waits_ages_and_waste_arrive_over_otlp_from_the_export_process(
    exported: tuple[OtlpReceiver, TelemetrySetup],
) -> None:
    rx, setup = exported
    request = TracerProvider().get_tracer("engine").start_span("request")
    setup.telemetry.record_kv_wait(KvWait(Tier.HOST, 0.003, T0), request_span=request)
    entries = [EvictedEntry(8, idle_s=12.0, reused=False, unread_bytes=2048)]
    setup.telemetry.record_eviction(EvictionRecord(Tier.HOST, 8, 0.001, T0, entries))
    setup.force_flush()

    def arrived() -> bool:
        names = {m.name for m in rx.metrics()}
        return {sc.METRIC_REQUEST_KV_WAIT, sc.METRIC_EVICTION_AGE, sc.METRIC_WASTED_SIZE} <= names

    assert rx.wait_for(arrived, 30)
    wait = rx.latest_metric(sc.METRIC_REQUEST_KV_WAIT)
    assert wait is not None
    point = wait.histogram.data_points[0]
    assert point.count == 1 and attributes(point.attributes) == {sc.ATTR_TIER: "host"}
    age = rx.latest_metric(sc.METRIC_EVICTION_AGE)
    assert age is not None and age.histogram.data_points[0].sum == pytest.approx(12.0)
    wasted = rx.latest_metric(sc.METRIC_WASTED_SIZE)
    assert wasted is not None
    assert {attributes(p.attributes)[sc.ATTR_OPERATION]: p.as_int for p in wasted.sum.data_points}["backup"] == 2048
