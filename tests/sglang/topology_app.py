"""A 2-rank SGLang server's process topology on a CPU, knowing nothing about OpenTelemetry (run by test_topology.py).

The launcher (this file's ``__main__``) does what ``sglang.srt.entrypoints.engine`` does: it starts one scheduler
process per TP rank with the ``spawn`` start method and never imports SGLang itself. Each scheduler does what
``run_scheduler_process`` does first: ``load_plugins()``, then publish its ranks and build SGLang's parallel groups
(gloo), then runs SGLang's real UnifiedRadixCache with HiCache: a backup, then an eviction and a load back, the TP
ranks agreeing on completed acks through the group, then a prefill batch admitting a prompt on that prefix. Any
telemetry comes from our ``sglang.srt.plugins`` entry point and the ``OTEL_*`` environment.

Protocol (one JSON line per event on stdout): each scheduler reports ``counted`` once its second step is counted;
the launcher prints which of ``sglang`` / ``torch`` it imported, SIGKILLs rank 1 with SGLang's ``kill_process_tree``
and lets rank 0 exit normally.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from array import array
from typing import Any

WORLD = 2
TOKENS = 20
NEW = 8  # the admitted prompt's tokens past the cached prefix


def scheduler(rank: int, init_method: str, conn: Any) -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # first thing, as run_scheduler_process does

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from otel_hicache.testing.sglang import build_hicache, init_cpu_parallel, install_cpu_shims

    group = init_cpu_parallel(rank, WORLD, init_method)
    install_cpu_shims()
    cache, allocator, _ = build_hicache("write_through", tp_group=group, kv_size=64)
    key = RadixKey(array("q", range(1, TOKENS + 1)))
    cache.insert(InsertParams(key=key, value=allocator.alloc(TOKENS)))
    cache.flush_pending_backups()
    cache.writing_check()  # device -> host backup, agreed across the ranks

    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor

    telemetry = SGLangHiCacheInstrumentor().telemetry
    assert telemetry is not None, "the plugin did not instrument this scheduler"
    assert telemetry.flush(30.0), "the export process did not answer"  # it is up: the first window is exported

    assert cache.evict(EvictParams(num_tokens=TOKENS)).num_tokens_evicted == TOKENS
    match = cache.match_prefix(MatchPrefixParams(key=key))
    assert cache.load_back(match.best_match_node)
    cache.ready_to_load_host_cache()
    cache.loading_check()  # host -> device load back: the last window, never flushed by this process
    admit(cache, allocator, list(range(1, TOKENS + NEW + 1)))  # a prompt on the loaded-back prefix: a device hit
    telemetry.snapshot()  # returns once the deferred records (acks, the batch split, the capacity feed) are counted
    conn.send("counted")
    conn.recv()  # rank 0 is told to exit; rank 1 is killed while waiting here


def admit(cache: Any, allocator: Any, tokens: list[int]) -> None:
    """One prefill batch of one request, admitted by SGLang's ``PrefillAdder`` and its stats built as the scheduler
    builds them (``PrefillStats.from_adder``), on every rank (TP ranks admit the same batches)."""
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.managers.scheduler_components.metrics_reporter import PrefillStats

    from otel_hicache.testing.sglang import make_request

    req = make_request(tokens, "topology")
    req.init_next_round_input(cache)
    adder = PrefillAdder(cache.page_size, cache, allocator, None, 1.0, 1 << 20, None)
    assert adder.add_one_req(req, False, None) is AddReqResult.CONTINUE
    PrefillStats.from_adder(adder, running_reqs=[])


def main() -> None:
    spawn = multiprocessing.get_context("spawn")  # as sglang.srt.entrypoints.engine sets it
    init_method = f"tcp://127.0.0.1:{sys.argv[1]}"
    children, pipes = [], []
    for rank in range(WORLD):
        ours, theirs = spawn.Pipe()
        child = spawn.Process(target=scheduler, args=(rank, init_method, theirs), name=f"scheduler-tp{rank}")
        child.start()
        children.append(child)
        pipes.append(ours)
    for rank, pipe in enumerate(pipes):
        if not pipe.poll(120):
            raise SystemExit(f"scheduler {rank} did not report")
        assert pipe.recv() == "counted"
        print(json.dumps({"event": "counted", "rank": rank, "pid": children[rank].pid}), flush=True)
    imported = sorted({name.split(".")[0] for name in sys.modules} & {"sglang", "torch"})
    print(json.dumps({"event": "launcher", "imported": imported, "pid": os.getpid()}), flush=True)

    from sglang.srt.utils import kill_process_tree  # how SGLang stops its schedulers

    kill_process_tree(children[1].pid)
    pipes[0].send("exit")
    for child in children:
        child.join(60)
    print(json.dumps({"event": "exit", "codes": [child.exitcode for child in children]}), flush=True)


if __name__ == "__main__":
    main()
