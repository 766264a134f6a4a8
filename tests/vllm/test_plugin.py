"""The ``vllm.general_plugins`` entry point in a vLLM process: naming it in ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``,
or ``*``, turns it off. (What the plugin exports from a real engine's processes, tagged ``hicache.engine=vllm`` and with
their ranks, is in tests/vllm/test_real_offline.py and tests/vllm/test_real_server.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from otel_hicache.testing.otlp_receiver import OtlpReceiver

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
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("disabled", ["flask,vllm_kv_offload", "*"])
def test_naming_the_entry_point_in_otel_python_disabled_instrumentations_turns_the_plugin_off(disabled: str) -> None:
    with OtlpReceiver() as receiver:
        run_app(receiver, OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=disabled)
        assert not receiver.metric_requests and not receiver.spans()
