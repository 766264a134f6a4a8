"""With SGLang's request tracing on, transfers and requests are connected in traces.

SGLang's ``--enable-trace`` (``process_tracing_init``) gives each request a span in the scheduler process. A load back
started for a request (``init_load_back`` -> ``load_back(..., req=req)``, at admission) links its ``hicache.load_back``
span to that span, and the admission puts the request's per-tier prefix split on it (``hicache.prefix.tokens.<mode>``).
The request spans go through SGLang's own provider (exported to an OTLP receiver here); ours into the test SDK.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("sglang")

from otel_hicache import semconv as sc
from otel_hicache.testing.otlp_receiver import OtlpReceiver
from otel_hicache.testing.sdk import Sdk
from otel_hicache.testing.sglang import build_hicache, make_request, pump

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def sglang_request_tracing() -> Iterator[OtlpReceiver]:
    """SGLang's request tracing, as ``--enable-trace`` sets it up in a scheduler process (once per process), exporting
    to a receiver; the process's global tracer provider is then SGLang's."""
    from opentelemetry import trace as otel_trace
    from sglang.srt.observability import trace

    with OtlpReceiver() as receiver:
        trace.process_tracing_init(receiver.grpc_endpoint, "sglang-requests")
        trace.trace_set_thread_info("Scheduler", 0, 0, 0)
        yield receiver
        otel_trace.get_tracer_provider().force_flush()  # type: ignore[attr-defined]


def test_a_load_back_links_to_the_request_it_served_and_the_request_span_carries_its_prefix_split(
    instrumented: Sdk, sglang_request_tracing: OtlpReceiver
) -> None:
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.managers.scheduler_components.metrics_reporter import PrefillStats
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache, allocator, _ = build_hicache("write_through", kv_size=128)
    on_host, new = list(range(100, 124)), [7] * 5
    cache.insert(InsertParams(key=RadixKey(array("q", on_host)), value=allocator.alloc(len(on_host))))
    cache.flush_pending_backups()
    pump(cache, lambda: not cache.ongoing_write_through, "backup")
    assert cache.evict(EvictParams(num_tokens=len(on_host))).num_tokens_evicted == len(on_host)  # now host only

    traced, untraced = make_request(on_host + new, "traced"), make_request(on_host + [9] * 3, "untraced")
    traced.time_stats.init_trace_ctx(traced.rid, None)
    traced.time_stats.trace_ctx.trace_req_start()
    request_span: Any = traced.time_stats.trace_ctx.thread_context.thread_span
    adder = PrefillAdder(cache.page_size, cache, allocator, None, 1.0, 4096, None)
    traced.init_next_round_input(cache)
    assert adder.add_one_req(traced, False, None) is AddReqResult.CONTINUE  # its load back is started here
    cache.ready_to_load_host_cache()
    pump(cache, lambda: not cache.cache_controller.ack_load_queue, "load back")
    untraced.init_next_round_input(cache)  # a request without tracing: nothing to link, nothing on a span
    assert adder.add_one_req(untraced, False, None) is AddReqResult.CONTINUE
    PrefillStats.from_adder(adder, running_reqs=[])  # the batch's stats, as the scheduler builds them
    traced.time_stats.trace_ctx.trace_req_finish()
    instrumented.telemetry.flush()

    (load_back,) = instrumented.spans(sc.SPAN_NAMES[sc.TransferOperation.LOAD_BACK])
    assert [link.context for link in load_back.links] == [request_span.get_span_context()]
    assert load_back.attributes is not None and load_back.attributes[sc.ATTR_TOKENS] == len(on_host)
    split = {k: v for k, v in request_span.attributes.items() if k.startswith(sc.ATTR_PREFIX_TOKENS)}
    assert split == {
        f"{sc.ATTR_PREFIX_TOKENS}.input": len(new),
        f"{sc.ATTR_PREFIX_TOKENS}.device_hit": 0,
        f"{sc.ATTR_PREFIX_TOKENS}.host_hit": len(on_host),
        f"{sc.ATTR_PREFIX_TOKENS}.storage_hit": 0,
    }
    # The counters hold both admissions, whatever the tracing.
    prefill = instrumented.counters()[sc.METRIC_PREFILL_TOKENS]
    assert prefill[("input",)] == len(new) + 3
    # The request span went out through SGLang's own provider, with the split on it.
    receiver = sglang_request_tracing
    span_id = request_span.get_span_context().span_id.to_bytes(8, "big")
    assert receiver.wait_for(lambda: any(s.span_id == span_id for s in receiver.spans()), timeout_s=15)


def test_a_backup_links_to_the_request_whose_tokens_it_wrote(
    instrumented: Sdk, sglang_request_tracing: OtlpReceiver
) -> None:
    cache, allocator, req_to_token_pool = build_hicache("write_through", kv_size=128)
    tokens = list(range(300, 316))
    req = make_request(tokens, "traced-backup")
    req.time_stats.init_trace_ctx(req.rid, None)
    req.time_stats.trace_ctx.trace_req_start()
    request_span: Any = req.time_stats.trace_ctx.thread_context.thread_span
    req.init_next_round_input(cache)  # nothing cached yet
    req_to_token_pool.alloc([req])
    req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(tokens)] = allocator.alloc(len(tokens))
    req.kv.kv_allocated_len = len(tokens)
    cache.checkpoint_into_tree(req, up_to=len(tokens))  # the scheduler caches the prefilled request: write-through
    cache.flush_pending_backups()
    pump(cache, lambda: not cache.ongoing_write_through, "backup")
    req.time_stats.trace_ctx.trace_req_finish()
    instrumented.telemetry.flush()

    (backup,) = instrumented.spans(sc.SPAN_NAMES[sc.TransferOperation.BACKUP])
    assert backup.attributes is not None and backup.attributes[sc.ATTR_TOKENS] == len(tokens)
    assert [link.context for link in backup.links] == [request_span.get_span_context()]


def test_a_request_waiting_for_its_load_back_records_that_wait_once_and_on_its_span(
    instrumented: Sdk, sglang_request_tracing: OtlpReceiver
) -> None:
    """hicache.request.kv_wait{tier=host}: from the admission that starts a request's load back until that load back
    is seen complete; one point per request that waited, none for a request that waited for nothing."""
    import time

    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache, allocator, _ = build_hicache("write_through", kv_size=128)
    first, second = list(range(100, 124)), list(range(200, 216))
    for prefix in (first, second):
        cache.insert(InsertParams(key=RadixKey(array("q", prefix)), value=allocator.alloc(len(prefix))))
    cache.flush_pending_backups()
    pump(cache, lambda: not cache.ongoing_write_through, "backup")
    assert cache.evict(EvictParams(num_tokens=len(first) + len(second))).num_tokens_evicted == 40  # host only

    traced, untraced, uncached = (
        make_request(first + [7] * 5, "traced"),
        make_request(second + [8] * 3, "untraced"),
        make_request([9] * 6, "uncached"),
    )
    traced.time_stats.init_trace_ctx(traced.rid, None)
    traced.time_stats.trace_ctx.trace_req_start()
    request_span: Any = traced.time_stats.trace_ctx.thread_context.thread_span
    adder = PrefillAdder(cache.page_size, cache, allocator, None, 1.0, 4096, None)
    started = time.monotonic()
    for req in (traced, untraced, uncached):
        req.init_next_round_input(cache)
        assert adder.add_one_req(req, False, None) is AddReqResult.CONTINUE  # load backs start here
    cache.ready_to_load_host_cache()
    pump(cache, lambda: not cache.cache_controller.ack_load_queue, "load back")
    waited_at_most = time.monotonic() - started
    instrumented.telemetry.flush()
    traced.time_stats.trace_ctx.trace_req_finish()

    points = instrumented.points(sc.METRIC_REQUEST_KV_WAIT)
    assert set(points) == {frozenset({(sc.ATTR_TIER, "host")})}  # tier values from the closed set only
    (host,) = points.values()
    assert host.count == 2  # the traced and the untraced request; the uncached one waited for nothing
    traced_wait = request_span.attributes[f"{sc.ATTR_KV_WAIT}.host"]
    assert 0 < traced_wait < host.sum <= 2 * waited_at_most  # the untraced request waited too
    assert host.sum - traced_wait <= waited_at_most
    above = bisect.bisect_left(host.explicit_bounds, waited_at_most) + 1  # the buckets of longer waits
    assert not any(host.bucket_counts[above:])
