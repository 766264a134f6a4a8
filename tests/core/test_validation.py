"""Hostile records: each mapping is read once, a record is counted whole or not at all, nothing re-enters or leaks."""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
from opentelemetry.trace import SpanContext, TraceFlags

from otel_hicache import semconv as sc
from otel_hicache.records import EvictionRecord, PoolUsage, TransferFailure, TransferRecord
from otel_hicache.semconv import Tier, TimingSource, TransferOperation
from otel_hicache.telemetry import HiCacheTelemetry
from otel_hicache.testing.sdk import Sdk, attributes_of, make_sdk

T0 = 1_700_000_000_000_000_000


def backup(tokens: Any, num_bytes: Any = 100, **kw: Any) -> TransferRecord:
    fields: dict[str, Any] = {
        "operation": TransferOperation.BACKUP,
        "tokens_by_pool": tokens,
        "num_bytes": num_bytes,
        "submit_time_ns": T0,
        "complete_time_ns": T0 + 1000,
        "copy_duration_s": 0.001,
        "timing_source": TimingSource.HOST_CLOCK,
    }
    fields.update(kw)
    return TransferRecord(**fields)


def kv(sdk: Sdk) -> Any:
    return sdk.telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS].get(("backup", "kv"), 0)


def rejected(sdk: Sdk, problem: str, kind: str = "transfer") -> int:
    return sdk.telemetry.snapshot()[sc.METRIC_RECORDS_REJECTED].get((kind, problem), 0)


class Shifty(Mapping[str, int]):
    """A mapping whose values change every time it is read."""

    def __init__(self) -> None:
        self.reads = 0

    def __getitem__(self, key: str) -> int:
        return 10 * self.reads

    def __iter__(self) -> Iterator[str]:
        self.reads += 1
        return iter(["kv", f"pool-{self.reads}"])

    def __len__(self) -> int:
        return 2


class Exploding(Mapping[str, int]):
    """A mapping that raises half-way through being read."""

    def __getitem__(self, key: str) -> int:
        if key == "swa":
            raise RuntimeError("pool freed under us")
        return 7

    def __iter__(self) -> Iterator[str]:
        return iter(["kv", "swa"])

    def __len__(self) -> int:
        return 2


def test_a_mapping_that_changes_between_reads_is_read_once_and_counted_as_read(sdk: Sdk) -> None:
    tokens = Shifty()
    sdk.telemetry.record_transfer(backup(tokens))
    assert tokens.reads == 1
    snap = sdk.telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS]
    assert snap[("backup", "kv")] == 10 and snap[("backup", "other")] == 10  # never negative, no new pool name
    (span,) = sdk.spans()
    assert attributes_of(span)["hicache.transfer.tokens.kv"] == 10  # the span shows what was counted


def test_a_mapping_that_raises_half_way_is_refused_whole(sdk: Sdk, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="otel_hicache"):
        sdk.telemetry.record_transfer(backup(Exploding()))
    assert kv(sdk) == 0  # nothing of it counted, not even the kv part read before the error
    assert rejected(sdk, "malformed") == 1
    assert sdk.spans() == []
    assert "nothing of it was counted" in caplog.text


def test_a_mapping_that_calls_back_into_the_telemetry_cannot_deadlock_it(sdk: Sdk) -> None:
    class Reentrant(Mapping[str, int]):
        def __getitem__(self, key: str) -> int:
            sdk.telemetry.record_transfer(backup({"kv": 1}))  # re-enters while being validated
            sdk.telemetry.snapshot()
            return 5

        def __iter__(self) -> Iterator[str]:
            return iter(["kv"])

        def __len__(self) -> int:
            return 1

    caller = threading.Thread(target=sdk.telemetry.record_transfer, args=(backup(Reentrant()),))
    caller.start()
    caller.join(10)
    assert not caller.is_alive(), "re-entrant record deadlocked the telemetry"
    assert kv(sdk) == 6
    other = threading.Thread(target=sdk.telemetry.record_transfer, args=(backup({"kv": 1}),))
    other.start()
    other.join(10)
    assert not other.is_alive() and kv(sdk) == 7  # every other thread still gets through


def test_numpy_and_torch_scalars_become_plain_ints_and_floats(sdk: Sdk, caplog: pytest.LogCaptureFixture) -> None:
    torch = pytest.importorskip("torch")
    with caplog.at_level(logging.WARNING):
        for _ in range(100):
            sdk.telemetry.record_transfer(
                backup(
                    {"kv": np.int64(16), "swa": torch.tensor(4)},
                    np.uint32(2000),
                    copy_duration_s=np.float32(0.25),
                    merged_ops=np.int16(3),
                    node_count=np.int64(2),
                )
            )
        spans = sdk.spans()
        sdk.metrics()
    assert kv(sdk) == 1600
    assert len(spans) == 100
    attrs = attributes_of(spans[0])
    for name in (
        "hicache.transfer.tokens.kv",
        "hicache.transfer.tokens.swa",
        "hicache.transfer.byte_count",
        "hicache.transfer.merged_ops",
        "hicache.transfer.nodes",
    ):
        assert type(attrs[name]) is int, name
    assert type(attrs["hicache.transfer.copy_duration"]) is float
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]  # no SDK type warnings


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"timing_source": "sundial"}, "unknown_timing_source"),
        ({"copy_duration_s": 0.5, "timing_source": TimingSource.NONE}, "unknown_timing_source"),
        ({"copy_duration_s": "0.5"}, "bad_duration"),
        ({"merged_ops": -1}, "negative_count"),
        ({"node_count": 1.5}, "bad_count"),
    ],
)
def test_a_record_that_could_not_yield_its_span_is_refused_not_silently_half_kept(
    sdk: Sdk, fields: dict[str, Any], problem: str
) -> None:
    sdk.telemetry.record_transfer(backup({"kv": 3}, **fields))
    assert kv(sdk) == 0 and rejected(sdk, problem) == 1
    assert sdk.spans() == []


def test_a_link_that_is_not_a_span_context_is_left_out_and_counted(sdk: Sdk) -> None:
    good = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    sdk.telemetry.record_transfer(backup({"kv": 3}, links=(good, "trace-123", None)))
    (span,) = sdk.spans()
    assert [link.context.span_id for link in span.links] == [0xDEF]
    normalized = sdk.telemetry.snapshot()[sc.METRIC_RECORDS_NORMALIZED]
    assert normalized[("transfer", "bad_link")] == 1
    assert kv(sdk) == 3


def test_one_bad_pool_source_among_good_ones_is_skipped_and_counted(sdk: Sdk) -> None:
    sdk.telemetry.add_pool_usage_source(lambda: [PoolUsage(Tier.HOST, "kv", 10, 100)])
    sdk.telemetry.add_pool_usage_source(lambda: [PoolUsage("attic", "kv", 1, 2)])  # type: ignore[arg-type]
    sdk.telemetry.add_pool_usage_source(lambda: [PoolUsage(Tier.DEVICE, "kv", 5, 4)])  # more used than there is
    sdk.telemetry.add_pool_usage_source(lambda: [PoolUsage(Tier.DEVICE, "swa", 3, 8)])
    assert sdk.value(sc.METRIC_POOL_LIMIT, {sc.ATTR_TIER: "host", sc.ATTR_POOL: "kv"}) == 100
    assert sdk.value(sc.METRIC_POOL_LIMIT, {sc.ATTR_TIER: "device", sc.ATTR_POOL: "swa"}) == 8
    assert sdk.value(sc.METRIC_POOL_LIMIT, {sc.ATTR_TIER: "device", sc.ATTR_POOL: "kv"}) is None
    assert rejected(sdk, "unknown_tier", "pool_usage") >= 1
    assert rejected(sdk, "absurd_count", "pool_usage") >= 1


def test_a_burst_far_past_the_queue_keeps_counters_exact_and_counts_every_lost_span() -> None:
    sdk = make_sdk(max_queue=64, flush_interval_s=3600)
    for _ in range(64 * 20):
        sdk.telemetry.record_transfer(backup({"kv": 2}))
    assert kv(sdk) == 2 * 64 * 20
    spans = len(sdk.spans())
    dropped = sdk.telemetry.snapshot()[sc.METRIC_RECORDS_DROPPED][("transfer",)]
    assert spans >= 64 and spans + dropped == 64 * 20
    sdk.telemetry.shutdown()


def test_no_telemetry_instance_outlives_its_last_reference() -> None:
    refs = []
    for _ in range(5):
        telemetry = HiCacheTelemetry(spans=False)
        telemetry.record_transfer(backup({"kv": 1}))
        telemetry.record_transfer_deferred(lambda _: backup({"kv": 1}), None)
        telemetry.shutdown(1)
        refs.append(weakref.ref(telemetry))
        del telemetry
    gc.collect()
    assert [r for r in refs if r() is not None] == []


def test_a_pool_name_object_that_lies_about_itself_is_counted_under_our_own_name(sdk: Sdk) -> None:
    class Liar(str):
        def __str__(self) -> str:
            return "../../etc"

    sdk.telemetry.record_transfer(backup({Liar("kv"): 4}))
    assert kv(sdk) == 4
    (span,) = sdk.spans()
    assert "hicache.transfer.tokens.kv" in attributes_of(span)


def test_a_link_whose_ids_do_not_fit_the_wire_is_left_out(sdk: Sdk) -> None:
    oversized = SpanContext(1 << 130, 0xDEF, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    sdk.telemetry.record_transfer(backup({"kv": 3}, links=(oversized,)))
    (span,) = sdk.spans()
    assert span.links == () or list(span.links) == []
    assert sdk.telemetry.snapshot()[sc.METRIC_RECORDS_NORMALIZED][("transfer", "bad_link")] == 1


def test_a_link_whose_properties_call_back_into_the_telemetry_cannot_deadlock_it(sdk: Sdk) -> None:
    class Reentrant(SpanContext):
        @property
        def trace_flags(self) -> TraceFlags:
            sdk.telemetry.record_failure(TransferFailure(TransferOperation.BACKUP, "host_pool_full", {"kv": 1}, T0))
            return TraceFlags(TraceFlags.SAMPLED)

    link = Reentrant(0xABC, 0xDEF, is_remote=True)
    caller = threading.Thread(target=sdk.telemetry.record_transfer, args=(backup({"kv": 2}, links=(link,)),))
    caller.start()
    caller.join(10)
    assert not caller.is_alive(), "a link read under the telemetry's lock deadlocked it"
    assert kv(sdk) == 2 and [lk.context.span_id for lk in sdk.spans()[0].links] == [0xDEF]


def test_an_error_type_object_that_lies_about_itself_is_counted_under_our_own_name(sdk: Sdk) -> None:
    class Liar(str):
        def __str__(self) -> str:
            return "zzz"

    sdk.telemetry.record_failure(TransferFailure(TransferOperation.BACKUP, Liar("host_pool_full"), {"kv": 1}, T0))
    assert sdk.telemetry.snapshot()[sc.METRIC_TRANSFER_FAILURES] == {("backup", "host_pool_full"): 1}


def test_a_timestamp_past_int64_is_refused_whole(sdk: Sdk) -> None:
    sdk.telemetry.record_eviction(EvictionRecord(Tier.DEVICE, 5, 0.001, 1 << 63))
    sdk.telemetry.record_transfer(backup({"kv": 5}, submit_time_ns=1 << 64, complete_time_ns=1 << 64))
    snap = sdk.telemetry.snapshot()
    assert snap[sc.METRIC_EVICTION_TOKENS][("device", None)] == 0 and kv(sdk) == 0
    assert snap[sc.METRIC_RECORDS_REJECTED] == {("eviction", "absurd_count"): 1, ("transfer", "absurd_count"): 1}


def test_a_counter_that_would_pass_int64_refuses_the_record_whole_instead_of_raising(sdk: Sdk) -> None:
    huge = 1 << 50  # the largest byte count a record may carry
    for _ in range(8191):
        sdk.telemetry.record_transfer(backup({"kv": 1}, huge))
    sdk.telemetry.record_transfer(backup({"kv": 1}, huge))  # the 8192nd would pass 2**63 - 1
    snap = sdk.telemetry.snapshot()
    assert kv(sdk) == 8191  # counted whole or not at all: its tokens are not in either
    assert snap[sc.METRIC_TRANSFER_SIZE][("backup", None, "host_clock")] == 8191 * huge
    assert snap[sc.METRIC_RECORDS_REJECTED] == {("transfer", "absurd_count"): 1}


def test_a_dropped_telemetry_with_a_running_host_thread_is_freed() -> None:
    def hosts() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "otel-hicache-host"]

    before = len(hosts())  # other tests' telemetries may still be alive
    refs = []
    for _ in range(5):
        telemetry = HiCacheTelemetry(spans=False)
        telemetry.record_transfer_deferred(lambda _: backup({"kv": 1}), None)  # starts the host thread
        telemetry.add_pool_usage_source(lambda: [PoolUsage(Tier.HOST, "kv", 1, 2)])
        assert telemetry.flush(5)
        refs.append(weakref.ref(telemetry))
        del telemetry
    deadline = time.monotonic() + 5
    while (any(r() is not None for r in refs) or len(hosts()) > before) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert [r for r in refs if r() is not None] == []
    assert len(hosts()) <= before  # each host thread ended with its telemetry


def test_a_slow_pool_source_or_span_processor_never_stretches_flush_or_shutdown_past_their_timeout() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    class Slow(InMemorySpanExporter):
        def export(self, spans: Any) -> Any:
            time.sleep(0.01)
            return super().export(spans)

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Slow()))
    telemetry = HiCacheTelemetry(provider, flush_interval_s=3600)

    def slow_source() -> list[PoolUsage]:
        time.sleep(10)
        return []

    telemetry.add_pool_usage_source(slow_source)
    for _ in range(500):
        telemetry.record_transfer(backup({"kv": 1}))
    start = time.monotonic()
    assert not telemetry.flush(1.0)  # 500 spans at 10 ms each do not fit in a second
    telemetry.shutdown(1.0)
    assert time.monotonic() - start < 4


def test_deferred_records_left_at_shutdown_are_counted_as_shed(sdk: Sdk) -> None:
    release = threading.Event()
    sdk.telemetry.record_transfer_deferred(lambda _: backup({"kv": 1}) if release.wait(30) else None, None)
    time.sleep(0.1)  # the host thread is inside the hung build
    for _ in range(10):
        sdk.telemetry.record_transfer_deferred(lambda _: backup({"kv": 1}), None)
    sdk.telemetry.shutdown(1.0)
    release.set()
    shed = sdk.telemetry.snapshot()[sc.METRIC_RECORDS_REJECTED].get(("transfer", "queue_full"), 0)
    assert shed == 10  # none of them unaccounted
