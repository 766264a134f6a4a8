"""A real server's process topology: every scheduler reports once, with its ranks, through the plugin route alone.

topology_app.py launches 2 TP scheduler processes the way SGLang 0.5.23 does (spawn; ``load_plugins()`` first; ranks
published and gloo groups built by SGLang's own code; the real UnifiedRadixCache with HiCache), with only ``OTEL_*``
variables set: no ``opentelemetry-instrument``, no code change. The data must arrive at an OTLP receiver in this test
process. Rank 1 is then stopped with SIGKILL by SGLang's ``kill_process_tree``; its last window must still arrive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

from otel_hicache import semconv as sc
from otel_hicache.integrations.sglang.plugin import ENTRY_POINT, load
from otel_hicache.testing import free_port
from otel_hicache.testing.otlp_receiver import OtlpReceiver, attributes

pytestmark = pytest.mark.sglang

APP = Path(__file__).with_name("topology_app.py")
TOKENS = 20  # what each rank backs up and loads back (topology_app.TOKENS)
NEW = 8  # the admitted prompt's tokens past that prefix (topology_app.NEW)
BACKUP, LOAD_BACK = sc.TransferOperation.BACKUP.value, sc.TransferOperation.LOAD_BACK.value


def test_our_plugin_is_registered_for_sglang_load_plugins() -> None:
    found = [e for e in entry_points(group="sglang.srt.plugins") if e.name == ENTRY_POINT]
    assert found, "no sglang.srt.plugins entry point: install the package (pip install -e .) so its metadata exists"
    assert found[0].load() is load


class Process:
    """What one process (one Resource, told apart by ``process.pid``) exported."""

    def __init__(self) -> None:
        self.resource: dict[str, Any] = {}
        self.metrics: dict[str, Any] = {}  # name -> latest export
        self.spans: list[Any] = []

    def points(self, name: str) -> dict[tuple[str, ...], int]:
        metric = self.metrics.get(name)
        if metric is None:
            return {}
        out = {}
        for point in metric.sum.data_points:
            attrs = attributes(point.attributes)
            out[tuple(str(attrs[k]) for k in sorted(attrs))] = point.as_int
        return {k: v for k, v in out.items() if v}


def by_process(receiver: OtlpReceiver) -> dict[int, Process]:
    processes: dict[int, Process] = defaultdict(Process)
    for request in list(receiver.metric_requests):
        for rm in request.resource_metrics:
            resource = attributes(rm.resource.attributes)
            process = processes[resource["process.pid"]]
            process.resource = resource
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    process.metrics[metric.name] = metric
    for request in list(receiver.trace_requests):
        for rs in request.resource_spans:
            resource = attributes(rs.resource.attributes)
            processes[resource["process.pid"]].spans += [s for ss in rs.scope_spans for s in ss.spans]
    return dict(processes)


def test_two_tp_schedulers_report_once_with_their_ranks_and_a_sigkilled_one_loses_nothing_counted() -> None:
    with OtlpReceiver() as receiver:
        env = {
            **os.environ,
            "OTEL_SERVICE_NAME": "sglang-topology",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_METRIC_EXPORT_INTERVAL": "600000",  # no periodic export: what arrives was flushed or exported last
        }
        env.pop("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", None)
        run = subprocess.run(
            [sys.executable, str(APP), str(free_port())], env=env, capture_output=True, text=True, timeout=240
        )
        assert run.returncode == 0, run.stderr[-4000:]
        events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        pids = {e["rank"]: e["pid"] for e in events if e["event"] == "counted"}
        (launcher,) = [e for e in events if e["event"] == "launcher"]
        (exit_codes,) = [e["codes"] for e in events if e["event"] == "exit"]

        def arrived() -> bool:
            processes = by_process(receiver)
            return all(  # both exporters exported their last window (they outlive their schedulers)
                pid in processes and any(k[0] == LOAD_BACK for k in processes[pid].points(sc.METRIC_TRANSFER_SIZE))
                for pid in pids.values()
            )

        receiver.wait_for(arrived, timeout_s=30)
        processes = by_process(receiver)

    assert launcher["imported"] == [], "the launcher imported SGLang or torch"
    assert exit_codes == [0, -9], "rank 0 exits normally, rank 1 is SIGKILLed"
    # Only the two schedulers export: not the launcher, not multiprocessing's resource tracker.
    assert set(processes) == {pids[0], pids[1]}
    for rank in (0, 1):
        resource = processes[pids[rank]].resource
        assert resource["service.name"] == "sglang-topology"
        assert (resource[sc.RESOURCE_TP_RANK], resource[sc.RESOURCE_ATTN_TP_RANK], resource[sc.RESOURCE_PP_RANK]) == (
            rank,
            rank,
            0,
        )

    rank0, rank1 = processes[pids[0]], processes[pids[1]]
    # Token flows are logical: reported by rank 0 only, once (one backup and one load back of TOKENS tokens).
    assert rank0.points(sc.METRIC_TRANSFER_TOKENS) == {(BACKUP, "kv"): TOKENS, (LOAD_BACK, "kv"): TOKENS}
    assert rank0.points(sc.METRIC_EVICTION_TOKENS) == {("False", "device"): TOKENS}  # inserted once: not reused
    assert rank0.points(sc.METRIC_POOL_LIMIT)  # the host pool's size, in tokens
    # The prefill batch (each rank's one wrapper of it, `PrefillStats.from_adder`): its split, and the capacity curve
    # of both tiers at every factor, from rank 0 only.
    assert rank0.points(sc.METRIC_PREFILL_TOKENS) == {("input",): NEW, ("device_hit",): TOKENS}
    curve = rank0.metrics[sc.METRIC_CAPACITY_HIT_RATIO].gauge.data_points
    tiers_and_factors = {
        (a[sc.ATTR_TIER], a[sc.ATTR_CAPACITY_FACTOR]) for a in (attributes(p.attributes) for p in curve)
    }
    assert tiers_and_factors == {(tier, factor) for tier in ("device", "host") for factor in sc.CAPACITY_FACTORS}
    for name in (
        sc.METRIC_TRANSFER_TOKENS,
        sc.METRIC_EVICTION_TOKENS,
        sc.METRIC_POOL_USAGE,
        sc.METRIC_POOL_LIMIT,
        sc.METRIC_PREFILL_TOKENS,
        sc.METRIC_CAPACITY_HIT_RATIO,
    ):
        assert name not in rank1.metrics, name
    # Bytes are per rank: each rank moved its own shard (here the same size), and the SIGKILLed rank's last window
    # (its load back, never flushed by the process) arrived from its export process.
    sizes0 = {key[0]: n for key, n in rank0.points(sc.METRIC_TRANSFER_SIZE).items()}
    sizes1 = {key[0]: n for key, n in rank1.points(sc.METRIC_TRANSFER_SIZE).items()}
    assert set(sizes0) == {BACKUP, LOAD_BACK} and sizes0[BACKUP] > 0
    assert sizes1 == sizes0
    for process in (rank0, rank1):
        assert sorted(span.name for span in process.spans) == [f"hicache.{BACKUP}", f"hicache.{LOAD_BACK}"]
