"""Helpers of the reference-cache tests: small cache configurations, a seeded workload, a verifier of KV content."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import torch

from otel_hicache.cache.content import page_content
from otel_hicache.cache.hicache import CacheConfig, HiCache
from otel_hicache.cache.pools import PoolSpec

POOLS = (
    PoolSpec("kv", layers=2, heads=2, head_dim=8),
    PoolSpec("draft", layers=1, heads=1, head_dim=8, sidecar_of="kv"),
    PoolSpec("mamba", layers=2, heads=1, head_dim=16, kv=False, per_node=True),
)


def small_config(storage_dir: Path | None, policy: str = "write_through", **overrides: object) -> CacheConfig:
    base = CacheConfig(
        pools=POOLS,
        page_size=4,
        device_tokens=256,
        host_tokens=384,
        device_states=32,
        host_states=48,
        write_policy=policy,
        storage_dir=storage_dir,
        prefetch_threshold=4,
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


def expected_value(cache: HiCache, pool: str, names: list[str]) -> torch.Tensor:
    spec = cache.device.pools[pool].spec
    if spec.per_node:
        return page_content(spec, names[-1], cache.config.seed, 1)
    return torch.cat([page_content(spec, n, cache.config.seed, cache.config.page_size) for n in names], dim=1)


def read_value(group, value: dict[str, list[int]], pool: str) -> torch.Tensor:
    p = group.pools[pool]
    pages = value[p.spec.sidecar_of or pool]
    return torch.cat([p.page_view(page) for page in pages], dim=1).cpu()


def run_workload(cache: HiCache, n: int, seed: int = 0, in_flight: int = 2) -> list[int]:
    """Admit ``n`` prompts of the seeded chat workload; returns each prompt's length.

    Every in-flight transfer and L3 job is settled after each request, so what hits where does not depend on
    thread timing and the run is the same on every machine (the threads themselves are tested in test_storage).
    """
    from otel_hicache.cache.workload import WorkloadConfig, requests

    wl = WorkloadConfig(seed=seed, documents=8, document_tokens=64, system_tokens=16, turn_tokens=(4, 16))
    held: collections.deque = collections.deque()
    lengths = []
    for prompt, _ in zip(requests(wl), range(n), strict=False):
        held.append(cache.admit(prompt))
        lengths.append(len(prompt))
        if len(held) > in_flight:
            cache.release(held.popleft())
        cache.flush()
    while held:
        cache.release(held.popleft())
    cache.flush()
    return lengths


def verify_tree(cache: HiCache) -> collections.Counter[str]:
    """Every device and (completed) host copy in the tree holds exactly the KV the model wrote. Returns counts."""
    checked: collections.Counter[str] = collections.Counter()
    for node in cache.tree.nodes.values():
        if node is cache.tree.root:
            continue
        for tier, group, value in (("device", cache.device, node.device), ("host", cache.host, node.host)):
            if value is None or (tier == "host" and not node.backed):
                continue
            for pool in group.pools:
                owner = group.pools[pool].spec.sidecar_of or pool
                if owner not in value:
                    continue
                got = read_value(group, value, pool)
                assert torch.equal(got, expected_value(cache, pool, node.names)), f"{tier}/{pool} node {node.id}"
                checked[f"{tier}/{pool}"] += 1
    return checked
