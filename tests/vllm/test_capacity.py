"""Capacity answers on a real vLLM engine, checked by re-running: vLLM's offline ``LLM`` (main, engine-core and worker
processes) serves one seeded workload at today's sizes - its GPU prefix cache of 64 blocks of 32 tokens, its CPU tier
of 128 chunks - and its engine core exports ``hicache.capacity.hit_ratio`` over OTLP into the in-process receiver;
then the same workload is served again by fresh engines with one tier at 0.5x and 2x (the CPU tier also at 4x), the
other unchanged. Each prediction must be within 3 points of the share vLLM's own counters observe in that re-run
(``vllm:prompt_tokens_by_source``), the prediction at 1x within 2 points of the first run's.

Six engines in one process (:mod:`tests.vllm.capacity_app`), each started once: the fewest that re-run every size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from otel_hicache import semconv as sc
from otel_hicache.testing.otlp_receiver import OtlpReceiver
from otel_hicache.testing.vllm import BLOCK_TOKENS, environment
from tests.vllm.capacity_app import results
from tests.vllm.engine import Exported, needs_cpu_build, otlp_environment, run_offline

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2700), needs_cpu_build]

SERVICE = "vllm-capacity"
REQUESTS = 400
GPU_BLOCKS, CPU_CHUNKS = 65, 128  # today: 64 blocks usable (vLLM keeps one null block), 128 chunks of one block
#: label -> (tier, factor), GPU blocks, CPU chunks
RUNS: dict[str, tuple[tuple[str, str], int, int]] = {
    "today": (("", "1"), GPU_BLOCKS, CPU_CHUNKS),
    "device-0.5": (("device", "0.5"), 33, CPU_CHUNKS),
    "device-2": (("device", "2"), 129, CPU_CHUNKS),
    "host-0.5": (("host", "0.5"), GPU_BLOCKS, CPU_CHUNKS // 2),
    "host-2": (("host", "2"), GPU_BLOCKS, 2 * CPU_CHUNKS),
    "host-4": (("host", "4"), GPU_BLOCKS, 4 * CPU_CHUNKS),
}


@dataclass
class Runs:
    exported: Exported
    observed: dict[str, dict[str, float]]  # label -> vLLM's prompt tokens by source

    def share(self, label: str, tier: str) -> float:
        """The share of prompt tokens vLLM served from ``tier`` or a faster one in run ``label``."""
        by_source = self.observed[label]
        hits = by_source["local_cache_hit"] + (by_source["external_kv_transfer"] if tier == "host" else 0)
        return hits / sum(by_source.values())

    def engine_core(self, label: str) -> tuple[dict[str, Any], dict[tuple[str, str], float]]:
        """Run ``label``'s engine core: its Resource and its last export of the capacity curve."""
        (found,) = [
            (resource, metric)
            for resource, metric in self.exported.latest(sc.METRIC_CAPACITY_HIT_RATIO).values()
            if resource["service.name"] == f"{SERVICE}-{label}"
        ]
        resource, metric = found
        curve = {}
        for point in metric.gauge.data_points:
            attrs = {a.key: a.value.string_value for a in point.attributes}
            curve[attrs[sc.ATTR_TIER], attrs[sc.ATTR_CAPACITY_FACTOR]] = point.as_double
        return resource, curve


@pytest.fixture(scope="module")
def runs(tiny_model: Path) -> Iterator[Runs]:
    with OtlpReceiver() as receiver:
        env = environment(**otlp_environment(receiver, SERVICE))
        spec = ",".join(f"{label}:{gpu}:{cpu}" for label, (_, gpu, cpu) in RUNS.items())
        arguments = ("--requests", str(REQUESTS), "--runs", spec)
        log = run_offline(tiny_model, env, *arguments, timeout_s=2400, module="tests.vllm.capacity_app")
        observed = {str(r["label"]): r["by_source"] for r in results(log)}
        assert list(observed) == list(RUNS)
        exported = Exported(receiver)
        services = {f"{SERVICE}-{label}" for label in RUNS}
        assert exported.wait(
            lambda: {r["service.name"] for r in exported.resources(sc.METRIC_CAPACITY_HIT_RATIO)} == services,
            timeout_s=60,
        )
        yield Runs(exported, observed)  # type: ignore[arg-type]


def test_the_engine_core_exports_the_curve_of_both_tiers_over_otlp(runs: Runs) -> None:
    resource, curve = runs.engine_core("today")
    assert resource["hicache.engine"] == "vllm"
    assert set(curve) == {(tier, f) for tier in ("device", "host") for f in sc.CAPACITY_FACTORS}
    assert all(0 <= ratio <= 1 for ratio in curve.values())
    for tier in ("device", "host"):  # a bigger tier never serves less
        ratios = [curve[tier, f] for f in sc.CAPACITY_FACTORS]
        assert ratios == sorted(ratios)
    # today's capacities it was computed for, exported beside it
    limit = runs.exported.total(sc.METRIC_POOL_LIMIT, {sc.ATTR_TIER: "host"}, pids={int(resource["process.pid"])})
    assert limit == CPU_CHUNKS * BLOCK_TOKENS
    # only the engine core (the scheduler) of each engine reports it: one process per run
    assert len(runs.exported.resources(sc.METRIC_CAPACITY_HIT_RATIO)) == len(RUNS)


def test_each_prediction_is_what_rerunning_vllm_at_that_size_observes(runs: Runs) -> None:
    _, predicted = runs.engine_core("today")
    errors = {(tier, "1"): predicted[tier, "1"] - runs.share("today", tier) for tier in ("device", "host")}
    for label, ((tier, factor), _, _) in RUNS.items():
        if label != "today":
            errors[tier, factor] = predicted[tier, factor] - runs.share(label, tier)
    report = {key: round(100 * error, 1) for key, error in errors.items()}
    assert all(abs(error) <= 0.02 for (_, factor), error in errors.items() if factor == "1"), report
    assert all(abs(error) <= 0.03 for error in errors.values()), report
