"""The engine-neutral vocabulary: OTel naming rules and closed value sets."""

from __future__ import annotations

import re

from otel_hicache import semconv as sc

NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")
UCUM = {"s", "By", "{token}", "{transfer}", "{record}", "{mismatch}", "{lookup}", "{page}", "1"}


def test_instrument_names_are_dotted_lowercase_with_ucum_units_and_unique() -> None:
    names = [spec.name for spec in sc.INSTRUMENTS]
    assert len(names) == len(set(names))
    for spec in sc.INSTRUMENTS:
        assert NAME.match(spec.name), spec.name
        assert spec.unit in UCUM, (spec.name, spec.unit)
        assert spec.description.endswith("."), spec.name
        assert all(NAME.match(a) for a in spec.attributes), spec.attributes


def test_histograms_are_in_seconds_with_increasing_buckets_from_100us_to_60s() -> None:
    for buckets in (sc.TRANSFER_DURATION_BUCKETS, sc.EVICTION_DURATION_BUCKETS, sc.KV_WAIT_BUCKETS):
        assert list(buckets) == sorted(set(buckets))
        assert buckets[0] == 0.0001 and buckets[-1] == 60.0


def test_eviction_ages_span_a_tenth_of_a_second_to_a_day() -> None:
    buckets = sc.EVICTION_AGE_BUCKETS
    assert list(buckets) == sorted(set(buckets))
    assert buckets[0] == 0.1 and buckets[-1] == 86400.0


def test_attribute_values_are_closed_sets() -> None:
    assert {op.value for op in sc.TransferOperation} == {"backup", "load_back", "storage_backup", "storage_prefetch"}
    assert {r.value for r in sc.DropReason} == {"host_pressure", "write_through_unbacked_eviction", "other"}
    assert {m.value for m in sc.PrefillMode} == {"input", "device_hit", "host_hit", "storage_hit", "other"}
    assert sc.POOLS == {"kv", "swa", "mamba", "indexer", "draft"} and sc.OTHER_POOL not in sc.POOLS
    # the worst case number of transfer-token series is known in advance
    assert len(sc.TransferOperation) * (len(sc.POOLS) + 1) < 100


def test_span_names_follow_the_operation() -> None:
    assert sc.SPAN_NAMES == {
        sc.TransferOperation.BACKUP: "hicache.backup",
        sc.TransferOperation.LOAD_BACK: "hicache.load_back",
        sc.TransferOperation.STORAGE_BACKUP: "hicache.storage_backup",
        sc.TransferOperation.STORAGE_PREFETCH: "hicache.storage_prefetch",
    }
