"""The demo the CLI runs: the reference cache under the seeded chat workload, reporting through the telemetry core.

Sized so ~200 requests take a few seconds on a CPU and exercise all four transfer operations, eviction on both
tiers, drops under ``write_back`` and hits on all three tiers, with real (small) tensors.
"""

from __future__ import annotations

import collections
import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from otel_hicache.cache.hicache import Admission, CacheConfig, HiCache, default_device
from otel_hicache.cache.pools import PoolSpec
from otel_hicache.cache.workload import WorkloadConfig
from otel_hicache.cache.workload import requests as workload_requests
from otel_hicache.semconv import DropReason, PrefillMode, Tier, TransferOperation
from otel_hicache.telemetry import HiCacheTelemetry

DEMO_POOLS = (
    PoolSpec("kv", layers=4, heads=2, head_dim=32),  # 1 KiB per token
    PoolSpec("draft", layers=1, heads=2, head_dim=32, sidecar_of="kv"),  # rides kv's indices: bytes only
    PoolSpec("mamba", layers=4, heads=1, head_dim=64, kv=False, per_node=True),  # one state slot per node
)
DEFAULT_REQUESTS = 200
#: Each tier's capacity in tokens by default (``otel-hicache demo --device-tokens / --host-tokens``).
DEVICE_TOKENS = 1536
HOST_TOKENS = 1536
PAGE_TOKENS = 16
IN_FLIGHT = 2  # admitted requests holding their prefix at once


@dataclass
class DemoResult:
    """Ground truth of a demo run, counted by the cache at the copy sites (not read back from telemetry).

    ``copied_tokens[operation][pool]``: tokens (state slots for mamba) actually copied, sidecars excluded;
    ``copied_bytes[operation][pool]``: bytes of the tensors copied, sidecars included;
    ``dropped_tokens[reason]``: kv tokens freed with no copy anywhere (``dropped_tokens_by_pool`` per pool);
    ``prefix_tokens[mode]``: prefill tokens by mode; ``evicted_tokens[tier]``: slots freed by eviction.
    """

    requests: int
    wall_time_s: float
    device: str
    write_policy: str
    copied_tokens: dict[str, dict[str, int]]
    copied_bytes: dict[str, dict[str, int]]
    dropped_tokens: dict[str, int]
    dropped_tokens_by_pool: dict[str, dict[str, int]]
    prefix_tokens: dict[str, int]
    evicted_tokens: dict[str, int]
    transfer_failures: dict[str, int] = field(default_factory=dict)  # "operation/error_type" -> count
    #: requests served without caching their KV: each had no device room with nothing else in flight (a prompt longer
    #: than the device)
    uncached_requests: int = 0
    #: tier -> {"tokens": capacity today, "hit_ratio": {factor: predicted share}}: ``hicache.capacity.hit_ratio``
    capacity: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def served_shares(self) -> dict[str, float]:
        """Tier -> share of prompt tokens served by that tier or a faster one (what ``capacity`` predicts at 1x)."""
        total = sum(self.prefix_tokens.values())
        shares, served = {}, 0
        for tier, mode in ((Tier.DEVICE, PrefillMode.DEVICE_HIT), (Tier.HOST, PrefillMode.HOST_HIT)):
            served += self.prefix_tokens.get(mode.value, 0)
            shares[tier.value] = served / total if total else 0.0
        return shares

    @property
    def hit_rate(self) -> float:
        hits = sum(v for k, v in self.prefix_tokens.items() if k != PrefillMode.INPUT.value)
        total = hits + self.prefix_tokens.get(PrefillMode.INPUT.value, 0)
        return hits / total if total else 0.0


def demo_config(
    device: str,
    write_policy: str,
    storage_dir: str | os.PathLike[str] | None,
    seed: int,
    device_tokens: int = DEVICE_TOKENS,
    host_tokens: int = HOST_TOKENS,
    pools: tuple[PoolSpec, ...] = DEMO_POOLS,
) -> CacheConfig:
    return CacheConfig(
        pools=pools,
        page_size=PAGE_TOKENS,
        device_tokens=device_tokens,
        host_tokens=host_tokens,
        device_states=48,
        host_states=96,
        write_policy=write_policy,
        storage_dir=storage_dir,
        device=device,
        seed=seed,
    )


def run_demo(
    telemetry: HiCacheTelemetry,
    *,
    requests: int | None = None,
    seconds: float | None = None,
    seed: int = 0,
    device: str | None = None,
    write_policy: str = "write_back",
    storage_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[int], None] | None = None,
    device_tokens: int = DEVICE_TOKENS,
    host_tokens: int = HOST_TOKENS,
    pools: tuple[PoolSpec, ...] = DEMO_POOLS,
    l3: bool = True,
) -> DemoResult:
    """Serve ``requests`` prompts (default 200), or as many as fit in ``seconds``, or whichever ends first, with each
    tier sized in tokens (at least one page). ``pools``: the cache's pool kinds (the anchor ``kv`` first); ``l3``
    False: no L3 store (``storage_dir`` unused). ``python -m benchmarks capacity_reruns`` re-runs it at each size."""
    if requests is not None and requests < 0:
        raise ValueError(f"requests must be >= 0, not {requests}")
    if min(device_tokens, host_tokens) < PAGE_TOKENS:
        raise ValueError(f"each tier holds at least one page ({PAGE_TOKENS} tokens)")
    if seconds is not None and not seconds > 0:
        raise ValueError(f"seconds must be > 0, not {seconds}")
    if requests is None and seconds is None:
        requests = DEFAULT_REQUESTS
    device = device or default_device()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    with contextlib.ExitStack() as cleanup:  # unwinds in reverse: the cache closes before its L3 store goes
        if not l3:
            storage_dir = None
        elif storage_dir is None:
            storage_dir = cleanup.enter_context(
                tempfile.TemporaryDirectory(prefix="otel-hicache-l3-", ignore_cleanup_errors=True)
            )
        config = demo_config(device, write_policy, storage_dir, seed, device_tokens, host_tokens, pools)
        cache = HiCache(config, telemetry)
        cleanup.callback(cache.close)
        start = time.perf_counter()
        deadline = start + seconds if seconds is not None else None
        served = 0
        in_flight: collections.deque[Admission] = collections.deque()
        for prompt in workload_requests(WorkloadConfig(seed=seed)):
            if (requests is not None and served >= requests) or (
                deadline is not None and time.perf_counter() >= deadline
            ):
                break
            while in_flight and not cache.has_room(prompt):  # as a scheduler waits for memory: in flight ends first
                cache.release(in_flight.popleft())
            in_flight.append(cache.admit(prompt))
            if len(in_flight) > IN_FLIGHT:
                cache.release(in_flight.popleft())
            # Settle in-flight transfers and L3 jobs each step: the run (and every count) is then the same for a
            # seed on any machine, instead of depending on how fast the L3 threads got the GIL.
            cache.flush()
            served += 1
            if progress is not None:
                progress(served)
        while in_flight:
            cache.release(in_flight.popleft())
    return _result(cache, served, time.perf_counter() - start, device, write_policy)


def _result(cache: HiCache, served: int, wall: float, device: str, policy: str) -> DemoResult:
    owning = set(cache.host.owning)
    tokens = {op.value: {p: 0 for p in sorted(owning)} for op in TransferOperation}
    nbytes = {op.value: {p: 0 for p in cache.host.pools} for op in TransferOperation}
    sources = [cache.controller.stats] + ([cache.store.stats] if cache.store is not None else [])
    failures: dict[str, int] = {}
    for stats in sources:
        for (op, pool), n in stats.slots.items():
            if pool in owning:
                tokens[op][pool] += n
        for (op, pool), n in stats.bytes.items():
            nbytes[op][pool] += n
    if cache.store is not None:
        failures = {f"{op}/{err}": n for (op, err), n in cache.store.stats.failures.items()}
    cache.telemetry.snapshot()  # waits until every lookup the cache fed the capacity estimator is counted
    capacity = {
        tier: {"tokens": curve.tokens, "hit_ratio": curve.hit_ratio} for tier, curve in cache.capacity.curve().items()
    }
    dropped_by_pool: dict[str, dict[str, int]] = {r.value: {} for r in DropReason}
    for (reason, pool), n in cache.stats.dropped.items():
        dropped_by_pool[reason][pool] = n
    return DemoResult(
        requests=served,
        wall_time_s=wall,
        device=device,
        write_policy=policy,
        copied_tokens=tokens,
        copied_bytes=nbytes,
        dropped_tokens={r: by_pool.get("kv", 0) for r, by_pool in dropped_by_pool.items()},
        dropped_tokens_by_pool=dropped_by_pool,
        prefix_tokens={m.value: cache.stats.prefix.get(m.value, 0) for m in PrefillMode if m is not PrefillMode.OTHER},
        evicted_tokens={t.value: cache.stats.evicted.get(t.value, 0) for t in (Tier.DEVICE, Tier.HOST)},
        transfer_failures=failures,
        uncached_requests=cache.stats.uncached,
        capacity=capacity,
    )
