"""Write policies, eviction, drops and load back behave as SGLang HiCache defines them."""

from __future__ import annotations

import pytest

from otel_hicache import semconv as sc
from otel_hicache.cache.hicache import CacheConfig, HiCache
from otel_hicache.summary import by_first
from tests.cache.support import small_config

A = list(range(100, 132))  # 8 pages
B = list(range(200, 232))


def _drops(csdk) -> dict:
    return {k: v for k, v in csdk.telemetry.snapshot()[sc.METRIC_DROPPED_TOKENS].items() if v}


def test_write_through_backs_up_on_insert(csdk) -> None:
    cache = HiCache(small_config(None, "write_through"), csdk.telemetry)
    cache.release(cache.admit(A))
    cache.flush()
    assert cache.controller.stats.slots[("backup", "kv")] == 32
    assert all(n.backed for n in cache.tree.nodes.values() if n is not cache.tree.root)
    cache.close()


def test_write_through_selective_backs_up_on_the_second_hit(csdk) -> None:
    cache = HiCache(small_config(None, "write_through_selective"), csdk.telemetry)
    cache.release(cache.admit(A))
    cache.flush()
    assert cache.controller.stats.slots[("backup", "kv")] == 0
    cache.release(cache.admit(A))
    cache.flush()
    assert cache.controller.stats.slots[("backup", "kv")] == 32
    cache.close()


def test_write_back_backs_up_inside_eviction_then_demotes(csdk) -> None:
    cache = HiCache(small_config(None, "write_back"), csdk.telemetry)
    cache.release(cache.admit(A))
    cache.flush()
    assert cache.controller.stats.slots[("backup", "kv")] == 0
    assert cache.evict_device(32) == 32
    assert cache.controller.stats.slots[("backup", "kv")] == 32  # blocking backup happened in the eviction
    assert cache.match_prefix(A) == (0, 32, 0)  # demoted: host copy only
    assert by_first(csdk.telemetry.snapshot()[sc.METRIC_EVICTION_TOKENS])["device"] == 32
    assert not _drops(csdk)
    cache.close()


def test_load_back_is_all_or_nothing_and_counts_host_hits(csdk) -> None:
    cache = HiCache(small_config(None, "write_through"), csdk.telemetry)
    cache.release(cache.admit(A))
    cache.release(cache.admit(A[:16] + B))  # splits A's node: the evicted path is two nodes
    cache.flush()
    cache.evict_device(10_000)
    assert cache.match_prefix(A) == (0, 32, 0)
    admission = cache.admit(A)
    assert admission.split == (0, 0, 32, 0)
    cache.flush()
    assert cache.controller.stats.slots[("load_back", "kv")] == 32
    assert all(n.device is not None for n in admission.nodes)
    cache.release(admission)
    cache.close()


def test_host_hits_under_the_load_back_threshold_are_recomputed(csdk) -> None:
    cache = HiCache(small_config(None, "write_through", load_back_threshold=10), csdk.telemetry)
    short = A[:8]  # 2 pages: under the 10-token threshold
    cache.release(cache.admit(short))
    cache.flush()
    cache.evict_device(10_000)
    admission = cache.admit(short)
    assert admission.split == (8, 0, 0, 0) and cache.stats.load_back_skipped == 1
    assert cache.controller.stats.slots[("load_back", "kv")] == 0
    cache.release(admission)
    cache.close()


@pytest.mark.parametrize(
    ("policy", "reason"),
    [
        ("write_through", "write_through_unbacked_eviction"),
        ("write_through_selective", None),  # deleted too, but only exactly write_through counts it
        ("write_back", "host_pressure"),
    ],
)
def test_unbacked_eviction_drops_by_policy(csdk, policy: str, reason: str | None) -> None:
    # The host holds 8 tokens: A's backup (32 tokens) can never fit, so A stays unbacked on the device.
    cache = HiCache(small_config(None, policy, host_tokens=8), csdk.telemetry)
    cache.release(cache.admit(A))
    cache.release(cache.admit(A))  # a second hit: selective would back up now if it could
    cache.flush()
    assert cache.evict_device(32) == 32
    assert cache.match_prefix(A) == (0, 0, 0)  # gone from every tier
    expected = {} if reason is None else {(reason, "kv"): 32, (reason, "mamba"): 1}
    assert _drops(csdk) == expected
    failures = csdk.telemetry.snapshot()[sc.METRIC_TRANSFER_FAILURES]
    assert failures.get(("backup", "host_pool_full"), 0) >= 1  # the backup that could not get host slots
    cache.close()


def test_locked_prefix_is_never_evicted(csdk) -> None:
    cache = HiCache(small_config(None, "write_back"), csdk.telemetry)
    held = cache.admit(A)
    assert cache.evict_device(10_000) == 0
    cache.release(held)
    assert cache.evict_device(10_000) == 32
    cache.close()


def test_a_request_the_device_has_no_room_for_is_told_so_before_it_is_admitted(csdk) -> None:
    """``has_room`` counts the device's free tokens and those no request in flight holds, against the prompt's tokens
    not already pinned there: with two requests in flight holding the whole device (2 x 32 pages), a third prompt has
    no room, one extending a request in flight has; admitted anyway, the third is served without caching its KV."""
    cache = HiCache(small_config(None), csdk.telemetry)
    held = [cache.admit(list(range(k * 1000, k * 1000 + 128))) for k in (1, 2)]
    third = list(range(3000, 3128))
    assert not cache.has_room(third)
    assert cache.has_room([*range(1000, 1128), 7, 7, 7])  # its 128 tokens are pinned: nothing new to hold
    cache.release(cache.admit(third))
    assert cache.stats.uncached == 1
    for admission in held:
        cache.release(admission)
    assert cache.has_room(third)
    cache.close()


def test_a_bad_write_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="write_policy must be one of"):
        CacheConfig(write_policy="write_sometimes")
