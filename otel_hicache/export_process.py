"""The export process: builds spans and metrics from a host's channel and exports them, outside the host.

The host (:class:`ExportProcess`, a :class:`~otel_hicache.telemetry.Consumer`) starts it on first use through a
short-lived launcher that forks and exits, so the exporter is not a child of the host: an engine that stops its
scheduler with ``kill_process_tree`` (SGLang) or SIGKILL does not take the exporter with it. The two share:

* the channel's memory (a ``memfd``): the exact counter table and the record ring;
* a pipe the host holds the write end of. A byte on it asks for a flush; end-of-file means the host is gone,
  whether it shut down, exited, or was killed. Then the exporter drains the ring, exports one last time (within
  ``final_timeout_s``, whatever the collector does) and exits.

Everything is built under the host's Resource (its ``process.pid``, ranks, service name), from the ``OTEL_*``
environment the host was configured with. The exporter's own threads and OTLP encoding never touch the host's GIL.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from otel_hicache.channel import EXPORTER_DONE, EXPORTER_PID, FLUSH_DONE, FLUSH_REQ, HEADER_INTS, Channel

_log = logging.getLogger(__name__)

#: The launcher: fork, let the parent exit at once (the host reaps it), exec the exporter in the orphaned child.
_LAUNCHER = (
    "import os, sys\n"
    "if os.fork():\n    os._exit(0)\n"
    "os.execv(sys.executable, [sys.executable, '-c', 'import sys; from otel_hicache.export_process import main; "
    "main(sys.argv[1:])', *sys.argv[1:]])\n"
)
#: How often the exporter looks at the ring when the host sends nothing.
POLL_INTERVAL_S = 0.1
#: How much lower the exporter's CPU priority is than the host's (``nice``): it yields the cores to the scheduler.
EXPORTER_NICENESS = 10
#: The longest the exporter works on its last export after the host is gone.
FINAL_TIMEOUT_S = 5.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


class ExportProcess:
    """The host's handle on its export process (the :class:`~otel_hicache.telemetry.Consumer` for OTLP)."""

    def __init__(self, channel: Channel, config: dict[str, Any], env: Mapping[str, str]) -> None:
        self._channel = channel
        self._config = config
        self._env = dict(env)
        self._write_fd: int | None = None
        self._close_write: weakref.finalize | None = None  # a dropped telemetry still ends its exporter
        self._spawner: threading.Thread | None = None
        self._warned = False

    # ------------------------------------------------------------------ Consumer
    def start(self) -> None:
        """Open the pipe now and launch the exporter on a short-lived thread (the caller never waits for it)."""
        read_fd, self._write_fd = os.pipe()
        self._close_write = weakref.finalize(self, os.close, self._write_fd)
        os.set_blocking(self._write_fd, False)
        self._spawner = threading.Thread(target=self._spawn, args=(read_fd,), name="otel-hicache-launch", daemon=True)
        self._spawner.start()

    def revive(self) -> None:
        """The ring is full: if the exporter died (killed, out of memory), start a new one on the same memory; it
        carries on from the ring's read position and the exact counters. Logged once."""
        spawner, pid = self._spawner, self._channel.ints[EXPORTER_PID]
        if spawner is None or (pid == 0 and spawner.is_alive()):
            return  # never started, or still starting
        if pid:
            try:
                os.kill(pid, 0)
                return  # alive, only behind
            except PermissionError:
                return
            except ProcessLookupError:
                pass
        if not self._warned:
            self._warned = True
            _log.warning("otel_hicache: the export process is gone; starting a new one (lost spans are counted)")
        self._channel.ints[EXPORTER_PID] = 0
        self._end_pipe()
        self.start()

    def drain(self, budget_ns: int) -> bool:
        return False  # the exporter drains the ring itself

    def flush(self, timeout_s: float) -> bool:
        """Ask the exporter to drain the ring and export now; wait (bounded) for it to say done."""
        ints = self._channel.ints
        request = ints[FLUSH_REQ] + 1
        ints[FLUSH_REQ] = request
        self._poke()
        return self._wait(lambda: ints[FLUSH_DONE] >= request, timeout_s)

    def close(self, timeout_s: float) -> bool:
        """End of file on the pipe: the exporter exports the last window and exits; wait for that, bounded. The
        memory stays mapped here (later records still count) but its descriptor is released."""
        self._end_pipe()
        ints = self._channel.ints
        done = self._wait(lambda: ints[EXPORTER_DONE] != 0, timeout_s)
        self._channel.release_fd()
        return done

    def _end_pipe(self) -> None:
        if self._close_write is not None:
            self._close_write()  # closes the write end once, whoever calls first
        self._write_fd = None

    def before_fork(self) -> bool:
        return False  # nothing of the export runs in this process

    def after_fork_in_parent(self, held: bool) -> None:
        return None

    def after_fork_in_child(self, channel: Channel) -> ExportProcess:
        """The child gets its own exporter later; closing the inherited pipe end leaves the parent's running."""
        self._end_pipe()
        config = dict(self._config)
        config["resource"] = child_resource(config["resource"])
        return ExportProcess(channel, config, self._env)

    # ------------------------------------------------------------------ internals
    def _poke(self) -> None:
        if self._write_fd is None:
            return
        try:
            os.write(self._write_fd, b"f")
        except OSError:  # pipe full (the exporter is behind and will see the request) or the exporter is gone
            pass

    def _wait(self, done: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        pause = 0.001
        while not done():
            if time.monotonic() >= deadline:
                if not self._warned and not self._channel.ints[EXPORTER_PID]:
                    self._warned = True
                    _log.warning("otel_hicache: the export process has not attached yet; records wait in its queue")
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)  # an export takes milliseconds: poll less the longer it takes
        return True

    def _spawn(self, read_fd: int) -> None:
        channel_fd = self._channel.fd
        assert channel_fd is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update({k: v for k, v in self._env.items() if k.startswith("OTEL_")})
        env.setdefault("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        command = [sys.executable, "-c", _LAUNCHER, str(read_fd), str(channel_fd), json.dumps(self._config)]
        try:
            launcher = subprocess.Popen(command, pass_fds=(read_fd, channel_fd), stdin=subprocess.DEVNULL, env=env,
                                        start_new_session=True)  # fmt: skip
            launcher.wait(timeout=60)
        except Exception as exc:
            _log.warning("otel_hicache: could not start the export process (%r); spans and metrics stay queued", exc)
        finally:
            os.close(read_fd)


def child_resource(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """A forked child's Resource: its own ``process.pid`` and ``service.instance.id``, the rest inherited."""
    out = dict(attributes)
    out["process.pid"] = os.getpid()
    if "service.instance.id" in out:
        out["service.instance.id"] = str(uuid.uuid4())
    return out


# ---------------------------------------------------------------------- the exporter's side
class OncePerLogger(logging.Filter):
    """One line per logger: a dead collector gets one line, not one per export attempt (the SDK's own
    ``otel.sdk.*`` metrics count every failed export)."""

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
    """A dead collector costs one log line per kind of failure, not one per export attempt (idempotent)."""
    for name in EXPORTER_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OncePerLogger) for f in logger.filters):
            logger.addFilter(OncePerLogger())


def main(argv: list[str]) -> None:
    read_fd, channel_fd, config = int(argv[0]), int(argv[1]), json.loads(argv[2])
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("otel_hicache export process %(process)d: %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    quiet_exporters()
    stop = threading.Event()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the host
    os.nice(EXPORTER_NICENESS)  # background work: on a busy host, the scheduler runs first

    from otel_hicache.accumulation import Layout
    from otel_hicache.export import Emitter
    from otel_hicache.sdk import export_providers

    channel = Channel(Layout(config["pools"], config["seed_pools"], HEADER_INTS), config["capacity"], shared=True,
                      fd=channel_fd)  # fmt: skip
    tracer_provider, meter_provider = export_providers(config)
    emitter = Emitter(channel.counters, tracer_provider, meter_provider, spans=config["spans"],
                      token_metrics=config["token_metrics"])  # fmt: skip
    ints = channel.ints
    ints[EXPORTER_PID] = os.getpid()
    timeout_ms = int(config.get("final_timeout_s", FINAL_TIMEOUT_S) * 1000)

    def drain() -> None:
        while records := channel.take(512):
            for record in records:
                try:
                    emitter.emit(record)
                except Exception:
                    _log.debug("emitting a record failed", exc_info=True)

    def export_now() -> None:
        drain()
        tracer_provider.force_flush(timeout_ms)
        meter_provider.force_flush(timeout_ms)

    poke = threading.Event()
    ending_lock = threading.Lock()
    deadline = threading.Timer(timeout_ms / 1000 + 0.5, os._exit, args=(0,))
    deadline.daemon = True

    def ending() -> None:
        """The host is gone (or SIGTERM): from now on the process has ``final_timeout_s`` to live, even if the main
        loop is stuck in an export to a dead collector. Once, whether the pipe or the signal says it first."""
        if ending_lock.acquire(blocking=False):
            stop.set()
            deadline.start()
        poke.set()

    def watch_host() -> None:
        """Owns the pipe: a byte is a flush request; end of file means the host is gone."""
        while os.read(read_fd, 4096):
            poke.set()
        ending()

    signal.signal(signal.SIGTERM, lambda *_: ending())  # the container is going away: last export, then exit
    threading.Thread(target=watch_host, name="otel-hicache-watch-host", daemon=True).start()
    while not stop.is_set():
        poke.wait(POLL_INTERVAL_S)
        poke.clear()
        drain()
        request = ints[FLUSH_REQ]
        if request > ints[FLUSH_DONE] and not stop.is_set():
            export_now()
            ints[FLUSH_DONE] = request

    try:
        export_now()
    finally:
        ints[EXPORTER_DONE] = 1
        logging.shutdown()
        os._exit(0)
