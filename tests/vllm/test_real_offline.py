"""A real vLLM engine, offline: vLLM's ``LLM`` (main, engine-core and worker processes) serving the tiny model with
its CPU tier, our plugin loaded by vLLM itself in each process, exporting over OTLP into the in-process receiver.

The workload (:mod:`tests.vllm.offline_app`): prompts 1, 2, 3, then 1 again, one at a time. The engine's KV cache
holds two prompts, so prompt 1 has left it when it comes back, and its KV comes back from the CPU tier (16 chunks:
room for every prompt's five blocks, no eviction). Everything the plugin exported is compared with vLLM's own
metrics, as its stat loggers hold them in the main process (``prometheus_client.REGISTRY``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from otel_hicache.testing.otlp_receiver import OtlpReceiver
from tests.vllm.engine import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    DIRECTIONS,
    PROMPT_TOKENS,
    ROOT,
    Exported,
    assert_transfers_equal_vllms,
    environment,
    holds_what_vllm_counted,
    otlp_environment,
    vllm_total,
)
from tests.vllm.offline_app import result

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CPU_CHUNKS = 16
REQUESTS = (1, 2, 3, 1)
DISTINCT_PROMPTS = 3


@dataclass
class Run:
    exported: Exported
    pid: int  # the LLM's (main) process
    requests: list[dict[str, Any]]
    vllm: dict[str, float]  # vLLM's metrics at the end

    def vllm_total(self, name: str, **labels: str) -> float:
        return vllm_total(self.vllm, name, **labels)


@pytest.fixture(scope="module")
def offline(tiny_model: Path) -> Iterator[Run]:
    with OtlpReceiver() as receiver:
        done = subprocess.run(
            [sys.executable, "-m", "tests.vllm.offline_app", str(tiny_model), "--cpu-chunks", str(CPU_CHUNKS),
             "--requests", ",".join(map(str, REQUESTS))],
            cwd=ROOT, env=environment(**otlp_environment(receiver, "vllm-offline")), capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out = result(done.stdout)
        run = Run(Exported(receiver), out["pid"], out["requests"], out["metrics"])
        # the engine's processes export their last window as they end
        assert run.exported.wait(
            lambda: holds_what_vllm_counted(run.exported, run.vllm) and run.exported.total("hicache.pool.limit") > 0,
            timeout_s=60,
        )
        yield run


def test_a_prefix_evicted_from_the_engines_cache_comes_back_from_the_cpu_tier(offline: Run) -> None:
    first, *_, again = offline.requests
    assert [r["cached"] for r in offline.requests] == [0, 0, 0, PROMPT_TOKENS]
    assert again["text"] == first["text"]
    assert offline.vllm_total("vllm:prompt_tokens_cached_by_source_total", source="host") == PROMPT_TOKENS
    assert offline.exported.total("hicache.transfer.tokens", {"hicache.operation": "load_back"}) == PROMPT_TOKENS


@pytest.mark.parametrize(("operation", "direction"), DIRECTIONS)
def test_transfer_bytes_time_and_count_equal_vllms_own_metrics(offline: Run, operation: str, direction: str) -> None:
    assert_transfers_equal_vllms(offline.exported, offline.vllm, operation, direction)


def test_tokens_are_the_blocks_vllm_moved(offline: Run) -> None:
    """Each distinct prompt's five full blocks are stored once; the returning prompt's five are loaded."""
    stored = offline.exported.total("hicache.transfer.tokens", {"hicache.operation": "backup"})
    assert stored == DISTINCT_PROMPTS * PROMPT_TOKENS
    assert stored == offline.vllm_total("vllm:kv_offload_store_bytes_total") / BLOCK_BYTES * BLOCK_TOKENS


def test_the_cpu_tiers_capacity_and_occupancy_are_its_chunks_in_tokens(offline: Run) -> None:
    host = {"hicache.tier": "host", "hicache.pool": "kv"}
    assert offline.exported.total("hicache.pool.limit", host) == CPU_CHUNKS * BLOCK_TOKENS
    used = offline.exported.total("hicache.pool.usage", {**host, "hicache.pool.state": "used"})
    assert used == DISTINCT_PROMPTS * PROMPT_TOKENS
    assert offline.exported.total("hicache.eviction.tokens") == 0


def test_vllm_loads_the_plugin_in_its_engine_core_and_worker_which_report_as_vllm(offline: Run) -> None:
    """The worker reports the transfers, the engine core (the scheduler) the CPU tier; the main process, which never
    offloads, builds nothing."""
    resources = {r["process.pid"]: r for r in offline.exported.resources("hicache.transfer.size")}
    (engine_core,) = {r["process.pid"] for r in offline.exported.resources("hicache.pool.limit")}
    (worker,) = set(resources) - {engine_core}
    assert offline.pid not in resources
    assert {r["hicache.engine"] for r in resources.values()} == {"vllm"}
    assert {r["service.name"] for r in resources.values()} == {"vllm-offline"}
    assert resources[worker]["hicache.rank.tp"] == 0
