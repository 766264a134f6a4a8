"""Faults in vLLM's offloading path, instrumented: the adapter never raises into vLLM, vLLM's own exceptions reach
vLLM unchanged, and what vLLM counted before it raised is still reported.

The faults come from offloading workers that are not vLLM's (any ``OffloadingWorker`` an out-of-tree spec brings):
results with odd sizes or times, a failed result, a result without size and time. Each test's worker is the test
support's real host-copy worker with its results altered on the way to vLLM's ``get_finished``.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan

from otel_hicache.integrations.vllm import VLLMOffloadInstrumentor
from otel_hicache.testing.sdk import Sdk
from tests.vllm import support

pytestmark = pytest.mark.vllm

Alter = Callable[[list[Any]], list[Any]]


def faulty_engine(alter: Alter) -> support.Engine:
    """An engine whose worker's finished results go through ``alter`` before vLLM reads them."""
    engine = support.engine()
    connector = engine.worker.connector_worker
    assert connector is not None and isinstance(connector.worker, support.HostCopyWorker)
    connector.worker.alter = alter
    return engine


def outcome(run: Callable[[], Any]) -> tuple[type[BaseException], str] | None:
    try:
        run()
    except Exception as exc:
        return type(exc), str(exc)
    return None


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def with_results(**changes: Any) -> Alter:
    return lambda results: [dataclasses.replace(r, **changes) for r in results]


@pytest.mark.parametrize(
    ("changes", "plain"),
    [
        ({"transfer_time": "n/a"}, TypeError),  # vLLM adds the string to its float total
        ({"transfer_size": math.nan}, None),  # vLLM adds NaN and goes on
    ],
    ids=["string_time", "nan_size"],
)
def test_odd_sizes_and_times_give_vllm_exactly_the_outcome_it_has_uninstrumented(
    otel: Sdk, changes: dict[str, Any], plain: type[BaseException] | None
) -> None:
    uninstrumented = outcome(lambda: faulty_engine(with_results(**changes)).store("a", [0, 1]))
    assert (uninstrumented and uninstrumented[0]) == plain
    instrumentor = VLLMOffloadInstrumentor()
    instrumentor.instrument(telemetry=otel.telemetry)
    try:
        assert outcome(lambda: faulty_engine(with_results(**changes)).store("a", [0, 1])) == uninstrumented
    finally:
        instrumentor.uninstrument()
    # what is not a count of bytes is refused whole (and counted), never reported as one
    assert otel.spans("hicache.backup") == []
    rejected = otel.counters().get("otel_hicache.records.rejected", {})
    assert sum(rejected.values()) == (0 if plain else 1)


def test_a_failed_result_is_a_failure_on_vllm_that_completes_it_and_what_came_before_is_reported(
    instrumented: Sdk,
) -> None:
    """The third of three stores fails. vLLM < 0.34 asserts on it in ``get_finished`` after counting the first two
    (the failed job stays pending: vLLM never completed it); vLLM 0.34 completes it as failed
    (``mark_completed(job_id, success=False)``): one failed backup, ``error.type=copy_failed``, nothing pending."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    def fail_third(results: list[Any]) -> list[Any]:
        return [*results[:2], *(dataclasses.replace(r, success=False) for r in results[2:])]

    completes_failures = "success" in inspect.signature(OffloadingWorkerMetadata.mark_completed).parameters
    engine = faulty_engine(fail_third)
    if completes_failures:
        engine.store_together({"a": [0], "b": [1, 2], "c": [3, 4, 5]})
    else:
        with pytest.raises(AssertionError):
            engine.store_together({"a": [0], "b": [1, 2], "c": [3, 4, 5]})
    if completes_failures:  # the step completed: what vLLM counted went out with its worker metadata
        vllm = engine.vllm_stats()
        counted_bytes, counted_time = vllm["vllm:kv_offload_store_bytes"], vllm["vllm:kv_offload_store_time"]
    else:  # get_finished raised: what it counted is still on the worker's metadata
        counted_bytes, counted_time = engine.transfer_stats.store.bytes, engine.transfer_stats.store.time
    backups = [attributes(s) for s in instrumented.spans("hicache.backup")]
    assert [s["hicache.transfer.nodes"] for s in backups] == [1, 2]
    assert sum(s["hicache.transfer.byte_count"] for s in backups) == counted_bytes > 0
    assert sum(s["hicache.transfer.copy_duration"] for s in backups) == pytest.approx(counted_time)
    (state,) = [v for v in vars(engine.worker.connector_worker).values() if type(v).__name__ == "_Connector"]
    failed = {"hicache.operation": "backup", "error.type": "copy_failed"}
    if completes_failures:
        assert state.pending == {}
        assert instrumented.value("hicache.transfer.failures", failed) == 1
    else:  # the two reported jobs are no longer pending; the failed one, which vLLM never completed, is
        assert [entry.blocks for entry in state.pending.values()] == [3]
        assert instrumented.counters().get("hicache.transfer.failures", {}) == {}


def test_a_result_without_size_and_time_is_a_transfer_of_unknown_size_that_vllm_does_not_count(
    instrumented: Sdk,
) -> None:
    """Only third-party workers produce such results. The blocks did move (vLLM completes the job), so it is a
    transfer with its tokens and blocks; its size and duration are unknown: no byte count on its span (not 0), no
    bytes counted, no duration point (timing source ``none``), which keeps bytes, time and count equal to vLLM's,
    which counts nothing for it."""
    engine = faulty_engine(with_results(transfer_size=None, transfer_time=None))
    assert engine.store("a", [0, 1, 2])
    vllm = engine.vllm_stats()
    (span,) = map(attributes, instrumented.spans("hicache.backup"))
    assert span["hicache.transfer.tokens.kv"] == 3 * support.BLOCK_SIZE
    assert span["hicache.transfer.nodes"] == 3
    assert span["hicache.timing.source"] == "none"
    assert "hicache.transfer.copy_duration" not in span
    assert "hicache.transfer.byte_count" not in span
    assert instrumented.points("hicache.transfer.duration") == {}
    sizes = instrumented.counters()["hicache.transfer.size"]
    assert sum(sizes.values()) == vllm.get("vllm:kv_offload_store_bytes", 0) == 0
