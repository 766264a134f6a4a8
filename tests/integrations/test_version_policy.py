"""Each instrumentor checks its own engine's release, once per process family, under ``opentelemetry-instrument`` too.

An unsupported SGLang is installed for the test as a distribution record only (``sglang-<version>.dist-info`` on the
path: what ``importlib.metadata`` reads), in a process of its own group running ``opentelemetry-instrument`` and then
SGLang's plugin entry point, as a scheduler process under ``opentelemetry-instrument`` does. No engine code is needed:
the version check reads the installed version only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INSTRUMENT = Path(sys.executable).with_name("opentelemetry-instrument")
PLUGIN = "from otel_hicache.integrations.sglang.plugin import load; load(); load()"


@pytest.mark.skipif(not INSTRUMENT.exists(), reason="opentelemetry-instrument is not installed in this venv")
@pytest.mark.parametrize("version", ["0.5.20", "0.5.99"])  # older than supported; newer than checked
def test_an_unsupported_sglang_gets_one_line_and_vllm_is_not_checked_against_it(
    tmp_path: Path, fresh_warnings: Path, version: str
) -> None:
    record = tmp_path / f"sglang-{version}.dist-info"
    record.mkdir()
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]),
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "TMPDIR": str(fresh_warnings.parent),  # this test's family markers, nowhere else
    }
    env.pop("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", None)
    run = subprocess.run(
        [str(INSTRUMENT), sys.executable, "-c", PLUGIN],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [line for line in run.stderr.splitlines() if "sglang" in line.lower()]
    assert len(lines) == 1, run.stderr[-4000:]  # the instrumentor's check, and neither the distro's nor the plugin's
    assert f"found sglang {version}" in lines[0] and "sglang >= 0.5.22, < 0.5.24" in lines[0]
    assert "vllm" not in run.stderr.lower()  # vLLM's instrumentor: its own engine is absent, said at debug level
