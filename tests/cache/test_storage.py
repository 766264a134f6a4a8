"""The L3 file store: background threads, shutdown with work in flight, real faults, corrupted entries."""

from __future__ import annotations

import errno
import logging
import os
import threading

import pytest
import torch

from otel_hicache import semconv as sc
from otel_hicache.cache.content import page_content, page_hashes
from otel_hicache.cache.pools import PoolGroup
from otel_hicache.cache.storage import FileStore, StorageJob
from otel_hicache.semconv import Tier, TransferOperation
from tests.cache.support import POOLS

PS = 4
MODEL = "test-model"


@pytest.fixture
def host() -> PoolGroup:
    group = PoolGroup(Tier.HOST, POOLS, token_slots=512, node_slots=8, page_size=PS, device="cpu")
    return group


def _fill(host: PoolGroup, names: list[str]) -> dict[str, list[int]]:
    value, _ = host.alloc(len(names), False)
    assert value is not None
    for pool in ("kv", "draft"):
        p = host.pools[pool]
        for page, name in zip(value["kv"], names, strict=True):
            p.page_view(page).copy_(page_content(p.spec, name, 0, PS))
    return value


def _names(seed: int, pages: int) -> list[str]:
    return page_hashes([seed * 10_000 + i for i in range(pages * PS)], PS)


def _failures(csdk) -> dict:
    return {k: v for k, v in csdk.telemetry.snapshot()[sc.METRIC_TRANSFER_FAILURES].items() if v}


def test_backups_and_prefetches_run_concurrently_and_round_trip(csdk, tmp_path, host) -> None:
    store = FileStore(tmp_path, host, csdk.telemetry, model=MODEL, queue_size=64)
    jobs = []
    for seed in range(8):
        names = _names(seed, 6)
        jobs.append(StorageJob(TransferOperation.STORAGE_BACKUP, seed, names, _fill(host, names)))
    submitted = [threading.Thread(target=store.submit, args=(j,)) for j in jobs]  # submitters on several threads
    for t in submitted:
        t.start()
    for t in submitted:
        t.join()
    for j in jobs:
        assert j.done.wait(10) and j.pages_done == 6
    reads = []
    for j in jobs:  # read everything back into other host pages while nothing else runs
        value, _ = host.alloc(6, False)
        reads.append((StorageJob(TransferOperation.STORAGE_PREFETCH, j.tag, j.names, value), j))
        assert store.submit(reads[-1][0])
    for r, j in reads:
        assert r.done.wait(10) and r.pages_done == 6
        for pool in ("kv", "draft"):
            p = host.pools[pool]
            for a, b in zip(r.host_value["kv"], j.host_value["kv"], strict=True):
                assert torch.equal(p.page_view(a), p.page_view(b))
    store.shutdown()
    snap = csdk.telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS]
    assert snap[("storage_backup", "kv")] == snap[("storage_prefetch", "kv")] == 8 * 6 * PS
    assert not _failures(csdk)


def test_shutdown_with_work_in_flight_cancels_cleanly(csdk, tmp_path, host) -> None:
    store = FileStore(tmp_path, host, csdk.telemetry, model=MODEL, queue_size=64)
    jobs = []
    for seed in range(20):
        names = _names(seed, 5)
        jobs.append(StorageJob(TransferOperation.STORAGE_BACKUP, seed, names, _fill(host, names)))
        store.submit(jobs[-1])
    store.shutdown(timeout_s=10)
    assert all(j.done.is_set() for j in jobs)  # nobody waits forever
    assert not any(t.is_alive() for t in store._threads)
    cancelled = _failures(csdk).get(("storage_backup", "cancelled"), 0)
    written = sum(1 for j in jobs if j.pages_done == 5)
    assert written + cancelled == 20
    assert not list(tmp_path.rglob("*.tmp"))
    for path in tmp_path.rglob("*.kv"):
        store._read_entry(path.stem)  # whatever was written is whole: this raises otherwise
    assert not store.submit(StorageJob(TransferOperation.STORAGE_BACKUP, 99, _names(99, 1), jobs[0].host_value))


def test_a_failing_write_is_a_failure_and_a_log_line_never_an_entry(csdk, tmp_path, host, monkeypatch, caplog) -> None:
    store = FileStore(tmp_path, host, csdk.telemetry, model=MODEL)

    def disk_full(src: str, dst: str) -> None:  # a fault we cannot cause here: the disk filling up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    names = _names(1, 3)
    job = StorageJob(TransferOperation.STORAGE_BACKUP, 1, names, _fill(host, names))
    with caplog.at_level(logging.WARNING, logger="otel_hicache.cache.storage"):
        assert store.submit(job)
        assert job.done.wait(10)
    store.shutdown()
    assert job.pages_done == 0
    assert _failures(csdk) == {("storage_backup", "storage_write_failed"): 1}
    [line] = [r.getMessage() for r in caplog.records]
    assert "storage_write_failed" in line and "ENOSPC" in line and names[0] not in line
    assert store.hit_pages(names) == 0 and not list(tmp_path.rglob("*.tmp"))


def test_a_store_directory_replaced_by_a_file_fails_writes_without_crashing(csdk, tmp_path, host) -> None:
    root = tmp_path / "l3"
    store = FileStore(root, host, csdk.telemetry, model=MODEL)
    names = _names(2, 2)
    store.namespace.mkdir()
    (store.namespace / names[0][:2]).write_bytes(b"not a directory")  # a real fault: a file for a directory
    job = StorageJob(TransferOperation.STORAGE_BACKUP, 2, names, _fill(host, names))
    store.submit(job)
    assert job.done.wait(10)
    store.shutdown()
    assert job.pages_done == 0
    assert _failures(csdk) == {("storage_backup", "storage_write_failed"): 1}


def test_a_corrupted_entry_is_never_served(csdk, tmp_path, host) -> None:
    store = FileStore(tmp_path, host, csdk.telemetry, model=MODEL)
    names = _names(3, 3)
    job = StorageJob(TransferOperation.STORAGE_BACKUP, 3, names, _fill(host, names))
    store.submit(job)
    assert job.done.wait(10) and job.pages_done == 3
    path = store._path(names[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the payload
    path.write_bytes(bytes(data))
    value, _ = host.alloc(3, False)
    before = [host.pools["kv"].page_view(p).clone() for p in value["kv"]]
    fetch = StorageJob(TransferOperation.STORAGE_PREFETCH, 3, names, value)
    store.submit(fetch)
    assert fetch.done.wait(10)
    store.shutdown()
    assert fetch.pages_done == 1  # the leading intact page only
    assert torch.equal(host.pools["kv"].page_view(value["kv"][1]), before[1])  # nothing written from the bad file
    assert not path.exists() and store.hit_pages(names) == 1
    assert _failures(csdk) == {("storage_prefetch", "storage_read_failed"): 1}


def test_a_full_queue_is_a_failure_not_a_block(csdk, tmp_path, host) -> None:
    store = FileStore(tmp_path, host, csdk.telemetry, model=MODEL, queue_size=1)
    big = _names(4, 100)
    value = _fill(host, big)
    results = [store.submit(StorageJob(TransferOperation.STORAGE_BACKUP, i, big, value)) for i in range(6)]
    store.shutdown()
    assert results.count(False) >= 4
    assert _failures(csdk)[("storage_backup", "storage_queue_full")] == results.count(False)
