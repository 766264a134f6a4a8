"""Records and the prefix split: SGLang's semantics, checked on every input hypothesis can find."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from otel_hicache import semconv as sc
from otel_hicache.records import PrefixSplit, TransferRecord, prefix_split, split_cached_prefix_by_tier
from otel_hicache.semconv import TransferOperation
from tests.conftest import make_sdk

lengths = st.integers(min_value=0, max_value=100_000)


@given(prefix=lengths, host=lengths, storage=lengths, is_storage=st.booleans())
def test_split_without_storage_start_partitions_the_prefix(
    prefix: int, host: int, storage: int, is_storage: bool
) -> None:
    device, host_hit, storage_hit = split_cached_prefix_by_tier(prefix, host, storage, None, is_storage)
    assert device + host_hit + storage_hit == prefix
    assert min(device, host_hit, storage_hit) >= 0
    assert host_hit + storage_hit == min(prefix, host)  # the host tail is split between L2 and L3
    if is_storage:
        assert host_hit == 0
    else:
        assert storage_hit == min(prefix, host, storage)


@given(prefix=lengths, host=lengths, storage=lengths, start=lengths, is_storage=st.booleans())
def test_split_with_storage_start_is_the_clipped_l3_span(
    prefix: int, host: int, storage: int, start: int, is_storage: bool
) -> None:
    device, host_hit, storage_hit = split_cached_prefix_by_tier(prefix, host, storage, start, is_storage)
    assert device + host_hit + storage_hit == prefix
    assert storage_hit == max(0, min(prefix, start + storage) - start)
    assert 0 <= host_hit <= min(prefix, host)
    if is_storage:
        assert host_hit == 0


def test_split_examples_from_sglang() -> None:
    assert split_cached_prefix_by_tier(100, 0, 0) == (100, 0, 0)
    assert split_cached_prefix_by_tier(100, 40, 0) == (60, 40, 0)
    assert split_cached_prefix_by_tier(100, 40, 10) == (60, 30, 10)
    assert split_cached_prefix_by_tier(100, 40, 10, host_hit_is_storage=True) == (60, 0, 40)
    assert split_cached_prefix_by_tier(100, 40, 30, storage_hit_start=70) == (60, 10, 30)
    assert split_cached_prefix_by_tier(50, 80, 0) == (0, 50, 0)  # evicted tail clipped by the prefix


@given(input_len=st.integers(0, 10_000), prefix=st.integers(0, 10_000), host=lengths, storage=lengths)
def test_prefix_split_modes_add_up_to_the_request(input_len: int, prefix: int, host: int, storage: int) -> None:
    prefix = min(prefix, input_len)
    split = prefix_split(input_len, prefix, host, storage)
    assert sum(split) == input_len
    assert split.input_tokens == input_len - prefix
    assert set(split.by_mode()) == set(sc.PrefillMode)


pools = st.sampled_from(["kv", "swa", "mamba", "draft", "indexer"])
transfer = st.tuples(
    st.sampled_from(list(TransferOperation)),
    st.dictionaries(pools, st.integers(0, 1 << 20), min_size=1, max_size=4),
    st.integers(0, 1 << 12),  # bytes per token
)


@given(st.lists(transfer, max_size=40), st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500)), max_size=10))
def test_counters_equal_the_sum_of_the_records(records: list, splits: list) -> None:
    sdk = make_sdk(flush_interval_s=3600)
    expected_tokens: dict[tuple[str, str], int] = {}
    expected_bytes: dict[tuple[str, str, str], int] = {}
    for op, tokens, per_token in records:
        by_pool = {pool: n * per_token for pool, n in tokens.items()}
        sdk.telemetry.record_transfer(TransferRecord(op, tokens, sum(by_pool.values()), 0, 1, bytes_by_pool=by_pool))
        for pool, n in tokens.items():
            expected_tokens[(op.value, pool)] = expected_tokens.get((op.value, pool), 0) + n
            key = (op.value, pool, "none")  # untimed
            expected_bytes[key] = expected_bytes.get(key, 0) + by_pool[pool]
    for computed, hit in splits:
        sdk.telemetry.record_prefix_split(PrefixSplit(computed, hit, 0, 0))
    snap = sdk.telemetry.snapshot()
    got_tokens = {k: v for k, v in snap[sc.METRIC_TRANSFER_TOKENS].items() if v}
    got_bytes = {k: v for k, v in snap[sc.METRIC_TRANSFER_SIZE].items() if v}
    assert got_tokens == {k: v for k, v in expected_tokens.items() if v}
    assert got_bytes == {k: v for k, v in expected_bytes.items() if v}
    exported = {
        (dict(a)[sc.ATTR_OPERATION], dict(a)[sc.ATTR_POOL]): p.value
        for a, p in sdk.points(sc.METRIC_TRANSFER_TOKENS).items()
        if p.value
    }
    assert exported == got_tokens
    assert snap[sc.METRIC_PREFILL_TOKENS][("input",)] == sum(c for c, _ in splits)
    assert snap[sc.METRIC_PREFILL_TOKENS][("device_hit",)] == sum(h for _, h in splits)
    sdk.telemetry.shutdown()
