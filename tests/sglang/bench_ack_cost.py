"""Scheduler-thread CPU time per backup ack on SGLang's real ack path (a benchmark, not a test).

Run: .venv-sglang/bin/python tests/sglang/bench_ack_cost.py [--acks 400] [--reps 15]

Three set-ups on SGLang 0.5.23's real UnifiedRadixCache: bare (no metrics), SGLang's prometheus metrics, and the
instrumentor (spans on, SGLang's metrics off). Per ack it times the two calls the instrumentor wraps, separately:
``start_writing`` (which also runs the copy; one token per ack keeps that small) and ``writing_check`` (SGLang pops
the finished ack, releases locks, logs its metrics; this is where SGLang's prometheus cost is). The set-ups run
interleaved, ``reps`` rounds of ``acks`` acks each, and the report gives the median of the per-round means, so a
slow period of the machine hits every set-up alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import conftest as c


def one_round(cache: Any, acks: int) -> tuple[float, float]:
    """Mean thread CPU ns per ack in (start_writing, writing_check)."""
    cc = cache.cache_controller
    device = cache.token_to_kv_pool_allocator.alloc(1)
    cache.tree_core.finish_write_through = lambda *a, **k: None  # the acks belong to no tree node
    submit = check = 0
    clock = time.thread_time_ns
    for _ in range(acks):
        host = cc.write(device, node_id=-1, flush=False)
        t0 = clock()
        cc.start_writing()
        t1 = clock()
        cache.ongoing_write_through[-1] = (None, None, [])  # what UnifiedRadixCache records per submitted backup
        t2 = clock()
        cache.writing_check()
        t3 = clock()
        submit += t1 - t0
        check += t3 - t2
        cc.mem_pool_host.free(host)
    cache.token_to_kv_pool_allocator.free(device)
    return submit / acks, check / acks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--acks", type=int, default=400)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()

    import sglang.srt.mem_cache.pool_host.common as common
    import sglang.srt.mem_cache.pool_host.mha as mha
    import sglang.test.kits.unified_radix_cache.fixtures as kit
    from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector

    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor

    mha.transfer_kv_direct, common.ALLOC_MEMORY_FUNCS["cpu"] = c._transfer_kv_direct, c._alloc_plain
    kit.get_device = lambda *_a, **_k: "cpu"
    metrics = RadixCacheMetricsCollector(labels={"cache_type": "bench"})
    otel = c.Otel()
    instrumentor = SGLangHiCacheInstrumentor()
    setups = {
        "bare": (c.build_hicache("write_through")[0], False),
        "sglang prometheus": (c.build_hicache("write_through", metrics=metrics)[0], False),
        "instrumentor (spans on)": (c.build_hicache("write_through")[0], True),
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in setups}
    for rep in range(args.reps + 1):
        for name, (cache, instrumented) in setups.items():
            if instrumented:
                instrumentor.instrument(telemetry=otel.telemetry, stat_loggers=False)
            result = one_round(cache, args.acks)
            if instrumented:
                instrumentor.uninstrument()
            if rep:  # round 0 warms up
                samples[name].append(result)
        otel.telemetry.flush()
        otel.spans_exporter.clear()

    med = {name: tuple(statistics.median(s[i] for s in runs) / 1000 for i in (0, 1)) for name, runs in samples.items()}
    bare = med["bare"]
    print(f"{'us per ack (median of ' + str(args.reps) + ' rounds)':38s} {'start_writing':>14s} {'writing_check':>14s}")
    for name, (submit, check) in med.items():
        print(f"{name:38s} {submit:14.2f} {check:14.2f}")
    print()
    prom_cost = med["sglang prometheus"][1] - bare[1]
    ours = (med["instrumentor (spans on)"][0] - bare[0], med["instrumentor (spans on)"][1] - bare[1])
    print(f"SGLang prometheus, writing_check delta:     {prom_cost:6.2f} us")
    print(f"instrumentor, start_writing delta:          {ours[0]:6.2f} us")
    print(f"instrumentor, writing_check delta:          {ours[1]:6.2f} us")
    total = ours[0] + ours[1]
    print(f"instrumentor total / SGLang prometheus:     {total:6.2f} us = {total / prom_cost:.2f}x")
    otel.shutdown()


if __name__ == "__main__":
    main()
