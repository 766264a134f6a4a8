"""The SGLang plugin: never instruments twice (also under ``opentelemetry-instrument``), and the standard opt-out
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=sglang_hicache`` turns it off."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from otel_hicache.integrations._base import disabled
from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor
from otel_hicache.integrations.sglang.plugin import ENTRY_POINT, load

pytestmark = pytest.mark.sglang

INSTRUMENT = Path(sys.executable).with_name("opentelemetry-instrument")


@pytest.mark.parametrize("value", ["sglang_hicache", "flask, sglang_hicache", "*"])
def test_the_standard_variable_disables_the_plugin(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", value)
    instrumentor = SGLangHiCacheInstrumentor()
    assert not instrumentor.is_instrumented_by_opentelemetry
    load()
    assert not instrumentor.is_instrumented_by_opentelemetry


def test_other_names_leave_it_enabled() -> None:
    assert not disabled(ENTRY_POINT, {"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "sglang, sglang_hicache_x"})
    assert not disabled(ENTRY_POINT, {})
    assert ENTRY_POINT == "sglang_hicache"  # the name of both entry points (pyproject.toml)


def test_the_plugin_instruments_lazily_and_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.managers.cache_controller import HiCacheController

    monkeypatch.delenv("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", raising=False)
    instrumentor = SGLangHiCacheInstrumentor()
    try:
        load()
        load()  # SGLang's load_plugins() guards itself; the plugin does too
        assert instrumentor.is_instrumented_by_opentelemetry
        assert instrumentor.telemetry is None  # no HiCache event yet: nothing built, nothing exported
        wrapper = vars(HiCacheController)["start_writing"]
        assert not hasattr(wrapper.__wrapped__, "__wrapped__")  # one wrapper
    finally:
        instrumentor.uninstrument()


@pytest.mark.skipif(not INSTRUMENT.exists(), reason="opentelemetry-instrument is not installed in this venv")
@pytest.mark.skipif(importlib.util.find_spec("opentelemetry.distro") is None, reason="needs opentelemetry-distro")
def test_under_opentelemetry_instrument_load_plugins_does_not_wrap_again() -> None:
    program = (
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"  # as run_scheduler_process does, after opentelemetry-instrument instrumented the process
        "from sglang.srt.managers.cache_controller import HiCacheController\n"
        "wrapper = vars(HiCacheController)['start_writing']\n"
        "print(hasattr(wrapper, '__wrapped__'), hasattr(wrapper.__wrapped__, '__wrapped__'))\n"
    )
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"}
    env.pop("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", None)
    run = subprocess.run(
        [str(INSTRUMENT), sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split() == ["True", "False"]
