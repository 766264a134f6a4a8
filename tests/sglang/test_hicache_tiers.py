"""Per-tier prefill hits, the L3 file backend, drops and a hybrid pool, against SGLang 0.5.23's own counters.

Every scenario runs SGLang's real classes on a CPU (:mod:`otel_hicache.testing.sglang`): a real ``PrefillAdder``
admitting real ``Req`` objects whose prefixes sit on the device, on the host and in L3; SGLang's file backend
(``HiCacheFile``) written and read by the controller's own storage threads; a real SWA hybrid cache. The OTel values
must equal what SGLang's prometheus collectors count for the same run.
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest

pytest.importorskip("sglang")

from prometheus_client import REGISTRY

from otel_hicache import semconv as sc
from otel_hicache.testing.sdk import Sdk
from otel_hicache.testing.sglang import FileStorage, build_hicache, make_request, pump

pytestmark = pytest.mark.sglang

STORAGE_LABELS = {"storage_backend": "file"}
# The scheduler's label set (values as prometheus_client stores them).
SCHEDULER_LABELS = {"model_name": "dummy", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
RADIX_LABELS = {"cache_type": "UnifiedRadixCache", "tp_rank": "0"}
PAGE = 4  # L3 stores whole pages: one file per page
MODES = [m.value for m in sc.PrefillMode if m is not sc.PrefillMode.OTHER]  # SGLang's four


def prom(name: str, labels: dict[str, str], **extra: str) -> float:
    return REGISTRY.get_sample_value(name, {**labels, **extra}) or 0.0


def insert(cache: Any, allocator: Any, tokens: list[int]) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=allocator.alloc(len(tokens))))


def backed_up_to_l3(cache: Any) -> None:
    """Submit the pending write-through backups and run scheduler steps until L2 and L3 backups are all acked."""
    cache.flush_pending_backups()
    pump(cache, lambda: not cache.ongoing_write_through and not cache.ongoing_backup, "L2 + L3 backup")


def storage_metrics(prometheus_collector: Any) -> Any:
    from sglang.srt.observability.metrics_collector import StorageMetricsCollector

    return prometheus_collector(StorageMetricsCollector, labels=STORAGE_LABELS)


# ---------------------------------------------------------------------------------------------------------- L3
def test_storage_backup_and_prefetch_match_sglang_counters_and_the_bytes_on_disk(
    instrumented: Sdk, file_storage: FileStorage, prometheus_collector: Any
) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    seq = list(range(1, 25))  # 6 pages
    metrics = storage_metrics(prometheus_collector)
    producer, allocator, _ = file_storage.build("write_through", metrics, kv_size=128, page_size=PAGE)
    insert(producer, allocator, seq)
    backed_up_to_l3(producer)

    on_disk = file_storage.stored_bytes()
    assert prom("sglang:backuped_tokens_total", STORAGE_LABELS) == len(seq)
    assert on_disk == len(seq) * producer.cache_controller.storage_host_pool.size_per_token
    snap = instrumented.counters()
    assert snap[sc.METRIC_TRANSFER_TOKENS][("storage_backup", "kv")] == len(seq)
    assert snap[sc.METRIC_TRANSFER_SIZE][("storage_backup", None, "host_clock")] == on_disk

    # A second engine finds the prefix only in L3 and prefetches it into its host pool.
    consumer, _, _ = file_storage.build("write_through", metrics, kv_size=128, page_size=PAGE)
    request = CacheRequestHandle("l3-reader", 0)
    consumer.prefetch_from_storage(request, consumer.root_node_handle(), array("q", seq))
    pump(consumer, lambda: consumer.check_prefetch_progress(request), "L3 prefetch")
    match = consumer.match_prefix(MatchPrefixParams(key=RadixKey(array("q", seq))))
    assert match.host_hit_length == len(seq)

    assert prom("sglang:prefetched_tokens_total", STORAGE_LABELS) == len(seq)
    snap = instrumented.counters()
    assert snap[sc.METRIC_TRANSFER_TOKENS][("storage_prefetch", "kv")] == len(seq)
    assert snap[sc.METRIC_TRANSFER_SIZE][("storage_prefetch", None, "none")] == on_disk  # every stored page read back

    (backup,) = instrumented.spans(sc.SPAN_NAMES[sc.TransferOperation.STORAGE_BACKUP])
    (prefetch,) = instrumented.spans(sc.SPAN_NAMES[sc.TransferOperation.STORAGE_PREFETCH])
    assert backup.attributes is not None and backup.attributes[sc.ATTR_TIMING_SOURCE] == "host_clock"  # its own clock
    for span in (backup, prefetch):
        assert span.attributes is not None and span.start_time is not None and span.end_time is not None
        assert span.attributes[sc.ATTR_TOKENS] == len(seq)
        assert span.attributes[sc.ATTR_BYTES] == on_disk
        assert span.start_time <= span.end_time


# ---------------------------------------------------------------------------------------------------------- prefill
def _prefetch_on_arrival(cache: Any, req: Any) -> None:
    """What ``Scheduler._prefetch_kvcache`` does for a new request in cache mode (the Scheduler module itself needs
    the HTTP server stack to import): match, then ask L3 for the part no lower tier holds."""
    req.init_next_round_input(cache, cow_mamba=False)
    matched = req.prefix_len + req.host_hit_length
    end = req._compute_max_prefix_len(len(req.full_untruncated_fill_ids))
    anchor = req.last_host_node
    assert cache.is_backuped(anchor) or cache.is_root(anchor)
    cache.prefetch_from_storage(
        req.cache_request_handle,
        anchor,
        req.full_untruncated_fill_ids[matched:end],
        cache.get_last_hash_value(anchor),
        None,
        matched_prefix_tokens=req.full_untruncated_fill_ids[:matched],
    )


def _admit(cache: Any, allocator: Any, reqs: list[Any]) -> Any:
    """``Scheduler._get_new_batch_prefill``'s admission loop for ``reqs``: prefetch gate, L3 span, match, add; then
    the batch's ``PrefillStats``, as the scheduler builds them (metrics on or off)."""
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.managers.scheduler_components.metrics_reporter import PrefillStats

    adder = PrefillAdder(cache.page_size, cache, allocator, None, 1.0, 4096, None)
    for req in reqs:
        assert cache.check_prefetch_progress(req.cache_request_handle)
        loaded, start = cache.pop_prefetch_loaded_span(req.cache_request_handle)
        if loaded > 0:
            req.storage_hit_length, req.storage_hit_start, req.host_hit_is_storage = loaded, start, False
        req.init_next_round_input(cache)
        assert adder.add_one_req(req, False, None) is AddReqResult.CONTINUE
    return PrefillStats.from_adder(adder, running_reqs=[])


def test_prefill_tokens_per_mode_equal_sglang_effective_prefill_counter(
    instrumented: Sdk, file_storage: FileStorage, prometheus_collector: Any
) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector
    from sglang.srt.server_args import ServerArgs

    on_device, on_host, in_l3 = list(range(1, 17)), list(range(100, 124)), list(range(500, 524))
    l3_metrics = storage_metrics(prometheus_collector)
    producer, producer_allocator, _ = file_storage.build("write_through", l3_metrics, kv_size=128, page_size=PAGE)
    insert(producer, producer_allocator, in_l3)
    backed_up_to_l3(producer)

    cache, allocator, _ = file_storage.build("write_through", l3_metrics, kv_size=128, page_size=PAGE)
    insert(cache, allocator, on_host)
    backed_up_to_l3(cache)
    assert cache.evict(EvictParams(num_tokens=len(on_host))).num_tokens_evicted == len(on_host)  # demoted to host
    insert(cache, allocator, on_device)

    new = [7] * 5
    reqs = [
        make_request(on_device + new, "device"),
        make_request(on_host + new, "host"),
        make_request(in_l3 + new, "storage"),
        make_request(on_device + [8] * 3, "retracted", retracted=True),  # a re-count: neither input nor hits
    ]
    for req in reqs:
        _prefetch_on_arrival(cache, req)
    pump(cache, lambda: all(cache.check_prefetch_progress(r.cache_request_handle) for r in reqs), "prefetch")
    stats = _admit(cache, allocator, reqs)
    assert reqs[2].storage_hit_length == len(in_l3)

    # SGLang's metrics reporter: the batch's PrefillStats, retracted re-counts taken out of the input.
    scheduler_metrics = prometheus_collector(
        SchedulerMetricsCollector, labels=SCHEDULER_LABELS, server_args=ServerArgs(model_path="dummy")
    )
    scheduler_metrics.increment_effective_prefill_tokens(
        input_tokens=stats.log_input_tokens - stats.reprocessed_log_input_tokens,
        device_hit_tokens=stats.log_device_hit_tokens,
        host_hit_tokens=stats.log_host_hit_tokens,
        storage_hit_tokens=stats.log_storage_hit_tokens,
    )

    sglang = {m: prom("sglang:prefill_effective_tokens_total", SCHEDULER_LABELS, mode=m) for m in MODES}
    assert sglang == {"input": 3 * len(new), "device_hit": 16, "host_hit": 24, "storage_hit": 24}
    prefill = instrumented.counters()[sc.METRIC_PREFILL_TOKENS]
    assert {m: prefill.get((m,), 0) for m in MODES} == sglang

    cache.ready_to_load_host_cache()  # let the admitted load-backs run, as the batch would
    pump(cache, lambda: not cache.cache_controller.ack_load_queue, "load-back")


# ---------------------------------------------------------------------------------------------------------- drops
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective"])
def test_unbacked_eviction_drop_is_counted_under_exactly_write_through(
    policy: str, instrumented: Sdk, sglang_metrics: Any
) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    reason = sc.DropReason.WRITE_THROUGH_UNBACKED_EVICTION.value
    before = prom("sglang:hicache_dropped_tokens_total", RADIX_LABELS, reason=reason, pool="kv")
    cache, allocator, _ = build_hicache(policy, metrics=sglang_metrics)
    host = cache.cache_controller.mem_pool_host
    hog = host.alloc(host.available_size())  # no host room: the backup cannot be taken, the node stays unbacked
    seq = list(range(1, 21))
    insert(cache, allocator, seq)
    cache.flush_pending_backups()
    cache.writing_check()

    assert cache.evict(EvictParams(num_tokens=len(seq))).num_tokens_evicted == len(seq)

    dropped = prom("sglang:hicache_dropped_tokens_total", RADIX_LABELS, reason=reason, pool="kv") - before
    assert dropped == (len(seq) if policy == "write_through" else 0)
    assert instrumented.counters()[sc.METRIC_DROPPED_TOKENS].get((reason, "kv"), 0) == dropped
    host.free(hog)


# ---------------------------------------------------------------------------------------------------------- hybrid
def test_swa_hybrid_backup_and_load_back_count_the_swa_pool_like_sglang(instrumented: Sdk, sglang_metrics: Any) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    series = {"backup": "sglang:hicache_backup_", "load_back": "sglang:load_back_"}

    def sglang_pools() -> dict[tuple[str, str], float]:
        tokens = {
            (op, pool): prom(f"{name}tokens_total", RADIX_LABELS, pool=pool)
            for op, name in series.items()
            for pool in ("kv", "swa")
        }
        return tokens | {(op, "bytes"): prom(f"{name}bytes_total", RADIX_LABELS) for op, name in series.items()}

    before = sglang_pools()
    cache, allocator, _ = build_hicache(
        "write_through", metrics=sglang_metrics, kv_size=128, num_layers=4, hybrid_swa=True
    )
    assert type(cache.cache_controller).__name__ == "HybridCacheController"
    seq = list(range(1, 21))
    insert(cache, allocator, seq)
    cache.flush_pending_backups()
    cache.writing_check()
    cache.evict(EvictParams(num_tokens=len(seq)))
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", seq))))
    assert match.host_hit_length > 0
    assert cache.load_back(match.best_match_node)
    cache.ready_to_load_host_cache()
    cache.loading_check()

    sglang = {k: v - before[k] for k, v in sglang_pools().items()}
    assert sglang[("backup", "swa")] > 0 and sglang[("load_back", "swa")] > 0  # the non-kv pool really moved
    snap = instrumented.counters()
    tokens, size = snap[sc.METRIC_TRANSFER_TOKENS], snap[sc.METRIC_TRANSFER_SIZE]
    ours = {(op, pool): tokens.get((op, pool), 0) for op, pool in sglang if pool != "bytes"}
    ours |= {(op, "bytes"): size.get((op, None, "none"), 0) for op in ("backup", "load_back")}  # untimed on CPU
    assert ours == sglang


def test_a_request_held_for_its_storage_prefetch_records_that_wait_at_its_admission(
    instrumented: Sdk, file_storage: FileStorage, prometheus_collector: Any
) -> None:
    """hicache.request.kv_wait{tier=storage}: from the prefetch's start until SGLang's stop policy lets the request
    go (``check_prefetch_progress`` says yes), recorded when the request is admitted; a request with nothing to
    prefetch records nothing."""
    import time

    in_l3, new = list(range(500, 524)), [7] * 5
    l3_metrics = storage_metrics(prometheus_collector)
    producer, producer_allocator, _ = file_storage.build("write_through", l3_metrics, kv_size=128, page_size=PAGE)
    insert(producer, producer_allocator, in_l3)
    backed_up_to_l3(producer)

    cache, allocator, _ = file_storage.build("write_through", l3_metrics, kv_size=128, page_size=PAGE)
    from_l3, fresh = make_request(in_l3 + new, "storage"), make_request([9] * 8, "fresh")
    started = time.monotonic()
    for req in (from_l3, fresh):
        _prefetch_on_arrival(cache, req)
    pump(cache, lambda: all(cache.check_prefetch_progress(r.cache_request_handle) for r in (from_l3, fresh)), "L3")
    held_at_most = time.monotonic() - started
    assert instrumented.points(sc.METRIC_REQUEST_KV_WAIT) == {}  # released, not admitted yet
    _admit(cache, allocator, [from_l3, fresh])
    assert from_l3.storage_hit_length == len(in_l3)

    points = instrumented.points(sc.METRIC_REQUEST_KV_WAIT)
    assert set(points) == {frozenset({(sc.ATTR_TIER, "storage")})}
    (storage,) = points.values()
    assert storage.count == 1 and 0 < storage.sum <= held_at_most
    cache.ready_to_load_host_cache()  # let the admitted load-backs run, as the batch would
    pump(cache, lambda: not cache.cache_controller.ack_load_queue, "load-back")
