"""Scheduler-thread CPU time per consumed backup ack on SGLang's real ack path (a benchmark, not a test).

Run: .venv-sglang/bin/python tests/sglang/bench_ack_cost.py
Compares writing_check over N merged write acks: bare, with SGLang's prometheus metrics, with the instrumentor.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import conftest as c

N = 2000


def run(cache, tokens: int = 8) -> float:
    """CPU ns per ack spent in start_writing + writing_check (copy excluded: the acks are prepared first)."""
    cc = cache.cache_controller
    alloc = cache.token_to_kv_pool_allocator
    device = alloc.alloc(tokens)
    total = 0
    for _ in range(N):
        host = cc.write(device, node_id=-1, flush=False)
        t0 = time.thread_time_ns()
        cc.start_writing()
        total += time.thread_time_ns() - t0
        cache.ongoing_write_through[-1] = (None, None, [])  # lets SGLang's own writing_check release the ack
        cache.tree_core.finish_write_through = lambda *a, **k: None
        t0 = time.thread_time_ns()
        cache.writing_check()
        total += time.thread_time_ns() - t0
        cc.mem_pool_host.free(host)
    return total / N / 1000


def main() -> None:
    import sglang.srt.mem_cache.pool_host.common as common
    import sglang.srt.mem_cache.pool_host.mha as mha
    import sglang.test.kits.unified_radix_cache.fixtures as kit
    from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector

    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor

    mha.transfer_kv_direct, common.ALLOC_MEMORY_FUNCS["cpu"] = c._transfer_kv_direct, c._alloc_plain
    kit.get_device = lambda *_a, **_k: "cpu"
    metrics = RadixCacheMetricsCollector(labels={"cache_type": "bench"})
    results = {}
    for label, with_metrics, instrument in (
        ("bare", False, False),
        ("sglang prometheus", True, False),
        ("instrumentor (spans on)", False, True),
    ):
        otel = c.Otel()
        inst = SGLangHiCacheInstrumentor()
        if instrument:
            inst.instrument(telemetry=otel.telemetry, stat_loggers=False)
        cache, _, _ = c.build_hicache("write_through", metrics=metrics if with_metrics else None)
        run(cache)  # warm up
        results[label] = min(run(cache) for _ in range(3))
        if instrument:
            inst.uninstrument()
        otel.shutdown()
    for label, us in results.items():
        print(f"{label:28s} {us:7.2f} us/ack   (+{us - results['bare']:.2f} us over bare)")


if __name__ == "__main__":
    main()
