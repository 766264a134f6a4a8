"""``summarize``: the numbers the CLI prints, computed from what the telemetry would export."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from otel_hicache import (
    DropReason,
    DropRecord,
    EvictedEntry,
    EvictionRecord,
    KvWait,
    PoolUsage,
    PrefixSplit,
    Tier,
    TimingSource,
    TransferOperation,
    TransferRecord,
    configure,
    now_ns,
)
from otel_hicache.sdk import TelemetrySetup
from otel_hicache.summary import _bucket_quantile, summarize
from otel_hicache.testing.otlp_receiver import OtlpReceiver

MiB = 1 << 20


@pytest.fixture
def setup() -> Iterator[TelemetrySetup]:
    made = configure(pools=("kv", "mamba"), env={})
    yield made
    made.shutdown()


def transfer(
    op: TransferOperation, tokens: int, nbytes: int, duration: float | None, pool: str = "kv"
) -> TransferRecord:
    t0 = now_ns()
    return TransferRecord(
        operation=op,
        tokens_by_pool={pool: tokens},
        num_bytes=nbytes,
        submit_time_ns=t0,
        complete_time_ns=t0 + 1_000_000,
        copy_duration_s=duration,
        timing_source=TimingSource.HOST_CLOCK if duration is not None else TimingSource.NONE,
    )


def test_hit_rates_are_each_tiers_share_of_all_prefill_tokens(setup: TelemetrySetup) -> None:
    setup.telemetry.record_prefix_split(PrefixSplit(input_tokens=100, device_hit=500, host_hit=300, storage_hit=100))
    setup.telemetry.record_prefix_split(PrefixSplit(input_tokens=0, device_hit=0, host_hit=0, storage_hit=0))
    s = summarize(setup)
    assert s.prefill_total == 1000
    assert s.hit_rates == {"device": 0.5, "host": 0.3, "storage": 0.1}


def test_no_prefill_yet_means_no_hit_rate_rather_than_zero(setup: TelemetrySetup) -> None:
    assert summarize(setup).hit_rates == {"device": None, "host": None, "storage": None}


def test_bandwidth_is_bytes_over_summed_copy_time_and_percentiles_are_exact_from_spans(setup: TelemetrySetup) -> None:
    for i in range(1, 101):  # 1..100 ms copies of 1 MiB each
        setup.telemetry.record_transfer(transfer(TransferOperation.BACKUP, 1024, MiB, i / 1000))
    setup.telemetry.record_transfer(transfer(TransferOperation.LOAD_BACK, 512, MiB // 2, 0.002))
    s = summarize(setup)
    backup = s.durations["backup"]
    assert backup.source == "spans" and backup.count == 100 and backup.timing_sources == ("host_clock",)
    assert backup.p50_s == pytest.approx(0.050) and backup.p99_s == pytest.approx(0.099)
    assert backup.total_s == pytest.approx(5.05)
    assert s.bandwidth_bytes_per_s["backup"] == pytest.approx(100 * MiB / 5.05)
    assert s.bandwidth_bytes_per_s["load_back"] == pytest.approx((MiB // 2) / 0.002)
    assert s.tokens[("backup", "kv")] == 102_400 and s.bytes_by_operation["backup"] == 100 * MiB
    assert "storage_backup" not in s.durations  # nothing timed: no made-up numbers


def test_untimed_transfers_count_but_do_not_inflate_the_bandwidth(setup: TelemetrySetup) -> None:
    setup.telemetry.record_transfer(transfer(TransferOperation.BACKUP, 1024, MiB, 0.001))
    setup.telemetry.record_transfer(transfer(TransferOperation.BACKUP, 1024, 9 * MiB, None))  # timing unavailable
    s = summarize(setup)
    assert s.bytes_by_operation["backup"] == 10 * MiB
    assert s.bandwidth_bytes_per_s["backup"] == pytest.approx(MiB / 0.001)


def test_beyond_the_kept_spans_percentiles_come_from_the_histogram_buckets(setup: TelemetrySetup) -> None:
    assert setup.recent_spans is not None
    n = 2100  # more than the 2048 spans the embedded store keeps
    for _ in range(n):
        setup.telemetry.record_transfer(transfer(TransferOperation.LOAD_BACK, 16, 16 * 1024, 0.003))
    s = summarize(setup)
    stats = s.durations["load_back"]
    assert stats.source == "histogram" and stats.count == n
    assert stats.p50_s is not None and stats.p99_s is not None
    assert 0.0025 <= stats.p50_s <= 0.005 and 0.0025 <= stats.p99_s <= 0.005  # inside the (2.5 ms, 5 ms] bucket
    assert s.spans_recorded == n


def test_bucket_quantile_interpolates_like_prometheus_histogram_quantile() -> None:
    bounds, counts = (0.1, 0.2, 0.4), [10, 10, 0, 0]  # 10 in (0, 0.1], 10 in (0.1, 0.2]
    assert _bucket_quantile(0.5, bounds, counts) == pytest.approx(0.1)
    assert _bucket_quantile(0.75, bounds, counts) == pytest.approx(0.15)
    assert _bucket_quantile(0.25, bounds, counts) == pytest.approx(0.05)
    assert _bucket_quantile(0.99, bounds, [0, 0, 0, 5]) == 0.4  # only +Inf: its lower bound
    assert _bucket_quantile(0.5, bounds, [0, 0, 0, 0]) is None


def test_drops_pools_and_pipeline_problems_are_reported(setup: TelemetrySetup) -> None:
    setup.telemetry.record_drop(DropRecord(DropReason.HOST_PRESSURE, {"kv": 64, "mamba": 2}, now_ns()))
    setup.telemetry.add_pool_usage_source(lambda: [PoolUsage(Tier.HOST, "kv", 750, 1000)])
    setup.telemetry.record_transfer(transfer(TransferOperation.BACKUP, -1, 0, None))  # malformed: refused
    s = summarize(setup)
    assert s.drops[("host_pressure", "kv")] == 64 and s.drops[("host_pressure", "mamba")] == 2
    assert s.dropped_total == 66
    (pool,) = s.pools
    assert (pool.tier, pool.pool, pool.used, pool.limit, pool.fraction_used) == ("host", "kv", 750, 1000, 0.75)
    assert s.pipeline["rejected"] == 1


def test_exporting_over_otlp_still_gives_exact_counters_from_the_snapshot() -> None:
    with OtlpReceiver() as receiver:
        setup = configure(endpoint=receiver.grpc_endpoint, env={})
        try:
            setup.telemetry.record_transfer(transfer(TransferOperation.BACKUP, 256, MiB, 0.001))
            setup.telemetry.record_prefix_split(PrefixSplit(10, 30, 0, 0))
            s = summarize(setup)
        finally:
            setup.shutdown()
    assert s.source == "snapshot"
    assert s.tokens[("backup", "kv")] == 256 and s.bytes_by_operation["backup"] == MiB
    assert s.hit_rates["device"] == 0.75
    assert s.durations == {} and s.notes  # durations live in the backend; the summary says so


def test_kv_wait_percentiles_per_tier_come_from_the_histogram_buckets(setup: TelemetrySetup) -> None:
    for i in range(1, 101):  # 1..100 ms
        setup.telemetry.record_kv_wait(KvWait(Tier.HOST, i / 1000, now_ns()))
    setup.telemetry.record_kv_wait(KvWait(Tier.STORAGE, 0.3, now_ns()))
    waits = summarize(setup).kv_waits
    assert set(waits) == {"host", "storage"}
    host = waits["host"]
    assert host.count == 100 and host.total_s == pytest.approx(5.05) and host.source == "histogram"
    assert host.p50_s is not None and host.p99_s is not None
    assert 0.025 <= host.p50_s <= 0.05 and 0.05 <= host.p99_s <= 0.1  # inside the buckets holding the ranks
    storage = waits["storage"]
    assert storage.count == 1 and storage.p50_s is not None and 0.25 <= storage.p50_s <= 0.5


def test_tier_sizing_is_the_never_reused_share_of_tokens_of_known_reuse_and_the_age_at_eviction(
    setup: TelemetrySetup,
) -> None:
    host = [EvictedEntry(32, idle_s=1.0, reused=True), EvictedEntry(64, idle_s=20.0, reused=False)]
    setup.telemetry.record_eviction(EvictionRecord(Tier.HOST, 100, 0.001, now_ns(), host))  # 4 tokens unknown
    setup.telemetry.record_eviction(EvictionRecord(Tier.DEVICE, 16, 0.001, now_ns()))  # reuse unknown
    sizing = summarize(setup).tier_sizing
    assert sizing["host"].evicted_tokens == 100 and sizing["host"].reuse_known_tokens == 96
    assert sizing["host"].never_reused_share == pytest.approx(64 / 96)
    age = sizing["host"].age
    assert age is not None and age.count == 2 and age.total_s == pytest.approx(21.0)
    assert sizing["device"].never_reused_share is None and sizing["device"].age is None  # nothing known: no share
    assert "storage" not in sizing


def test_wasted_share_is_of_the_bytes_the_operation_wrote(setup: TelemetrySetup) -> None:
    setup.telemetry.record_transfer(transfer(TransferOperation.BACKUP, 1024, 10 * MiB, 0.01))
    entries = [EvictedEntry(16, unread_bytes=4 * MiB), EvictedEntry(16, unread_bytes=MiB)]
    setup.telemetry.record_eviction(EvictionRecord(Tier.HOST, 32, 0.001, now_ns(), entries))
    s = summarize(setup)
    assert s.wasted_bytes == {"backup": 5 * MiB, "storage_backup": 0}
    assert s.wasted_shares == {"backup": 0.5, "storage_backup": None}  # nothing written to storage: no share


def test_load_seconds_per_token_scale_the_timed_copies_to_every_byte_and_compare_with_recompute(
    setup: TelemetrySetup,
) -> None:
    setup.telemetry.record_transfer(transfer(TransferOperation.LOAD_BACK, 1024, MiB, 0.001))
    setup.telemetry.record_transfer(transfer(TransferOperation.LOAD_BACK, 1024, MiB, None))  # same size, untimed
    setup.telemetry.record_transfer(transfer(TransferOperation.LOAD_BACK, 1024, MiB, None, pool="mamba"))
    setup.telemetry.record_transfer(transfer(TransferOperation.BACKUP, 1024, MiB, 0.001))  # not a load
    s = summarize(setup, prefill_seconds_per_token=2e-6)
    # 1 ms per MiB timed, 3 MiB moved for 2,048 kv tokens (mamba's are state slots, not tokens)
    assert s.load_seconds_per_token == {"load_back": pytest.approx(0.003 / 2048)}
    assert s.load_vs_recompute == {"load_back": pytest.approx(0.003 / 2048 / 2e-6)}
    assert summarize(setup).load_vs_recompute == {}  # no recompute cost given: no comparison


def test_exported_over_otlp_reuse_comes_from_the_exact_counters() -> None:
    with OtlpReceiver() as receiver:
        setup = configure(endpoint=receiver.grpc_endpoint, env={})
        try:
            entries = [EvictedEntry(8, idle_s=2.0, reused=True), EvictedEntry(24, idle_s=3.0, reused=False)]
            setup.telemetry.record_eviction(EvictionRecord(Tier.DEVICE, 32, 0.001, now_ns(), entries))
            setup.telemetry.record_kv_wait(KvWait(Tier.HOST, 0.01, now_ns()))
            s = summarize(setup)
        finally:
            setup.shutdown()
    assert s.tier_sizing["device"].never_reused_share == 0.75
    assert s.tier_sizing["device"].age is None and s.kv_waits == {}  # histograms live in the backend


def test_module_docstring_example_runs() -> None:
    import doctest

    import otel_hicache.summary

    result = doctest.testmod(otel_hicache.summary)
    assert result.attempted > 0 and result.failed == 0
