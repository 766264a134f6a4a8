"""Counting and refusals (``_internal.host.counting.Tally``): a checked record's counts land in its slots of the exact
table (counters, histogram buckets and sums) and a transfer's span on the ring, all or nothing; what is refused,
corrected or lost is counted and said once."""

from __future__ import annotations

import logging

import pytest

from otel_hicache import semconv as sc
from otel_hicache._internal.host import validation
from otel_hicache._internal.host.counting import Tally
from otel_hicache._internal.shared.accumulation import Layout
from otel_hicache._internal.shared.channel import HEADER_INTS, Channel
from otel_hicache.records import DropRecord, EvictedEntry, EvictionRecord, TransferRecord
from otel_hicache.semconv import DropReason, Problem, RecordKind, Tier, TimingSource, TransferOperation

KNOWN = {pool: pool for pool in sc.POOLS}
INT64_MAX = (1 << 63) - 1


def tally(capacity: int = 8) -> Tally:
    layout = Layout([*sorted(KNOWN), sc.OTHER_POOL], ["kv"], HEADER_INTS)
    made = Tally(layout, KNOWN)
    made.bind(Channel(layout, capacity, shared=False))
    return made


def transfer(tokens: dict[str, int], num_bytes: int = 4096, seconds: float | None = 0.002) -> validation.Transfer:
    source = TimingSource.NONE if seconds is None else TimingSource.HOST_CLOCK
    record = TransferRecord(TransferOperation.BACKUP, tokens, num_bytes, 10, 20, seconds, source)
    return validation.transfer(record, KNOWN)


def test_a_transfer_adds_its_tokens_and_bytes_to_its_series_and_queues_its_span() -> None:
    counts = tally()
    counts.transfer(transfer({"kv": 256, "swa": 64}, num_bytes=8192))
    snap = counts.snapshot()
    assert snap[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 256
    assert snap[sc.METRIC_TRANSFER_TOKENS][("backup", "swa")] == 64
    assert snap[sc.METRIC_TRANSFER_SIZE][("backup", None, "host_clock")] == 8192
    (queued,) = counts.channel.take(10)
    assert isinstance(queued, TransferRecord)
    assert (queued.tokens_by_pool, queued.num_bytes, queued.copy_duration_s) == ({"kv": 256, "swa": 64}, 8192, 0.002)
    (duration,) = counts.channel.counters.histogram(sc.METRIC_TRANSFER_DURATION)
    assert duration.attributes == {sc.ATTR_OPERATION: "backup", sc.ATTR_TIMING_SOURCE: "host_clock"}
    assert (duration.count, duration.sum) == (1, 0.002)
    assert duration.bucket_counts[sc.TRANSFER_DURATION_BUCKETS.index(0.0025)] == 1  # 0.001 < 0.002 <= 0.0025


def test_a_histogram_counts_each_value_in_the_buckets_of_the_sdk_rule_and_sums_them() -> None:
    counts = tally()
    bounds = sc.KV_WAIT_BUCKETS
    values = [0.0, bounds[0], bounds[0] * 1.5, bounds[-1], bounds[-1] * 2]  # on a boundary: the bucket it closes
    for value in values:
        counts.kv_wait(validation.Wait(Tier.HOST, value, 1))
    (series,) = counts.channel.counters.histogram(sc.METRIC_REQUEST_KV_WAIT)
    expected = [0] * (len(bounds) + 1)
    for i in (0, 0, 1, len(bounds) - 1, len(bounds)):
        expected[i] += 1
    assert series.bucket_counts == tuple(expected)
    assert (series.count, series.sum) == (5, sum(values))
    assert counts.channel.take(10) == []  # the ring carries no metric


def test_a_count_past_int64_leaves_every_series_as_it_was_and_is_refused() -> None:
    counts = tally()
    counts.transfer(transfer({"kv": 8}))
    kv = counts.layout.slots[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")]
    counts.channel.ints[kv] = INT64_MAX - 4  # a table that has counted almost all int64 can hold
    before = counts.snapshot()
    counts.transfer(transfer({"kv": 8}))  # its bytes fit, its tokens do not
    after = counts.snapshot()
    after_rejected = after.pop(sc.METRIC_RECORDS_REJECTED)
    before.pop(sc.METRIC_RECORDS_REJECTED)
    assert after == before
    assert after_rejected == {("transfer", "absurd_count"): 1}
    assert len(counts.channel.take(10)) == 1  # no span for what was not counted


def test_a_full_ring_or_a_closed_tally_still_counts_and_says_once_that_spans_are_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counts = tally(capacity=1)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            counts.transfer(transfer({"kv": 1}))
        counts.closed = True
        counts.transfer(transfer({"kv": 1}))
    snap = counts.snapshot()
    assert snap[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 4
    assert snap[sc.METRIC_RECORDS_DROPPED][("transfer",)] == 3
    assert len(counts.channel.take(10)) == 1
    assert sum("span queue full" in r.getMessage() for r in caplog.records) == 1


def test_an_eviction_counts_each_entry_by_reuse_the_rest_as_unknown_and_the_unread_bytes_as_wasted() -> None:
    counts = tally()
    entries = [
        EvictedEntry(tokens=32, idle_s=4.0, reused=True),
        EvictedEntry(tokens=16, idle_s=9.0, reused=False, unread_bytes=1024),
        EvictedEntry(tokens=16, reused=False, unread_bytes=512, written_by=TransferOperation.STORAGE_PREFETCH),
    ]
    counts.eviction(validation.eviction(EvictionRecord(Tier.HOST, 100, 0.003, 5, entries)))
    snap = counts.snapshot()
    evicted = {key: n for key, n in snap[sc.METRIC_EVICTION_TOKENS].items() if key[0] == "host" and n}
    assert evicted == {("host", True): 32, ("host", False): 32, ("host", None): 36}
    assert snap[sc.METRIC_WASTED_SIZE][("backup",)] == 1024
    assert snap[sc.METRIC_WASTED_SIZE][("storage_prefetch",)] == 512
    histograms = counts.channel.counters
    ((duration,), (ages,)) = (
        histograms.histogram(sc.METRIC_EVICTION_DURATION),
        histograms.histogram(sc.METRIC_EVICTION_AGE),
    )
    assert (duration.attributes, duration.count, duration.sum) == ({sc.ATTR_TIER: "host"}, 1, 0.003)
    assert (ages.count, ages.sum) == (2, 13.0)
    assert counts.channel.take(10) == []


def test_corrections_are_counted_with_the_record_and_each_refusal_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counts = tally()
    corrections: list[Problem] = []
    drop = validation.drop(DropRecord(DropReason.HOST_PRESSURE, {"kv": 8, "mystery": 2}, 1), KNOWN, corrections)
    with caplog.at_level(logging.WARNING):
        counts.drop(drop, corrections)
        for _ in range(3):
            counts.reject(RecordKind.DROP, Problem.NEGATIVE_COUNT)
    snap = counts.snapshot()
    assert snap[sc.METRIC_DROPPED_TOKENS][("host_pressure", "other")] == 2
    assert snap[sc.METRIC_RECORDS_NORMALIZED][("drop", "unknown_pool")] == 1
    assert snap[sc.METRIC_RECORDS_REJECTED][("drop", "negative_count")] == 3
    assert sum("negative_count" in r.getMessage() for r in caplog.records) == 1


def test_an_engine_check_counts_our_instrument_names_and_refuses_anything_else() -> None:
    counts = tally()
    counts.mismatches([sc.METRIC_TRANSFER_SIZE, sc.METRIC_TRANSFER_SIZE, "vllm:unknown", 7])
    snap = counts.snapshot()
    assert snap[sc.METRIC_ENGINE_MISMATCH] == {(sc.METRIC_TRANSFER_SIZE,): 2}
    assert snap[sc.METRIC_RECORDS_REJECTED][("engine_check", "malformed")] == 2


def test_a_swap_makes_the_new_memory_under_the_lock_from_the_old_and_counts_on_there() -> None:
    counts = tally()
    counts.transfer(transfer({"kv": 5}))
    seen_locked = []

    def private_copy(old: Channel) -> Channel:
        seen_locked.append(counts.lock.locked())
        return old.private_copy()

    old = counts.swap(private_copy)
    counts.transfer(transfer({"kv": 7}))
    assert seen_locked == [True] and counts.channel is not old
    assert counts.snapshot()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 12
    assert old.counters.snapshot()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 5
