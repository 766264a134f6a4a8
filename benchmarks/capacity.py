"""What the capacity estimator costs per admitted request (``hicache.capacity.hit_ratio``), for a 4,096-token prompt.

* **Scheduler thread**: ``feed.put((next(feed.seq), payload, prompt_tokens))``, the producer's whole share, timed with
  ``time.perf_counter_ns()`` around batches while the telemetry's host thread runs (goal: about 1 us).
* **Host process CPU**: what the host thread spends on one lookup (``time.process_time_ns()`` around
  :meth:`~otel_hicache.capacity.CapacityFeed.build`, the host thread's call), with the page keys given (vLLM's block
  hashes) and computed from the token ids (:func:`~otel_hicache.capacity.page_keys`, SGLang), with only inclusive
  tiers and with an exclusive (write-back) one, while every page is sampled (a working set under 8,192 pages) and in
  the steady state of a large one (every prompt new: the sampling rate has dropped far below 1).
* **The hot path with the estimator on**: ``record_transfer`` per call on the calling thread, with and without a
  producer feeding a 4,096-token lookup every 4 transfers (the host thread then builds lookups beside it).
* **The host thread of a host whose only deferred work is the estimator** (vLLM's engine core), exporting over OTLP
  to a receiver in this process: its wakes (voluntary context switches, ``/proc``) and CPU per second, idle and at
  ``ADMISSIONS_PER_S`` admissions a second (block hashes given). Every wake takes the host's GIL.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

from benchmarks._common import Table, host_thread_id, median, thread_cpu_ns
from otel_hicache._internal.host.worker import DEFERRED_TICK_S, PATIENT_TICK_S
from otel_hicache.capacity import TierCapacity, page_keys
from otel_hicache.records import TransferRecord
from otel_hicache.semconv import Tier, TimingSource, TransferOperation
from otel_hicache.telemetry import HiCacheTelemetry
from otel_hicache.testing.otlp_receiver import OtlpReceiver
from otel_hicache.testing.sdk import make_sdk

PROMPT_TOKENS = 4096
PAGE = 16
PAGES = PROMPT_TOKENS // PAGE
INCLUSIVE = (TierCapacity(Tier.DEVICE, 1 << 20), TierCapacity(Tier.HOST, 1 << 22))
EXCLUSIVE = (TierCapacity(Tier.DEVICE, 1 << 20), TierCapacity(Tier.HOST, 1 << 22, inclusive=False))
PUT_GOAL_NS = 1_000
ADMISSIONS_PER_S = 50


@dataclass
class Params:
    puts: int = 20_000
    lookups: int = 400  # timed, per variant
    warm: int = 600  # lookups of new prompts before the steady state is timed (8,192 pages sampled long before)
    transfers: int = 20_000
    wake_seconds: float = 5.0  # per phase (idle, admitting)

    @classmethod
    def smoke(cls) -> Params:
        return cls(puts=200, lookups=5, warm=40, transfers=200, wake_seconds=1.0)


def _record() -> TransferRecord:
    return TransferRecord(TransferOperation.BACKUP, {"kv": 256}, 1 << 20, 10, 20, 0.001, TimingSource.HOST_CLOCK)


def _put_ns(params: Params) -> float:
    """Median scheduler-thread cost of one put, over batches of 100, the host thread building meanwhile."""
    sdk = make_sdk(spans=False)
    try:
        feed = sdk.telemetry.capacity_feed(PAGE, INCLUSIVE)
        hashes = list(range(PAGES))
        batches = []
        for _ in range(max(1, params.puts // 100)):
            t0 = time.perf_counter_ns()
            for _ in range(100):
                feed.put((next(feed.seq), hashes, PROMPT_TOKENS))
            batches.append((time.perf_counter_ns() - t0) / 100)
            sdk.telemetry.snapshot()  # let the host thread drain: no shedding
        return median(batches)
    finally:
        sdk.shutdown()


def _build_cpu_ns(params: Params, *, computed: bool, exclusive: bool, steady: bool) -> float:
    """Host CPU per lookup: ``feed.build`` on this thread (the host thread's call), median per lookup."""
    sdk = make_sdk(spans=False)
    rng = random.Random(1)
    try:
        keys = (lambda ids: page_keys(ids, PAGE)) if computed else None
        feed = sdk.telemetry.capacity_feed(PAGE, EXCLUSIVE if exclusive else INCLUSIVE, keys)
        shared = [[rng.randrange(32_000) for _ in range(PROMPT_TOKENS)] for _ in range(16)]  # 4,096 pages in all
        serial = iter(range(1 << 62))

        def lookup() -> list[int]:
            if steady:  # a new prompt every time: the sample fills, then the rate keeps dropping
                base = next(serial) * PAGES
                ids = [base + i for i in range(PROMPT_TOKENS)] if computed else list(range(base, base + PAGES))
                return ids
            prompt = rng.choice(shared)
            return prompt if computed else list(page_keys(prompt, PAGE))

        for _ in range(params.warm if steady else 0):
            feed.build((0, lookup(), PROMPT_TOKENS))
        samples = []
        for _ in range(params.lookups):
            payload = lookup()
            t0 = time.process_time_ns()
            feed.build((0, payload, PROMPT_TOKENS))
            samples.append(time.process_time_ns() - t0)
        return median(samples)
    finally:
        sdk.shutdown()


def _transfer_ns(params: Params, telemetry: HiCacheTelemetry, feed_every: int | None) -> float:
    """Median calling-thread wall time of record_transfer, over batches of 100."""
    record = _record()
    feed = telemetry.capacity_feed(PAGE, INCLUSIVE) if feed_every else None
    hashes = [[random.Random(i).getrandbits(60) for _ in range(PAGES)] for i in range(64)]
    batches = []
    for batch in range(max(1, params.transfers // 100)):
        t0 = time.perf_counter_ns()
        for _ in range(100):
            telemetry.record_transfer(record)
        batches.append((time.perf_counter_ns() - t0) / 100)
        if feed is not None and feed_every:  # outside the timed batch: the hot path is record_transfer's
            for i in range(100 // feed_every):
                feed.put((next(feed.seq), hashes[(batch + i) % 64], PROMPT_TOKENS))
    return median(batches)


def _host_thread(tid: int) -> tuple[int, int]:
    """(voluntary context switches, CPU ns) of this process's thread ``tid`` so far."""
    with open(f"/proc/self/task/{tid}/status") as f:
        switches = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return switches, thread_cpu_ns(os.getpid(), tid)


def _estimator_only_wakes(params: Params) -> dict[str, tuple[float, float]]:
    """Per phase ('idle', 'admitting'): the host thread's (wakes, CPU ns) per second, over OTLP with the estimator
    as its only deferred work."""
    from otel_hicache.sdk import configure

    prompts = [[random.Random(i).getrandbits(60) for _ in range(PAGES)] for i in range(64)]
    found: dict[str, tuple[float, float]] = {}
    with OtlpReceiver() as receiver:
        setup = configure(env={}, endpoint=receiver.grpc_endpoint, protocol="grpc")
        try:
            feed = setup.telemetry.capacity_feed(PAGE, INCLUSIVE)
            tid = host_thread_id()
            assert tid is not None, "configure() over OTLP starts the host thread"
            time.sleep(1.0)  # the export process's start is not a phase's
            for phase in ("idle", "admitting"):
                switches, cpu_ns = _host_thread(tid)
                start = time.monotonic()
                for n in range(int(params.wake_seconds * ADMISSIONS_PER_S)):
                    if phase == "admitting":
                        feed.put((next(feed.seq), prompts[n % 64], PROMPT_TOKENS))
                    time.sleep(max(0.0, start + (n + 1) / ADMISSIONS_PER_S - time.monotonic()))
                elapsed = time.monotonic() - start
                switches_after, cpu_after = _host_thread(tid)
                found[phase] = ((switches_after - switches) / elapsed, (cpu_after - cpu_ns) / elapsed)
        finally:
            setup.shutdown()
    return found


def run(params: Params, command: str) -> Table:
    table = Table(
        key="capacity",
        title="Capacity estimator: cost per admitted 4,096-token request (16-token pages)",
        columns=["Where", "Variant", "Cost per request"],
        command=command,
    )
    put = _put_ns(params)
    table.rows.append(["scheduler thread", "feed.put (a tuple and a deque append)", f"{put:.0f} ns"])
    data: dict[str, float] = {"put_ns": put}
    for steady in (False, True):
        for computed in (False, True):
            for exclusive in (False, True):
                cpu = _build_cpu_ns(params, computed=computed, exclusive=exclusive, steady=steady)
                variant = (
                    f"{'keys computed from token ids' if computed else 'block hashes given'}, "
                    f"{'write-back host (simulated)' if exclusive else 'inclusive tiers'}, "
                    f"{'steady state, new prompts (sampled)' if steady else 'every page sampled'}"
                )
                table.rows.append(["host thread CPU", variant, f"{cpu / 1000:.1f} us"])
                data[f"build_ns/{int(steady)}{int(computed)}{int(exclusive)}"] = cpu
    for label, every in (("off", None), ("on: a lookup every 4 transfers", 4)):
        sdk = make_sdk(spans=False)
        try:
            cost = _transfer_ns(params, sdk.telemetry, every)
        finally:
            sdk.shutdown()
        table.rows.append(["scheduler thread", f"record_transfer, estimator {label}", f"{cost:.0f} ns"])
        data[f"record_transfer_ns/{label}"] = cost
    for phase, (wakes, cpu_ns) in _estimator_only_wakes(params).items():
        variant = "idle" if phase == "idle" else f"{ADMISSIONS_PER_S} admissions/s"
        per = f"{wakes:.1f} wakes/s, {cpu_ns / 1e6:.2f} ms CPU/s"
        if phase != "idle":
            per += f" ({cpu_ns / ADMISSIONS_PER_S / 1000:.0f} us per request)"
        table.rows.append(["host thread, estimator its only deferred work (OTLP)", variant, per])
        data[f"host_wakes_per_s/{phase}"], data[f"host_cpu_ns_per_s/{phase}"] = wakes, cpu_ns
    table.data = data
    table.notes.append(
        f"Goal: about {PUT_GOAL_NS} ns on the scheduler thread per admitted request; the host thread's CPU per "
        "request is small next to its prefill (tens of milliseconds for 4,096 tokens on a GPU, seconds on a CPU)."
    )
    table.notes.append(
        "Medians. 'every page sampled': 16 shared prompts (4,096 pages); 'steady state': every prompt new, so the "
        "sample (8,192 pages) is full and its rate keeps dropping; computing keys costs a hash per 16-token page."
    )
    table.notes.append(
        f"'estimator its only deferred work': configure() over OTLP gRPC to a receiver in this process, "
        f"{params.wake_seconds:g} s per phase, {ADMISSIONS_PER_S} admissions a second of 64 prompts (block hashes "
        "given); wakes = the host thread's voluntary context switches (each takes the host's GIL), CPU = its "
        f"schedstat time. The thread looks for lookups every {PATIENT_TICK_S:g} s here (PATIENT_TICK_S), every "
        f"{DEFERRED_TICK_S * 1e3:g} ms once deferred records come, and pauses 1 ms after each 50 us slice."
    )
    return table
