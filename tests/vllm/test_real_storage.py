"""A real vLLM engine with a storage tier: vLLM's ``LLM`` (main, engine-core and worker processes) serving the tiny
model with vLLM's tiering - a CPU primary tier of one prompt (5 chunks of one block) and vLLM's filesystem tier in a
temporary folder behind it - our plugin loaded by vLLM in each process, exporting over OTLP into the in-process
receiver.

The workload, one request at a time, each prompt five blocks: prompts 1, 2, 3, then 1 again. The engine's KV cache
holds two prompts and the CPU tier one, so when prompt 1 comes back it has left both: vLLM's filesystem tier, which
every prompt's chunks were cascaded to, promotes them to the CPU tier and the connector loads them from there. Every
series of tier ``storage`` is compared with vLLM's own metrics as its stat loggers hold them in the main process.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from otel_hicache.testing.otlp_receiver import OtlpReceiver
from otel_hicache.testing.vllm import PROMPT_TOKENS, environment
from tests.vllm.engine import Exported, needs_cpu_build, otlp_environment, run_offline, vllm_total
from tests.vllm.offline_app import result

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), needs_cpu_build]

CPU_CHUNKS = 5
REQUESTS = (1, 2, 3, 1)
FS = {"tier": "1:fs"}


@dataclass
class Run:
    exported: Exported
    requests: list[dict[str, Any]]
    vllm: dict[str, float]

    def vllm_total(self, name: str, **labels: str) -> float:
        return vllm_total(self.vllm, name, **labels)

    def storage(self, name: str, operation: str, field: str = "value") -> float:
        return self.exported.total(name, {"hicache.operation": operation}, field=field)


@pytest.fixture(scope="module")
def tiered(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    storage = tmp_path_factory.mktemp("fs")
    with OtlpReceiver() as receiver:
        env = environment(**otlp_environment(receiver, "vllm-storage"))
        requests = ",".join(map(str, REQUESTS))
        arguments = ("--cpu-chunks", str(CPU_CHUNKS), "--requests", requests, "--storage-dir", str(storage))
        out = result(run_offline(tiny_model, env, *arguments))
        run = Run(Exported(receiver), out["requests"], out["metrics"])
        written = run.vllm_total("vllm:kv_offload_tiering_write_bytes_total", **FS)
        read = run.vllm_total("vllm:kv_offload_tiering_read_bytes_total", **FS)
        # the engine's processes export their last window as they end
        assert run.exported.wait(
            lambda: (
                run.storage("hicache.transfer.size", "storage_backup") == written
                and run.storage("hicache.transfer.size", "storage_prefetch") == read
            ),
            timeout_s=60,
        ), (written, read)
        yield run


def test_a_prompt_evicted_from_the_cpu_tier_comes_back_from_the_filesystem_tier(tiered: Run) -> None:
    first, again = tiered.requests[0], tiered.requests[3]
    assert [r["cached"] for r in tiered.requests] == [0, 0, 0, PROMPT_TOKENS]
    assert again["text"] == first["text"]  # the KV that came back from disk is the KV that was stored
    assert tiered.vllm_total("vllm:prompt_tokens_cached_by_source_total", source="disk") == PROMPT_TOKENS
    prefill = tiered.exported.total("hicache.prefill.tokens", {"hicache.prefill.mode": "storage_hit"})
    assert prefill == PROMPT_TOKENS


def test_storage_transfers_equal_vllms_tiering_metrics(tiered: Run) -> None:
    written = tiered.vllm_total("vllm:kv_offload_tiering_write_bytes_total", **FS)
    read = tiered.vllm_total("vllm:kv_offload_tiering_read_bytes_total", **FS)
    assert written > 0 and read > 0
    assert tiered.storage("hicache.transfer.size", "storage_backup") == written
    assert tiered.storage("hicache.transfer.size", "storage_prefetch") == read
    for operation, direction in (("storage_backup", "write"), ("storage_prefetch", "read")):
        seconds = tiered.vllm_total(f"vllm:kv_offload_tiering_{direction}_time_total", **FS)
        ours = tiered.storage("hicache.transfer.duration", operation, field="sum")
        assert ours == pytest.approx(seconds, rel=1e-6), operation
    # the returning prompt's five blocks were promoted; each distinct prompt's five were cascaded
    assert tiered.storage("hicache.transfer.tokens", "storage_prefetch") == PROMPT_TOKENS
    assert tiered.storage("hicache.transfer.tokens", "storage_backup") == 3 * PROMPT_TOKENS
    assert tiered.exported.total("hicache.transfer.failures") == 0
