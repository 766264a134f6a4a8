"""SGLang's names and helpers, kept out of the core: its pool names, the porting table, the prefix split."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from otel_hicache import semconv as sc
from otel_hicache.integrations.sglang import prefix_split, split_cached_prefix_by_tier
from otel_hicache.integrations.sglang.semconv import SGLANG_POOLS, SGLANG_SERIES

lengths = st.integers(min_value=0, max_value=100_000)


def test_sglang_pool_names_only_add_to_the_core_pool_kinds() -> None:
    assert len(set(SGLANG_POOLS)) == len(SGLANG_POOLS)
    assert not set(SGLANG_POOLS) & sc.POOLS and sc.OTHER_POOL not in SGLANG_POOLS
    assert "auxiliary_swa" in SGLANG_POOLS and not any(p.startswith("deepseek") for p in sc.POOLS)


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
    assert set(split.by_mode()) == set(sc.PrefillMode) - {sc.PrefillMode.OTHER}  # other: only an engine's unknown hits


def test_every_sglang_hicache_series_in_the_reference_has_an_otel_equivalent() -> None:
    reference = Path(__file__).parents[2] / ".." / "shared" / "reference" / "sglang-hicache.md"
    listed = (
        {"sglang:" + n for n in re.findall(r"`sglang:([a-z_]+)`", reference.read_text())}
        if reference.exists()
        else set()
    )
    listed |= {
        "sglang:hicache_backup_tokens_total",
        "sglang:hicache_backup_bytes_total",
        "sglang:hicache_backup_duration_seconds",
        "sglang:load_back_tokens_total",
        "sglang:load_back_bytes_total",
        "sglang:load_back_duration_seconds",
        "sglang:hicache_dropped_tokens_total",
        "sglang:evicted_tokens_total",
        "sglang:eviction_duration_seconds",
        "sglang:prefill_effective_tokens_total",
        "sglang:hicache_host_used_tokens",
        "sglang:hicache_host_total_tokens",
        "sglang:prefetched_tokens_total",
        "sglang:backuped_tokens_total",
    }
    mapped = {sglang.split("{")[0] for sglang, _ in SGLANG_SERIES}
    assert listed <= mapped
    otel_families = {
        "hicache_transfer_tokens_total",
        "hicache_transfer_size_bytes_total",
        "hicache_transfer_duration_seconds",
        "hicache_dropped_tokens_total",
        "hicache_eviction_tokens_total",
        "hicache_eviction_duration_seconds",
        "hicache_prefill_tokens_total",
        "hicache_pool_usage",
        "hicache_pool_limit",
    }
    for _, ours in SGLANG_SERIES:
        assert ours.split("{")[0] in otel_families, ours


def test_the_sglang_suite_needs_no_sglang_test_kit() -> None:
    """Only SGLang's own classes: its test kits (``sglang.test.kits.*``, new in 0.5.23) would pin the suite to one
    release."""
    root = Path(__file__).parents[2]
    sources = [
        *root.glob("tests/sglang/*.py"),
        root / "src/otel_hicache/testing/sglang.py",
        *root.glob("benchmarks/*.py"),
    ]
    users = [p.relative_to(root) for p in sources if re.search(r"\bsglang\.test\b", p.read_text())]
    assert users == []
