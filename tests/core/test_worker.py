"""The host-side worker (``_internal.host.worker.HostWorker``): on its own thread it builds deferred records oldest
first, reads pool sources and runs engine checks; reads of the counters wait for what is queued; closing counts what
was never built; a worker nobody holds ends its thread."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import metrics, trace

from otel_hicache import semconv as sc
from otel_hicache._internal.host import validation
from otel_hicache._internal.host import worker as worker_module
from otel_hicache._internal.host.consumers import InProcessConsumer
from otel_hicache._internal.host.counting import Tally
from otel_hicache._internal.host.worker import (
    DEFERRED_TICK_S,
    HOST_THREAD_NAME,
    PATIENT_TICK_S,
    TEND_INTERVAL_S,
    HostWorker,
    weakly,
)
from otel_hicache._internal.shared.accumulation import Layout
from otel_hicache._internal.shared.channel import HEADER_INTS
from otel_hicache.records import PoolUsage, TransferRecord
from otel_hicache.semconv import RecordKind, Tier, TransferOperation

KNOWN = {pool: pool for pool in sc.POOLS}


def make(max_queue: int = 64) -> tuple[HostWorker, Tally]:
    tally = Tally(Layout([*sorted(KNOWN), sc.OTHER_POOL], ["kv"], HEADER_INTS), KNOWN)

    def count(record: TransferRecord) -> None:  # the telemetry's record_transfer, without the facade
        tally.transfer(validation.transfer(record, KNOWN))

    worker = HostWorker(tally, count, max_queue=max_queue, interval_s=0.05, shared=False)
    consumer = InProcessConsumer(
        worker.channel,
        trace.NoOpTracerProvider(),
        metrics.NoOpMeterProvider(),
        spans=False,
        token_metrics=True,
        before_collect=lambda: None,
    )
    worker.attach(consumer)
    return worker, tally


@pytest.fixture
def host() -> Iterator[tuple[HostWorker, Tally]]:
    worker, tally = make()
    yield worker, tally
    worker.close(2.0)


def backup(tokens: int) -> TransferRecord:
    return TransferRecord(TransferOperation.BACKUP, {"kv": tokens}, 64 * tokens, 1_000, 2_000)


def kv_tokens(tally: Tally) -> int:
    return tally.snapshot()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")]


def test_deferred_entries_are_built_on_the_host_thread_in_order_and_counted_before_a_read(
    host: tuple[HostWorker, Tally],
) -> None:
    worker, tally = host
    built: list[tuple[str, int]] = []

    def build(entry: tuple[int, int]) -> TransferRecord:
        built.append((threading.current_thread().name, entry[1]))
        return backup(entry[1])

    queue = worker.new_queue(build)
    for tokens in (1, 2, 3):
        queue.put((next(queue.seq), tokens))
    assert worker.settle()
    assert built == [(HOST_THREAD_NAME, 1), (HOST_THREAD_NAME, 2), (HOST_THREAD_NAME, 3)]
    assert kv_tokens(tally) == 6


def test_pool_sources_are_summed_per_tier_and_pool_and_a_failing_one_is_skipped_and_counted(
    host: tuple[HostWorker, Tally],
) -> None:
    worker, tally = host
    worker.pool_sources += [  # registered without starting the thread: this test does the reading
        lambda: [PoolUsage(Tier.HOST, "kv", 10, 100)],
        lambda: [PoolUsage(Tier.HOST, "kv", 5, 50), PoolUsage(Tier.DEVICE, "swa", 1, 2)],
        lambda: 1 / 0,  # type: ignore[list-item, return-value]
    ]
    worker.read_pools()
    assert sorted(tally.channel.counters.pools()) == [("device", "swa", 1, 2), ("host", "kv", 15, 150)]
    assert tally.snapshot()[sc.METRIC_RECORDS_REJECTED][("pool_usage", "source_failed")] == 1
    worker.pool_sources.clear()
    worker.read_pools()  # the last reading is cleared once no source is left
    assert tally.channel.counters.pools() == []


def test_an_engine_check_may_read_the_counters_it_checks(host: tuple[HostWorker, Tally]) -> None:
    worker, tally = host
    seen: list[int] = []

    def check() -> list[str]:
        worker.settle()  # what a check's snapshot() does: no deadlock, no second run of the checks
        worker.run_engine_checks()
        seen.append(kv_tokens(tally))
        return [sc.METRIC_TRANSFER_TOKENS]

    worker.deferred.put_numbered(backup, 9)
    worker.add_engine_check(check)
    assert worker.settle()
    worker.run_engine_checks()
    assert seen and seen[-1] == 9
    assert tally.snapshot()[sc.METRIC_ENGINE_MISMATCH][(sc.METRIC_TRANSFER_TOKENS,)] == len(seen)


def spend_a_slice(entry: tuple[int, int]) -> TransferRecord:
    """A build that outlasts a slice of the host thread (its CPU, not a wait): one build per round."""
    end = time.thread_time_ns() + 2 * worker_module.SLICE_NS
    while time.thread_time_ns() < end:
        pass
    return backup(entry[1])


#: With SLOW_PAUSE_S after each round of one build, these entries take the host thread 10 s at its own pace.
SLOW_PAUSE_S = 0.1
ENTRIES = 100


@pytest.fixture
def slow_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[HostWorker, Tally]]:
    """A worker whose host thread pauses SLOW_PAUSE_S after a busy round, with ENTRIES queued that each fill a round,
    tokens 1 to ENTRIES."""
    monkeypatch.setattr(worker_module, "PAUSE_S", SLOW_PAUSE_S)
    monkeypatch.setattr(worker_module, "BACKLOG_PAUSE_S", SLOW_PAUSE_S)
    worker, tally = make(max_queue=2 * ENTRIES)
    queue = worker.new_queue(spend_a_slice)
    for tokens in range(1, ENTRIES + 1):
        queue.put((next(queue.seq), tokens))
    yield worker, tally
    worker.close(1)


@pytest.mark.parametrize("wait", ["flush", "close", "exit"])
def test_a_flush_or_a_shutdown_has_what_waits_built_without_the_host_threads_pauses(
    slow_host: tuple[HostWorker, Tally], wait: str
) -> None:
    """While a flush, a shutdown or the interpreter's exit waits for the deferred records, the host thread builds them
    back to back (after the pause it may be in): a pause would cost it a wake and the waiting thread a millisecond
    each, for nobody's benefit; at exit, what is not built in half a second is lost."""
    worker, tally = slow_host
    if wait == "flush":
        assert worker.settle(5, hurry=True)
    elif wait == "close":
        worker.close(10)  # half of it for the records
    else:
        worker_module._flush_at_exit()  # half a second for every telemetry
    assert kv_tokens(tally) == sum(range(1, ENTRIES + 1))
    assert tally.snapshot()[sc.METRIC_RECORDS_REJECTED].get(("transfer", "queue_full"), 0) == 0


def test_a_read_of_the_counters_keeps_the_host_threads_pace(slow_host: tuple[HostWorker, Tally]) -> None:
    """A read (a snapshot, an in-process collection) is no reason for the host thread to hold the GIL longer: it
    waits, bounded, and the thread keeps pausing between its rounds."""
    worker, tally = slow_host
    assert not worker.settle(0.3)
    assert kv_tokens(tally) < sum(range(1, ENTRIES + 1)) // 2
    assert worker.settle(5, hurry=True)
    assert kv_tokens(tally) == sum(range(1, ENTRIES + 1))


def test_closing_counts_what_was_never_built_as_shed_and_stops_the_thread() -> None:
    worker, tally = make(max_queue=8)
    release = threading.Event()
    worker.deferred.put_numbered(lambda _: release.wait(30) and None, None)  # the thread hangs in this build
    queue = worker.new_queue(lambda entry: backup(1))
    deadline = time.monotonic() + 5
    while worker.deferred and time.monotonic() < deadline:
        time.sleep(0.001)
    for _ in range(3):
        queue.put((next(queue.seq),))
    thread: Any = worker._thread
    worker.close(0.5)
    release.set()
    thread.join(5)
    assert not thread.is_alive()
    assert tally.snapshot()[sc.METRIC_RECORDS_REJECTED][("transfer", "queue_full")] == 3


def test_a_worker_nobody_holds_ends_its_thread() -> None:
    worker, _ = make()
    worker.deferred.put_numbered(backup, 1)
    worker.want_fast()
    assert worker.settle()
    thread: Any = worker._thread
    del worker
    gc.collect()
    thread.join(5 * TEND_INTERVAL_S)
    assert not thread.is_alive()


def test_a_weak_callback_does_nothing_once_its_object_is_gone() -> None:
    class Counter:
        n = 0

        def add(self, k: int) -> None:
            self.n += k

    counter = Counter()
    add = weakly(counter.add)
    add(2)
    assert counter.n == 2
    del counter
    gc.collect()
    add(3)  # nothing to call, nothing raised


def test_a_pool_source_alone_leaves_an_exporting_hosts_thread_on_its_slow_tick() -> None:
    """Sources are read once a second: a host whose export process does the rest (vLLM's engine core, with its CPU
    tier as a source) is not woken 20 times a second for them; deferred records still get the fast tick."""
    from otel_hicache.sdk import configure
    from otel_hicache.testing.otlp_receiver import OtlpReceiver

    with OtlpReceiver() as rx:
        setup = configure(env={}, endpoint=rx.grpc_endpoint, protocol="grpc")
        try:
            host = setup.telemetry._host
            setup.telemetry.add_pool_usage_source(lambda: [PoolUsage(Tier.HOST, "kv", used=1, limit=2)])
            assert host.started and host.pool_sources and host.tick_s() == TEND_INTERVAL_S
            setup.telemetry.record_transfer_deferred(lambda _: backup(1), None)
            assert host.tick_s() < TEND_INTERVAL_S
        finally:
            setup.shutdown()


def test_patient_queues_alone_wake_an_exporting_hosts_thread_four_times_a_second() -> None:
    """vLLM's engine core feeds the capacity estimator (an estimate published once a second) and queues counts that
    every read waits for: neither needs a 50 ms tick (20 wakes a second of a thread that takes the engine's GIL); they
    are still all built, and deferred records still get the fast tick."""
    from otel_hicache.capacity import TierCapacity
    from otel_hicache.sdk import configure
    from otel_hicache.testing.otlp_receiver import OtlpReceiver

    with OtlpReceiver() as rx:
        setup = configure(env={}, endpoint=rx.grpc_endpoint, protocol="grpc")
        try:
            telemetry = setup.telemetry
            host = telemetry._host
            feed = telemetry.capacity_feed(16, [TierCapacity(Tier.DEVICE, 1024)])
            for i in range(3):
                feed.put((next(feed.seq), [i, i + 1], 32))
            splits = telemetry.deferred_queue(
                lambda entries: telemetry.record_prefix_splits(row for _, row in entries),
                batched=True,
                kind=RecordKind.PREFIX_SPLIT,
                patient=True,
            )
            splits.put((next(splits.seq), (32, 0, 16, 0, 0)))
            assert host.started and not host.fast_ready and host.tick_s() == PATIENT_TICK_S
            assert host.settle() and host.waiting() == 0
            assert telemetry.snapshot()["hicache.prefill.tokens"][("host_hit",)] == 16
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:  # a forked child (its own thread and exporter): its deferred records get the fast tick too
                try:
                    ticks = [host.tick_s()]
                    telemetry.record_transfer_deferred(lambda _: backup(1), None)
                    os.write(write_end, repr([*ticks, host.tick_s()]).encode())
                finally:
                    os._exit(0)
            os.close(write_end)
            in_child = os.read(read_end, 100).decode()
            os.waitpid(pid, 0)
            assert in_child == repr([PATIENT_TICK_S, DEFERRED_TICK_S])
            telemetry.record_transfer_deferred(lambda _: backup(1), None)
            assert host.fast_ready and host.tick_s() == DEFERRED_TICK_S
        finally:
            setup.shutdown()
