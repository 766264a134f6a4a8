"""A real vLLM engine, offline: vLLM's ``LLM`` (main, engine-core and worker processes) serving the tiny model with
its CPU tier, our plugin loaded by vLLM itself in each process, exporting over OTLP into the in-process receiver.

The workload (:mod:`tests.vllm.offline_app`), one request at a time, each prompt five blocks: prompts 1, 2, 3, then
1 again, then 4, 5, 6. The engine's KV cache holds two prompts and the CPU tier three (15 chunks of one block), in
vLLM's LRU order (a request's chunks are used again when it finishes). So, derived from that alone:

* prompt 1 has left the engine's cache when it comes back: its KV is loaded from the CPU tier, and it is the one
  request that waits for a load;
* prompt 4 evicts prompt 2's chunks (never read), prompt 5 prompt 3's (never read), prompt 6 prompt 1's (read by the
  load): 15 entries, 10 unread chunks wasted, each idle from its last use (prompt 2's and 3's store, prompt 1's load)
  to its eviction.

Everything the plugin exported is compared with vLLM's own metrics, as its stat loggers hold them in the main process
(``prometheus_client.REGISTRY``), and with what the workload implies.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from otel_hicache.semconv import PrefillMode
from otel_hicache.testing.otlp_receiver import OtlpReceiver
from otel_hicache.testing.vllm import BLOCK_BYTES, BLOCK_TOKENS, PROMPT_TOKENS, environment
from tests.vllm.engine import (
    DIRECTIONS,
    Exported,
    assert_prefill_split_equals_vllms,
    assert_transfers_equal_vllms,
    holds_what_vllm_counted,
    needs_cpu_build,
    otlp_environment,
    run_offline,
    vllm_total,
)
from tests.vllm.offline_app import result

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), needs_cpu_build]

CPU_CHUNKS = 15
REQUESTS = (1, 2, 3, 1, 4, 5, 6)
CHUNKS_PER_PROMPT = PROMPT_TOKENS // BLOCK_TOKENS
DISTINCT_PROMPTS = 6


@dataclass
class Run:
    exported: Exported
    pid: int  # the LLM's (main) process
    requests: list[dict[str, Any]]
    vllm: dict[str, float]  # vLLM's metrics at the end
    log: str  # what its processes wrote (stdout and stderr)

    def vllm_total(self, name: str, **labels: str) -> float:
        return vllm_total(self.vllm, name, **labels)

    def between(self, used: int, evicted: int) -> tuple[float, float]:
        """Bounds on the idle time of a chunk last used during request ``used`` and evicted during ``evicted``."""
        first, last = self.requests[used], self.requests[evicted]
        return last["start"] - first["end"], last["end"] - first["start"]


@pytest.fixture(scope="module")
def offline(tiny_model: Path) -> Iterator[Run]:
    with OtlpReceiver() as receiver:
        env = environment(**otlp_environment(receiver, "vllm-offline"))
        requests = ",".join(map(str, REQUESTS))
        log = run_offline(tiny_model, env, "--cpu-chunks", str(CPU_CHUNKS), "--requests", requests)
        out = result(log)
        run = Run(Exported(receiver), out["pid"], out["requests"], out["metrics"], log)
        # the engine's processes export their last window as they end
        assert run.exported.wait(
            lambda: holds_what_vllm_counted(run.exported, run.vllm) and run.exported.total("hicache.pool.limit") > 0,
            timeout_s=60,
        )
        yield run


def test_a_prefix_evicted_from_the_engines_cache_comes_back_from_the_cpu_tier(offline: Run) -> None:
    first, again = offline.requests[0], offline.requests[3]
    assert [r["cached"] for r in offline.requests] == [0, 0, 0, PROMPT_TOKENS, 0, 0, 0]
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
    assert offline.exported.total("hicache.pool.usage", {**host, "hicache.slot.state": "used"}) == (
        CPU_CHUNKS * BLOCK_TOKENS  # prompts 4, 5, 6
    )


def test_the_tier_split_of_every_prefill_equals_vllms_own(offline: Run) -> None:
    split = assert_prefill_split_equals_vllms(offline.exported, offline.vllm)
    assert split["host_hit"] == PROMPT_TOKENS  # the returning prompt; none was still in the engine's cache


def test_the_one_request_that_loaded_from_the_cpu_tier_is_the_one_that_waited(offline: Run) -> None:
    (waits,) = [p for attrs, p in offline.exported.points("hicache.request.kv_wait") if p.count]
    again = offline.requests[3]
    assert waits.count == 1
    assert 0 < waits.sum <= again["end"] - again["start"]
    assert {a["hicache.tier"] for a, p in offline.exported.points("hicache.request.kv_wait") if p.count} == {"host"}


def test_evictions_say_which_chunks_a_load_read_how_long_they_sat_idle_and_what_was_stored_in_vain(
    offline: Run,
) -> None:
    def evicted(reused: bool) -> float:
        where = {"hicache.tier": "host", "hicache.eviction.reused": reused}
        return offline.exported.total("hicache.eviction.tokens", where)

    assert (evicted(True), evicted(False)) == (PROMPT_TOKENS, 2 * PROMPT_TOKENS)  # prompt 1's; prompts 2's and 3's
    assert offline.exported.total("hicache.eviction.tokens") == 3 * PROMPT_TOKENS  # none of unknown reuse
    wasted = offline.exported.total("hicache.wasted.size", {"hicache.operation": "backup"})
    assert wasted == 2 * CHUNKS_PER_PROMPT * BLOCK_BYTES
    assert wasted == offline.vllm_total("vllm:kv_offload_store_bytes_total") * 2 / DISTINCT_PROMPTS
    count = offline.exported.total("hicache.eviction.age", {"hicache.tier": "host"}, field="count")
    idle = offline.exported.total("hicache.eviction.age", {"hicache.tier": "host"}, field="sum")
    # prompt 2 stored at request 1, evicted at 4; prompt 3 stored at 2, evicted at 5; prompt 1 read at 3, evicted at 6
    bounds = [offline.between(1, 4), offline.between(2, 5), offline.between(3, 6)]
    assert count == 3 * CHUNKS_PER_PROMPT
    assert CHUNKS_PER_PROMPT * sum(low for low, _ in bounds) <= idle <= CHUNKS_PER_PROMPT * sum(h for _, h in bounds)


def test_every_series_stays_within_its_closed_attribute_sets(offline: Run) -> None:
    closed: dict[str, dict[str, set[Any]]] = {
        "hicache.eviction.tokens": {
            "hicache.tier": {"device", "host", "storage"},
            "hicache.eviction.reused": {True, False},
        },
        "hicache.eviction.age": {"hicache.tier": {"device", "host", "storage"}},
        "hicache.request.kv_wait": {"hicache.tier": {"host", "storage"}},
        "hicache.wasted.size": {"hicache.operation": {"backup", "storage_backup", "load_back"}},
        "hicache.prefill.tokens": {"hicache.prefill.mode": {m.value for m in PrefillMode}},
    }
    for name, sets in closed.items():
        points = offline.exported.points(name)
        assert points, name
        for attrs, _ in points:
            assert set(attrs) <= set(sets) and all(attrs[k] in sets[k] for k in attrs), (name, attrs)


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


def test_every_target_fits_this_vllm_in_each_of_its_processes_and_nothing_of_ours_failed(offline: Run) -> None:
    """No process warned of a target left unpatched, a module missing or a hook of ours that failed."""
    assert [line for line in offline.log.splitlines() if "otel_hicache: " in line] == []
