"""What the process tests share: a record, what a receiver got per host process, hosts in processes of their own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from otel_hicache import semconv as sc
from otel_hicache.records import TransferRecord
from otel_hicache.semconv import TimingSource, TransferOperation
from otel_hicache.testing.otlp_receiver import OtlpReceiver, attributes

SPAN = sc.SPAN_NAMES[TransferOperation.BACKUP]
#: The nobody user, for hosts that must not be root (RLIMIT_NPROC binds any other user that lacks CAP_SYS_RESOURCE and
#: CAP_SYS_ADMIN). It keeps the right to read and run what root can (CAP_DAC_*): the test venv's interpreter may live
#: where only root looks (pyenv under /root), and its exporters run that interpreter too.
_CAPS = "+dac_override,+dac_read_search"
NOBODY = [
    "setpriv",
    "--reuid=65534",
    "--regid=65534",
    "--clear-groups",
    f"--inh-caps={_CAPS}",
    f"--ambient-caps={_CAPS}",
]


def record(tokens: int = 3) -> TransferRecord:
    return TransferRecord(TransferOperation.BACKUP, {"kv": tokens}, tokens * 64, 10, 20, 0.001, TimingSource.HOST_CLOCK)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any OTEL_* variable (a developer's shell must not leak into a host)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, **extra}


def host(
    script: str, *args: str, env: dict[str, str] | None = None, user: Sequence[str] = (), **popen: Any
) -> subprocess.Popen[str]:
    """``script`` in a fresh interpreter (``user``: a command prefix that drops privileges; ``popen``: more
    :class:`subprocess.Popen` arguments)."""
    return subprocess.Popen(
        [*user, sys.executable, "-c", script, *args], env=clean_env() if env is None else env, text=True, **popen
    )


def tokens_by_pid(rx: OtlpReceiver) -> dict[int, int]:
    """The latest cumulative ``hicache.transfer.tokens{backup, kv}`` of each process (``process.pid``)."""
    return {int(str(key)): value for key, value in tokens_by(rx, "process.pid").items()}


def tokens_by(rx: OtlpReceiver, resource_key: str) -> dict[object, int]:
    """The latest cumulative ``hicache.transfer.tokens{backup, kv}`` by the value of a Resource attribute."""
    latest: dict[object, int] = {}
    for request in list(rx.metric_requests):
        for rm in request.resource_metrics:
            key = attributes(rm.resource.attributes).get(resource_key)
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name != sc.METRIC_TRANSFER_TOKENS:
                        continue
                    for point in metric.sum.data_points:
                        if attributes(point.attributes) == {sc.ATTR_OPERATION: "backup", sc.ATTR_POOL: "kv"}:
                            latest[key] = point.as_int
    return latest


def resources(rx: OtlpReceiver) -> list[dict[str, object]]:
    """The Resource of every metric export received."""
    return [
        attributes(rm.resource.attributes) for request in list(rx.metric_requests) for rm in request.resource_metrics
    ]


def span_ids_by_pid(rx: OtlpReceiver) -> dict[int, list[bytes]]:
    """Every transfer span id received, by process (a span received twice is listed twice)."""
    out: dict[int, list[bytes]] = {}
    for request in list(rx.trace_requests):
        for rs in request.resource_spans:
            pid = int(attributes(rs.resource.attributes)["process.pid"])
            ids = out.setdefault(pid, [])
            ids += [s.span_id for ss in rs.scope_spans for s in ss.spans if s.name == SPAN]
    return out


def spans_by_pid(rx: OtlpReceiver) -> dict[int, int]:
    """How many distinct transfer spans each process delivered."""
    return {pid: len(set(ids)) for pid, ids in span_ids_by_pid(rx).items()}


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def black_hole_server() -> Iterator[str]:
    """A collector that accepts connections and never answers (the worst kind: no error, no progress)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
