"""The export process's lifecycle without holes, with real processes, real exporters and a live receiver.

Short-lived hosts, however they end; exporters killed at low and high record rates; a burst before the exporter has
started; hosts that cannot have a thread, a process or a file descriptor; a reader of the host's output; a host that is
PID 1; a host process that exports over OTLP running nothing of the export itself. Each counted transfer must arrive
as a span or be counted as dropped, and every count must arrive exactly. Bounds on time are generous: the behaviour
they separate differs by many seconds (or forever).

``OTEL_HICACHE_TEST_REPEAT`` (default 2) sets how many hosts of each exit kind run (the measurements in the closing
note of issue 19 ran 20).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest

from otel_hicache import semconv as sc
from otel_hicache._internal.host.worker import HOST_THREAD_NAME
from otel_hicache.sdk import configure
from otel_hicache.testing.otlp_receiver import OtlpReceiver
from tests.core.support import (
    NOBODY,
    clean_env,
    host,
    record,
    resources,
    span_ids_by_pid,
    spans_by_pid,
    tokens_by_pid,
)

REPEAT = int(os.environ.get("OTEL_HICACHE_TEST_REPEAT", "2"))
#: The most a dead exporter stays unreplaced: the host thread looks once a second, waits out a back-off of 0.5 s after
#: a launch that died young, and the new exporter imports the SDK (~0.3 s quiet, several seconds on a loaded machine).
REPLACED_WITHIN_S = 15.0

SHORT_LIVED = textwrap.dedent(
    """
    import os, signal, sys
    from otel_hicache import configure
    from otel_hicache.records import TransferRecord
    setup = configure(endpoint=sys.argv[1], protocol="grpc")
    record = TransferRecord("backup", {"kv": 3}, 192, 10, 20, 0.001, "host_clock")
    for _ in range(100):
        setup.telemetry.record_transfer(record)
    how = sys.argv[2]
    if how == "sys.exit":
        sys.exit(0)
    if how == "os._exit":
        os._exit(0)
    if how != "return":
        os.kill(os.getpid(), getattr(signal, how))
    """
)


def test_a_host_that_ends_right_after_its_records_loses_none_of_them_however_it_ends() -> None:
    """Was: exact in 2/10 hosts with sys.exit, 3/10 with os._exit, 7/10 with SIGKILL (the exporter started on a thread
    the exit stopped, with descriptors the exit closed)."""
    exits = ["return", "sys.exit", "os._exit", "SIGTERM", "SIGKILL"] * REPEAT
    with OtlpReceiver() as rx:
        hosts = [host(SHORT_LIVED, rx.grpc_endpoint, how) for how in exits]  # all at once: a loaded machine
        for process in hosts:
            process.wait(120)
        expected = {process.pid: 300 for process in hosts}
        assert rx.wait_for(lambda: tokens_by_pid(rx) == expected, 120), _missing(tokens_by_pid(rx), expected, exits)
        assert rx.wait_for(lambda: spans_by_pid(rx) == {pid: 100 for pid in expected}, 60)


def _missing(got: dict[int, int], expected: dict[int, int], exits: list[str]) -> str:
    pids = list(expected)
    return ", ".join(f"{exits[pids.index(pid)]}: {got.get(pid)}" for pid in pids if got.get(pid) != expected[pid])


POOL = textwrap.dedent(
    """
    import json, multiprocessing, os, sys
    from otel_hicache import configure
    from otel_hicache.records import TransferRecord

    RECORD = TransferRecord("backup", {"kv": 3}, 192, 10, 20, 0.001, "host_clock")
    setup = None

    def init(endpoint):  # a spawned worker configures itself, as an engine's worker does
        global setup
        setup = configure(endpoint=endpoint, protocol="grpc")

    def work(n):
        for _ in range(n):
            setup.telemetry.record_transfer(RECORD)
        return os.getpid(), n

    if __name__ == "__main__":
        endpoint, method = sys.argv[1], sys.argv[2]
        if method == "fork":  # forked workers inherit the parent's telemetry and report from zero as themselves
            setup = configure(endpoint=endpoint, protocol="grpc")
        pool = multiprocessing.get_context(method).Pool(
            4, initializer=init if method == "spawn" else None, initargs=(endpoint,), maxtasksperchild=1
        )
        done = {}
        for pid, n in pool.map(work, [100] * 12, chunksize=1):
            done[pid] = done.get(pid, 0) + 3 * n
        pool.close()
        pool.join()
        print(json.dumps(done))
    """
)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_short_lived_pool_workers_under_load_lose_nothing(method: str, tmp_path: Path) -> None:
    """Workers that retire after one task each (twelve of them, four at a time) report every token. Was: 7-20 % lost
    (here, on the code before: workers whose counts never arrived)."""
    script = tmp_path / "pool.py"  # spawned workers import the main module: a file, not -c
    script.write_text(POOL)
    with OtlpReceiver() as rx:
        run = subprocess.run(
            [sys.executable, str(script), rx.grpc_endpoint, method],
            env=clean_env(),
            text=True,
            capture_output=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        expected = {int(pid): tokens for pid, tokens in json.loads(run.stdout).items()}
        assert len(expected) == 12
        got = lambda: {pid: n for pid, n in tokens_by_pid(rx).items() if pid in expected}  # noqa: E731
        assert rx.wait_for(lambda: got() == expected, 120), (got(), expected)


# ---------------------------------------------------------------------- a dead exporter
def _replacement(telemetry: object, first: int, keep_recording: object) -> float:
    """Seconds until an exporter other than ``first`` attached, ``keep_recording()`` called meanwhile."""
    start = time.monotonic()
    while telemetry.export_pid in (None, first):  # type: ignore[attr-defined]
        assert time.monotonic() - start < REPLACED_WITHIN_S, "the dead export process was not replaced"
        keep_recording()  # type: ignore[operator]
    return time.monotonic() - start


@pytest.mark.parametrize("rate", ["100/s", "unpaced"])
def test_a_killed_export_process_is_replaced_at_any_rate_and_every_transfer_is_accounted_for(rate: str) -> None:
    """SIGKILLed while spans are being exported: replaced within the bound whatever the rate (was: only once the ring
    was full, never at 100/s), counters exact, and every transfer a distinct span received or a counted drop (was:
    the spans in the dead exporter's queue neither)."""
    with OtlpReceiver() as rx:
        setup = configure(env={}, endpoint=rx.grpc_endpoint, protocol="grpc")
        telemetry = setup.telemetry
        recorded = 0

        def paced() -> None:
            nonlocal recorded
            telemetry.record_transfer(record())
            recorded += 1
            if rate == "100/s":
                time.sleep(0.01)

        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # spans flow: the exporter attaches and exports
            paced()
        assert telemetry.flush(30) and telemetry.export_pid is not None
        first = telemetry.export_pid
        for _ in range(50 if rate == "100/s" else 5000):
            paced()
        os.kill(first, signal.SIGKILL)  # most likely in the middle of building or exporting a batch
        _replacement(telemetry, first, paced)
        for _ in range(100):
            paced()
        assert telemetry.flush(30)
        dropped = telemetry.snapshot()[sc.METRIC_RECORDS_DROPPED].get(("transfer",), 0)
        if rate == "100/s":
            assert dropped == 0  # the ring holds what arrives while no exporter reads it
        pid = os.getpid()
        assert rx.wait_for(lambda: tokens_by_pid(rx).get(pid) == 3 * recorded, 30), (tokens_by_pid(rx), 3 * recorded)
        assert rx.wait_for(lambda: spans_by_pid(rx).get(pid, 0) + dropped == recorded, 30), (
            spans_by_pid(rx).get(pid),
            dropped,
            recorded,
        )
        setup.shutdown()


def test_a_burst_before_the_export_process_attached_is_served_by_one_export_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The ring fills during the exporter's start-up: one exporter still (was: a second one on the same ring, 512
    spans twice, two histogram counts under one identity, a false "export process is gone")."""
    with OtlpReceiver() as rx, caplog.at_level(logging.WARNING, logger="otel_hicache"):
        setup = configure(env={}, endpoint=rx.grpc_endpoint, protocol="grpc")
        telemetry = setup.telemetry
        n = 20_000  # more than the ring's 8192 slots, long before the exporter has imported the SDK
        for _ in range(n):
            telemetry.record_transfer(record())
        first = telemetry.export_pid
        assert telemetry.flush(30)
        assert first in (None, telemetry.export_pid)
        dropped = telemetry.snapshot()[sc.METRIC_RECORDS_DROPPED][("transfer",)]
        assert dropped > 0
        pid = os.getpid()
        assert rx.wait_for(lambda: len(span_ids_by_pid(rx).get(pid, [])) + dropped == n, 30)
        ids = span_ids_by_pid(rx)[pid]
        assert len(ids) == len(set(ids)), "spans exported twice: two exporters on one ring"
        durations = rx.latest_metric(sc.METRIC_TRANSFER_DURATION)  # every transfer, its span dropped or not
        assert durations is not None and sum(p.count for p in durations.histogram.data_points) == n
        assert "is gone" not in caplog.text
        setup.shutdown()


# ---------------------------------------------------------------------- hostile environments
SQUEEZED = textwrap.dedent(
    """
    import os, resource, sys, time
    import otel_hicache.sdk  # everything configure() needs, imported before the squeeze
    from otel_hicache import configure
    from otel_hicache.records import TransferRecord

    endpoint, squeeze = sys.argv[1], sys.argv[2]
    r = TransferRecord("backup", {"kv": 3}, 192, 10, 20, 0.001, "host_clock")
    held = []
    if squeeze == "nproc":  # this user (nobody) may start no thread and no process
        nproc = resource.getrlimit(resource.RLIMIT_NPROC)
        resource.setrlimit(resource.RLIMIT_NPROC, (1, nproc[1]))
    else:  # leave only so many file descriptors free
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        for _ in range(int(squeeze)):
            os.close(held.pop())
    setup = configure(endpoint=endpoint, protocol="grpc")
    for _ in range(50):
        setup.telemetry.record_transfer(r)
        setup.telemetry.record_transfer_deferred(lambda payload: payload, r)
    squeezed = setup.telemetry.flush(1)
    if squeeze == "nproc":  # the squeeze ends
        resource.setrlimit(resource.RLIMIT_NPROC, nproc)
    for fd in held:
        os.close(fd)
    deadline = time.monotonic() + 60
    while not setup.telemetry.flush(2) and time.monotonic() < deadline:
        pass
    print(squeezed, setup.telemetry.flush(2), flush=True)
    setup.shutdown()
    """
)


def test_no_thread_process_or_file_descriptor_to_be_had_never_raises_or_kills_and_export_resumes() -> None:
    """As an unprivileged user: RLIMIT_NPROC reached, and 0, 1, 2, 3 or 5 free file descriptors, from before
    configure(). Was: RuntimeError("can't start new thread") into the caller, a raw OSError from configure(), SIGABRT
    from gRPC in the host; a failed launch never retried."""
    squeezes = ["nproc", "0", "1", "2", "3", "5"]
    with OtlpReceiver() as rx:
        hosts = [
            host(SQUEEZED, rx.grpc_endpoint, squeeze, user=NOBODY, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for squeeze in squeezes
        ]
        results = [process.communicate(timeout=180) for process in hosts]
        for squeeze, process, (out, err) in zip(squeezes, hosts, results, strict=True):
            assert process.returncode == 0, (squeeze, process.returncode, err)  # no exception, no signal
            assert "Traceback" not in err, (squeeze, err)
            assert out.split() == ["False", "True"], (squeeze, out, err)  # nothing exported squeezed; then all
        expected = {process.pid: 300 for process in hosts}
        assert rx.wait_for(lambda: tokens_by_pid(rx) == expected, 60), (tokens_by_pid(rx), squeezes)
        assert rx.wait_for(lambda: spans_by_pid(rx) == {pid: 100 for pid in expected}, 30)


HOLDS_NOTHING = textwrap.dedent(
    """
    import sys
    from otel_hicache import configure
    from otel_hicache.records import TransferRecord
    setup = configure(endpoint=sys.argv[1], protocol="grpc")
    setup.telemetry.record_transfer(TransferRecord("backup", {"kv": 3}, 192, 10, 20, 0.001, "host_clock"))
    setup.telemetry.flush(4)  # meanwhile the span export to a collector that never answers times out, and is logged
    print(setup.telemetry.export_pid, flush=True)
    sys.stdin.read()  # until the test lets it exit
    """
)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_reader_of_the_hosts_output_sees_its_end_when_the_host_exits(black_hole: str) -> None:
    """The exporter, still exporting to a black hole after the host exited, holds none of the host's stdio (was: EOF
    3 s after the host's exit), and its log lines came through the host's own logging while the host lived."""
    process = host(
        HOLDS_NOTHING,
        black_hole,
        env=clean_env(OTEL_EXPORTER_OTLP_TIMEOUT="3"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    exporter = int(process.stdout.readline())
    host_pipes = {os.fstat(stream.fileno()).st_ino for stream in (process.stdin, process.stdout, process.stderr)}
    fds = {fd: os.readlink(f"/proc/{exporter}/fd/{fd}") for fd in (0, 1, 2)}
    assert fds[0] == fds[1] == "/dev/null"
    assert fds[2].startswith("pipe:[") and int(fds[2][6:-1]) not in host_pipes
    output: dict[str, str] = {}
    ends: dict[str, float] = {}

    def read(name: str, stream: object) -> None:
        output[name] = stream.read()  # type: ignore[attr-defined]
        ends[name] = time.monotonic()

    readers = [threading.Thread(target=read, args=item) for item in (("out", process.stdout), ("err", process.stderr))]
    for reader in readers:
        reader.start()
    process.stdin.close()
    assert process.wait(60) == 0
    exited = time.monotonic()
    for reader in readers:
        reader.join(30)
    assert max(ends.values()) - exited < 0.5, output
    assert _running(exporter)  # still on its last export: and yet the host's output ended
    assert re.search(
        rf"otel_hicache export process {exporter}: opentelemetry\.exporter\.otlp\S*: Failed to export", output["err"]
    ), output["err"]


CYCLES = textwrap.dedent(
    """
    import ctypes, os, sys, time
    from otel_hicache import configure
    from otel_hicache.records import TransferRecord
    if sys.argv[2] == "subreaper":
        assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER: orphans come to this process
    else:
        assert os.getpid() == 1
    for _ in range(5):
        setup = configure(endpoint=sys.argv[1], protocol="grpc")
        setup.telemetry.record_transfer(TransferRecord("backup", {"kv": 3}, 192, 10, 20, 0.001, "host_clock"))
        setup.shutdown()
    time.sleep(0.5)  # an exporter that ends late is a zombie by now
    zombies = 0
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        zombies += stat[0] == "Z" and int(stat[1]) == os.getpid()
    print(zombies, flush=True)
    """
)


def _unshare_works() -> bool:
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
        return done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.parametrize("where", ["pid1", "subreaper"])
def test_a_host_that_reaps_orphans_is_left_no_zombie_exporter(where: str) -> None:
    """PID 1 of a PID namespace (``unshare --pid --fork``: a container without an init) and a child subreaper get the
    orphaned exporters; after 5 configure/shutdown cycles none is a zombie (was: 5)."""
    prefix = []
    if where == "pid1":
        if not _unshare_works():
            pytest.skip("unshare --pid --fork is not permitted here (the subreaper case covers the same ground)")
        prefix = ["unshare", "--pid", "--fork", "--mount-proc"]
    with OtlpReceiver() as rx:
        run = subprocess.run(
            [*prefix, sys.executable, "-c", CYCLES, rx.grpc_endpoint, where],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["0"], run.stderr


IN_THE_HOST = textwrap.dedent(
    """
    import json, logging, os, sys, threading
    from otel_hicache import configure
    from otel_hicache._internal.export.main import EXPORTER_LOGGERS
    from otel_hicache.records import TransferRecord
    environ = dict(os.environ)
    filters = {name: list(logging.getLogger(name).filters) for name in EXPORTER_LOGGERS}
    setup = configure()  # OTEL_EXPORTER_OTLP_ENDPOINT from the environment
    for _ in range(100):
        setup.telemetry.record_transfer(TransferRecord("backup", {"kv": 3}, 192, 10, 20, 0.001, "host_clock"))
    report = {"flushed": setup.telemetry.flush(30), "environ": dict(os.environ) == environ}
    report["filters"] = {name: list(logging.getLogger(name).filters) for name in EXPORTER_LOGGERS} == filters
    report["grpc"] = "grpc" in sys.modules
    report["threads"] = sorted(thread.name for thread in threading.enumerate())
    setup.meter_provider  # what SGLang's stat loggers ask for: the app's meter provider alone
    report["with_meter"] = sorted(thread.name for thread in threading.enumerate())
    print(json.dumps(report))
    """
)


def test_over_otlp_the_host_runs_no_export_work_and_its_environment_and_loggers_stay_as_they_were() -> None:
    """Was: a span batch processor and a periodic metric reader with gRPC channels in the host, OTEL_* variables set
    in os.environ, once-per-logger filters on the SDK's loggers (the app's own exporters silenced too). The app's
    meter provider, when asked for, comes without a tracer provider's batch processor."""
    with OtlpReceiver() as rx:
        env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=rx.grpc_endpoint)
        run = subprocess.run([sys.executable, "-c", IN_THE_HOST], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        report = json.loads(run.stdout)
        ours = ["MainThread", HOST_THREAD_NAME]
        assert report == {
            "flushed": True,
            "environ": True,
            "filters": True,
            "grpc": False,
            "threads": sorted(ours),
            "with_meter": sorted([*ours, "OtelPeriodicExportingMetricReader"]),
        }
        assert rx.wait_for(lambda: list(tokens_by_pid(rx).values()) == [300], 30)


def test_a_resource_of_200_kib_reaches_the_exporter_through_a_channel_no_other_user_can_read() -> None:
    """Was: the whole configuration as one argv string: E2BIG near 128 KiB, and the Resource in everyone's ``ps``."""
    blob = "x" * (200 * 1024)
    with OtlpReceiver() as rx:
        setup = configure(
            env={"OTEL_EXPORTER_OTLP_ENDPOINT": rx.grpc_endpoint, "OTEL_RESOURCE_ATTRIBUTES": "blob=" + blob}
        )
        setup.telemetry.record_transfer(record())
        assert setup.telemetry.flush(30)
        assert rx.wait_for(lambda: any(r.get("blob") == blob for r in resources(rx)), 30)
        exporter = setup.telemetry.export_pid
        cmdline = Path(f"/proc/{exporter}/cmdline").read_bytes()
        assert b"blob" not in cmdline and b"otel-hicache" not in cmdline and len(cmdline) < 2048
        peek = f"import os\ntry:\n    os.listdir('/proc/{exporter}/fd')\nexcept PermissionError:\n    print('denied')"
        other = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", peek],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert other.stdout.strip() == "denied", other.stderr  # the memfds are behind the exporter's fd table
        setup.shutdown()


def test_a_telemetry_dropped_without_shutdown_is_freed_and_its_export_process_ends() -> None:
    with OtlpReceiver() as rx:
        setup = configure(env={}, endpoint=rx.grpc_endpoint, protocol="grpc")
        setup.telemetry.record_transfer(record())
        assert setup.telemetry.flush(30)
        exporter = setup.telemetry.export_pid
        assert exporter is not None
        dropped = weakref.ref(setup.telemetry)
        del setup
        gc.collect()
        assert dropped() is None
        deadline = time.monotonic() + 30
        while _running(exporter) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(exporter)
        assert rx.wait_for(lambda: tokens_by_pid(rx) == {os.getpid(): 3}, 30)
