"""What the capacity estimator costs each engine per admitted request: the scheduler thread, and the host process.

Run in each engine's venv::

    .venv-sglang/bin/python -m benchmarks.engine_capacity sglang
    .venv-vllm/bin/python -m benchmarks.engine_capacity vllm

* **Scheduler thread**: vLLM: the admission method wrapped as the instrumentor wraps it (wrapt, the failure-rule guard
  of :mod:`otel_hicache.integrations._base`, our hook handing the request over), called on a real admitted request
  (vLLM's ``Request`` with vLLM's own block hasher), minus the same call of an unwrapped no-op standing in for the
  engine's method: what instrumenting adds per admission; embedded (a reference queued for the host thread), and
  exporting over OTLP (the block hashes joined into the id ring for the export process), at 4,096 and 80 tokens.
  SGLang: what its batch's wrapper (``PrefillStats.from_adder``) does per admitted request (a batch of one real
  ``Req`` from a real ``PrefillAdder`` admission, a request of its own each time), and apart, what any wrapper costs
  per batch. Thread CPU time, median of blocks.
* **Host process**: the telemetry host thread's work for one admitted 4,096-token request - its page keys (SGLang:
  hashed from its token ids, at page sizes 1 and 16; vLLM: its own block hashes, 16-token blocks) and the estimator's
  update - on a model warmed with 5,000 requests of a Zipf-over-documents workload (sampling at its fixed size); and
  per request of that workload itself (prompts of ~830 tokens on average), once the first 3,000 have filled the
  sample.
* **How long the host thread holds the GIL at a stretch** (SGLang): while it builds 40 such lookups at its own pace,
  its CPU time between two of its pauses (each lets the scheduler thread have the GIL; garbage collection off
  meanwhile: a collection of a large heap runs on whichever thread triggers it): the 99th percentile and the longest,
  and how many pauses it takes per lookup (each a round the scheduler thread pays for: a wake and two hand-overs of
  the GIL, ``benchmarks sglang``'s control).
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import itertools
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, SupportsIndex

PROMPT_TOKENS = 4096
WARM_REQUESTS = 5_000
FILLED = 3_000


def _thread_ns(call: Callable[[], object], n: int, blocks: int = 15, pause_s: float = 0.0) -> float:
    """Median over ``blocks`` of the thread CPU per call of ``call``, ``n`` calls a block, ``pause_s`` between
    blocks (untimed: an export process reads the id ring meanwhile)."""
    per_call = []
    for _ in range(blocks):
        t0 = time.thread_time_ns()
        for _ in range(n):
            call()
        per_call.append((time.thread_time_ns() - t0) / n)
        time.sleep(pause_s)
    return statistics.median(per_call)


def _wrapped_cost(
    hook: Any, instance: Any, args: tuple[Any, ...], n: int = 20_000, blocks: int = 15, pause_s: float = 0.0
) -> float:
    """Thread CPU (ns) the instrumentation adds to one admission: ``hook`` installed as the instrumentor installs it,
    around a no-op standing in for the engine's method, minus that no-op called bare (``blocks`` of ``n`` calls,
    ``pause_s`` between them)."""
    import wrapt

    from otel_hicache.integrations._patching import AdapterSwitch, guarded

    def admission(*_: Any) -> None:
        return None

    method = wrapt.FunctionWrapper(admission, guarded(hook, "bench", "capacity", AdapterSwitch("bench")))
    bound = method.__get__(instance, type(instance))  # a method call on the engine's object, as in the engine
    return _thread_ns(lambda: bound(*args), n, blocks, pause_s) - _thread_ns(lambda: admission(instance, *args), n)


def _passthrough(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A hook that only calls the engine's method: the cost of being wrapped at all."""
    return wrapped(*args, **kwargs)


def _warm(feed: Any, payload: Callable[[list[int]], Any]) -> float:
    """Feed ``feed`` :data:`WARM_REQUESTS` lookups of a Zipf-over-documents workload (prompts of ~830 tokens on
    average); the thread CPU per lookup (ns) of those after the first :data:`FILLED` (the sample full by then)."""
    from otel_hicache.testing.workloads import documents

    entries = [(0, payload(p), len(p)) for p in itertools.islice(documents(seed=3, count=2000, scale=4), WARM_REQUESTS)]
    for entry in entries[:FILLED]:
        feed.build(entry)
    t0 = time.thread_time_ns()
    for entry in entries[FILLED:]:
        feed.build(entry)
    return (time.thread_time_ns() - t0) / (WARM_REQUESTS - FILLED)


def _longest_holds(telemetry: Any, feed: Any, entry: tuple[int, Any, int], lookups: int) -> tuple[float, float, float]:
    """The telemetry's host thread's stretches of work between two of its pauses (each pause lets the scheduler thread
    have the GIL) while it builds ``lookups`` copies of ``entry`` at its own pace: CPU time (no wait for the GIL in it),
    the 99th percentile and the longest, ns, and its pauses per lookup (each a round for the scheduler thread: a wake
    and two hand-overs of the GIL). Its pauses are seen by wrapping ``time.sleep`` meanwhile."""
    from otel_hicache._internal.host.worker import HOST_THREAD_NAME

    host = telemetry._host  # its HostWorker: the queue is drained when nothing waits and nothing is being built
    sleep, last, holds = time.sleep, [0], []

    def timed(seconds: float | SupportsIndex) -> None:
        if threading.current_thread().name == HOST_THREAD_NAME:
            now = time.thread_time_ns()
            if last[0]:
                holds.append(now - last[0])
            sleep(seconds)
            last[0] = time.thread_time_ns()
        else:
            sleep(seconds)

    for _ in range(lookups):
        feed.put((next(feed.seq), *entry[1:]))
    gc.collect()
    gc.disable()  # a collection of this process's large heap runs on whichever thread triggers it, for milliseconds
    time.sleep = timed
    try:
        host._wake.set()  # a patient queue: taken at the next tick, now
        while host.waiting() or host._building:
            sleep(0.001)
    finally:
        time.sleep = sleep
        gc.enable()
    pauses = len(holds) + 1
    holds.sort()
    return holds[int(0.99 * len(holds))], holds[-1], pauses / lookups


def _sampled_keys(model: Any, req: Any, page: int) -> tuple[int, list[int]]:
    """Every page key of SGLang's request ``req`` and its sampling hash, the sampled ones kept: the estimator's work
    before its model's (it reads them lazily, with the lookup)."""
    from otel_hicache.integrations.sglang.capacity import request_keys

    return model.sample(request_keys(req, page), PROMPT_TOKENS)


def _row(engine: str, what: str, ns: float) -> str:
    return f"| {engine} | {what} | {ns / 1000:,.2f} |"


def sglang() -> list[str]:
    import logging

    from opentelemetry.sdk.metrics import MeterProvider

    from otel_hicache.capacity import TierCapacity
    from otel_hicache.integrations._base import ProcessSink
    from otel_hicache.integrations.sglang.capacity import CapacityHooks, request_keys
    from otel_hicache.semconv import Engine, Tier
    from otel_hicache.telemetry import HiCacheTelemetry
    from otel_hicache.testing.sglang import install_cpu_shims, make_request
    from otel_hicache.testing.sglang_serving import Served

    logging.getLogger("sglang").setLevel(logging.ERROR)
    install_cpu_shims()
    from sglang.srt.managers.schedule_policy import PrefillAdder

    telemetry = HiCacheTelemetry(meter_provider=MeterProvider())
    # The host thread's part first: the scheduler thread's hands over lookups by the thousand, which its host thread
    # would build meanwhile.
    host_rows = []
    for page in (1, 16):
        tiers = (TierCapacity(Tier.DEVICE, 1 << 20), TierCapacity(Tier.HOST, 1 << 21))
        feed = telemetry.capacity_feed(page, tiers, keys=functools.partial(request_keys, page_tokens=page))
        mixed = _warm(feed, lambda prompt: make_request(prompt, "warm"))
        what = f"host thread, Zipf over documents (~830 tokens a prompt), page {page}: keys + model"
        host_rows.append(_row("SGLang 0.5.23", what, mixed))
        request = make_request(list(range(7, 7 + PROMPT_TOKENS)), "bench")
        entry = (0, request, PROMPT_TOKENS)
        keys = _thread_ns(functools.partial(_sampled_keys, feed._model, request, page), 20, blocks=7)
        total = _thread_ns(functools.partial(feed.build, entry), 20, blocks=7)
        host_rows.append(_row("SGLang 0.5.23", f"host thread, 4,096-token request, page {page}: keys, sampled", keys))
        host_rows.append(_row("SGLang 0.5.23", f"host thread, 4,096-token request, page {page}: keys + model", total))
        p99, longest, pauses = _longest_holds(telemetry, feed, entry, 40)
        what = f"host thread's CPU between two pauses while it builds those, page {page}: p99 / longest"
        host_rows.append(f"| SGLang 0.5.23 | {what} | {p99 / 1000:,.0f} / {longest / 1000:,.0f} |")
        host_rows.append(f"| SGLang 0.5.23 | and its pauses per lookup, page {page} | {pauses:.2f} |")

    served = Served("write_through", 8192, 16384, page_size=16)
    req = make_request(list(range(1, PROMPT_TOKENS + 1)), "bench")
    req.init_next_round_input(served.cache)
    adder = PrefillAdder(16, served.cache, served.allocator, None, 1.0, 1 << 20, None)
    hooks = CapacityHooks(ProcessSink(Engine.SGLANG, telemetry=telemetry))
    hooks.feed(adder)  # the feed exists from the first admission on
    n, blocks = 2_000, 15
    requests = [copy.copy(req) for _ in range(n * blocks * 2)]  # a request of its own per batch
    for i, each in enumerate(requests):
        each.rid = f"bench-{i}"
    admitted = iter(requests)

    def batch_of_one() -> None:
        adder.can_run_list = [next(admitted)]

    def admissions() -> None:
        batch_of_one()
        hooks.admissions(adder)

    cost = _thread_ns(admissions, n, blocks) - _thread_ns(batch_of_one, n, blocks)
    rows = [_row("SGLang 0.5.23", "scheduler thread: in its batch's `from_adder` wrapper", cost)]
    guard = _wrapped_cost(_passthrough, adder, (req, None, 0))
    rows.append(
        _row("SGLang 0.5.23", "and per batch: any wrapper of the instrumentor (wrapt + failure-rule guard)", guard)
    )
    served.close()
    telemetry.shutdown()
    return rows + host_rows


def vllm() -> list[str]:
    from opentelemetry.sdk.metrics import MeterProvider
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from otel_hicache import semconv as sc
    from otel_hicache._internal.shared.ids import ARENA_BYTES
    from otel_hicache.capacity import TierCapacity
    from otel_hicache.integrations._base import ProcessSink
    from otel_hicache.integrations.vllm.capacity import CapacityHooks
    from otel_hicache.integrations.vllm.cpu_tier import CpuTierHooks
    from otel_hicache.integrations.vllm.instrumentor import vllm_ranks
    from otel_hicache.sdk import configure
    from otel_hicache.semconv import Engine, Tier
    from otel_hicache.telemetry import HiCacheTelemetry

    block = 16
    hash_fn = get_hash_fn_by_name("sha256_cbor")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(block, hash_fn)

    def request(tokens: list[int]) -> Any:
        return Request("bench", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)

    rows = []
    telemetry = HiCacheTelemetry(meter_provider=MeterProvider())
    sink = ProcessSink(Engine.VLLM, telemetry=telemetry)
    hooks = CapacityHooks(sink, vllm_ranks, CpuTierHooks(sink, vllm_ranks).policies)
    feed = telemetry.capacity_feed(block, (TierCapacity(Tier.DEVICE, 1 << 20), TierCapacity(Tier.HOST, 1 << 21)))
    hooks._started, hooks._feed = True, feed  # as after the first admission (which reads the KVCacheManager)
    admitted = request(list(range(1, PROMPT_TOKENS + 1)))
    cost = _wrapped_cost(hooks.admitted, None, (admitted, 0))
    rows.append(_row("vLLM 0.32", "scheduler thread: `record_prefix_cache_stats` wrapped", cost))
    guard = _wrapped_cost(_passthrough, None, (admitted, 0))
    rows.append(_row("vLLM 0.32", "of which any wrapper of the instrumentor (wrapt + failure-rule guard)", guard))
    mixed = _warm(feed, lambda prompt: request(prompt).block_hashes)
    rows.append(_row("vLLM 0.32", "host thread, Zipf over documents (~830 tokens a prompt), block 16: model", mixed))
    entry = (0, request(list(range(7, 7 + PROMPT_TOKENS))).block_hashes, PROMPT_TOKENS)
    model = _thread_ns(functools.partial(feed.build, entry), 20, blocks=7)
    rows.append(_row("vLLM 0.32", "host thread, 4,096-token request, block 16: model (keys: vLLM's)", model))
    telemetry.shutdown()
    # Exporting over OTLP (a collector nobody listens at: the hand-over does not depend on it), the block hashes go to
    # the export process: joined into the id ring on the scheduler thread, blocks of at most half the ring's records.
    setup = configure(env={}, endpoint="http://127.0.0.1:9", protocol="grpc")
    otlp = ProcessSink(Engine.VLLM, telemetry=setup.telemetry)
    hooks = CapacityHooks(otlp, vllm_ranks, CpuTierHooks(otlp, vllm_ranks).policies)
    feed = setup.telemetry.capacity_feed(block, (TierCapacity(Tier.DEVICE, 1 << 20), TierCapacity(Tier.HOST, 1 << 21)))
    hooks._started, hooks._feed = True, feed
    for tokens in (PROMPT_TOKENS, 80):
        admitted = request(list(range(1, tokens + 1)))
        fits = ARENA_BYTES // (32 * (len(admitted.block_hashes) + 1))  # sha256: 32 bytes a block, and the header
        cost = _wrapped_cost(hooks.admitted, None, (admitted, 0), n=min(2_000, fits // 2), blocks=41, pause_s=0.25)
        what = f"scheduler thread, over OTLP: `record_prefix_cache_stats` wrapped, {tokens:,} tokens (id ring)"
        rows.append(_row("vLLM 0.32", what, cost))
    rejected = setup.telemetry.snapshot()[sc.METRIC_RECORDS_REJECTED]
    setup.shutdown(timeout_s=1)
    if sum(rejected.values()):
        raise SystemExit(f"lookups were refused, so the figure is not the hand-over's: {rejected}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=("sglang", "vllm"))
    args = parser.parse_args()
    rows = sglang() if args.engine == "sglang" else vllm()
    print("| engine | per admitted request | us |")
    print("|---|---|---|")
    print("\n".join(rows))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
