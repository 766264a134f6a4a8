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
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from otel_hicache import semconv as sc
from otel_hicache.integrations._base import EngineInstrumentor, ProcessSink, Target, Wrapper
from otel_hicache.records import TransferRecord
from otel_hicache.testing.sdk import Sdk
from otel_hicache.timing import now_ns
from tests.releases import record_release

INSTRUMENT = Path(sys.executable).with_name("opentelemetry-instrument")
PLUGIN = "from otel_hicache.integrations.sglang.plugin import load; load(); load()"


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
    installed_as: Callable[[str, str], str],
    caplog: pytest.LogCaptureFixture,
    version: str,
    instrumented: bool,
    said: list[tuple[int, str]],
) -> None:
    installed_as("toy-engine", version)
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
    record_release(tmp_path, "sglang", version)
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


CHECKED_ENGINE = """
class KVStore:
    offloaded = 0  # the engine's own count of tokens offloaded

    def offload(self, tokens):
        KVStore.offloaded += tokens
"""


class CheckedToyAdapter(EngineInstrumentor):
    """An adapter of the same ``toy-engine`` with one target, ``toy_checked_engine.KVStore.offload`` (each call one
    backup record), and a self-check registered at the first event as the real adapters do: our tokens against the
    engine's own count, one mismatch each time the difference changes."""

    _engine = "toy engine"

    def instrumentation_dependencies(self) -> Collection[str]:
        return ToyAdapter().instrumentation_dependencies()

    def _patches(self, sink: ProcessSink, options: Mapping[str, Any]) -> Iterable[tuple[Target, Wrapper]]:
        ours = [0]
        reported = [0]  # the difference last reported: a persistent one is one mismatch

        def offload(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            telemetry = sink.get()
            assert telemetry is not None
            if not ours[0]:
                engine = type(instance)

                def check() -> list[str]:
                    difference = engine.offloaded - ours[0]
                    changed, reported[0] = difference != reported[0], difference
                    return [sc.METRIC_TRANSFER_TOKENS] if changed and difference else []

                telemetry.add_engine_check(check, sink.switch.mismatched)
            result = wrapped(*args, **kwargs)
            ours[0] += args[0]
            telemetry.record_transfer(
                TransferRecord(sc.TransferOperation.BACKUP, {"kv": args[0]}, 0, now_ns(), now_ns())
            )
            return result

        return [(Target("toy_checked_engine", "KVStore", "offload", ("tokens",)), offload)]


@pytest.mark.parametrize(("version", "turned_off"), [("1.4.0", True), ("1.1.3", False)])
def test_a_mismatch_turns_an_untested_release_off_in_this_process_with_one_warning_and_a_tested_one_stays_on(
    installed_as: Callable[[str, str], str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sdk: Sdk,
    caplog: pytest.LogCaptureFixture,
    version: str,
    turned_off: bool,
) -> None:
    release = installed_as("toy-engine", version)
    (tmp_path / "toy_checked_engine.py").write_text(CHECKED_ENGINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    adapter = CheckedToyAdapter()
    with caplog.at_level(logging.WARNING, logger="otel_hicache"):
        adapter.instrument(telemetry=sdk.telemetry)
        try:
            import toy_checked_engine  # type: ignore[import-not-found]  # written by the test

            store = toy_checked_engine.KVStore()
            store.offload(4)
            assert sdk.counters()[sc.METRIC_ENGINE_MISMATCH] == {}
            missed = vars(toy_checked_engine.KVStore)["offload"].__wrapped__  # a release's path our hook misses
            missed(store, 2)
            assert sum(sdk.counters()[sc.METRIC_ENGINE_MISMATCH].values()) == 1  # counted either way
            store.offload(8)
            backed_up = sdk.counters()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")]
            assert backed_up == (4 if turned_off else 12)  # off: the wrapper passes straight through
            missed(store, 1)
            mismatches = sum(sdk.counters()[sc.METRIC_ENGINE_MISMATCH].values())
            assert mismatches == (1 if turned_off else 2)  # off: its check ended; on: a new difference counted
            if turned_off:
                child = os.fork()
                if child == 0:  # a forked child inherits it: the same release, the same code
                    os._exit(0 if adapter._sink.switch.off else 1)  # type: ignore[union-attr]
                assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
        finally:
            adapter.uninstrument()
            sys.modules.pop("toy_checked_engine", None)
    off = [r.getMessage() for r in caplog.records if "off in this process" in r.getMessage()]
    assert len(off) == (1 if turned_off else 0)
    if turned_off:
        assert release in off[0] and sc.METRIC_TRANSFER_TOKENS in off[0]
