"""On CUDA: dedicated copy streams, device-timed copies, pinned host memory, intact bytes. Skipped on CPU."""

from __future__ import annotations

import pytest
import torch

from otel_hicache import semconv as sc
from otel_hicache.cache.demo import run_demo
from otel_hicache.cache.hicache import HiCache
from tests.cache.support import run_workload, small_config, verify_tree

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)"),
]


def test_cuda_cache_uses_streams_events_and_pinned_memory(csdk, tmp_path) -> None:
    cache = HiCache(small_config(tmp_path, "write_back", device="cuda"), csdk.telemetry)
    try:
        assert cache.host.pools["kv"].buffer.is_pinned()
        assert cache.device.pools["kv"].buffer.is_cuda
        assert cache.controller.d2h_stream is not None and cache.controller.h2d_stream is not None
        run_workload(cache, 120)
        torch.cuda.synchronize()
        assert verify_tree(cache)["host/kv"] > 0
    finally:
        cache.close()
    spans = csdk.spans()
    transfers = [s for s in spans if s.name in ("hicache.backup", "hicache.load_back")]
    assert transfers and all(s.attributes[sc.ATTR_TIMING_SOURCE] == "cuda_event" for s in transfers)
    assert all(s.attributes[sc.ATTR_COPY_DURATION] >= 0 for s in transfers)
    points = csdk.points(sc.METRIC_TRANSFER_DURATION)
    assert any(dict(k).get(sc.ATTR_TIMING_SOURCE) == "cuda_event" for k in points)


def test_cuda_demo_runs(csdk) -> None:
    result = run_demo(csdk.telemetry, requests=100, device="cuda")
    assert result.device == "cuda" and result.copied_tokens["load_back"]["kv"] > 0


def test_cuda_load_backs_time_the_request_wait_on_the_device(csdk, tmp_path) -> None:
    """The host KV wait runs from an event on the compute stream to the load's finish event, both read once complete:
    at most one wait per merged load (a copy done before the forward needed it is no wait)."""
    cache = HiCache(small_config(tmp_path, "write_through", device="cuda"), csdk.telemetry)
    try:
        run_workload(cache, 120)
    finally:
        cache.close()
    loads = cache.controller.stats.transfers["load_back"]
    host = csdk.points(sc.METRIC_REQUEST_KV_WAIT)[frozenset({sc.ATTR_TIER: "host"}.items())]
    assert 0 < host.count <= loads and host.sum > 0
