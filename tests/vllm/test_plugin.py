"""The ``vllm.general_plugins`` entry point in real vLLM processes: vLLM loads it, the process configures telemetry
from the ``OTEL_*`` environment at its first transfer, and exports what vLLM's own metrics hold, tagged
``hicache.engine=vllm`` and with its ranks; one rank of a tensor-parallel group reports tokens; opt-out works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from otel_hicache.testing.otlp_receiver import OtlpReceiver, attributes

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).parents[2]


def run_app(receiver: OtlpReceiver, *args: str, **env: str) -> dict[str, float]:
    environment = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": "vllm-test",
        "PYTHONPATH": str(ROOT),
        **env,
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm.offload_app", *args],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def totals(receiver: OtlpReceiver, name: str, operation: str) -> float:
    """The last export's total of counter / histogram ``name`` for ``operation`` (sum for histograms)."""
    metric = receiver.latest_metric(name)
    if metric is None:
        return 0
    data: Any = metric.sum if metric.HasField("sum") else metric.histogram
    points = [p for p in data.data_points if attributes(p.attributes).get("hicache.operation") == operation]
    return sum(p.as_int or p.as_double for p in points) if metric.HasField("sum") else sum(p.sum for p in points)


def resources(receiver: OtlpReceiver) -> list[dict[str, Any]]:
    return [attributes(rm.resource.attributes) for r in receiver.metric_requests for rm in r.resource_metrics]


def test_the_plugin_exports_what_vllms_own_metrics_hold_tagged_with_the_engine() -> None:
    with OtlpReceiver() as receiver:
        vllm = run_app(receiver)
        assert totals(receiver, "hicache.transfer.size", "backup") == vllm["vllm:kv_offload_store_bytes"] > 0
        assert totals(receiver, "hicache.transfer.size", "load_back") == vllm["vllm:kv_offload_load_bytes"] > 0
        assert totals(receiver, "hicache.transfer.duration", "backup") == pytest.approx(
            vllm["vllm:kv_offload_store_time"], rel=1e-9
        )
        assert totals(receiver, "hicache.transfer.tokens", "backup") > 0
        assert {s.name for s in receiver.spans()} == {"hicache.backup", "hicache.load_back"}
        resource = resources(receiver)[-1]
        assert resource["hicache.engine"] == "vllm"
        assert (resource["hicache.rank.tp"], resource["hicache.rank.pp"]) == (0, 0)


def test_a_second_tensor_parallel_rank_reports_bytes_but_not_tokens() -> None:
    with OtlpReceiver() as receiver:
        vllm = run_app(receiver, "--rank", "1", "--tp", "2")
        assert totals(receiver, "hicache.transfer.size", "backup") == vllm["vllm:kv_offload_store_bytes"] > 0
        assert receiver.latest_metric("hicache.transfer.tokens") is None
        assert resources(receiver)[-1]["hicache.rank.tp"] == 1


def test_naming_the_entry_point_in_otel_python_disabled_instrumentations_turns_the_plugin_off() -> None:
    with OtlpReceiver() as receiver:
        run_app(receiver, OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="flask,vllm_kv_offload")
        assert not receiver.metric_requests and not receiver.spans()
