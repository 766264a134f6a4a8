"""Records: counted exactly, whatever mix of pools and modes hypothesis can find."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from otel_hicache import semconv as sc
from otel_hicache.records import PrefixSplit, TransferRecord
from otel_hicache.semconv import TransferOperation
from otel_hicache.testing.sdk import make_sdk

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
