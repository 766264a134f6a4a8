"""Every KV byte read back after any path (backup, evict, load back, L3 backup, prefetch) is what the model wrote."""

from __future__ import annotations

import pytest
import torch

from otel_hicache.cache.hicache import HiCache
from tests.cache.support import expected_value, read_value, run_workload, small_config, verify_tree


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("seed", [0, 7])
def test_seeded_workload_keeps_every_copy_intact(csdk, tmp_path, policy: str, seed: int) -> None:
    cache = HiCache(small_config(tmp_path, policy, seed=seed), csdk.telemetry)
    try:
        run_workload(cache, 120, seed=seed)
        # every path ran: D->H, H->D, L3 write and L3 read, evictions on both tiers
        assert cache.store is not None
        ops = {op for (op, _pool) in cache.controller.stats.slots} | {op for (op, _) in cache.store.stats.slots}
        assert ops == {"backup", "load_back", "storage_backup", "storage_prefetch"}
        assert cache.stats.evicted["device"] > 0 and cache.stats.evicted["host"] > 0
        checked = verify_tree(cache)
        assert checked["device/kv"] > 0 and checked["host/kv"] > 0 and checked["host/draft"] > 0
    finally:
        cache.close()


def test_l3_files_hold_the_pages_they_are_named_after(csdk, tmp_path) -> None:
    cache = HiCache(small_config(tmp_path, "write_through"), csdk.telemetry)
    try:
        run_workload(cache, 60)
        store = cache.store
        assert store is not None
        by_name = {name: node for node in cache.tree.nodes.values() for name in node.names}
        files = list(tmp_path.rglob("*.kv"))
        assert files and {p.parent.parent for p in files} == {store.namespace}
        for path in files:
            store._read_entry(path.stem)  # raises unless header, size and checksum are all good
        # A stored page read into fresh host memory equals the model's KV for that page name.
        name = next(n for n in by_name if store.contains(n))
        value, _ = cache.host.alloc(1, False)
        assert value is not None
        store._load_payload(value, 0, store._read_entry(name))
        for pool in ("kv", "draft"):
            assert torch.equal(read_value(cache.host, value, pool), expected_value(cache, pool, [name]))
        assert not list(tmp_path.rglob("*.tmp"))  # atomic writes leave no temporaries
    finally:
        cache.close()


def test_storage_hit_after_the_tree_forgot_the_prefix_serves_the_stored_kv(csdk, tmp_path) -> None:
    cache = HiCache(small_config(tmp_path, "write_through"), csdk.telemetry)
    prompt = list(range(1000, 1040))  # 10 pages
    try:
        cache.release(cache.admit(prompt))
        cache.flush()
        assert cache.match_prefix(prompt) == (40, 0, 0)
        # Forget it on L1 and L2: demote everything, then evict every host-only leaf.
        cache.evict_device(10_000)
        cache.evict_host(10_000)
        assert cache.match_prefix(prompt) == (0, 0, 40)
        admission = cache.admit([*prompt, 1, 2, 3, 4])
        assert admission.split.storage_hit == 40 and admission.split.input_tokens == 4
        cache.flush()
        node = admission.nodes[0]
        assert node.device is not None
        for pool in ("kv", "draft"):
            assert torch.equal(read_value(cache.device, node.device, pool), expected_value(cache, pool, node.names))
        cache.release(admission)
    finally:
        cache.close()
