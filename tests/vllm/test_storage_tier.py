"""vLLM's storage tiers: its tiering spec (a CPU primary tier of 4 chunks, its filesystem tier in a temporary folder)
under vLLM's real scheduler, stepped with its connector and a worker copying real blocks (:mod:`tests.vllm.stepping`,
``HostCopyTieringSpec``). The CPU tier evicts; the filesystem tier keeps every chunk cascaded to it and promotes it
back when a prompt comes again. Every ``hicache.*`` series of tier ``storage`` equals vLLM's own, read where vLLM's
stat loggers read them (each step's ``kv_connector_stats`` and connector prefix-cache stats)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from otel_hicache import semconv as sc
from otel_hicache.testing.sdk import Sdk
from tests.vllm import stepping

pytestmark = pytest.mark.vllm

CHUNK_TOKENS = stepping.support.BLOCK_SIZE  # one block per chunk


@pytest.fixture
def tiered(instrumented: Sdk, tmp_path: Path) -> Iterator[stepping.Stepper]:
    """An engine whose CPU tier (4 chunks) cascades to vLLM's filesystem tier under ``tmp_path``."""
    fs = {"type": "fs", "root_dir": str(tmp_path / "fs"), "n_read_threads": 2, "n_write_threads": 2}
    engine = stepping.stepper(cpu_chunks=4, spec_name="HostCopyTieringSpec", secondary_tiers=[fs])
    yield engine
    engine.worker.connector_worker.spec.release()  # the worker's side of the shared region, then the scheduler's
    engine.connector.manager.shutdown()


def serve(engine: stepping.Stepper, requests: int = 9) -> None:
    """``requests`` prompts of 3 blocks over three prefixes, one at a time: each comes back after the CPU tier
    evicted it (4 chunks hold one prompt)."""
    for request in range(requests):
        engine.add(f"r{request}", stepping.prompt(request % 3, blocks=3))
        engine.run(steps=400, pause_s=0.002)


def vllm_counters(engine: stepping.Stepper) -> Counter[tuple[str, tuple[str, ...]]]:
    """vLLM's offloading counters, summed over every step's ``kv_connector_stats``, by (name, labels)."""
    total: Counter[tuple[str, tuple[str, ...]]] = Counter()
    for outputs in engine.outputs:
        for output in outputs.values():
            stats = (output.scheduler_stats.kv_connector_stats if output.scheduler_stats else None) or {}
            for name, by_labels in stats.get("data", {}).items():
                if stats["types"].get(name) == "counter":
                    for labels, value in by_labels.items():
                        total[name, labels] += value
    return total


def vllm_hits_by_source(engine: stepping.Stepper) -> Counter[str]:
    """The prompt tokens vLLM's connector served, by source, summed over every step's connector prefix-cache stats."""
    total: Counter[str] = Counter()
    for outputs in engine.outputs:
        for output in outputs.values():
            stats = output.scheduler_stats.connector_prefix_cache_stats if output.scheduler_stats else None
            for source, tokens in (getattr(stats, "hits_by_source", None) or {}).items():
                total[str(getattr(source, "value", source))] += tokens
    return total


def test_transfers_to_and_from_the_filesystem_tier_equal_vllms_tiering_metrics(
    instrumented: Sdk, tiered: stepping.Stepper
) -> None:
    serve(tiered)
    vllm = vllm_counters(tiered)
    tier = ("1:fs",)
    written, read = vllm["vllm:kv_offload_tiering_write_bytes", tier], vllm["vllm:kv_offload_tiering_read_bytes", tier]
    assert written > 0 and read > 0  # the workload cascades and promotes
    size: Counter[str] = Counter()
    for (operation, *_), value in instrumented.counters()[sc.METRIC_TRANSFER_SIZE].items():
        size[operation] += value
    assert size["storage_backup"] == written and size["storage_prefetch"] == read
    tokens = instrumented.counters()[sc.METRIC_TRANSFER_TOKENS]
    chunk_bytes = tiered.connector.manager._metrics._primary_chunk_size  # what vLLM multiplies its chunks by
    assert tokens[("storage_backup", "kv")] == written // chunk_bytes * CHUNK_TOKENS
    assert tokens[("storage_prefetch", "kv")] == read // chunk_bytes * CHUNK_TOKENS
    durations = {
        dict(attrs)[sc.ATTR_OPERATION]: point.sum
        for attrs, point in instrumented.points(sc.METRIC_TRANSFER_DURATION).items()
    }
    assert durations["storage_backup"] == pytest.approx(vllm["vllm:kv_offload_tiering_write_time", tier], rel=1e-9)
    assert durations["storage_prefetch"] == pytest.approx(vllm["vllm:kv_offload_tiering_read_time", tier], rel=1e-9)
    spans = [dict(span.attributes or {}) for span in instrumented.spans("hicache.storage_prefetch")]
    assert spans
    assert sum(int(str(span[sc.ATTR_TOKENS])) for span in spans) == tokens[("storage_prefetch", "kv")]
    # the request's split: the tokens vLLM's connector served from the disk tier are our storage_hit
    prefill = instrumented.counters()[sc.METRIC_PREFILL_TOKENS]
    assert prefill[(sc.PrefillMode.STORAGE_HIT.value,)] == vllm_hits_by_source(tiered)["disk"] > 0


def test_failed_jobs_are_failures_by_reason_as_vllm_counts_them(instrumented: Sdk, tiered: stepping.Stepper) -> None:
    """Real faults of the filesystem tier: its block files cut short after they were written (a promotion reading
    them fails), then its directory turned into a file (every cascade fails)."""
    tier = tiered.connector.manager.secondary_tiers[0]
    serve(tiered, requests=3)  # three prompts cascaded
    directory = Path(f"{tier.file_mapper.base_path}_r{tier.file_mapper.rank}")
    blocks = list(directory.rglob("*.bin"))
    assert blocks
    for block in blocks:
        block.write_bytes(b"")
    serve(tiered, requests=3)  # each comes back: found, but unreadable
    for path in sorted(directory.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    directory.rmdir()
    directory.write_text("not a directory")
    for request in range(3, 6):  # new prompts: their cascades cannot be written
        tiered.add(f"new{request}", stepping.prompt(10 + request, blocks=3))
        tiered.run(steps=400, pause_s=0.002)
    vllm = vllm_counters(tiered)
    failures = instrumented.counters()[sc.METRIC_TRANSFER_FAILURES]
    read_failed = failures[("storage_prefetch", "storage_read_failed")]
    write_failed = failures[("storage_backup", "storage_write_failed")]
    assert read_failed == vllm["vllm:kv_offload_tiering_promotion_job_failures", ("1:fs",)] > 0
    assert write_failed == vllm["vllm:kv_offload_tiering_cascade_job_failures", ("1:fs",)] > 0
