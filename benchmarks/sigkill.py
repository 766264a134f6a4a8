"""What a SIGKILL of the host loses: acks handed over (deferred) but not counted yet when the process dies.

SGLang stops its schedulers with SIGKILL (``kill_process_tree``). Over OTLP, the export process outlives the host and
exports everything the host counted; only records still queued for the host's telemetry thread (built and counted in
slices, every ``DEFERRED_TICK_S``) die with it. Measured: a spawned host configured from ``OTEL_*`` only hands over one
1-token ack every ``1 / rate`` s with ``record_transfer_deferred`` (deferred like the SGLang ack queues) and is
SIGKILLed at a random moment; the exported token total is compared with the acks handed over. Window = lost acks /
rate.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from typing import Any

from benchmarks._common import Table, median
from otel_hicache import semconv as sc
from otel_hicache.testing.otlp_receiver import OtlpReceiver

RATE = 1000.0  # acks per second handed over by the host


def _build(tokens: int) -> Any:
    from otel_hicache.records import TransferRecord
    from otel_hicache.timing import now_ns

    now = now_ns()
    return TransferRecord(sc.TransferOperation.BACKUP, {"kv": tokens}, tokens * 1024, now, now)


def _host(handed: Any, ready: Any) -> None:
    from otel_hicache.sdk import configure

    telemetry = configure().telemetry
    telemetry.record_transfer(_build(1))
    telemetry.flush(30.0)  # the export process is up
    ready.set()
    period = 1.0 / RATE
    next_t = time.perf_counter()
    while True:
        telemetry.record_transfer_deferred(_build, 1)
        handed.value += 1
        next_t += period
        time.sleep(max(0.0, next_t - time.perf_counter()))


def _exported(receiver: OtlpReceiver) -> int:
    metric = receiver.latest_metric(sc.METRIC_TRANSFER_TOKENS)
    return 0 if metric is None else sum(p.as_int for p in metric.sum.data_points)


def _one(spawn: Any) -> tuple[int, int]:
    """(acks handed over, acks exported) for one SIGKILLed host."""
    with OtlpReceiver() as receiver:
        os.environ.update(
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint,
            OTEL_METRIC_EXPORT_INTERVAL="600000",
            OTEL_TRACES_EXPORTER="none",
        )
        handed, ready = spawn.Value("q", 0, lock=False), spawn.Event()
        host = spawn.Process(target=_host, args=(handed, ready))
        host.start()
        if not ready.wait(60):
            host.kill()
            raise RuntimeError("the host did not start")
        time.sleep(0.3 + random.random() * 0.3)
        os.kill(host.pid, signal.SIGKILL)
        host.join()
        total = handed.value
        last, stable_since = -1, time.monotonic()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and time.monotonic() - stable_since < 1.0:  # the last export arrived
            now = _exported(receiver)
            if now != last:
                last, stable_since = now, time.monotonic()
            time.sleep(0.05)
        return total, max(0, last - 1)  # minus the warm-up transfer


def run(smoke: bool, command: str) -> Table:
    saved = dict(os.environ)
    spawn = multiprocessing.get_context("spawn")
    try:
        results = [_one(spawn) for _ in range(1 if smoke else 5)]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    lost = [max(0, handed - exported) for handed, exported in results]
    table = Table(
        key="sigkill",
        title="SIGKILL of the host: acks handed over but not exported",
        columns=["Run", "Acks handed over", "Acks exported", "Lost", "Window (ms)"],
        command=command,
    )
    for i, ((handed, exported), n) in enumerate(zip(results, lost, strict=True), 1):
        table.rows.append([i, handed, exported, n, f"{n / RATE * 1000:.0f}"])
    table.data = {"runs": [{"handed": h, "exported": e} for h, e in results], "rate": RATE}
    table.checks["nothing exported that was not handed over"] = all(e <= h for h, e in results)
    table.checks["the last window arrived (a SIGKILLed host still exports)"] = all(e > 0 for _, e in results)
    table.notes.append(
        f"{RATE:g} acks/s, SIGKILL at a random moment; window = lost / rate: median "
        f"{median([n / RATE * 1000 for n in lost]):.0f} ms, max {max(lost) / RATE * 1000:.0f} ms."
    )
    return table
