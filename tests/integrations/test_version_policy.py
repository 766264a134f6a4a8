"""Each instrumentor checks its own engine's release, once per process family, under ``opentelemetry-instrument`` too:
a release in the tested range is instrumented, one above it is instrumented untested (by shape) with one info line,
one below it is refused with one warning.

An unsupported SGLang is installed for the test as a distribution record only (``sglang-<version>.dist-info`` on the
path: what ``importlib.metadata`` reads), in a process of its own group running ``opentelemetry-instrument`` and then
SGLang's plugin entry point, as a scheduler process under ``opentelemetry-instrument`` does. No engine code is needed:
the version check reads the installed version only.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from otel_hicache.integrations._base import EngineInstrumentor, ProcessSink, Target, Wrapper

INSTRUMENT = Path(sys.executable).with_name("opentelemetry-instrument")
PLUGIN = "from otel_hicache.integrations.sglang.plugin import load; load(); load()"


def record(directory: Path, name: str, version: str) -> None:
    """``name`` installed at ``version`` as ``importlib.metadata`` reads it: a distribution record in ``directory``."""
    record = directory / f"{name.replace('-', '_')}-{version}.dist-info"
    record.mkdir()
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


class ToyAdapter(EngineInstrumentor):
    """An adapter of the engine ``toy-engine`` tested from 1.0 up to 1.2, patching nothing."""

    _engine = "toy engine"

    def instrumentation_dependencies(self) -> Collection[str]:
        return ("toy-engine >= 1.0, < 1.2",)

    def _patches(self, sink: ProcessSink, options: Mapping[str, Any]) -> Iterable[tuple[Target, Wrapper]]:
        return ()


@pytest.mark.parametrize(
    ("version", "instrumented", "said"),
    [
        ("1.1.3", True, []),  # tested
        ("1.4.0", True, [(logging.INFO, "toy-engine 1.4.0 is newer than the tested toy-engine >= 1.0, < 1.2")]),
        ("0.9.0", False, [(logging.WARNING, "found toy-engine 0.9.0, need toy-engine >= 1.0, < 1.2")]),
    ],
)
def test_a_release_above_the_tested_range_is_instrumented_with_one_info_line_and_one_below_is_refused(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    version: str,
    instrumented: bool,
    said: list[tuple[int, str]],
) -> None:
    record(tmp_path, "toy-engine", version)
    monkeypatch.syspath_prepend(str(tmp_path))
    adapter = ToyAdapter()
    with caplog.at_level(logging.DEBUG, logger="otel_hicache"):
        for _ in range(2):  # a second instrument() in the process family says nothing new
            adapter.instrument()
            assert adapter.is_instrumented_by_opentelemetry is instrumented
            if instrumented:
                adapter.uninstrument()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == len(said)
    assert all(level == want and text in line for (level, line), (want, text) in zip(lines, said, strict=True))


@pytest.mark.skipif(not INSTRUMENT.exists(), reason="opentelemetry-instrument is not installed in this venv")
def test_an_sglang_below_the_tested_range_gets_one_line_and_vllm_is_not_checked_against_it(
    tmp_path: Path, fresh_warnings: Path
) -> None:
    version = "0.5.20"
    record(tmp_path, "sglang", version)
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
