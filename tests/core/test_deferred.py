"""A producer's own deferred queue (``HiCacheTelemetry.deferred_queue``): the producer puts entries with two C calls,
the host thread builds them in order, and whatever cannot be kept is shed and counted exactly."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

from otel_hicache import semconv as sc
from otel_hicache._internal.host.deferred import DeferredQueue
from otel_hicache._internal.host.worker import BATCH_ENTRIES
from otel_hicache.records import TransferRecord
from otel_hicache.semconv import TransferOperation
from otel_hicache.testing.sdk import Sdk, make_sdk

SHED = ("transfer", "queue_full")


def backup(tokens: int) -> TransferRecord:
    return TransferRecord(TransferOperation.BACKUP, {"kv": tokens}, 64 * tokens, 1_000, 2_000)


def backup_entry(entry: tuple[int, int]) -> TransferRecord:
    return backup(entry[1])


@pytest.fixture
def small() -> Iterator[Sdk]:
    sdk = make_sdk(max_queue=4)
    yield sdk
    sdk.telemetry.shutdown(1.0)


def counted(sdk: Sdk) -> tuple[int, int]:
    """(backup tokens counted, records shed) as the telemetry holds them now."""
    snap = sdk.telemetry.snapshot()
    return snap[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")], snap[sc.METRIC_RECORDS_REJECTED].get(SHED, 0)


def hold_the_host_thread(sdk: Sdk) -> threading.Event:
    """Make the host thread hang in a build (record_transfer_deferred's queue is taken first); set to release."""
    release = threading.Event()
    sdk.telemetry.record_transfer_deferred(lambda _: backup(1000) if release.wait(30) else None, None)
    deadline = time.monotonic() + 5
    while sdk.telemetry._host.deferred and time.monotonic() < deadline:
        time.sleep(0.001)
    return release


def test_entries_are_built_on_the_host_thread_in_order_and_none_reports_nothing(small: Sdk) -> None:
    built: list[tuple[str, int]] = []

    def build(entry: tuple[int, int]) -> TransferRecord | None:
        tokens = entry[1]
        built.append((threading.current_thread().name, tokens))
        return None if tokens == 0 else backup(tokens)

    queue = small.telemetry.deferred_queue(build)
    put, seq = queue.put, queue.seq  # what a producer caches
    for tokens in (3, 0, 5):
        put((next(seq), tokens))
    assert small.telemetry.flush()
    assert built == [("otel-hicache-host", 3), ("otel-hicache-host", 0), ("otel-hicache-host", 5)]
    assert counted(small) == (8, 0)  # the None entry is neither counted nor a rejection


def test_entries_past_the_bound_are_shed_oldest_first_and_each_is_counted(small: Sdk) -> None:
    queue = small.telemetry.deferred_queue(backup_entry)
    release = hold_the_host_thread(small)
    for tokens in range(1, 11):  # 10 entries into a queue of 4, nobody taking
        queue.put((next(queue.seq), tokens))
    assert len(queue) == 4
    release.set()
    assert small.telemetry.flush()
    assert counted(small) == (1000 + 7 + 8 + 9 + 10, 6)  # the newest 4 built, the 6 oldest shed and counted


def test_a_batched_queue_builds_every_entry_waiting_in_one_call_and_counts_what_was_shed_among_them(
    small: Sdk,
) -> None:
    calls: list[list[int]] = []

    def build(entries: list[tuple[int, int]]) -> None:
        calls.append([tokens for _, tokens in entries])
        for _, tokens in entries:
            small.telemetry.record_transfer(backup(tokens))

    queue = small.telemetry.deferred_queue(build, batched=True)
    release = hold_the_host_thread(small)
    for tokens in range(1, 8):  # 7 entries into a queue of 4, nobody taking: the 3 oldest shed
        queue.put((next(queue.seq), tokens))
    release.set()
    assert small.telemetry.flush()
    assert calls == [[4, 5, 6, 7]]  # one call, oldest first
    assert counted(small) == (1000 + 4 + 5 + 6 + 7, 3)


def test_a_batched_build_gets_at_most_a_bounded_batch_however_many_wait() -> None:
    sdk = make_sdk(max_queue=100)
    sizes: list[int] = []

    def build(entries: list[tuple[int, int]]) -> None:
        sizes.append(len(entries))
        for _, tokens in entries:
            sdk.telemetry.record_transfer(backup(tokens))

    queue = sdk.telemetry.deferred_queue(build, batched=True)
    release = hold_the_host_thread(sdk)
    for _ in range(3 * BATCH_ENTRIES + 1):  # what waits after a stall: built in slices, a batch a call
        queue.put((next(queue.seq), 1))
    release.set()
    assert sdk.telemetry.flush()
    assert sizes == [BATCH_ENTRIES] * 3 + [1]
    assert counted(sdk) == (1000 + 3 * BATCH_ENTRIES + 1, 0)
    sdk.telemetry.shutdown(1.0)


def test_a_discard_racing_a_batch_take_leaves_each_entry_counted_once() -> None:
    """A close that gave up waiting for the host thread discards what is queued while that thread takes a batch:
    every entry is then counted once, as never built, and none is built as well; the next entry is no gap."""
    queue = DeferredQueue(lambda entries: None, 100, batched=True)
    deque = queue._entries
    counted_by_discard: list[int] = []

    class Racing:  # the deque, whose second popleft lets the closing thread in
        def __init__(self) -> None:
            self.pops = 0

        def popleft(self) -> tuple[int, int]:
            entry = deque.popleft()
            self.pops += 1
            if self.pops == 2:
                counted_by_discard.append(queue.discard())
            return entry

        def clear(self) -> None:
            deque.clear()

    for tokens in range(4):
        queue.put((next(queue.seq), tokens))
    queue._entries = Racing()  # type: ignore[assignment]
    assert queue.take_batch(16) == (0, [])
    assert counted_by_discard == [4]
    queue._entries = deque
    queue.put((next(queue.seq), 9))
    assert queue.take_batch(16)[0] == 0


def test_a_batch_whose_build_raises_counts_each_of_its_entries_as_refused(small: Sdk) -> None:
    def broken(entries: list[tuple[int, int]]) -> None:
        raise RuntimeError("a bug in the build, before it reported anything")

    queue = small.telemetry.deferred_queue(broken, batched=True)
    release = hold_the_host_thread(small)
    for tokens in (1, 2, 3):
        queue.put((next(queue.seq), tokens))
    release.set()
    assert small.telemetry.flush()
    failed = small.telemetry.snapshot()[sc.METRIC_RECORDS_REJECTED][("transfer", "build_failed")]
    assert failed == 3


def test_entries_never_built_by_shutdown_are_counted_as_shed() -> None:
    sdk = make_sdk(max_queue=4)
    queue = sdk.telemetry.deferred_queue(backup_entry)
    release = hold_the_host_thread(sdk)
    for tokens in range(1, 7):  # 2 shed on the way in, 4 still queued at shutdown
        queue.put((next(queue.seq), tokens))
    sdk.telemetry.shutdown(1.0)
    release.set()
    assert counted(sdk)[1] == 6


def test_a_closed_queue_is_dropped_once_drained(small: Sdk) -> None:
    queue = small.telemetry.deferred_queue(backup_entry)
    queue.put((next(queue.seq), 2))
    queue.close()
    assert small.telemetry.flush()
    assert counted(small) == (2, 0)
    deadline = time.monotonic() + 5
    while queue in small.telemetry._host.queues and time.monotonic() < deadline:
        time.sleep(0.005)
    assert queue not in small.telemetry._host.queues


def test_a_forked_child_builds_its_own_entries_and_none_of_the_parents(small: Sdk) -> None:
    queue = small.telemetry.deferred_queue(backup_entry)
    release = hold_the_host_thread(small)
    queue.put((next(queue.seq), 7))  # the parent's, unbuilt at the fork
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own telemetry from zero, its own host thread
        try:
            queue.put((next(queue.seq), 3))
            os.write(write_end, repr(counted(small)).encode())  # a read of the counters waits for the build
        finally:
            os._exit(0)
    os.close(write_end)
    child = os.read(read_end, 100).decode()
    os.waitpid(pid, 0)
    release.set()
    assert small.telemetry.flush()
    assert child == repr((3, 0))  # built in the child (no call started its host thread), the parent's 7 not there
    assert counted(small) == (1000 + 7, 0)


def test_entries_put_after_shutdown_are_counted_as_shed_not_lost() -> None:
    sdk = make_sdk(max_queue=4)
    queue = sdk.telemetry.deferred_queue(backup_entry)
    sdk.telemetry.shutdown(1.0)
    for tokens in (1, 2, 3):  # a producer still running (a scheduler consuming acks) after shutdown
        queue.put((next(queue.seq), tokens))
    late = sdk.telemetry.deferred_queue(backup_entry)  # a producer's first entry after shutdown
    late.put((next(late.seq), 4))
    assert counted(sdk) == (0, 4)  # as record_transfer_deferred after shutdown: each one counted, none built
    assert counted(sdk) == (0, 4)  # and counted once
