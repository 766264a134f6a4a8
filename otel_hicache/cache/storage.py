"""L3 store on local files: page files named by the prefix hash, written atomically, read back only if intact.

Each file holds one page of every per-token pool (sidecars included): a header (magic, payload length, a BLAKE2b
checksum of the payload) then the raw bytes. Writes go to a temporary file then ``os.replace``, so a reader sees
a whole entry or none; a read whose length or checksum does not match is a miss, the entry is deleted and counted
as a ``storage_read_failed`` failure, so a corrupted entry is never served.

Backup (host -> file) and prefetch (file -> host) run in background threads fed by bounded queues. A full queue,
a failed write or read is one :class:`TransferFailure` plus one log line; nothing raises into the caller. Each job
that moved data is one :class:`TransferRecord` (``storage_backup`` / ``storage_prefetch``) timed by the host clock.
Per-node pools (mamba state) stay on L1/L2: L3 keeps per-token pools only.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from otel_hicache.cache.pools import PoolGroup
from otel_hicache.records import TransferFailure, TransferRecord
from otel_hicache.semconv import TimingSource, TransferOperation
from otel_hicache.telemetry import HiCacheTelemetry
from otel_hicache.timing import now_ns

_log = logging.getLogger(__name__)
_MAGIC = b"OHKV1\0\0\0"
_HEADER = len(_MAGIC) + 8 + 32
STORAGE_BACKUP = TransferOperation.STORAGE_BACKUP
STORAGE_PREFETCH = TransferOperation.STORAGE_PREFETCH


@dataclass
class StorageJob:
    """One backup or prefetch of consecutive pages of one prefix. ``done`` is set when the thread is finished."""

    operation: TransferOperation
    tag: int  # the caller's handle (a node id)
    names: list[str]  # page names (prefix hashes), in prefix order
    host_value: dict[str, list[int]]  # host page per name, for every owning per-token pool
    pages_done: int = 0  # backup: pages now in the store; prefetch: leading pages loaded into host memory
    done: threading.Event = field(default_factory=threading.Event)


class StorageStats:
    """Ground truth counted at the file I/O: slots and bytes per (operation, pool) actually moved."""

    def __init__(self) -> None:
        self.slots: collections.Counter[tuple[str, str]] = collections.Counter()
        self.bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.failures: collections.Counter[tuple[str, str]] = collections.Counter()


class FileStore:
    """Page files under ``root``; one backup and one prefetch thread, each behind a bounded queue."""

    def __init__(
        self, root: str | os.PathLike[str], host: PoolGroup, telemetry: HiCacheTelemetry, *, queue_size: int = 64
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.host, self.telemetry = host, telemetry
        self.pools = [name for name in host.per_token]  # anchor first, sidecars included
        self.owning = set(host.owning)
        riders = dict(host.sidecars)
        self._index_pool = {name: riders.get(name, name) for name in self.pools}  # a sidecar uses its owner's pages
        self.stats = StorageStats()
        self._page_size = host.page_size
        self._queues = {
            op: queue.Queue[StorageJob | None](maxsize=queue_size) for op in (STORAGE_BACKUP, STORAGE_PREFETCH)
        }
        self.completed: collections.deque[StorageJob] = collections.deque()  # finished jobs, for the scheduler
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._worker, args=(op,), name=f"otel-hicache-{op.value}", daemon=True)
            for op in self._queues
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ scheduler side
    def contains(self, name: str) -> bool:
        return self._path(name).exists()

    def hit_pages(self, names: Sequence[str]) -> int:
        """How many leading pages of ``names`` the store holds."""
        n = 0
        for name in names:
            if not self.contains(name):
                break
            n += 1
        return n

    def submit(self, job: StorageJob) -> bool:
        """Queue a job; False (a ``storage_queue_full`` failure and one log line) if its queue is full or closed."""
        if not self._stopping:
            try:
                self._queues[job.operation].put_nowait(job)
                return True
            except queue.Full:
                pass
        self._failed(job, len(job.names), "storage_queue_full", "queue full" if not self._stopping else "store closed")
        job.done.set()
        self.completed.append(job)
        return False

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Finish the job in hand, cancel queued ones (each a ``cancelled`` failure), stop the threads."""
        self._stopping = True
        for q in self._queues.values():
            while True:
                try:
                    job = q.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    self._failed(job, len(job.names), "cancelled", "store shut down with the job queued")
                    job.done.set()
                    self.completed.append(job)
            q.put(None)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ worker threads
    def _worker(self, op: TransferOperation) -> None:
        q = self._queues[op]
        while True:
            job = q.get()
            if job is None:
                return
            try:
                if op is STORAGE_BACKUP:
                    self._backup(job)
                else:
                    self._prefetch(job)
            except Exception as exc:  # never let a thread die with jobs waiting on it
                self._failed(job, len(job.names) - job.pages_done, _error_for(op), repr(exc))
            finally:
                job.done.set()
                self.completed.append(job)

    def _backup(self, job: StorageJob) -> None:
        submit_ns, t0 = now_ns(), time.perf_counter()
        written = 0
        for i, name in enumerate(job.names):
            path = self._path(name)
            if path.exists():  # another prefix wrote the same page already
                job.pages_done = i + 1
                continue
            payload, sizes = self._page_payload(job.host_value, i)
            try:
                self._write_file(path, payload)
            except OSError as exc:
                self._failed(job, len(job.names) - i, "storage_write_failed", _describe(exc))
                break
            for pool, size in sizes.items():
                self.stats.slots[(STORAGE_BACKUP.value, pool)] += self._page_size
                self.stats.bytes[(STORAGE_BACKUP.value, pool)] += size
            written += 1
            job.pages_done = i + 1
        if written:
            self._report(STORAGE_BACKUP, written, submit_ns, time.perf_counter() - t0)

    def _prefetch(self, job: StorageJob) -> None:
        submit_ns, t0 = now_ns(), time.perf_counter()
        for i, name in enumerate(job.names):
            payload = self._read_file(self._path(name))
            if payload is None:
                self._failed(job, len(job.names) - i, "storage_read_failed", "entry missing or corrupted")
                break
            self._load_payload(job.host_value, i, payload)
            job.pages_done = i + 1
        if job.pages_done:
            self._report(STORAGE_PREFETCH, job.pages_done, submit_ns, time.perf_counter() - t0)

    # ------------------------------------------------------------------ files
    def _path(self, name: str) -> Path:
        return self.root / name[:2] / f"{name}.kv"

    def _write_file(self, path: Path, payload: bytes) -> None:
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
        header = _MAGIC + len(payload).to_bytes(8, "little") + hashlib.blake2b(payload, digest_size=32).digest()
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _read_file(self, path: Path) -> bytes | None:
        try:
            data = path.read_bytes()
        except OSError:
            return None
        size = int.from_bytes(data[len(_MAGIC) : len(_MAGIC) + 8], "little") if len(data) >= _HEADER else -1
        payload = data[_HEADER:]
        if (
            data[: len(_MAGIC)] != _MAGIC
            or size != len(payload)
            or size != self._payload_size()
            or hashlib.blake2b(payload, digest_size=32).digest() != data[len(_MAGIC) + 8 : _HEADER]
        ):
            path.unlink(missing_ok=True)  # never serve it, nor find it again
            return None
        return payload

    # ------------------------------------------------------------------ host pages <-> bytes
    def _page_payload(self, value: dict[str, list[int]], i: int) -> tuple[bytes, dict[str, int]]:
        parts = [_to_bytes(self.host.pools[n].page_view(value[self._index_pool[n]][i])) for n in self.pools]
        return b"".join(parts), {n: len(p) for n, p in zip(self.pools, parts, strict=True)}

    def _payload_size(self) -> int:
        return sum(self.host.pools[n].spec.bytes_per_slot * self._page_size for n in self.pools)

    def _load_payload(self, value: dict[str, list[int]], i: int, payload: bytes) -> None:
        offset = 0
        buf = bytearray(payload)
        for name in self.pools:
            pool = self.host.pools[name]
            n = pool.spec.bytes_per_slot * self._page_size
            src = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=offset)
            pool.page_view(value[self._index_pool[name]][i]).copy_(
                src.view(pool.spec.dtype).view(pool.spec.layers, self._page_size, -1)
            )
            offset += n
            self.stats.slots[(STORAGE_PREFETCH.value, name)] += self._page_size
            self.stats.bytes[(STORAGE_PREFETCH.value, name)] += n

    # ------------------------------------------------------------------ reporting
    def _report(self, op: TransferOperation, pages: int, submit_ns: int, seconds: float) -> None:
        slots = pages * self._page_size
        tokens = {n: slots for n in self.pools if n in self.owning}
        by_pool = {n: slots * self.host.pools[n].spec.bytes_per_slot for n in self.pools}
        self.telemetry.record_transfer(
            TransferRecord(
                op,
                tokens,
                sum(by_pool.values()),
                submit_ns,
                now_ns(),
                seconds,
                TimingSource.HOST_CLOCK,
                1,
                1,
                by_pool,
                io_backend="file",
            )
        )

    def _failed(self, job: StorageJob, pages: int, error: str, why: str) -> None:
        slots = pages * self._page_size
        self.stats.failures[(job.operation.value, error)] += 1
        self.telemetry.record_failure(
            TransferFailure(job.operation, error, {n: slots for n in self.pools if n in self.owning}, now_ns())
        )
        _log.warning("otel_hicache: L3 %s of %d page(s) failed (%s): %s", job.operation.value, pages, error, why)


def _to_bytes(view: torch.Tensor) -> bytes:
    # One memcpy out of a contiguous CPU copy (numpy is not a dependency; bytes(storage) is per-element slow).
    flat = view.contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())


def _error_for(op: TransferOperation) -> str:
    return "storage_write_failed" if op is STORAGE_BACKUP else "storage_read_failed"


def _describe(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno or 0, "") if exc.errno else ""
    return f"{code} {exc.strerror or exc}".strip()  # no path: file names are prefix hashes, kept out of logs
