"""The demo entry the CLI calls: ground truth that matches telemetry, every path exercised, clean arguments."""

from __future__ import annotations

import glob
import itertools
import os
import tempfile

import pytest

from otel_hicache import semconv as sc
from otel_hicache.cache.demo import DEMO_POOLS, PAGE_TOKENS, run_demo
from otel_hicache.cache.workload import WorkloadConfig
from otel_hicache.cache.workload import requests as workload_requests
from otel_hicache.testing.sdk import make_sdk


@pytest.fixture
def demo_sdk():
    made = make_sdk(pools=[p.name for p in DEMO_POOLS])
    yield made
    made.telemetry.shutdown()
    made.meter_provider.shutdown()
    made.tracer_provider.shutdown()


def test_two_hundred_requests_exercise_every_path_and_match_telemetry(demo_sdk) -> None:
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "otel-hicache-l3-*")))
    seen: list[int] = []
    result = run_demo(demo_sdk.telemetry, requests=200, device="cpu", progress=seen.append)
    assert result.requests == 200 and seen == list(range(1, 201))
    assert result.wall_time_s < 30
    left = set(glob.glob(os.path.join(tempfile.gettempdir(), "otel-hicache-l3-*"))) - before
    assert not left  # its temporary L3 store removed (others' may come and go meanwhile)
    for op in ("backup", "load_back", "storage_backup", "storage_prefetch"):
        assert result.copied_tokens[op]["kv"] > 0 and result.copied_bytes[op]["draft"] > 0
    assert result.evicted_tokens["device"] > 0 and result.evicted_tokens["host"] > 0
    assert result.dropped_tokens["host_pressure"] > 0
    assert all(result.prefix_tokens[m] > 0 for m in ("input", "device_hit", "host_hit", "storage_hit"))

    snap = demo_sdk.telemetry.snapshot()
    for op, pools in result.copied_tokens.items():
        for pool, n in pools.items():
            assert snap[sc.METRIC_TRANSFER_TOKENS].get((op, pool), 0) == n
    for op, pools in result.copied_bytes.items():
        for pool, n in pools.items():  # every reference-cache copy is timed by the host clock on a CPU
            assert snap[sc.METRIC_TRANSFER_SIZE].get((op, pool, "host_clock"), 0) == n
    assert snap[sc.METRIC_DROPPED_TOKENS][("host_pressure", "kv")] == result.dropped_tokens["host_pressure"]
    assert {k[0]: v for k, v in snap[sc.METRIC_PREFILL_TOKENS].items()} == result.prefix_tokens
    assert 0 < result.hit_rate < 1


def test_the_demo_waits_for_room_as_a_scheduler_does_at_any_device_size(demo_sdk) -> None:
    """With the device halved (768 tokens) the two requests in flight often hold the room the next one needs: the demo
    lets them finish first, so only a prompt longer than the whole device is served uncached."""
    result = run_demo(demo_sdk.telemetry, requests=300, seed=7, device="cpu", device_tokens=768, l3=False)
    prompts = itertools.islice(workload_requests(WorkloadConfig(seed=7)), 300)
    longer = sum(1 for prompt in prompts if len(prompt) // PAGE_TOKENS * PAGE_TOKENS > 768)
    assert result.uncached_requests <= longer


def test_same_seed_same_run(demo_sdk, tmp_path) -> None:
    a = run_demo(demo_sdk.telemetry, requests=60, device="cpu", seed=5, storage_dir=tmp_path / "a")
    b = run_demo(demo_sdk.telemetry, requests=60, device="cpu", seed=5, storage_dir=tmp_path / "b")
    c = run_demo(demo_sdk.telemetry, requests=60, device="cpu", seed=6, storage_dir=tmp_path / "c")
    assert (a.copied_tokens, a.prefix_tokens, a.dropped_tokens) == (b.copied_tokens, b.prefix_tokens, b.dropped_tokens)
    assert a.prefix_tokens != c.prefix_tokens
    assert list((tmp_path / "a").rglob("*.kv"))  # a given storage_dir is kept


def test_seconds_bounds_the_run(demo_sdk) -> None:
    result = run_demo(demo_sdk.telemetry, seconds=0.3, device="cpu", write_policy="write_through")
    assert result.requests > 0 and result.wall_time_s < 5


@pytest.mark.parametrize("kwargs", [{"requests": -1}, {"seconds": 0.0}, {"write_policy": "sometimes"}])
def test_bad_arguments_are_clear_errors_that_leave_no_l3_store(demo_sdk, kwargs: dict) -> None:
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "otel-hicache-l3-*")))
    with pytest.raises(ValueError):
        run_demo(demo_sdk.telemetry, device="cpu", **kwargs)
    assert not set(glob.glob(os.path.join(tempfile.gettempdir(), "otel-hicache-l3-*"))) - before
