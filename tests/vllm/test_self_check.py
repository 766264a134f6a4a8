"""The vLLM adapter's self-check: vLLM's worker role keeps its own transfer counters in the same process, and every
mismatch between them and what the adapter recorded is counted (``otel_hicache.engine.mismatch``), with one warning
per instrument, so an adapter that undercounts after a vLLM change says so."""

from __future__ import annotations

import logging

import pytest

from otel_hicache.testing.sdk import Sdk
from tests.vllm import support

pytestmark = pytest.mark.vllm

MISMATCH = "otel_hicache.engine.mismatch"


def test_a_run_the_adapter_reports_in_full_has_no_mismatch(instrumented: Sdk) -> None:
    engine = support.engine()
    support.run_workload(engine)
    assert engine.vllm_stats()["vllm:kv_offload_store_bytes"] > 0
    assert sum(instrumented.counters()[MISMATCH].values()) == 0


def test_a_vllm_change_the_adapter_misses_is_counted_as_a_mismatch_with_one_warning(
    instrumented: Sdk, caplog: pytest.LogCaptureFixture
) -> None:
    """Simulated: a vLLM release that completes jobs without ``mark_completed`` (the adapter's hook sees no
    completion, so it reports no transfer) while vLLM still counts the bytes and time."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    ours = vars(OffloadingWorkerMetadata)["mark_completed"]
    # ours goes back before the fixture uninstruments (a monkeypatch, undone after it, would leave it on the class)
    with (
        support.restored(OffloadingWorkerMetadata, "mark_completed", ours),
        caplog.at_level(logging.WARNING, "otel_hicache"),
    ):
        OffloadingWorkerMetadata.mark_completed = ours.__wrapped__  # vLLM's own, without our hook
        engine = support.engine()
        engine.store_together({"a": [0], "b": [1, 2]})  # one step: one hand-over to the scheduler
        assert engine.vllm_stats()["vllm:kv_offload_store_bytes"] > 0
        assert instrumented.spans("hicache.backup") == []
        counted = instrumented.counters()[MISMATCH]
        assert counted[("hicache.transfer.size",)] == counted[("hicache.transfer.duration",)] == 1
        assert instrumented.counters()[MISMATCH] == counted  # the same difference is not counted again

        engine.store_together({"c": [3]})  # the difference grows: one more
        counted = instrumented.counters()[MISMATCH]
        assert counted[("hicache.transfer.size",)] == counted[("hicache.transfer.duration",)] == 2
    warnings = [r.getMessage() for r in caplog.records if "disagrees with the engine" in r.getMessage()]
    assert sorted(w.split()[1] for w in warnings) == ["hicache.transfer.duration", "hicache.transfer.size"]


def test_a_transfer_the_adapter_never_noted_is_a_mismatch_also_in_steps_that_skip_our_get_finished(
    instrumented: Sdk,
) -> None:
    """Simulated: a vLLM release that submits jobs without ``handle_preemptions`` (the adapter notes none). With none
    of our transfers pending, the worker's steps skip our ``get_finished``; vLLM's count of what it finished (every
    ``DirectionalTransferStats.record``) still reaches the self-check, as vLLM makes it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker

    engine = support.engine()
    engine._step()  # nothing pending: the worker's later steps call vLLM's get_finished directly
    worker = engine.worker.connector_worker
    assert "get_finished" in vars(worker)
    ours = vars(OffloadingConnectorWorker)["handle_preemptions"]
    with support.restored(OffloadingConnectorWorker, "handle_preemptions", ours):
        OffloadingConnectorWorker.handle_preemptions = ours.__wrapped__  # vLLM's own, without our hook
        engine.store_together({"a": [0], "b": [1, 2]})
    assert engine.transfer_stats.store.bytes == 0  # handed to the scheduler at the step's end
    assert engine.vllm_stats()["vllm:kv_offload_store_bytes"] > 0
    assert instrumented.spans("hicache.backup") == []
    counted = instrumented.counters()[MISMATCH]
    assert counted[("hicache.transfer.size",)] == counted[("hicache.transfer.duration",)] == 1
