"""L3 store on local files: self-identifying page entries, written atomically, served only as the page asked for.

Entries live under ``root/<namespace>/<name[:2]>/<name>.kv``. The namespace is a fingerprint of what the bytes
mean - the model's identity, the page size and every stored pool's layout and dtype - so several models (or one
model under several layouts) can share one root and never see each other's pages. Each file holds one page of
every per-token pool (sidecars included) after a 128-byte header: magic, the namespace fingerprint, the page name,
the payload length and a BLAKE2b checksum over the header and the payload. Writes go to a temporary file then
``os.replace``, so a reader sees a whole entry or none.

A read opens the entry without following links, refuses anything but a regular file of exactly the expected size
before reading a byte, then checks every header field against the page and namespace it asked for and the
checksum against the bytes: an entry that fails any check, or any I/O error, is a miss and a ``storage_read_failed``
failure, never data. Such a page is *withdrawn*: no lookup reports it again (the bad file is deleted where it can
be) until a backup writes it anew. Page names must be lowercase hex (prefix hashes), so no name leaves the store.

Backup (host -> file) and prefetch (file -> host) run in background threads fed by bounded queues. A full queue,
a failed write, read or lookup is one :class:`TransferFailure` plus one log line; nothing raises into the caller
(:meth:`FileStore.hit_pages` and :meth:`FileStore.submit` run on the scheduler's path). A backup reports only the
pages that landed. Each job that moved data is one :class:`TransferRecord` (``storage_backup`` /
``storage_prefetch``) timed by the host clock. Per-node pools (mamba state) stay on L1/L2: L3 keeps per-token pools.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import queue
import re
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from opentelemetry.trace import SpanContext

from otel_hicache.cache.pools import PoolGroup
from otel_hicache.records import TransferFailure, TransferRecord
from otel_hicache.semconv import TimingSource, TransferOperation
from otel_hicache.telemetry import HiCacheTelemetry
from otel_hicache.timing import now_ns

_log = logging.getLogger(__name__)
_FORMAT = 2
_MAGIC = b"OHKV2\0\0\0"
_FINGERPRINT = 16  # bytes of the namespace fingerprint
_NAME_FIELD = 64  # bytes: a page name, NUL-padded
_NAME = re.compile(r"[0-9a-f]{2,64}")
_DIGEST = 32
_PREFIX = len(_MAGIC) + _FINGERPRINT + _NAME_FIELD + 8  # the header up to the checksum
_HEADER = _PREFIX + _DIGEST
_WITHDRAWN_MAX = 65_536  # names remembered as unservable; an older one forgotten costs one more failed lookup
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO must not hang a read
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
    links: tuple[SpanContext, ...] = ()  # the request spans the job serves (a prefetch: the request waiting for it)


class StorageStats:
    """Ground truth counted at the file I/O: slots and bytes per (operation, pool) actually moved."""

    def __init__(self) -> None:
        self.slots: collections.Counter[tuple[str, str]] = collections.Counter()
        self.bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.failures: collections.Counter[tuple[str, str]] = collections.Counter()


class _Rejected(Exception):
    """An entry that is not the page asked for (or not an entry at all); the message says why."""


class FileStore:
    """Page files of one namespace under ``root``; one backup and one prefetch thread, each behind a bounded queue.

    ``model`` identifies the model whose KV the pages hold (with the pools' layout it makes the namespace).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        host: PoolGroup,
        telemetry: HiCacheTelemetry,
        *,
        model: str,
        queue_size: int = 64,
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
        self._payload_size = sum(host.pools[n].spec.bytes_per_slot * self._page_size for n in self.pools)
        self._entry_size = _HEADER + self._payload_size
        layout = [
            [s.name, s.layers, s.heads, s.head_dim, s.kv, str(s.dtype), s.sidecar_of]
            for s in (host.pools[n].spec for n in self.pools)
        ]
        identity = json.dumps({"format": _FORMAT, "model": model, "page_size": self._page_size, "pools": layout})
        self._fingerprint = hashlib.blake2b(identity.encode(), digest_size=_FINGERPRINT).digest()
        self.namespace = self.root / self._fingerprint.hex()
        self._withdrawn: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._withdrawn_lock = threading.Lock()
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
        return self.hit_pages([name]) == 1

    def hit_pages(self, names: Sequence[str]) -> int:
        """How many leading pages of ``names`` the store holds; an unusable entry is a counted failure, never raised.

        One ``stat`` per page: the size and type are checked here, the header and checksum when the page is read.
        """
        for i, name in enumerate(names):
            why = self._lookup(name)
            if why is None:
                continue
            if why:
                self._failed(STORAGE_PREFETCH, len(names) - i, "storage_read_failed", why)
            return i
        return len(names)

    def submit(self, job: StorageJob) -> bool:
        """Queue a job; False (a failure and one log line) if a name is invalid or its queue is full or closed."""
        if not all(_NAME.fullmatch(name) for name in job.names):
            return self._refuse(job, _error_for(job.operation), "invalid page name")
        if not self._stopping:
            try:
                self._queues[job.operation].put_nowait(job)
                return True
            except queue.Full:
                pass
        return self._refuse(job, "storage_queue_full", "queue full" if not self._stopping else "store closed")

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
                    self._refuse(job, "cancelled", "store shut down with the job queued")
            q.put(None)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _refuse(self, job: StorageJob, error: str, why: str) -> bool:
        self._failed(job.operation, len(job.names), error, why)
        job.done.set()
        self.completed.append(job)
        return False

    def _lookup(self, name: str) -> str | None:
        """None if ``name`` looks stored; "" if absent; else why its entry cannot be served (then withdrawn)."""
        if not _NAME.fullmatch(name):
            return "invalid page name"
        if self._is_withdrawn(name):
            return ""
        try:
            st = os.stat(self._path(name), follow_symlinks=False)
        except FileNotFoundError:
            return ""
        except OSError as exc:
            why = _describe(exc)
        else:
            if stat.S_ISREG(st.st_mode) and st.st_size == self._entry_size:
                return None
            why = self._misfit(st)
        self._withdraw(name)
        return why

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
                self._failed(op, len(job.names) - job.pages_done, _error_for(op), repr(exc))
            finally:
                job.done.set()
                self.completed.append(job)

    def _backup(self, job: StorageJob) -> None:
        submit_ns, t0 = now_ns(), time.perf_counter()
        written = 0
        for i, name in enumerate(job.names):
            if not self._is_withdrawn(name) and self._holds(name):  # another prefix stored the same page already
                job.pages_done = i + 1
                continue
            payload, sizes = self._page_payload(job.host_value, i)
            try:
                self._write_entry(name, payload)
            except OSError as exc:
                self._withdraw(name)  # whatever is at the path is not this page
                self._failed(STORAGE_BACKUP, len(job.names) - i, "storage_write_failed", _describe(exc))
                break
            with self._withdrawn_lock:
                self._withdrawn.pop(name, None)
            for pool, size in sizes.items():
                self.stats.slots[(STORAGE_BACKUP.value, pool)] += self._page_size
                self.stats.bytes[(STORAGE_BACKUP.value, pool)] += size
            written += 1
            job.pages_done = i + 1
        if written:
            self._report(job, written, submit_ns, time.perf_counter() - t0)

    def _prefetch(self, job: StorageJob) -> None:
        submit_ns, t0 = now_ns(), time.perf_counter()
        for i, name in enumerate(job.names):
            payload = self._fetch(name)
            if isinstance(payload, str):
                self._failed(STORAGE_PREFETCH, len(job.names) - i, "storage_read_failed", payload)
                break
            self._load_payload(job.host_value, i, payload)
            job.pages_done = i + 1
        if job.pages_done:
            self._report(job, job.pages_done, submit_ns, time.perf_counter() - t0)

    def _fetch(self, name: str) -> memoryview | str:
        """The payload of ``name``'s entry, or why it cannot be served (then the page is withdrawn)."""
        if self._is_withdrawn(name):
            return "withdrawn"
        try:
            return self._read_entry(name)
        except OSError as exc:
            why = _describe(exc)
        except _Rejected as exc:
            self._discard(name)  # never served, nor found again
            why = str(exc)
        self._withdraw(name)
        return why

    # ------------------------------------------------------------------ entries
    def _path(self, name: str) -> Path:
        return self.namespace / name[:2] / f"{name}.kv"

    def _prefix(self, name: str) -> bytes:
        """The header an entry of ``name`` in this namespace starts with (everything before the checksum)."""
        return (
            _MAGIC
            + self._fingerprint
            + name.encode().ljust(_NAME_FIELD, b"\0")
            + self._payload_size.to_bytes(8, "little")
        )

    def _write_entry(self, name: str, payload: bytes) -> None:
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
        prefix = self._prefix(name)
        digest = hashlib.blake2b(prefix, digest_size=_DIGEST)
        digest.update(payload)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(prefix + digest.digest())
                f.write(payload)
            try:
                os.replace(tmp, path)
            except IsADirectoryError:  # an empty directory in the way goes; anything in one stays, and this fails
                os.rmdir(path)
                os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):  # the error to report is the one above
                tmp.unlink(missing_ok=True)
            raise

    def _read_entry(self, name: str, *, header_only: bool = False) -> memoryview:
        """The payload (or just the header) of ``name``'s entry; raises OSError or _Rejected, never reads a misfit."""
        fd = os.open(self._path(name), _OPEN_READ)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != self._entry_size:
                raise _Rejected(self._misfit(st))  # refused before reading a byte of it
            buf = memoryview(bytearray(_HEADER if header_only else self._entry_size))
            got = 0
            while got < len(buf) and (n := os.readv(fd, [buf[got:]])):
                got += n
        finally:
            os.close(fd)
        if got < len(buf):
            raise _Rejected("truncated while read")
        prefix = self._prefix(name)
        if buf[:_PREFIX] != prefix:
            fields = (("format", 0, len(_MAGIC)), ("namespace", len(_MAGIC), len(_MAGIC) + _FINGERPRINT))
            wrong = next((what for what, a, b in fields if buf[a:b] != prefix[a:b]), "page")
            raise _Rejected(f"header names another {wrong}")
        if not header_only:
            digest = hashlib.blake2b(buf[:_PREFIX], digest_size=_DIGEST)
            digest.update(buf[_HEADER:])
            if digest.digest() != buf[_PREFIX:_HEADER]:
                raise _Rejected("checksum mismatch")
        return buf[_HEADER:]

    def _misfit(self, st: os.stat_result) -> str:
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        return f"{st.st_size} bytes, not {self._entry_size}"

    def _holds(self, name: str) -> bool:
        """Whether ``name``'s entry is in place with a right header (the checksum is checked when it is read)."""
        try:
            self._read_entry(name, header_only=True)
            return True
        except (OSError, _Rejected):
            return False

    def _discard(self, name: str) -> None:
        """Delete what sits at ``name``'s entry path if it can be: a file, a link or an empty directory."""
        path = self._path(name)
        with contextlib.suppress(OSError):  # withdrawn anyway: never served, and a backup replaces it if it can
            if stat.S_ISDIR(os.lstat(path).st_mode):
                os.rmdir(path)
            else:
                path.unlink()

    def _withdraw(self, name: str) -> None:
        with self._withdrawn_lock:
            self._withdrawn[name] = None
            self._withdrawn.move_to_end(name)
            if len(self._withdrawn) > _WITHDRAWN_MAX:
                self._withdrawn.popitem(last=False)

    def _is_withdrawn(self, name: str) -> bool:
        with self._withdrawn_lock:
            return name in self._withdrawn

    # ------------------------------------------------------------------ host pages <-> bytes
    def _page_payload(self, value: dict[str, list[int]], i: int) -> tuple[bytes, dict[str, int]]:
        parts = [_to_bytes(self.host.pools[n].page_view(value[self._index_pool[n]][i])) for n in self.pools]
        return b"".join(parts), {n: len(p) for n, p in zip(self.pools, parts, strict=True)}

    def _load_payload(self, value: dict[str, list[int]], i: int, payload: memoryview) -> None:
        offset = 0
        for name in self.pools:
            pool = self.host.pools[name]
            n = pool.spec.bytes_per_slot * self._page_size
            src = torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=offset)
            pool.page_view(value[self._index_pool[name]][i]).copy_(
                src.view(pool.spec.dtype).view(pool.spec.layers, self._page_size, -1)
            )
            offset += n
            self.stats.slots[(STORAGE_PREFETCH.value, name)] += self._page_size
            self.stats.bytes[(STORAGE_PREFETCH.value, name)] += n

    # ------------------------------------------------------------------ reporting
    def _report(self, job: StorageJob, pages: int, submit_ns: int, seconds: float) -> None:
        slots = pages * self._page_size
        tokens = {n: slots for n in self.pools if n in self.owning}
        by_pool = {n: slots * self.host.pools[n].spec.bytes_per_slot for n in self.pools}
        self.telemetry.record_transfer(
            TransferRecord(
                operation=job.operation,
                tokens_by_pool=tokens,
                num_bytes=sum(by_pool.values()),
                submit_time_ns=submit_ns,
                complete_time_ns=now_ns(),
                copy_duration_s=seconds,
                timing_source=TimingSource.HOST_CLOCK,
                merged_ops=1,
                node_count=1,
                bytes_by_pool=by_pool,
                io_backend="file",
                links=job.links,
            )
        )

    def _failed(self, op: TransferOperation, pages: int, error: str, why: str) -> None:
        slots = pages * self._page_size
        self.stats.failures[(op.value, error)] += 1
        self.telemetry.record_failure(
            TransferFailure(op, error, {n: slots for n in self.pools if n in self.owning}, now_ns())
        )
        _log.warning("otel_hicache: L3 %s of %d page(s) failed (%s): %s", op.value, pages, error, why)


def _to_bytes(view: torch.Tensor) -> bytes:
    # One memcpy out of a contiguous CPU copy (numpy is not a dependency; bytes(storage) is per-element slow).
    flat = view.contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())


def _error_for(op: TransferOperation) -> str:
    return "storage_write_failed" if op is STORAGE_BACKUP else "storage_read_failed"


def _describe(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno or 0, "") if exc.errno else ""
    return f"{code} {exc.strerror or exc}".strip()  # no path: file names are prefix hashes, kept out of logs
