"""PD decode's own ack consumer: ``DecodeKVCacheOffloadManager`` pops its controller's write acks itself.

SGLang 0.5.23 consumes HiCache acks in four places (``grep -n "ack_write_queue\\|ack_load_queue"`` over its source):
``UnifiedRadixCache.writing_check`` (``pop(0)``; ``clear()`` under ``write_back``), ``UnifiedRadixCache.loading_check``
(``pop(0)``), ``HiCacheController.reset`` (``clear()``: discarded, never completed) and
``DecodeKVCacheOffloadManager._check_offload_progress`` (``pop(0)``: device -> host offloads of decoded tokens). The
other readers only count (``_count_ready_acks``, the controller's idle check, the retraction drain). The instrumentor
sees every one of them on the queue itself (``AckQueue``), so no consumer needs a wrapper of its own. The first three
are covered by test_hicache_instrumentation.py; this file runs the real decode offload manager on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("sglang")

from otel_hicache import semconv as sc
from otel_hicache.integrations.sglang.ack_queues import AckQueue
from otel_hicache.testing import free_port
from otel_hicache.testing.sdk import Sdk, attributes_of
from otel_hicache.testing.sglang import FileStorage, pump

pytestmark = pytest.mark.sglang

PROMPT, DECODED = 8, 5  # the prefill side offloaded the prompt; decode offloads the decoded tokens but the last


@pytest.fixture
def one_rank_world() -> Iterator[None]:
    """The manager asks ``torch.distributed`` for its TP group's size: a 1-rank gloo world, as a TP=1 server has."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_decode_offload_acks_are_reported_as_backups_and_leave_nothing_remembered(
    instrumented: Sdk, file_storage: FileStorage, prometheus_collector: Any, one_rank_world: None
) -> None:
    from sglang.srt.disaggregation.decode_kvcache_offload_manager import DecodeKVCacheOffloadManager
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.observability.metrics_collector import StorageMetricsCollector
    from sglang.srt.sampling.sampling_params import SamplingParams

    metrics = prometheus_collector(StorageMetricsCollector, labels={"storage_backend": "file", "tp_rank": "0"})
    cache, allocator, req_to_token_pool = file_storage.build("write_through", metrics, kv_size=64)
    manager = DecodeKVCacheOffloadManager(req_to_token_pool, allocator, tp_group=None, tree_cache=cache)
    cc = manager.cache_controller
    try:
        req = Req("decode-1", "", list(range(1, PROMPT + 1)), SamplingParams(max_new_tokens=16))
        req_to_token_pool.alloc([req])
        req_to_token_pool.req_to_token[req.kv.req_pool_idx, : PROMPT + DECODED - 1] = allocator.alloc(
            PROMPT + DECODED - 1
        )
        req.output_ids = list(range(100, 100 + DECODED))
        assert manager.offload_kv_cache(req)
        manager.check_offload_progress()  # consumes the ack: _check_offload_progress pops it
        assert cc.ack_write_queue == []
        pump(cache, lambda: manager.check_offload_progress() or not manager.ongoing_backup, "decode L3 backup")
    finally:
        cc._stop_storage_threads()

    offloaded = DECODED - 1  # output_ids[:-1]: the last token's KV is not written yet
    counters = {k: v for k, v in instrumented.counters()[sc.METRIC_TRANSFER_TOKENS].items() if v}
    assert counters == {("backup", "kv"): offloaded, ("storage_backup", "kv"): offloaded}
    (span,) = instrumented.spans(sc.SPAN_NAMES[sc.TransferOperation.BACKUP])
    assert attributes_of(span)[sc.ATTR_TOKENS] == offloaded
    assert attributes_of(span)[sc.ATTR_BYTES] == offloaded * manager.decode_host_mem_pool.size_per_token
    # The ack was seen leaving the controller's own (adopted) queue, and nothing is remembered of it.
    assert isinstance(cc.ack_write_queue, AckQueue) and cc.ack_write_queue.reporter is not None
    assert cc.ack_write_queue.reporter.submitted == {}
