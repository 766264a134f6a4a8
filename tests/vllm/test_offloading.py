"""vLLM's real KV offloading connector, instrumented: every hicache.* value equals what vLLM's own offloading
metrics hold for the same run (bytes and time per direction, transfer count), spans carry the same bytes and blocks,
and the CPU tier's occupancy is the manager's.

vLLM's side is read where vLLM's stat loggers read it: the scheduler role's ``get_kv_connector_stats()``
(``OffloadingConnectorStats``, reduced as vLLM's logging stat logger does), after the worker role's metadata went
through the scheduler role's ``update_connector_output``.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan

from otel_hicache._internal.host.worker import HOST_THREAD_NAME
from otel_hicache.integrations.vllm import hooks, per_request
from otel_hicache.testing.sdk import Sdk
from tests.vllm import stepping, support

pytestmark = pytest.mark.vllm

BACKUP = {"hicache.operation": "backup"}
LOAD_BACK = {"hicache.operation": "load_back"}


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def duration(otel: Sdk, operation: dict[str, str]) -> tuple[float, int]:
    points = [p for attrs, p in otel.points("hicache.transfer.duration").items() if set(operation.items()) <= attrs]
    return sum(p.sum for p in points), sum(p.count for p in points)


def size(otel: Sdk, operation: dict[str, str]) -> int:
    return sum(p.value for attrs, p in otel.points("hicache.transfer.size").items() if set(operation.items()) <= attrs)


def test_bytes_time_and_count_per_direction_equal_vllms_own_offload_metrics(instrumented: Sdk) -> None:
    engine = support.engine()
    support.run_workload(engine)
    vllm = engine.vllm_stats()

    assert size(instrumented, BACKUP) == vllm["vllm:kv_offload_store_bytes"] > 0
    assert size(instrumented, LOAD_BACK) == vllm["vllm:kv_offload_load_bytes"] > 0
    store_time, stores = duration(instrumented, BACKUP)
    load_time, loads = duration(instrumented, LOAD_BACK)
    assert store_time == pytest.approx(vllm["vllm:kv_offload_store_time"], rel=1e-9)
    assert load_time == pytest.approx(vllm["vllm:kv_offload_load_time"], rel=1e-9)
    assert (
        (stores, loads) == (vllm["vllm:kv_offload_store_size_count"], vllm["vllm:kv_offload_load_size_count"]) == (3, 2)
    )
    # a worker that is not vLLM's CUDA one times on the host
    sources = {
        dict(a)["hicache.timing.source"] for a, p in instrumented.points("hicache.transfer.size").items() if p.value
    }
    assert sources == {"host_clock"}


def test_spans_carry_each_transfers_bytes_blocks_and_tokens(instrumented: Sdk) -> None:
    engine = support.engine()
    support.run_workload(engine)
    vllm = engine.vllm_stats()
    page = support.ATTENTION.page_size_bytes * len(support.LAYERS)  # one GPU block, every layer

    backups = instrumented.spans("hicache.backup")
    loads = instrumented.spans("hicache.load_back")
    assert [attributes(s)["hicache.transfer.nodes"] for s in backups] == [1, 3, 5]
    assert [attributes(s)["hicache.transfer.nodes"] for s in loads] == [3, 5]
    for span in backups + loads:
        blocks = attributes(span)["hicache.transfer.nodes"]
        assert attributes(span)["hicache.transfer.byte_count"] == blocks * page
        assert attributes(span)["hicache.transfer.tokens.kv"] == blocks * support.BLOCK_SIZE
        assert span.start_time is not None and span.end_time is not None and span.start_time <= span.end_time
    assert sum(attributes(s)["hicache.transfer.byte_count"] for s in backups) == vllm["vllm:kv_offload_store_bytes"]
    assert sum(attributes(s)["hicache.transfer.byte_count"] for s in loads) == vllm["vllm:kv_offload_load_bytes"]
    assert sum(attributes(s)["hicache.transfer.copy_duration"] for s in backups) == pytest.approx(
        vllm["vllm:kv_offload_store_time"], rel=1e-9
    )
    tokens = instrumented.counters()["hicache.transfer.tokens"]
    assert sum(v for k, v in tokens.items() if "backup" in k) == 9 * support.BLOCK_SIZE


def test_a_finished_transfer_is_only_queued_by_the_workers_step_and_built_on_the_host_thread(
    instrumented: Sdk, monkeypatch: pytest.MonkeyPatch
) -> None:
    built_on: list[str] = []
    build = hooks._built

    def noted(payload: Any) -> Any:
        built_on.append(threading.current_thread().name)
        return build(payload)

    monkeypatch.setattr(hooks, "_built", noted)
    engine = support.engine()
    support.run_workload(engine)

    assert len(instrumented.spans("hicache.backup") + instrumented.spans("hicache.load_back")) == 5
    assert built_on == [HOST_THREAD_NAME] * 5  # none on the worker's thread, where vLLM's next forward waits


def test_a_worker_step_with_nothing_to_do_goes_through_one_wrapper_of_ours(instrumented: Sdk) -> None:
    """The step's first call (handle_preemptions) is wrapped every step; its later calls skip ours when they have
    nothing to do, and vLLM's hand-over of its counts (build_connector_worker_meta) is not wrapped: the self-check
    reads each count as vLLM makes it (test_self_check). Each wrapped call costs a step ~10 us cold."""
    engine = support.engine()
    engine._step()  # the first step decides what the later ones skip
    with support.WrappedCalls() as wrapped:
        engine._step()
        engine._step()
    assert wrapped.take() == {"OffloadingConnectorWorker.handle_preemptions": 2}


def test_a_workers_step_enters_our_later_wrappers_only_when_they_have_something_to_do(instrumented: Sdk) -> None:
    """handle_preemptions, the first of a step's calls, notes the step's transfers: start_kv_transfers' wrapper runs
    only in a step with loads, get_finished's only while a transfer is pending (each wrapped call costs the step
    ~10 us cold), and every transfer is still reported as vLLM counts it."""
    engine = support.engine()
    with support.Entered(hooks.OffloadHooks, "start_kv_transfers", "get_finished") as entered:
        engine._step()  # nothing to submit, nothing pending
        assert entered.take() == {}
        keys = engine.store("a", [0, 1])  # noted in its step, submitted and finished in the next
        assert keys is not None
        assert entered.take() == {"get_finished": 2}
        engine._step()
        assert entered.take() == {}
        engine.load("a", keys, [10, 11])  # submitted and finished in its step
        assert entered.take() == {"start_kv_transfers": 1, "get_finished": 1}
        engine._step()
        assert entered.take() == {}

    vllm = engine.vllm_stats()
    assert size(instrumented, BACKUP) == vllm["vllm:kv_offload_store_bytes"] > 0
    assert size(instrumented, LOAD_BACK) == vllm["vllm:kv_offload_load_bytes"] > 0


def test_a_worker_that_skipped_our_wrappers_calls_vllms_own_after_uninstrument_and_ours_after_instrument(
    instrumented: Sdk,
) -> None:
    from otel_hicache.integrations.vllm import VLLMOffloadInstrumentor

    engine = support.engine()
    keys = engine.store("a", [0, 1])
    assert keys is not None
    engine._step()  # no load, none pending: skips both
    worker = engine.worker.connector_worker
    assert {"start_kv_transfers", "get_finished"} <= set(vars(worker))

    VLLMOffloadInstrumentor().uninstrument()
    assert not {"start_kv_transfers", "get_finished"} & set(vars(worker))
    VLLMOffloadInstrumentor().instrument(telemetry=instrumented.telemetry)
    engine.load("a", keys, [10, 11])

    assert len(instrumented.spans("hicache.load_back")) == 1
    assert len(instrumented.spans("hicache.backup")) == 1


def test_with_vllms_tracing_off_a_connectors_steps_skip_our_link_wrapper_until_a_traced_request(
    instrumented: Sdk,
) -> None:
    """build_connector_meta's wrapper links each job to its request span, which only vLLM's tracing makes: without
    it, the connector's steps after the first call vLLM's method directly; a traced request brings the wrapper back."""
    engine = stepping.stepper()
    engine.add("a", list(range(40)), max_tokens=3)
    with support.Entered(per_request.RequestHooks, "build_connector_meta") as entered:
        engine.step()
        engine.step()
        assert entered.take() == {"build_connector_meta": 1}
        engine.scheduler.observability_config.otlp_traces_endpoint = "http://127.0.0.1:9"
        engine.add("b", list(range(100, 140)))
        engine.step()
        assert entered.take() == {"build_connector_meta": 1}


def test_until_the_connector_answers_a_sync_load_a_schedulers_steps_skip_our_sync_wait_wrapper(
    instrumented: Sdk,
) -> None:
    """update_from_output's wrapper reads the workers' waits for sync loads, which only vLLM >= 0.33 makes, and only
    with ``sync_load_budget_bytes``: without one, the scheduler's steps after the first call vLLM's method directly
    (test_kv_wait: a sync load brings the wrapper back)."""
    engine = stepping.stepper()
    engine.add("a", list(range(40)), max_tokens=3)
    with support.Entered(per_request.RequestHooks, "update_from_output") as entered:
        engine.run()
        assert entered.take() == {"update_from_output": 1}
    assert "update_from_output" in vars(engine.scheduler)


def test_cpu_tier_occupancy_is_the_managers_chunks_in_tokens(instrumented: Sdk) -> None:
    engine = support.engine(cpu_chunks=8)
    engine.store("a", [0, 1, 2])
    host = {"hicache.tier": "host", "hicache.pool": "kv"}
    assert instrumented.value("hicache.pool.limit", host) == 8 * support.BLOCK_SIZE
    assert instrumented.value("hicache.pool.usage", {**host, "hicache.slot.state": "used"}) == 3 * support.BLOCK_SIZE


def test_allocation_failures_are_failed_backups_counted_as_vllm_counts_them(instrumented: Sdk) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    engine = support.engine(cpu_chunks=2)
    assert engine.store("a", [0, 1])
    assert engine.store("b", [2, 3, 4]) is None  # vLLM's manager has no room: its scheduler counts a failure
    stats = OffloadingConnectorStats()
    for _ in range(2):  # what the scheduler role does for each store it cannot allocate
        stats.increase_counter("vllm:kv_offload_allocation_failure")
    failures = {"hicache.operation": "backup", "error.type": "host_pool_full"}
    assert (
        instrumented.value("hicache.transfer.failures", failures)
        == stats.reduce()["vllm:kv_offload_allocation_failure"]
        == 2
    )


def test_every_target_fits_this_vllm_and_is_patched_with_no_warning(
    otel: Sdk, caplog: pytest.LogCaptureFixture
) -> None:
    """Each target's declared shape (a plain function whose leading parameters are the ones its wrapper reads) is
    this vLLM's (0.32 or 0.33): the base's shape check lets every one through, exactly once."""
    from otel_hicache.integrations.vllm import VLLMOffloadInstrumentor
    from otel_hicache.integrations.vllm.capacity import CAPACITY_TARGET
    from otel_hicache.integrations.vllm.instrumentor import _TARGETS

    targets = [*(target for target, *_ in _TARGETS), CAPACITY_TARGET]
    modules = [importlib.import_module(t.module) for t in targets]
    holders = [getattr(m, t.owner) if t.owner else m for m, t in zip(modules, targets, strict=True)]
    originals = [vars(holder)[t.attribute] for holder, t in zip(holders, targets, strict=True)]
    instrumentor = VLLMOffloadInstrumentor()
    with caplog.at_level(logging.WARNING, logger="otel_hicache"):
        instrumentor.instrument(telemetry=otel.telemetry)
    try:
        for holder, t, original in zip(holders, targets, originals, strict=True):
            assert getattr(vars(holder)[t.attribute], "__wrapped__", None) is original, t.name
    finally:
        instrumentor.uninstrument()
    assert [r.getMessage() for r in caplog.records] == []
    assert [vars(holder)[t.attribute] for holder, t in zip(holders, targets, strict=True)] == originals


def test_uninstrument_restores_vllms_classes(instrumented: Sdk) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker

    from otel_hicache.integrations.vllm import VLLMOffloadInstrumentor

    assert hasattr(OffloadingConnectorWorker.get_finished, "__wrapped__")
    VLLMOffloadInstrumentor().uninstrument()
    assert not hasattr(OffloadingConnectorWorker.get_finished, "__wrapped__")
    engine = support.engine()
    support.run_workload(engine)
    assert instrumented.spans() == []
    VLLMOffloadInstrumentor().instrument(telemetry=instrumented.telemetry)  # the fixture uninstruments


def host_evictions(otel: Sdk) -> dict[bool | None, int]:
    """Evicted tokens of the CPU tier by ``hicache.eviction.reused`` (None: unknown)."""
    return {reused: n for (tier, reused), n in otel.counters()["hicache.eviction.tokens"].items() if tier == "host"}


def test_chunks_vllms_manager_evicts_are_host_tier_evictions_in_tokens(instrumented: Sdk) -> None:
    engine = support.engine(cpu_chunks=8)
    support.run_workload(engine)  # the third store (5 chunks) finds 4 free: vLLM's LRU policy evicts one chunk
    # the first request's, which no load read
    assert host_evictions(instrumented) == {False: 1 * support.BLOCK_SIZE, True: 0, None: 0}


def test_each_evicted_chunk_says_how_long_it_sat_idle_whether_a_load_read_it_and_what_it_wasted(
    instrumented: Sdk,
) -> None:
    """A tier of four chunks: a and b fill it, a is loaded back, then c and d each evict two chunks in vLLM's LRU
    order (insertion: this harness ends no request, which would refresh it): a's, read, and b's, never read."""
    engine = support.engine(cpu_chunks=4)
    a = engine.store("a", [0, 1])
    assert a is not None and engine.store("b", [2, 3])
    read = time.monotonic()
    engine.load("a", a, [10, 11])
    assert engine.store("c", [4, 5])
    assert engine.store("d", [6, 7])
    since_read = time.monotonic() - read

    two_chunks = 2 * support.BLOCK_SIZE  # tokens: a chunk holds one block
    assert host_evictions(instrumented) == {True: two_chunks, False: two_chunks, None: 0}
    stored = engine.vllm_stats()["vllm:kv_offload_store_bytes"]
    assert instrumented.counters()["hicache.wasted.size"][("backup",)] == stored // 4  # b's two of eight chunks
    (ages,) = instrumented.points("hicache.eviction.age").values()
    assert ages.count == 4
    assert 0 < ages.sum <= 2 * since_read + 2 * (time.monotonic() - read)


def test_a_store_flushed_at_preemption_is_one_transfer_as_vllm_counts_it(instrumented: Sdk) -> None:
    engine = support.engine()
    assert engine.store("a", [0, 1], flush=True)  # submitted and waited for by handle_preemptions
    assert engine.store("b", [2])
    vllm = engine.vllm_stats()
    backups = instrumented.spans("hicache.backup")
    assert [attributes(s)["hicache.transfer.nodes"] for s in backups] == [2, 1]
    assert sum(attributes(s)["hicache.transfer.byte_count"] for s in backups) == vllm["vllm:kv_offload_store_bytes"]
    assert len(backups) == vllm["vllm:kv_offload_store_size_count"]


@pytest.mark.parametrize(("rank", "reports_tokens"), [(0, True), (1, False)])
def test_instrumented_with_providers_one_tensor_parallel_rank_reports_tokens(rank: int, reports_tokens: bool) -> None:
    """The telemetry is built at the first record, when the worker's rank is known: bytes on every rank, tokens on
    rank 0 only (they are the same logical tokens on every rank)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader, NumberDataPoint
    from opentelemetry.sdk.trace import TracerProvider

    from otel_hicache.integrations.vllm import VLLMOffloadInstrumentor
    from otel_hicache.sdk import views

    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], views=views())
    instrumentor = VLLMOffloadInstrumentor()
    instrumentor.instrument(tracer_provider=TracerProvider(), meter_provider=meter_provider)
    try:
        engine = support.engine(rank=rank, tp=2)
        support.run_workload(engine)
        vllm = engine.vllm_stats()
        assert instrumentor.telemetry is not None
        instrumentor.telemetry.flush()
        data = reader.get_metrics_data()
        assert data is not None
        metrics = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
        stored = sum(
            p.value
            for p in metrics["hicache.transfer.size"].data.data_points
            if isinstance(p, NumberDataPoint) and dict(p.attributes or {})["hicache.operation"] == "backup"
        )
        assert stored == vllm["vllm:kv_offload_store_bytes"] > 0
        assert ("hicache.transfer.tokens" in metrics) is reports_tokens
    finally:
        instrumentor.uninstrument()
        telemetry = instrumentor.telemetry  # None when the engine failed before its first record
        if telemetry is not None:
            telemetry.shutdown()
        meter_provider.shutdown()


@pytest.mark.parametrize(
    "groups", [(support.ATTENTION, support.SLIDING), (support.SLIDING, support.ATTENTION)], ids=["full", "sliding"]
)
def test_a_hybrid_models_tokens_count_every_kv_group_in_its_pool_whatever_vllms_group_order(
    instrumented: Sdk, groups: tuple[Any, ...]
) -> None:
    """A prompt of five blocks: the full-attention group offloads all five, the sliding-window group the two in its
    window. vLLM orders the groups by each layer type's first appearance, so either may come first."""
    engine = support.engine(groups=groups)
    full, window = [0, 1, 2, 3, 4], [5, 6]
    keys = engine.store("a", *([full, window] if groups[0] is support.ATTENTION else [window, full]))
    assert keys is not None
    back = [[20, 21, 22, 23, 24], [30, 31]]
    engine.load("a", keys, *(back if groups[0] is support.ATTENTION else back[::-1]))
    vllm = engine.vllm_stats()

    tokens = instrumented.counters()["hicache.transfer.tokens"]
    for operation in ("backup", "load_back"):
        assert tokens[(operation, "kv")] == 5 * support.BLOCK_SIZE
        assert tokens[(operation, "swa")] == 2 * support.BLOCK_SIZE
    for span in instrumented.spans("hicache.backup") + instrumented.spans("hicache.load_back"):
        assert attributes(span)["hicache.transfer.tokens.kv"] == 5 * support.BLOCK_SIZE
        assert attributes(span)["hicache.transfer.tokens.swa"] == 2 * support.BLOCK_SIZE
        assert attributes(span)["hicache.transfer.nodes"] == 7  # blocks of every group
    assert size(instrumented, BACKUP) == vllm["vllm:kv_offload_store_bytes"] == 7 * support.ATTENTION.page_size_bytes
    assert size(instrumented, LOAD_BACK) == vllm["vllm:kv_offload_load_bytes"]
