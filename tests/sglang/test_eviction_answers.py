"""Is each tier the right size, and how much KV movement is wasted: eviction entries from SGLang's own radix nodes.

A scripted workload on SGLang's real UnifiedRadixCache whose answers the test knows: prefix A is reused (a second
request inserts it again: SGLang's ``hit_count``), B is not; both are backed up to the host, evicted from the device,
A is loaded back (its host copy read) and evicted from the device again, then the host tier evicts both copies.
"""

from __future__ import annotations

import bisect
import time
from array import array
from typing import Any

import pytest

pytest.importorskip("sglang")

from otel_hicache import semconv as sc
from otel_hicache.testing.sdk import Sdk
from otel_hicache.testing.sglang import build_hicache

pytestmark = pytest.mark.sglang

A, B = list(range(1, 21)), list(range(100, 130))


def test_evictions_per_tier_say_what_was_reused_how_old_it_was_and_what_was_written_for_nothing(
    instrumented: Sdk, sglang_metrics: Any
) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    started = time.monotonic()
    cache, allocator, _ = build_hicache("write_through", metrics=sglang_metrics, kv_size=128)

    def insert(tokens: list[int]) -> None:
        cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=allocator.alloc(len(tokens))))

    insert(A)
    insert(B)
    insert(A)  # a second request with prefix A: a hit on A's node
    cache.flush_pending_backups()
    cache.writing_check()
    assert cache.evict(EvictParams(num_tokens=len(A) + len(B))).num_tokens_evicted == 50  # both host only now

    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", A))))
    assert cache.load_back(match.best_match_node)  # A's host copy is read
    cache.ready_to_load_host_cache()
    cache.loading_check()
    assert cache.evict(EvictParams(num_tokens=len(A))).num_tokens_evicted == len(A)  # A leaves the device again
    assert cache.evict_host(len(A) + len(B)) == len(A) + len(B)  # the host tier frees both copies

    snap = instrumented.counters()
    assert {k: v for k, v in snap[sc.METRIC_EVICTION_TOKENS].items() if v} == {
        ("device", True): 2 * len(A),  # A, twice
        ("device", False): len(B),
        ("host", True): len(A),  # loaded back before its host copy went
        ("host", False): len(B),  # written to the host and never read
    }
    per_token = cache.cache_controller.mem_pool_host.size_per_token
    assert {k: v for k, v in snap[sc.METRIC_WASTED_SIZE].items() if v} == {("backup",): len(B) * per_token}
    ages = instrumented.points(sc.METRIC_EVICTION_AGE)
    assert set(ages) == {frozenset({(sc.ATTR_TIER, "device")}), frozenset({(sc.ATTR_TIER, "host")})}
    device, host = (ages[frozenset({(sc.ATTR_TIER, tier)})] for tier in ("device", "host"))
    assert (device.count, host.count) == (3, 2)  # one point per evicted node
    elapsed = time.monotonic() - started  # no node was idle longer than the whole workload
    above = bisect.bisect_left(device.explicit_bounds, elapsed) + 1  # the buckets of longer ages
    for ages_of_tier in (device, host):
        assert 0 <= ages_of_tier.sum <= ages_of_tier.count * elapsed
        assert not any(ages_of_tier.bucket_counts[above:])
    # SGLang's own device-eviction count is unchanged by the detail
    assert sum(v for (tier, _), v in snap[sc.METRIC_EVICTION_TOKENS].items() if tier == "device") == 2 * len(A) + len(B)
