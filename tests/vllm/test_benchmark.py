"""``python -m benchmarks vllm --smoke``: real vLLM engines with the plugin on and off serve the benchmark's workload
through the CPU tier, their busy timers count inside vLLM's processes, and the table holds sane numbers. No timing is
judged (benchmarks hold numbers, not tests)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.vllm_serving import OUTPUT_TOKENS, PER_GENERATE
from tests.vllm.engine import needs_cpu_build

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), needs_cpu_build]

ROOT = Path(__file__).resolve().parents[2]


def test_the_vllm_benchmark_runs_both_engines_through_the_cpu_tier(tmp_path: Path) -> None:
    out = tmp_path / "vllm.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "vllm", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (table,) = json.loads(out.read_text())["tables"]
    # stores and loads through the CPU tier in every run, every output token, the export processes up before the
    # engine's first request
    assert len(table["checks"]) == 3 and all(table["checks"].values()), table["checks"]
    assert [row[0] for row in table["rows"][:2]] == ["off", "on"]
    assert table["command"] == "python -m benchmarks vllm --smoke"
    for row in table["rows"][:2]:
        numbers = row[1:]
        assert len(numbers) == len(table["columns"]) - 1
        assert all(math.isfinite(v) and v >= 0 for v in numbers), row
        assert numbers[0] > 0 and numbers[1] > 0  # requests/s, output tokens/s
    runs = table["data"]["runs"]
    assert {name: len(r) for name, r in runs.items()} == {"off": 1, "on": 1}
    assert all(run["cached"] > 0 for r in runs.values() for run in r)  # prefixes were reused
    # the busy timers ran inside the engine core and the worker of both engines: every step timed once on each side
    # (a step per generated token at least), each KV connector's calls inside its process's own whole
    for run in (run for r in runs.values() for run in r):
        busy = run["busy"]
        assert busy["steps"] >= OUTPUT_TOKENS * run["requests"] / PER_GENERATE, busy
        assert busy["worker_steps"] >= busy["steps"], busy
        assert 0 < busy["core_connector_ns"] < busy["scheduler_ns"], busy
        assert 0 < busy["worker_connector_ns"] < busy["worker_ns"], busy
    # our host threads in the engine core and the worker of 'on' were found and timed (a worker's finished transfers
    # are built there); 'off' has none
    (on,), (off,) = runs["on"], runs["off"]
    assert on["busy"]["core_host_ns"] > 0 and on["busy"]["worker_host_ns"] > 0, on["busy"]
    assert off["busy"]["core_host_ns"] == off["busy"]["worker_host_ns"] == 0, off["busy"]
    exporters = table["data"]["exporters"]
    assert len(exporters["lead_s"]) == 2  # the engine core's and the worker's
    assert exporters["start_ms"] > 0 and exporters["timed_ms"] >= 0
