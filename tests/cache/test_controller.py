"""The controller: pending ops merge into one transfer, acks complete in FIFO order, pool-full is a failure."""

from __future__ import annotations

import torch

from otel_hicache import semconv as sc
from otel_hicache.cache.controller import CacheController, _runs
from otel_hicache.cache.pools import PoolGroup
from otel_hicache.semconv import Tier
from otel_hicache.testing.sdk import attributes_of
from tests.cache.support import POOLS


def _pages(group: PoolGroup, num_pages: int, with_state: bool = False) -> dict[str, list[int]]:
    """Pages the test knows the group can hold."""
    value, full = group.alloc(num_pages, with_state)
    assert value is not None, full
    return value


def _groups(host_tokens: int = 64) -> tuple[PoolGroup, PoolGroup]:
    device = PoolGroup(Tier.DEVICE, POOLS, token_slots=64, node_slots=4, page_size=4, device="cpu")
    host = PoolGroup(Tier.HOST, POOLS, token_slots=host_tokens, node_slots=4, page_size=4, device="cpu")
    return device, host


def test_pending_writes_merge_into_one_transfer_counted_like_sglang(csdk) -> None:
    device, host = _groups()
    ctl = CacheController(device, host, csdk.telemetry, write_policy="write_through")
    a, b = _pages(device, 2, True), _pages(device, 3)
    for pool in ("kv", "draft", "mamba"):
        device.pools[pool].buffer.normal_()
    ha, hb = ctl.write(a, 1), ctl.write(b, 2)
    assert ha is not None and hb is not None
    ctl.start_writing()
    assert len(ctl.ack_write_queue) == 1
    assert ctl.poll_writes() == [1, 2]
    [span] = csdk.spans()
    attrs = attributes_of(span)
    assert attrs[sc.ATTR_MERGED_OPS] == 2 and attrs[sc.ATTR_NODES] == 2
    assert attrs[f"{sc.ATTR_POOL_TOKENS}.kv"] == 20 and attrs[f"{sc.ATTR_POOL_TOKENS}.mamba"] == 1
    assert f"{sc.ATTR_POOL_TOKENS}.draft" not in attrs  # the sidecar rides kv's indices: bytes only
    kv, draft, mamba = (device.pools[p].spec.bytes_per_slot for p in ("kv", "draft", "mamba"))
    assert attrs[sc.ATTR_BYTES] == 20 * kv + 20 * draft + 1 * mamba
    for value, hvalue in ((a, ha), (b, hb)):
        for pool in ("kv", "draft"):
            for d, h in zip(value["kv"], hvalue["kv"], strict=True):
                assert torch.equal(device.pools[pool].page_view(d), host.pools[pool].page_view(h))
    assert torch.equal(device.pools["mamba"].page_view(a["mamba"][0]), host.pools["mamba"].page_view(ha["mamba"][0]))


def test_acks_complete_in_fifo_order_one_record_each(csdk) -> None:
    device, host = _groups()
    ctl = CacheController(device, host, csdk.telemetry)
    for node in (1, 2, 3):
        ctl.write(_pages(device, 1), node)
        ctl.start_writing()
    assert ctl.poll_writes() == [1, 2, 3] and ctl.poll_writes() == []
    assert csdk.telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 12
    assert len(csdk.spans()) == 3


def test_a_full_pool_returns_none_and_records_the_failure(csdk) -> None:
    device, host = _groups(host_tokens=8)
    ctl = CacheController(device, host, csdk.telemetry)
    assert ctl.write(_pages(device, 3), 1) is None
    hv = _pages(host, 2)
    device.alloc(device.pools["kv"].free_slots // 4, False)  # fill the device
    assert ctl.load(hv, 2) is None
    failures = csdk.telemetry.snapshot()[sc.METRIC_TRANSFER_FAILURES]
    assert failures == {("backup", "host_pool_full"): 1, ("load_back", "device_pool_full"): 1}
    assert host.pools["kv"].free_slots == 0  # nothing leaked by the failed write (8 slots taken by hv)


def test_runs_coalesce_pages_consecutive_on_both_sides() -> None:
    assert _runs([4, 5, 6, 9], [0, 1, 7, 8]) == [(4, 0, 2), (6, 7, 1), (9, 8, 1)]
