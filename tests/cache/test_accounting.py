"""What telemetry reports equals what the cache actually did, counted independently at the copy sites."""

from __future__ import annotations

import collections

import pytest

from otel_hicache import semconv as sc
from otel_hicache.cache.hicache import HiCache
from otel_hicache.integrations.sglang import split_cached_prefix_by_tier
from otel_hicache.summary import by_first
from tests.cache.support import run_workload, small_config


def _copied(cache: HiCache) -> tuple[collections.Counter, collections.Counter]:
    assert cache.store is not None
    slots = cache.controller.stats.slots + cache.store.stats.slots
    nbytes = cache.controller.stats.bytes + cache.store.stats.bytes
    return slots, nbytes


@pytest.mark.parametrize(("policy", "host_tokens"), [("write_through", 160), ("write_back", 384)])
def test_tokens_bytes_and_drops_match_the_copies(csdk, tmp_path, monkeypatch, policy: str, host_tokens: int) -> None:
    cache = HiCache(small_config(tmp_path, policy, host_tokens=host_tokens), csdk.telemetry)
    freed_without_copy: collections.Counter[str] = collections.Counter()
    real_drop = cache._drop

    def counting_drop(node, reason):
        before = {p: cache.device.pools[p].free_slots for p in cache.device.owning}
        dropped = real_drop(node, reason)
        if dropped and reason is not None:
            for p, n in before.items():
                freed_without_copy[p] += cache.device.pools[p].free_slots - n
        return dropped

    monkeypatch.setattr(cache, "_drop", counting_drop)
    try:
        lengths = run_workload(cache, 150)
    finally:
        cache.close()
    snap = csdk.telemetry.snapshot()
    slots, nbytes = _copied(cache)

    tokens = {k: v for k, v in snap[sc.METRIC_TRANSFER_TOKENS].items() if v}
    assert tokens == {k: v for k, v in slots.items() if k[1] != "draft"}  # sidecar tokens excluded
    size = {key: n for key, n in snap[sc.METRIC_TRANSFER_SIZE].items() if n}
    assert {source for _, _, source in size} == {"host_clock"}  # every copy timed (host clock on a CPU)
    assert {(op, pool): n for (op, pool, _), n in size.items()} == dict(nbytes)  # sidecar bytes included
    assert nbytes[("backup", "draft")] > 0 and ("backup", "draft") not in tokens

    reason = "host_pressure" if policy == "write_back" else "write_through_unbacked_eviction"
    drops = {k: v for k, v in snap[sc.METRIC_DROPPED_TOKENS].items() if v}
    assert drops == {(reason, p): n for p, n in freed_without_copy.items() if n}
    assert drops[(reason, "kv")] > 0

    # Every prefill token is counted exactly once: input + hits == prompt lengths.
    prefill = snap[sc.METRIC_PREFILL_TOKENS]
    assert sum(prefill.values()) == sum(lengths)
    assert {k[0]: v for k, v in prefill.items()} == dict(cache.stats.prefix)
    assert all(prefill[(m,)] > 0 for m in ("input", "device_hit", "host_hit", "storage_hit"))
    assert {t: n for t, n in by_first(snap[sc.METRIC_EVICTION_TOKENS]).items() if n} == dict(cache.stats.evicted)
    assert not any(snap[sc.METRIC_RECORDS_REJECTED].values())


def test_sdk_metrics_and_spans_agree_with_the_copies(csdk, tmp_path) -> None:
    cache = HiCache(small_config(tmp_path, "write_through"), csdk.telemetry)
    try:
        run_workload(cache, 80)
    finally:
        cache.close()
    slots, nbytes = _copied(cache)
    for (op, pool), n in slots.items():
        if pool != "draft":
            assert csdk.value(sc.METRIC_TRANSFER_TOKENS, {sc.ATTR_OPERATION: op, sc.ATTR_POOL: pool}) == n
        size = {sc.ATTR_OPERATION: op, sc.ATTR_POOL: pool, sc.ATTR_TIMING_SOURCE: "host_clock"}
        assert csdk.value(sc.METRIC_TRANSFER_SIZE, size) == nbytes[(op, pool)]

    spans = csdk.spans()
    by_op = collections.Counter(s.name for s in spans)
    assert by_op["hicache.backup"] == cache.controller.stats.transfers["backup"]  # one span per merged transfer
    assert by_op["hicache.load_back"] == cache.controller.stats.transfers["load_back"]
    span_kv = sum(s.attributes["hicache.transfer.tokens.kv"] for s in spans if s.name == "hicache.backup")
    assert span_kv == slots[("backup", "kv")]
    for s in spans:
        assert s.end_time >= s.start_time
        assert s.attributes[sc.ATTR_TIMING_SOURCE] == "host_clock"
        assert s.attributes[sc.ATTR_COPY_DURATION] >= 0
    assert not csdk.points(sc.METRIC_POOL_USAGE)  # a closed cache no longer reports occupancy


def test_pool_usage_is_reported_per_tier_and_pool(csdk, tmp_path) -> None:
    cache = HiCache(small_config(tmp_path, "write_through"), csdk.telemetry)
    try:
        cache.release(cache.admit(list(range(33))))  # 8 pages cached, one token not
        cache.flush()
        used = csdk.value(
            sc.METRIC_POOL_USAGE, {sc.ATTR_TIER: "device", sc.ATTR_POOL: "kv", sc.ATTR_SLOT_STATE: "used"}
        )
        host_used = csdk.value(
            sc.METRIC_POOL_USAGE, {sc.ATTR_TIER: "host", sc.ATTR_POOL: "kv", sc.ATTR_SLOT_STATE: "used"}
        )
        limit = csdk.value(sc.METRIC_POOL_LIMIT, {sc.ATTR_TIER: "device", sc.ATTR_POOL: "mamba"})
        assert (used, host_used, limit) == (32, 32, 32)
    finally:
        cache.close()


def test_prefix_split_agrees_with_sglang_split_cached_prefix_by_tier(csdk, tmp_path) -> None:
    cache = HiCache(small_config(tmp_path, "write_back"), csdk.telemetry)
    from otel_hicache.cache.workload import WorkloadConfig, requests

    wl = WorkloadConfig(seed=3, documents=8, document_tokens=64, system_tokens=16, turn_tokens=(4, 16))
    seen: collections.Counter[str] = collections.Counter()
    try:
        for prompt, _ in zip(requests(wl), range(120), strict=False):
            m = cache.match_prefix(prompt)
            a = cache.admit(prompt)
            s = a.split
            prefix = s.device_hit + s.host_hit + s.storage_hit
            assert (s.device_hit, s.host_hit, s.storage_hit) == split_cached_prefix_by_tier(
                prefix, s.host_hit + s.storage_hit, s.storage_hit
            )
            assert s.input_tokens == len(prompt) - prefix
            assert s.device_hit == m.device_len  # device hits are what match_prefix saw
            assert s.host_hit in (0, m.host_len) and s.storage_hit <= m.storage_len
            seen.update(k for k, v in zip(("device", "host", "storage"), s[1:], strict=True) if v)
            cache.release(a)
            cache.flush()  # settle L3 jobs so where a prompt hits does not depend on thread timing
    finally:
        cache.close()
    assert seen["device"] and seen["host"] and seen["storage"]
