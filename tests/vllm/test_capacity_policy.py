"""The capacity curve follows the CPU tier's eviction policy only where it models it: vLLM's real scheduler stepped
with its offloading connector (:mod:`tests.vllm.stepping`), its CPU tier evicting by ``lru`` (vLLM's default, modelled:
host points) or by ``arc`` (not modelled: no host points, one info line; the device tier is still predicted). A hybrid
model's KV cache (several groups: sliding-window layers beside full attention) is not modelled: no points, one line."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from otel_hicache import semconv as sc
from otel_hicache.testing.sdk import Sdk
from tests.vllm import stepping, support

pytestmark = pytest.mark.vllm


def curve_after_a_workload(
    otel: Sdk, policy: str, groups: tuple[Any, ...] = (support.ATTENTION,)
) -> dict[tuple[str, str], float]:
    """Twelve requests over four shared prefixes, served by an engine whose CPU tier evicts by ``policy`` (and whose
    KV cache has ``groups``): the curve exported then, by (tier, factor)."""
    engine = stepping.stepper(cpu_chunks=16, groups=groups, eviction_policy=policy)
    for request in range(12):
        engine.add(f"r{request}", stepping.prompt(request % 4, blocks=3))
        engine.run()
    points = otel.points(sc.METRIC_CAPACITY_HIT_RATIO)
    return {
        (dict(attrs)[sc.ATTR_TIER], dict(attrs)[sc.ATTR_CAPACITY_FACTOR]): point.value
        for attrs, point in points.items()
    }


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_cpu_tier_of_a_policy_the_model_does_not_follow_gets_no_points_and_one_info_line(
    instrumented: Sdk, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    with caplog.at_level(logging.INFO, logger="otel_hicache"):
        curve = curve_after_a_workload(instrumented, policy)
    tiers = {tier for tier, _ in curve}
    said = [r.getMessage() for r in caplog.records if sc.METRIC_CAPACITY_HIT_RATIO in r.getMessage()]
    assert curve[("device", "1")] > 0  # predicted either way: the device tier keeps what it keeps
    if policy == "lru":
        assert tiers == {"device", "host"} and said == []
        assert curve[("host", "1")] >= curve[("device", "1")]
    else:
        assert tiers == {"device"}
        assert len(said) == 1 and "'arc'" in said[0] and "no points for the host tier" in said[0]


def test_a_hybrid_models_kv_cache_gets_no_curve_and_one_info_line(
    instrumented: Sdk, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="otel_hicache"):
        curve = curve_after_a_workload(instrumented, "lru", groups=(support.SLIDING, support.ATTENTION))
        curve_after_a_workload(instrumented, "lru", groups=(support.SLIDING, support.ATTENTION))  # said once
    said = [r.getMessage() for r in caplog.records if sc.METRIC_CAPACITY_HIT_RATIO in r.getMessage()]
    assert curve == {}
    assert len(said) == 1 and "2 KV cache groups" in said[0] and "no points" in said[0]
