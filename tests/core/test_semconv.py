"""The vocabulary: OTel naming rules, closed value sets, and a port of every sglang:* HiCache series."""

from __future__ import annotations

import re
from pathlib import Path

from otel_hicache import semconv as sc

NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")
UCUM = {"s", "By", "{token}", "{transfer}", "{record}"}


def test_instrument_names_are_dotted_lowercase_with_ucum_units_and_unique() -> None:
    names = [spec.name for spec in sc.INSTRUMENTS]
    assert len(names) == len(set(names))
    for spec in sc.INSTRUMENTS:
        assert NAME.match(spec.name), spec.name
        assert spec.unit in UCUM, (spec.name, spec.unit)
        assert spec.description.endswith("."), spec.name
        assert all(NAME.match(a) for a in spec.attributes), spec.attributes


def test_histograms_are_in_seconds_with_increasing_buckets_from_100us_to_60s() -> None:
    for buckets in (sc.TRANSFER_DURATION_BUCKETS, sc.EVICTION_DURATION_BUCKETS):
        assert list(buckets) == sorted(set(buckets))
        assert buckets[0] == 0.0001 and buckets[-1] == 60.0


def test_attribute_values_are_closed_sets() -> None:
    assert {op.value for op in sc.TransferOperation} == {"backup", "load_back", "storage_backup", "storage_prefetch"}
    assert {r.value for r in sc.DropReason} == {"host_pressure", "write_through_unbacked_eviction"}
    assert {m.value for m in sc.PrefillMode} == {"input", "device_hit", "host_hit", "storage_hit"}
    assert {"kv", "swa", "mamba", "draft"} <= sc.POOLS and sc.OTHER_POOL not in sc.POOLS
    # the worst case number of transfer-token series is known in advance
    assert len(sc.TransferOperation) * (len(sc.POOLS) + 1) < 100


def test_span_names_follow_the_operation() -> None:
    assert sc.SPAN_NAMES == {
        sc.TransferOperation.BACKUP: "hicache.backup",
        sc.TransferOperation.LOAD_BACK: "hicache.load_back",
        sc.TransferOperation.STORAGE_BACKUP: "hicache.storage_backup",
        sc.TransferOperation.STORAGE_PREFETCH: "hicache.storage_prefetch",
    }


def test_every_sglang_hicache_series_in_the_reference_has_an_otel_equivalent() -> None:
    reference = Path(__file__).parents[2] / ".." / "shared" / "reference" / "sglang-hicache.md"
    listed = (
        {"sglang:" + n for n in re.findall(r"`sglang:([a-z_]+)`", reference.read_text())}
        if reference.exists()
        else set()
    )
    listed |= {
        "sglang:hicache_backup_tokens_total", "sglang:hicache_backup_bytes_total",
        "sglang:hicache_backup_duration_seconds", "sglang:load_back_tokens_total", "sglang:load_back_bytes_total",
        "sglang:load_back_duration_seconds", "sglang:hicache_dropped_tokens_total", "sglang:evicted_tokens_total",
        "sglang:eviction_duration_seconds", "sglang:prefill_effective_tokens_total",
        "sglang:hicache_host_used_tokens", "sglang:hicache_host_total_tokens", "sglang:prefetched_tokens_total",
        "sglang:backuped_tokens_total",
    }  # fmt: skip
    mapped = {sglang.split("{")[0] for sglang, _ in sc.SGLANG_SERIES}
    assert listed <= mapped
    otel_families = {
        "hicache_transfer_tokens_total", "hicache_transfer_size_bytes_total", "hicache_transfer_duration_seconds",
        "hicache_dropped_tokens_total", "hicache_eviction_tokens_total", "hicache_eviction_duration_seconds",
        "hicache_prefill_tokens_total", "hicache_pool_usage", "hicache_pool_limit",
    }  # fmt: skip
    for _, ours in sc.SGLANG_SERIES:
        assert ours.split("{")[0] in otel_families, ours
