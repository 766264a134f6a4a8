"""The host process in production: forks, exits, signals and dead collectors, with real processes and real exporters.

Exporting over OTLP, spans and metrics are built by an export process; the host only counts and packs records. These
tests check what a user of a real server sees: every process reports once under its own ``process.pid``, a killed
host still delivers what it counted, and no collector can make the host wait. Bounds on time are generous (an
unbounded wait would take the SDK's 30 s or the exporter's retries): they test behaviour, not speed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from otel_hicache import semconv as sc
from otel_hicache.records import PoolUsage
from otel_hicache.sdk import configure
from otel_hicache.testing.otlp_receiver import OtlpReceiver
from tests.core.support import alive, clean_env, closed_port, record, spans_by_pid, tokens_by_pid


# ---------------------------------------------------------------------- fork
def test_fork_storm_children_report_from_zero_as_their_own_process_and_the_parent_stays_exact() -> None:
    with OtlpReceiver() as rx:
        setup = configure(env={}, endpoint=rx.grpc_endpoint, protocol="grpc")
        recorded = 0
        stop = threading.Event()

        def parent_traffic() -> None:  # another thread records while the main thread forks
            nonlocal recorded
            while not stop.is_set():
                setup.telemetry.record_transfer(record())
                recorded += 1
                time.sleep(0.0005)

        traffic = threading.Thread(target=parent_traffic)
        traffic.start()
        children = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:  # child: records, flushes, reads its own counters, exits
                code = 3
                try:
                    for _ in range(10):
                        setup.telemetry.record_transfer(record())
                    flushed = setup.telemetry.flush(60)
                    mine = setup.telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")]
                    code = 0 if flushed and mine == 30 else 4
                finally:
                    os._exit(code)
            children.append(pid)
            time.sleep(0.05)
        deadline = time.monotonic() + 120
        codes: dict[int, int] = {}
        while len(codes) < len(children) and time.monotonic() < deadline:
            for pid in children:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        hung = [pid for pid in children if pid not in codes]
        for pid in hung:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        stop.set()
        traffic.join()
        assert not hung, f"{len(hung)} forked children hung"
        assert codes == dict.fromkeys(children, 0)  # each child flushed and counted exactly its own 30 tokens

        assert setup.telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 3 * recorded
        setup.force_flush(30)
        expected = {os.getpid(): 3 * recorded, **dict.fromkeys(children, 30)}
        assert rx.wait_for(lambda: tokens_by_pid(rx) == expected, 60), tokens_by_pid(rx)
        assert rx.wait_for(lambda: spans_by_pid(rx) == {pid: n // 3 for pid, n in expected.items()}, 30)
        setup.shutdown()


def test_a_forked_child_of_an_embedded_setup_starts_from_zero_without_hanging() -> None:
    setup = configure(env={})
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            setup.telemetry.record_transfer(record())
            setup.telemetry.flush(1)  # keeps the in-process consumer emitting while forks happen

    thread = threading.Thread(target=traffic)
    thread.start()
    codes = []
    for _ in range(40):
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                setup.telemetry.record_transfer(record(5))
                ok = setup.telemetry.flush(10)
                code = 0 if ok and setup.telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 5 else 4
            finally:
                os._exit(code)
        deadline = time.monotonic() + 30
        while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        if not done[0]:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(done[1]) if done[0] else "hung")
    stop.set()
    thread.join()
    setup.shutdown()
    assert codes == [0] * 40


# ---------------------------------------------------------------------- dead collectors, shutdown and exit
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
@pytest.mark.parametrize("collector", ["closed_port", "black_hole"])
def test_shutdown_is_bounded_whatever_the_collector_does(
    protocol: str, collector: str, request: pytest.FixtureRequest
) -> None:
    endpoint = closed_port() if collector == "closed_port" else request.getfixturevalue("black_hole")
    setup = configure(env={}, endpoint=endpoint, protocol=protocol)
    worst = 0.0
    for _ in range(1000):
        start = time.perf_counter()
        setup.telemetry.record_transfer(record())
        worst = max(worst, time.perf_counter() - start)
    assert worst < 0.5
    start = time.monotonic()
    setup.shutdown()  # default: 2 s
    assert time.monotonic() - start < 4  # the SDK alone waits 30 s on a dead collector
    assert setup.telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 3000


HOST = textwrap.dedent(
    """
    import sys, time
    from otel_hicache import configure
    from otel_hicache.records import PoolUsage, TransferRecord
    setup = configure(endpoint=sys.argv[1], protocol=sys.argv[2])
    for _ in range(int(sys.argv[3])):
        setup.telemetry.record_transfer(TransferRecord("backup", {"kv": 3}, 192, 10, 20, 0.001, "host_clock"))
    print("recorded", flush=True)
    if sys.argv[4] == "wait":
        time.sleep(600)
    """
)


def start_host(endpoint: str, protocol: str, n: int, then: str) -> subprocess.Popen[str]:
    host = subprocess.Popen(
        [sys.executable, "-c", HOST, endpoint, protocol, str(n), then],
        stdout=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    assert host.stdout is not None and host.stdout.readline().strip() == "recorded"
    return host


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
@pytest.mark.parametrize("collector", ["closed_port", "black_hole"])
def test_a_process_that_simply_exits_is_not_held_by_a_dead_collector(
    protocol: str, collector: str, request: pytest.FixtureRequest
) -> None:
    endpoint = closed_port() if collector == "closed_port" else request.getfixturevalue("black_hole")
    host = start_host(endpoint, protocol, 100, "exit")
    start = time.monotonic()
    assert host.wait(30) == 0
    assert time.monotonic() - start < 4  # was 38-43 s


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_host_still_delivers_everything_it_counted(sig: signal.Signals) -> None:
    with OtlpReceiver() as rx:
        host = start_host(rx.grpc_endpoint, "grpc", 500, "wait")
        start = time.monotonic()
        host.send_signal(sig)
        host.wait(10)
        assert time.monotonic() - start < 2  # well inside Docker's 10 s grace period
        # the export process saw the host go and exported the last window: every count, every span
        assert rx.wait_for(lambda: tokens_by_pid(rx) == {host.pid: 1500}, 30), tokens_by_pid(rx)
        assert rx.wait_for(lambda: spans_by_pid(rx) == {host.pid: 500}, 30)


def test_shutdown_releases_the_shared_memory_and_a_closed_telemetry_starts_nothing() -> None:
    def memfds() -> int:
        return sum(
            "otel-hicache" in os.readlink(f"/proc/self/fd/{fd}")
            for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")
        )

    before = memfds()
    with OtlpReceiver() as rx:
        for _ in range(5):
            setup = configure(env={}, endpoint=rx.grpc_endpoint, protocol="grpc")
            setup.telemetry.record_transfer(record())
            setup.shutdown()
        assert memfds() == before
        setup = configure(env={}, endpoint=rx.grpc_endpoint, protocol="grpc")
        setup.shutdown()
        setup.telemetry.record_transfer(record())  # after shutdown: counted, no export process started for it
        time.sleep(1)
        assert setup.telemetry.export_pid is None
        assert setup.telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 3


FLUSH_THEN_EXIT = textwrap.dedent(
    """
    import sys
    from otel_hicache import configure
    from otel_hicache.records import PoolUsage, TransferRecord
    setup = configure(endpoint=sys.argv[1], protocol=sys.argv[2])
    setup.telemetry.record_transfer(TransferRecord("backup", {"kv": 3}, 192, 10, 20, 0.001, "host_clock"))
    setup.force_flush(timeout_s=1)  # the exporter is now stuck exporting to a collector that never answers
    print(setup.telemetry.export_pid, flush=True)
    """
)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_an_export_process_stuck_on_a_black_hole_still_ends_soon_after_its_host(protocol: str, black_hole: str) -> None:
    host = subprocess.run(
        [sys.executable, "-c", FLUSH_THEN_EXIT, black_hole, protocol],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
    )
    assert host.returncode == 0, host.stderr
    exporter = int(host.stdout.split()[-1])
    deadline = time.monotonic() + 15  # its last export gets 5 s, whatever the collector does (was 82 s)
    while alive(exporter) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(exporter)


def test_a_process_whose_only_signal_is_pool_occupancy_exports_it_while_it_runs() -> None:
    """A vLLM engine core whose CPU tier never evicts records nothing but its occupancy: its export must not wait
    for a first record (or the exit)."""
    with OtlpReceiver() as rx:
        setup = configure(endpoint=rx.grpc_endpoint, env={**os.environ, "OTEL_METRIC_EXPORT_INTERVAL": "200"})
        try:
            setup.telemetry.add_pool_usage_source(lambda: [PoolUsage(sc.Tier.HOST, "kv", used=96, limit=512)])

            def limits() -> list[int]:
                metric = rx.latest_metric(sc.METRIC_POOL_LIMIT)
                return [] if metric is None else [p.as_int for p in metric.sum.data_points]

            assert rx.wait_for(lambda: limits() == [512], timeout_s=30), limits()
        finally:
            setup.shutdown()
