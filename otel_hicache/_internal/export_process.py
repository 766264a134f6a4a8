"""The export process: builds spans and metrics from a host's channel and exports them, outside the host.

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

Its configuration (the host's ``OTEL_*`` variables, the Resource) reaches it in a memfd passed as a file descriptor:
no other user can read it (``ps`` shows file descriptor numbers only) and it has no size limit. Its standard input
and output are ``/dev/null``: it holds none of the host's stdio, so a reader of the host's output sees end-of-file
when the host exits. Where the host reaps orphans (PID 1 of a container, or a child subreaper) it reaps its exporters.

The ring is the exporter's only queue: it builds spans from a batch of records with a processor that only collects
them, exports them synchronously (as the SDK's batch processor would: ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` at a time,
at least every ``OTEL_BSP_SCHEDULE_DELAY``) and then settles the slots. A span whose export fails is counted in
``otel_hicache.records.dropped``; a replacement for a dead exporter sends again what its predecessor had not settled,
under the same span and trace ids (an OTLP retry). Everything is exported under the host's Resource, and the
exporter's threads and OTLP encoding never touch the host's GIL.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator

from otel_hicache._internal.channel import (
    EXPORT_DROPPED,
    EXPORTER_PID,
    FLUSH_DONE,
    FLUSH_REQ,
    HEADER_INTS,
    ID_SEED,
    READ,
    SETTLED,
    Channel,
)

_log = logging.getLogger(__name__)

#: The launcher (``python -S``): fork, name the child on the liveness pipe, exit at once (the host reaps it); the
#: orphaned child execs the exporter.
_LAUNCHER = (
    "import os, sys\n"
    "pid = os.fork()\n"
    "if pid:\n    os.write(2, b'\\x1fP%d\\n' % pid)\n    os._exit(0)\n"
    "os.execv(sys.executable, [sys.executable, '-c', *sys.argv[1:]])\n"
)
#: The exporter's first lines: its configuration, environment included, before anything reads the environment (the
#: OTel API reads ``OTEL_PYTHON_CONTEXT`` on import).
_BOOT = (
    "import json, os, sys\n"
    "fds = [int(fd) for fd in sys.argv[1].split(',')]\n"
    "with os.fdopen(fds[2], 'rb') as f:\n    config = json.loads(f.read())\n"
    "os.environ.update(config.pop('environment'))\n"
    "from otel_hicache._internal.export_process import main\n"
    "main(fds[0], fds[1], config)\n"
)
#: How the liveness pipe's lines start: the launcher naming the exporter's pid, an exporter log record.
_PID_LINE, _LOG_LINE = b"\x1fP", b"\x1fL"
#: The longest line relayed (a longer one is cut).
MAX_LINE_BYTES = 2000
#: How often the exporter looks at the ring when the host sends nothing.
POLL_INTERVAL_S = 0.1
#: How much lower the exporter's CPU priority is than the host's (``nice``): it yields the cores to the scheduler.
EXPORTER_NICENESS = 10
#: The longest the exporter works on its last export after the host is gone.
FINAL_TIMEOUT_S = 5.0
#: A launch that ends (or fails to start) sooner than this counts as a failure: the next waits longer.
LIVED_S = 10.0
#: The longest wait before launching again while launches keep failing (0.5 s, then doubling).
MAX_BACKOFF_S = 30.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


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

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config
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
        config = dict(self._config)
        config["resource"] = child_resource(config["resource"])
        return ExportProcess(config)

    # ------------------------------------------------------------------ internals
    def _start(self, channel: Channel) -> None:
        try:
            self._launch = _spawn(channel, self._config)
        except Exception as exc:  # OSError (no fds, EAGAIN from fork), RuntimeError: never into the host
            self._failed()
            self._warn_once("start", "otel_hicache: could not start the export process (%r); retrying with back-off "
                            "(spans wait in the ring, counters stay exact)", exc)  # fmt: skip

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
        self._warn_once("gone", "otel_hicache: the export process %s is gone; a new one sends what it had not sent "
                        "(logged once)", launch.pid or "")  # fmt: skip

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
                    self._warn_once("attach", "otel_hicache: the export process has not attached yet; records wait in "
                                    "its ring")  # fmt: skip
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)  # an export takes milliseconds: poll less the longer it takes
        return True

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _log.warning(message, *args)


def _spawn(channel: Channel, config: Mapping[str, Any]) -> _Launch:
    """Launch an exporter for ``channel``: returns once the launcher runs (it holds every descriptor the exporter
    needs). Raises OSError when a pipe, memfd or process cannot be had; closes whatever it opened."""
    assert channel.fd is not None
    opened: list[int] = []
    try:
        settings_fd = _memory_file(json.dumps(config).encode())
        opened.append(settings_fd)
        hang_r, hang_w = os.pipe()
        opened += (hang_r, hang_w)
        live_r, live_w = os.pipe()
        opened += (live_r, live_w)
        env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}  # sent in the memfd
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        fds = (hang_r, channel.fd, settings_fd, live_w)
        launcher = subprocess.Popen(
            [sys.executable, "-S", "-c", _LAUNCHER, _BOOT, ",".join(map(str, fds))], pass_fds=fds, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=live_w, start_new_session=True,
        )  # fmt: skip
    except BaseException:
        for fd in opened:
            _close(fd)
        raise
    for fd in (settings_fd, hang_r, live_w):  # the launcher has them now
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
    if line.startswith(_PID_LINE):
        launch.pid = int(line[len(_PID_LINE) :] or 0)
        return
    level = logging.WARNING  # anything the exporter's runtime printed itself
    if line.startswith(_LOG_LINE):
        number, _, line = line[len(_LOG_LINE) :].partition(b" ")
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


def _forget_left_in_child() -> None:
    """A forked child does not tend its parent's finishing exporters (and starts with the list's lock free)."""
    global _LEFT_LOCK
    _LEFT_LOCK = threading.Lock()
    for launch in _LEFT:
        launch.forget()
    _LEFT.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_left_in_child)


def child_resource(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """A forked child's Resource: its own ``process.pid`` and ``service.instance.id``, the rest inherited."""
    out = dict(attributes)
    out["process.pid"] = os.getpid()
    out["service.instance.id"] = str(uuid.uuid4())
    return out


# ---------------------------------------------------------------------- the exporter's side
class OncePerLogger(logging.Filter):
    """One line per logger: a dead collector gets one line, not one per export attempt (the SDK's own
    ``otel.sdk.*`` metrics and ``otel_hicache.records.dropped`` count every lost span)."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name in self._seen:
            return False
        self._seen.add(record.name)
        return True


#: The SDK loggers that speak once per failed export; :func:`quiet_exporters` lets one line of each through.
EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.metrics._internal.export",
)


def quiet_exporters() -> None:
    """A dead collector costs one log line per kind of failure, not one per export attempt (the export process's
    own exporters: in a host, the loggers are the app's too)."""
    for name in EXPORTER_LOGGERS:
        logging.getLogger(name).addFilter(OncePerLogger())


class _Relayed(logging.Handler):
    """Log records as lines on standard error, which is the liveness pipe the host relays into its own logging; a
    line the pipe cannot take now (the host is not reading, or gone) is dropped, never waited for."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record).replace("\n", " | ").encode("utf-8", "replace")[:MAX_LINE_BYTES]
            os.write(2, _LOG_LINE + b"%d %s\n" % (record.levelno, text))
        except (OSError, ValueError):
            pass


class RingIds(IdGenerator):
    """Span and trace ids from the ring: the slot's sequence number, keyed by the ring's seed. A replacement exporter
    building a record again gives its span the ids it had (an OTLP retry, which a backend can deduplicate)."""

    def __init__(self, seed: int) -> None:
        self._key = seed.to_bytes(8, "little")
        self._digest = bytes(24)

    def at(self, sequence: int) -> None:
        """The next span is that of the record at ``sequence``."""
        self._digest = hashlib.blake2b(sequence.to_bytes(8, "little"), digest_size=24, key=self._key).digest()

    def generate_trace_id(self) -> int:
        return int.from_bytes(self._digest[:16], "big") or 1

    def generate_span_id(self) -> int:
        return int.from_bytes(self._digest[16:], "big") or 1


class Collect(SpanProcessor):
    """Keeps every ended span until taken: the export process sends them itself, synchronously."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)

    def take(self) -> list[ReadableSpan]:
        spans, self.spans = self.spans, []
        return spans


class _Sender:
    """Builds the ring's records into spans and histogram points, and sends the spans: ``batch`` at a time, at least
    every ``delay_s`` (the SDK batch processor's rule); then settles the slots. Only the main thread calls it."""

    def __init__(self, channel: Channel, emit: Callable[[Any], None], ids: RingIds, collect: Collect,
                 exporter: SpanExporter | None, batch: int, delay_s: float) -> None:  # fmt: skip
        self._channel, self._emit, self._ids, self._collect = channel, emit, ids, collect
        self._exporter, self._batch, self._delay_s = exporter, batch, delay_s
        self._since = 0.0  # when the oldest span not sent was built

    def build(self) -> None:
        channel, ids = self._channel, self._ids
        while True:
            first = channel.ints[READ]
            records = channel.take(512)
            if not records:
                break
            for i, record in enumerate(records):
                ids.at(first + i)
                try:
                    self._emit(record)
                except Exception:
                    _log.debug("emitting a record failed", exc_info=True)
        if not self._collect.spans:
            channel.settle()  # nothing waits to be sent: what was built is done with
        elif not self._since:
            self._since = time.monotonic()

    def due(self) -> bool:
        held = len(self._collect.spans)
        return held >= self._batch or (held > 0 and time.monotonic() - self._since >= self._delay_s)

    def send(self) -> None:
        spans = self._collect.take()
        ints = self._channel.ints
        for at in range(0, len(spans), self._batch):
            chunk: Sequence[ReadableSpan] = spans[at : at + self._batch]
            try:
                sent = self._exporter is not None and self._exporter.export(chunk) is SpanExportResult.SUCCESS
            except Exception:
                _log.debug("exporting spans failed", exc_info=True)
                sent = False
            if not sent:
                ints[EXPORT_DROPPED] += len(chunk)
        self._channel.settle()
        self._since = 0.0


def main(hangup_fd: int, channel_fd: int, config: dict[str, Any]) -> None:
    os.set_blocking(2, False)
    handler = _Relayed()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("otel_hicache.config").setLevel(logging.ERROR)  # the host warned about its settings already
    quiet_exporters()
    stop = threading.Event()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the host
    os.nice(EXPORTER_NICENESS)  # background work: on a busy host, the scheduler runs first

    from otel_hicache._internal.accumulation import Layout
    from otel_hicache._internal.emitter import Emitter
    from otel_hicache.sdk import export_providers

    channel = Channel(Layout(config["pools"], config["seed_pools"], HEADER_INTS), config["capacity"], shared=True,
                      fd=channel_fd)  # fmt: skip
    ints = channel.ints
    ids, collect = RingIds(ints[ID_SEED]), Collect()
    tracer_provider, meter_provider, span_exporter, settings = export_providers(config, collect, ids)
    emitter = Emitter(channel.counters, tracer_provider, meter_provider, spans=config["spans"],
                      token_metrics=config["token_metrics"])  # fmt: skip
    sender = _Sender(channel, emitter.emit, ids, collect, span_exporter, settings.bsp_max_export_batch_size,
                     settings.bsp_schedule_delay_ms / 1000)  # fmt: skip
    ints[READ] = ints[SETTLED]  # what a predecessor took and never settled is built and sent again
    ints[EXPORTER_PID] = os.getpid()
    final_s = config.get("final_timeout_s", FINAL_TIMEOUT_S)
    timeout_ms = int(final_s * 1000)

    poke = threading.Event()
    ending_lock = threading.Lock()
    deadline = threading.Timer(final_s + 0.5, os._exit, args=(0,))
    deadline.daemon = True

    def ending() -> None:
        """The host is gone (or SIGTERM): from now on the process has ``final_s`` to live, even if the main loop is
        stuck in an export to a dead collector. Once, whether the pipe or the signal says it first."""
        if ending_lock.acquire(blocking=False):
            stop.set()
            deadline.start()
        poke.set()

    def watch_host() -> None:
        """Owns the hang-up pipe: a byte is a flush request; end of file means the host is gone."""
        while os.read(hangup_fd, 4096):
            poke.set()
        ending()

    signal.signal(signal.SIGTERM, lambda *_: ending())  # the container is going away: last export, then exit
    threading.Thread(target=watch_host, name="otel-hicache-watch-host", daemon=True).start()
    while not stop.is_set():
        poke.wait(POLL_INTERVAL_S)
        poke.clear()
        sender.build()
        request = ints[FLUSH_REQ]
        if request > ints[FLUSH_DONE] and not stop.is_set():
            sender.send()
            meter_provider.force_flush(timeout_ms)
            ints[FLUSH_DONE] = request
        elif sender.due():
            sender.send()

    try:
        sender.build()
        if span_exporter is not None:  # half the time left for spans, whatever the collector does
            cut_off = threading.Timer(final_s / 2, span_exporter.shutdown)
            cut_off.daemon = True
            cut_off.start()
        sender.send()
        meter_provider.force_flush(timeout_ms)
    finally:
        logging.shutdown()
        os._exit(0)
