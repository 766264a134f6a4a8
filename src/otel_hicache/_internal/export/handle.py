"""The host's handle on its export process, which builds its spans and metrics and exports them outside the host.

The host (:class:`ExportProcess`, a :class:`~otel_hicache.telemetry.Consumer`) launches it synchronously when its
telemetry is configured (a few milliseconds: ``Popen`` of a launcher that forks and exits), so the exporter exists,
holding everything it needs, before ``configure()`` returns: a host that exits or is SIGKILLed a moment later loses
nothing it counted. Through the launcher the exporter is not a child of the host: an engine that stops its scheduler
with ``kill_process_tree`` (SGLang) or SIGKILL does not take the exporter with it. The two share:

* the channel's memory (a ``memfd``): the exact counter table and the record ring;
* a **hang-up pipe** the host holds the write end of. A byte on it asks for a flush; end-of-file means the host is
  gone, whether it shut down, exited, or was killed. Then the exporter builds what is left, exports one last time
  (within ``FINAL_TIMEOUT_S``, whatever the collector does) and exits;
* a **liveness pipe** of each launch, whose write end the launcher and the exporter hold as their standard error (and
  nothing else does): end-of-file proves that every process of that launch is gone. The host reads it on its thread
  about once a second and at flush and shutdown: it relays the exporter's log lines into its own ``logging``, and only
  a launch proven gone is replaced (with back-off while launches keep failing), so one exporter reads a ring at a time.
  "The launcher exited, the exporter has not attached yet" is not dead.

Its :class:`~otel_hicache._internal.shared.plan.ExportPlan` (the host's ``OTEL_*`` variables, the Resource, the
channel's layout) reaches it in a memfd passed as a file descriptor: no other user can read it (``ps`` shows file
descriptor numbers only) and it has no size limit. Its standard input and output are ``/dev/null``: it holds none of the
host's stdio, so a reader of the host's output sees end-of-file when the host exits. Where the host reaps orphans (PID 1
of a container, or a child subreaper) it reaps its exporters.

What the export process does with the ring is :mod:`otel_hicache._internal.export.main`, its program; its threads and
OTLP encoding never touch the host's GIL.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otel_hicache._internal.shared.channel import EXPORTER_PID, FLUSH_DONE, FLUSH_REQ, Channel
from otel_hicache._internal.shared.plan import LOG_LINE, MAX_LINE_BYTES, PID_LINE, ExportPlan

_log = logging.getLogger(__name__)

#: The launcher, run by path (``python -S``: it imports no ``site``).
_LAUNCHER = str(Path(__file__).with_name("launcher.py"))
#: A launch that ends (or fails to start) sooner than this counts as a failure: the next waits longer.
LIVED_S = 10.0
#: The longest wait before launching again while launches keep failing (0.5 s, then doubling).
MAX_BACKOFF_S = 30.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the directory holding otel_hicache


class _Launch:
    """One launch: the launcher, the host's ends of its pipes, the exporter's pid once announced. A launch dropped
    without :meth:`forget` (a telemetry dropped without shutdown) closes its ends, so its exporter ends too; at
    interpreter exit the shutdown closes them, or the OS."""

    __slots__ = ("__weakref__", "_fds", "launcher", "partial", "pid", "started")

    def __init__(self, launcher: subprocess.Popen[bytes], hangup: int, live: int) -> None:
        self.launcher = launcher
        self._fds = [hangup, live]  # -1 once closed
        weakref.finalize(self, _close_all, self._fds).atexit = False
        self.pid = 0
        self.partial = b""
        self.started = time.monotonic()

    @property
    def hangup(self) -> int:
        """The write end of the hang-up pipe (-1 once closed)."""
        return self._fds[0]

    @property
    def live(self) -> int:
        """The read end of the liveness pipe (-1 once closed)."""
        return self._fds[1]

    def hang_up(self) -> None:
        _close_all(self._fds, 1)

    def forget(self) -> None:
        """Close this process's ends (a forked child's copies, or a launch proven gone)."""
        _close_all(self._fds)


def _close_all(fds: list[int], count: int = 2) -> None:
    for i in range(count):
        if fds[i] >= 0:
            _close(fds[i])
            fds[i] = -1


#: Launches handed over by a shutdown whose exporter was still finishing: read and reaped by later tending (of any
#: telemetry; one thread at a time).
_LEFT: list[_Launch] = []
_LEFT_LOCK = threading.Lock()


class ExportProcess:
    """The host's handle on its export process (the :class:`~otel_hicache.telemetry.Consumer` for OTLP).

    Never raises: a launch that cannot be made (no process, thread or file descriptor to be had) is logged once and
    retried with back-off; spans wait in the ring meanwhile (a full ring counts what it cannot hold) and the counters
    stay exact.
    """

    def __init__(self, channel: Channel, plan: ExportPlan) -> None:
        self._plan = plan.for_channel(channel.layout.pools, channel.layout.seed_pools, channel.capacity)
        self._channel: Channel | None = None
        self._launch: _Launch | None = None
        self._failures = 0
        self._next_launch = 0.0
        self._closed = False
        self._warned: set[str] = set()
        self._lock = threading.Lock()  # the host thread, flush and shutdown tend it

    # ------------------------------------------------------------------ Consumer
    def tend(self, channel: Channel, now: bool = False) -> None:
        """Relay the exporter's log lines; if its launch is proven gone, reap it and launch a replacement (``now``:
        whatever the back-off says). The first call launches the first exporter."""
        with self._lock:
            try:
                self._tend(channel, now)
            except Exception:  # the last line of defence: never into the host
                _log.debug("otel_hicache: tending the export process failed", exc_info=True)

    def _tend(self, channel: Channel, now: bool) -> None:
        self._channel = channel
        _tend_left()
        launch = self._launch
        if launch is not None and not _relay(launch):
            self._ended(launch)
        if self._launch is None and not self._closed and channel.fd is not None:
            if now or time.monotonic() >= self._next_launch:
                self._start(channel)

    def drain(self, budget_ns: int) -> bool:
        return False  # the exporter drains the ring itself

    def flush(self, timeout_s: float) -> bool:
        """Ask the exporter to build and export everything now; wait (bounded) for it to say done."""
        channel = self._channel
        if channel is None or self._launch is None:
            return False
        ints = channel.ints
        request = ints[FLUSH_REQ] + 1
        ints[FLUSH_REQ] = request
        self._poke()
        done = self._wait(lambda: ints[FLUSH_DONE] >= request, timeout_s)
        self.tend(channel)  # the lines it logged meanwhile
        return done

    def close(self, channel: Channel, timeout_s: float) -> bool:
        """End of file on the hang-up pipe: the exporter exports the last window and exits; wait for that, bounded
        (relaying its last lines, reaping it). A launch proven gone is replaced first, so the last window goes out.
        The memory stays mapped here (later records still count) but its descriptor is released."""
        deadline = time.monotonic() + timeout_s
        done = False
        with self._lock:
            try:
                self._tend(channel, now=True)
                self._closed = True
                done = self._hang_up_and_wait(deadline)
            except Exception:  # the last line of defence: never into the host
                _log.debug("otel_hicache: closing the export process failed", exc_info=True)
        channel.release_fd()
        return done

    def _hang_up_and_wait(self, deadline: float) -> bool:
        launch, self._launch = self._launch, None
        if launch is None:
            return True
        launch.hang_up()
        while _relay(launch):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                with _LEFT_LOCK:
                    _LEFT.append(launch)  # still exporting: read and reaped later
                return False
            select.select([launch.live], [], [], remaining)
        self._ended(launch, wait_s=max(0.0, min(0.2, deadline - time.monotonic())))
        return True

    def before_fork(self) -> bool:
        return False  # nothing of the export runs in this process

    def after_fork_in_parent(self, held: bool) -> None:
        return None

    def after_fork_in_child(self, channel: Channel) -> ExportProcess:
        """The child gets its own exporter; closing the inherited pipe ends leaves the parent's running."""
        if self._launch is not None:
            self._launch.forget()
        return ExportProcess(channel, self._plan.for_child())

    # ------------------------------------------------------------------ internals
    def _start(self, channel: Channel) -> None:
        try:
            self._launch = _spawn(channel, dataclasses.replace(self._plan, ids=channel.ids_bytes))
        except Exception as exc:  # OSError (no fds, EAGAIN from fork), RuntimeError: never into the host
            self._failed()
            self._warn_once(
                "start",
                "otel_hicache: could not start the export process (%r); retrying with back-off "
                "(spans wait in the ring, counters stay exact)",
                exc,
            )

    def _failed(self) -> None:
        self._failures += 1
        self._next_launch = time.monotonic() + min(MAX_BACKOFF_S, 0.5 * 2 ** min(self._failures - 1, 8))

    def _ended(self, launch: _Launch, wait_s: float = 0.0) -> None:
        """``launch`` is proven gone: reap what is ours, and schedule a replacement."""
        launch.forget()
        _reap(launch, wait_s)
        self._launch = None
        if self._channel is not None:
            self._channel.ints[EXPORTER_PID] = 0  # its exporter's, if it attached: none reads the ring now
        if self._closed:
            return
        if time.monotonic() - launch.started < LIVED_S:
            self._failed()
        else:
            self._failures, self._next_launch = 0, 0.0
        self._warn_once(
            "gone",
            "otel_hicache: the export process %s is gone; a new one sends what it had not sent (logged once)",
            launch.pid or "",
        )

    def _poke(self) -> None:
        with self._lock:  # the descriptor is not closed (and its number reused) meanwhile
            launch = self._launch
            if launch is None or launch.hangup < 0:
                return
            try:
                os.write(launch.hangup, b"f")
            except OSError:  # pipe full (the exporter is behind and will see the request) or the exporter is gone
                pass

    def _wait(self, done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        pause = 0.001
        while not done():
            if time.monotonic() >= deadline:
                if self._channel is not None and not self._channel.ints[EXPORTER_PID]:
                    self._warn_once(
                        "attach", "otel_hicache: the export process has not attached yet; records wait in its ring"
                    )
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)  # an export takes milliseconds: poll less the longer it takes
        return True

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _log.warning(message, *args)


def _spawn(channel: Channel, plan: ExportPlan) -> _Launch:
    """Launch an exporter for ``channel``: returns once the launcher runs (it holds every descriptor the exporter
    needs). Raises OSError when a pipe, memfd or process cannot be had; closes whatever it opened."""
    assert channel.fd is not None
    opened: list[int] = []
    try:
        plan_fd = _memory_file(plan.to_json())
        opened.append(plan_fd)
        hang_r, hang_w = os.pipe()
        opened += (hang_r, hang_w)
        live_r, live_w = os.pipe()
        opened += (live_r, live_w)
        env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}  # sent in the memfd
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        fds = (hang_r, channel.fd, plan_fd, live_w)
        launcher = subprocess.Popen(
            [sys.executable, "-S", _LAUNCHER, ",".join(map(str, fds))],
            pass_fds=fds,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=live_w,
            start_new_session=True,
        )
    except BaseException:
        for fd in opened:
            _close(fd)
        raise
    for fd in (plan_fd, hang_r, live_w):  # the launcher has them now
        _close(fd)
    os.set_blocking(hang_w, False)
    os.set_blocking(live_r, False)
    return _Launch(launcher, hang_w, live_r)


def _memory_file(data: bytes) -> int:
    """A descriptor reading ``data`` from its start, with no name anywhere (memfd where the OS has it)."""
    memfd_create: Any = getattr(os, "memfd_create", None)
    if memfd_create is not None:
        fd = int(memfd_create("otel-hicache-config"))
    else:  # an unlinked temporary file
        import tempfile

        fd, path = tempfile.mkstemp(prefix="otel-hicache-")
        os.unlink(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _relay(launch: _Launch) -> bool:
    """Relay the launch's lines into this process's logging; False at end of file."""
    while launch.live >= 0:
        try:
            data = os.read(launch.live, 65536)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            if launch.partial:
                _relay_line(launch, launch.partial)
                launch.partial = b""
            return False
        lines = (launch.partial + data).split(b"\n")
        launch.partial = lines.pop()
        if len(launch.partial) > MAX_LINE_BYTES:
            lines.append(launch.partial)
            launch.partial = b""
        for line in lines:
            _relay_line(launch, line)
    return False


def _relay_line(launch: _Launch, line: bytes) -> None:
    if line.startswith(PID_LINE):
        launch.pid = int(line[len(PID_LINE) :] or 0)
        return
    level = logging.WARNING  # anything the exporter's runtime printed itself
    if line.startswith(LOG_LINE):
        number, _, line = line[len(LOG_LINE) :].partition(b" ")
        level = int(number) if number.isdigit() else level
    if line.strip():
        text = line[:MAX_LINE_BYTES].decode("utf-8", "replace")
        _log.log(level, "otel_hicache export process %s: %s", launch.pid or "?", text)


def _tend_left() -> None:
    if not _LEFT or not _LEFT_LOCK.acquire(blocking=False):
        return
    try:
        for launch in list(_LEFT):
            if not _relay(launch):
                launch.forget()
                _reap(launch, 0.0)
                _LEFT.remove(launch)
    finally:
        _LEFT_LOCK.release()


def _reap(launch: _Launch, wait_s: float) -> None:
    """Reap the launcher, and the exporter where orphans are this process's to reap (it is PID 1 or a subreaper:
    nobody else can reap them, so the pid cannot have been reused). ``wait_s``: how long to give an exporter whose
    pipe closed to become a zombie."""
    launch.launcher.poll()
    if not launch.pid or not _reaps_orphans():
        return
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if os.waitpid(launch.pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return  # not ours (yet)
        if time.monotonic() >= deadline:
            return
        time.sleep(0.005)


def _reaps_orphans() -> bool:
    if os.getpid() == 1:
        return True
    try:
        value = ctypes.c_int(0)
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(37, ctypes.byref(value), 0, 0, 0) == 0 and value.value)  # PR_GET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def forget_left_in_child() -> None:
    """A forked child does not tend its parent's finishing exporters (and starts with the list's lock free): an
    at-fork hook (:mod:`otel_hicache._internal.host.fork`)."""
    global _LEFT_LOCK
    _LEFT_LOCK = threading.Lock()
    for launch in _LEFT:
        launch.forget()
    _LEFT.clear()
