"""A real vLLM OpenAI server with tensor parallelism 2: its API-server, engine-core and two worker processes serve
the tiny model with its CPU tier, our plugin loaded by vLLM itself in each, exporting over OTLP into the in-process
receiver; compared with vLLM's own ``/metrics``.

The workload is the offline test's (prompts 1, 2, 3, then 1 again from the CPU tier; no eviction), sent over HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from otel_hicache.testing.otlp_receiver import OtlpReceiver
from tests.vllm.engine import (
    BLOCK_TOKENS,
    DIRECTIONS,
    PROMPT_TOKENS,
    Exported,
    Server,
    assert_transfers_equal_vllms,
    environment,
    holds_what_vllm_counted,
    otlp_environment,
    prompt,
    serve,
    vllm_total,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CPU_CHUNKS = 16
TP = 2
HOST = {"hicache.tier": "host", "hicache.pool": "kv"}


@dataclass
class Run:
    server: Server
    exported: Exported
    idle: tuple[float, float]  # the CPU tier's (capacity, occupancy) exported before any request
    texts: list[str]
    vllm: dict[str, float]  # vLLM's /metrics after the workload

    def vllm_total(self, name: str, **labels: str) -> float:
        return vllm_total(self.vllm, name, **labels)


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[Run]:
    with (
        OtlpReceiver() as receiver,
        serve(tiny_model, CPU_CHUNKS, environment(**otlp_environment(receiver, "vllm-server")), tp=TP) as server,
    ):
        exported = Exported(receiver)
        # the engine core reports its CPU tier from the start: no transfer, no eviction needed
        assert exported.wait(lambda: exported.total("hicache.pool.limit", HOST) > 0, timeout_s=60)
        idle = (
            exported.total("hicache.pool.limit", HOST),
            exported.total("hicache.pool.usage", {**HOST, "hicache.pool.state": "used"}),
        )
        texts = [server.complete(prompt(seed))["choices"][0]["text"] for seed in (1, 2, 3, 1)]
        for word in ("w1", "w2"):  # the steps that submit and finish the last prompt's stores
            server.complete(word, max_tokens=1)
        vllm = server.metrics()
        run = Run(server, exported, idle, texts, vllm)
        assert exported.wait(lambda: holds_what_vllm_counted(exported, vllm), timeout_s=60)
        yield run


def test_the_cpu_tiers_capacity_and_occupancy_are_exported_while_the_server_runs_evictions_or_not(
    served: Run,
) -> None:
    assert served.idle == (CPU_CHUNKS * BLOCK_TOKENS, 0)
    assert served.exported.wait(
        lambda: served.exported.total("hicache.pool.usage", {**HOST, "hicache.pool.state": "used"}) == 3 * PROMPT_TOKENS
    )
    assert served.exported.total("hicache.eviction.tokens") == 0


def test_a_prefix_evicted_from_the_engines_cache_comes_back_from_the_cpu_tier(served: Run) -> None:
    assert served.texts[3] == served.texts[0]
    assert served.vllm_total("vllm:prompt_tokens_cached_by_source_total", source="host") == PROMPT_TOKENS
    assert served.exported.total("hicache.transfer.tokens", {"hicache.operation": "load_back"}) == PROMPT_TOKENS


@pytest.mark.parametrize(("operation", "direction"), DIRECTIONS)
def test_bytes_time_and_count_summed_over_the_workers_equal_vllms_own_metrics(
    served: Run, operation: str, direction: str
) -> None:
    """vLLM counts a transfer per worker (each rank copies its own heads) and sums its workers, as we do."""
    assert_transfers_equal_vllms(served.exported, served.vllm, operation, direction)


def test_each_worker_rank_reports_its_bytes_and_only_rank_0_the_logical_tokens(served: Run) -> None:
    (engine_core,) = {r["process.pid"] for r in served.exported.resources("hicache.pool.limit")}
    sizes = served.exported.latest("hicache.transfer.size")
    workers = {resource["hicache.rank.tp"]: pid for pid, (resource, _) in sizes.items() if pid != engine_core}
    assert sorted(workers) == [0, 1]
    backup = {"hicache.operation": "backup"}
    assert all(served.exported.total("hicache.transfer.size", backup, pids={pid}) > 0 for pid in workers.values())
    reporting_tokens = set(served.exported.latest("hicache.transfer.tokens"))
    assert workers[0] in reporting_tokens and workers[1] not in reporting_tokens
    assert served.exported.total("hicache.transfer.tokens", backup) == 3 * PROMPT_TOKENS  # logical, not x TP
    assert served.server.process.pid not in sizes  # the API server never offloads: it builds nothing
