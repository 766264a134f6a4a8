"""Each request's wait for its CPU-tier KV, on vLLM's real scheduler (:mod:`tests.vllm.stepping`): the async loads of
every release (the request waits in ``WAITING_FOR_REMOTE_KVS``) and the sync loads of vLLM >= 0.33
(``sync_load_budget_bytes``: the worker waits inside the step). Both are the request's ``hicache.request.kv_wait
{host}`` and its request span's ``hicache.kv_wait.host``, and leave no state behind on the request.

A request's KV reaches the CPU tier when it is computed; the engine's own prefix cache is then emptied (vLLM's
``reset_prefix_cache``), so the same prompt again is a hit of the CPU tier only, loaded back.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from otel_hicache._internal.host.worker import HOST_THREAD_NAME
from otel_hicache.integrations.vllm import per_request
from otel_hicache.integrations.vllm.per_request import _STATE
from otel_hicache.integrations.vllm.semconv import SYNC_WAITS
from otel_hicache.telemetry import HiCacheTelemetry
from otel_hicache.testing.sdk import Sdk
from tests.vllm import stepping, support

pytestmark = pytest.mark.vllm

KV_WAIT = "hicache.request.kv_wait"
PROMPT_BLOCKS = 4


def sync_loads() -> bool:
    """Whether this vLLM has sync loads (a load job that says whether it is one)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob

    return "sync" in TransferJob.__dataclass_fields__


needs_sync_loads = pytest.mark.skipif("not sync_loads()", reason="vLLM < 0.33 has no sync loads")


def offloaded_then_asked_again(engine: stepping.Stepper, tracing: bool = False) -> Any:
    """Request ``a`` computes a prompt of four blocks, which goes to the CPU tier; the engine forgets it; ``b`` asks
    the same prompt and one more token: its four blocks come back from the CPU tier."""
    offloaded(engine)
    return asked_again(engine, tracing)


def offloaded(engine: stepping.Stepper) -> None:
    engine.add("a", stepping.prompt(1, PROMPT_BLOCKS))
    engine.run()
    assert engine.scheduler.kv_cache_manager.reset_prefix_cache()


def asked_again(engine: stepping.Stepper, tracing: bool = False) -> Any:
    headers = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"} if tracing else None
    return engine.add("b", [*stepping.prompt(1, PROMPT_BLOCKS), 7], trace_headers=headers)


def loaded(otel: Sdk) -> list[dict[str, Any]]:
    return [dict(s.attributes or {}) for s in otel.spans("hicache.load_back")]


def no_state_left(request: Any) -> None:
    state = getattr(request, _STATE)
    assert (state.wait_start_ns, state.matched_ns, state.sync_load) == (0, 0, False)


def test_an_async_load_is_the_requests_time_waiting_for_remote_kvs(instrumented: Sdk) -> None:
    engine = stepping.stepper(tracing=True)
    b = offloaded_then_asked_again(engine, tracing=True)
    out = engine.step()
    assert [job.req_id for job in out.kv_connector_metadata.load_jobs.values()] == ["b"]
    assert b.status.name == "WAITING_FOR_REMOTE_KVS"  # vLLM keeps it waiting while its KV loads
    engine.run()

    ((load),) = loaded(instrumented)
    assert load["hicache.transfer.nodes"] == PROMPT_BLOCKS
    (wait,) = instrumented.points(KV_WAIT).values()
    assert wait.count == 1 and wait.sum > 0
    header = engine.finished_trace_headers()["b"]["otel-hicache"]
    assert f"hicache.kv_wait.host={wait.sum!r}" in header
    no_state_left(b)


@needs_sync_loads
def test_a_sync_load_is_the_time_the_worker_waited_for_it_inside_the_step(instrumented: Sdk) -> None:
    """With a budget, vLLM loads the hit within the step: the request is scheduled at once, never waits in
    ``WAITING_FOR_REMOTE_KVS``; its worker's ``start_kv_transfers`` submits the load expedited and waits for it. That
    wait is the request's, on the metric and on its request span."""
    engine = stepping.stepper(tracing=True, sync_load_budget_bytes=1 << 30)
    b = offloaded_then_asked_again(engine, tracing=True)
    out = engine.step()
    assert [(job.req_id, job.sync) for job in out.kv_connector_metadata.load_jobs.values()] == [("b", True)]
    assert out.num_scheduled_tokens == {"b": 1}  # its one token past the hit, in the step that loaded the rest
    engine.run()

    ((load),) = loaded(instrumented)
    assert load["hicache.transfer.nodes"] == PROMPT_BLOCKS
    (wait,) = instrumented.points(KV_WAIT).values()
    assert wait.count == 1 and wait.sum >= load["hicache.transfer.copy_duration"] > 0
    header = engine.finished_trace_headers()["b"]["otel-hicache"]
    assert f"hicache.kv_wait.host={wait.sum!r}" in header
    no_state_left(b)


@needs_sync_loads
def test_the_first_sync_load_brings_back_the_wrapper_that_reads_the_workers_waits(instrumented: Sdk) -> None:
    """Until the connector answers a sync load, the scheduler's steps skip update_from_output's wrapper (nothing to
    read); the answer comes in the step's ``schedule()``, so the step's outputs, which carry the wait, go through it."""
    engine = stepping.stepper(sync_load_budget_bytes=1 << 30)
    offloaded(engine)
    assert "update_from_output" in vars(engine.scheduler)  # skipped: no sync load yet
    asked_again(engine)
    with support.Entered(per_request.RequestHooks, "update_from_output") as entered:
        engine.run()
    assert entered.take()["update_from_output"] >= 1
    (wait,) = instrumented.points(KV_WAIT).values()
    assert wait.count == 1 and wait.sum > 0


@needs_sync_loads
def test_a_load_over_the_sync_budget_is_async_and_waits_as_before(instrumented: Sdk) -> None:
    page = support.ATTENTION.page_size_bytes * len(support.LAYERS)
    engine = stepping.stepper(sync_load_budget_bytes=page)  # one block's worth: the four-block hit is too big
    b = offloaded_then_asked_again(engine)
    engine.run()
    (wait,) = instrumented.points(KV_WAIT).values()
    assert wait.count == 1
    no_state_left(b)


def test_the_engine_cores_step_only_queues_its_counts_and_the_host_thread_makes_them(
    instrumented: Sdk, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's split and KV wait, and the CPU tier's eviction passes: each step of vLLM's scheduler waits for
    what runs on its thread, so it only queues them; the telemetry's host thread counts them."""
    counted_on: dict[str, set[str]] = {}

    def noting(name: str) -> Any:
        method = getattr(HiCacheTelemetry, name)

        def noted(self: HiCacheTelemetry, *args: Any, **kwargs: Any) -> Any:
            counted_on.setdefault(name, set()).add(threading.current_thread().name)
            return method(self, *args, **kwargs)

        return noted

    counts = ("record_prefix_splits", "record_kv_wait", "record_eviction")
    for name in counts:
        monkeypatch.setattr(HiCacheTelemetry, name, noting(name))
    engine = stepping.stepper(cpu_chunks=6)
    for seed in (1, 2, 3):  # 12 blocks into a 6-chunk tier: evictions
        engine.add(f"r{seed}", stepping.prompt(seed, PROMPT_BLOCKS))
        engine.run()
    assert engine.scheduler.kv_cache_manager.reset_prefix_cache()
    engine.add("again", [*stepping.prompt(3, PROMPT_BLOCKS), 7])  # loaded back from the tier: a KV wait
    engine.run()

    counters = instrumented.counters()  # a read of the counts waits for what is queued
    assert sum(n for (tier, _), n in counters["hicache.eviction.tokens"].items() if tier == "host") > 0
    assert counters["hicache.prefill.tokens"][("host_hit",)] == PROMPT_BLOCKS * support.BLOCK_SIZE
    assert sum(point.count for point in instrumented.points(KV_WAIT).values()) == 1
    assert counted_on == {name: {HOST_THREAD_NAME} for name in counts}  # none on the thread each step waits for


def test_a_request_that_loads_nothing_waits_for_nothing(instrumented: Sdk) -> None:
    engine = stepping.stepper()
    a = engine.add("a", stepping.prompt(2, PROMPT_BLOCKS))
    engine.run()
    assert instrumented.points(KV_WAIT) == {}
    no_state_left(a)


@needs_sync_loads  # deferred loads come with the same release
def test_a_deferred_load_waits_from_its_admission_its_deferral_included(instrumented: Sdk) -> None:
    """vLLM >= 0.33 defers an async load admitted while an earlier step is in flight: the request waits in
    ``WAITING_FOR_REMOTE_KVS`` from its admission, but the connector hears of it (``update_state_after_alloc``) only
    once that step's output is in. Its wait starts at the admission."""
    engine = stepping.stepper(deferred_loads=True, tracing=True)
    offloaded(engine)
    c = engine.add("c", stepping.prompt(3, 1), max_tokens=4)
    engine.step()  # c's prefill
    in_flight = engine.scheduler.schedule()  # c's first decode, its output not in yet
    b = asked_again(engine, tracing=True)
    before = time.monotonic_ns()
    admitting = engine.scheduler.schedule()
    admitted = time.monotonic_ns()
    assert b.status.name == "WAITING_FOR_REMOTE_KVS" and "b" in engine.scheduler.deferred_loads
    assert not admitting.kv_connector_metadata.load_jobs  # deferred

    engine.execute(in_flight)  # its output is in: vLLM starts b's load (update_state_after_alloc)
    loading = time.monotonic_ns()
    assert "b" not in engine.scheduler.deferred_loads
    state = getattr(b, _STATE)
    assert before <= state.wait_start_ns <= admitted  # the wait runs from the admission, not from now
    engine.execute(admitting)
    engine.run()

    ((load),) = loaded(instrumented)
    assert load["hicache.transfer.nodes"] == PROMPT_BLOCKS
    (wait,) = instrumented.points(KV_WAIT).values()
    assert wait.count == 1 and wait.sum >= (loading - admitted) / 1e9
    assert f"hicache.kv_wait.host={wait.sum!r}" in engine.finished_trace_headers()["b"]["otel-hicache"]
    no_state_left(b)
    no_state_left(c)


@needs_sync_loads
def test_tensor_parallel_workers_sync_waits_merge_into_the_slowest(instrumented: Sdk) -> None:
    """Each worker waits for its share of a sync load; vLLM merges their metadata (``aggregate``) into what the
    scheduler gets: the request's wait is the slowest worker's, as the step waited for it."""
    metas = []
    for rank in (0, 1):
        engine = support.engine(rank=rank, tp=2)
        keys = engine.store("b", [0, 1, 2])
        assert keys is not None
        engine.load("b", keys, [10, 11, 12], sync=True)
        metas.append(engine.last_worker_meta)
    waits = [getattr(meta, SYNC_WAITS) for meta in metas]
    assert [list(w) for w in waits] == [["b"], ["b"]] and all(w["b"] > 0 for w in waits)
    merged = metas[0].aggregate(metas[1])
    assert getattr(merged, SYNC_WAITS) == {"b": max(w["b"] for w in waits)}
    assert dict(merged.completed_jobs) == {job: 2 for job in metas[0].completed_jobs}  # vLLM's own merge, as ever
