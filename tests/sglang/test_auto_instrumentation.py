"""Zero-code: ``opentelemetry-instrument`` alone brings HiCache spans and metrics out of an unmodified program.

The program (autoinstrumented_app.py) runs SGLang's real cache on a CPU in a subprocess; opentelemetry-distro's
configurator sets up the SDK with OTLP exporters from the environment, our ``opentelemetry_instrumentor`` entry point
patches SGLang, and the data must arrive at an OTLP receiver running in this test process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from otel_hicache import semconv as sc
from otel_hicache.testing.otlp_receiver import OtlpReceiver, attributes

pytestmark = pytest.mark.sglang

APP = Path(__file__).with_name("autoinstrumented_app.py")
INSTRUMENT = Path(sys.executable).with_name("opentelemetry-instrument")
TOKENS = 20  # what the app backs up and loads back


def test_our_instrumentor_is_registered_for_opentelemetry_instrument() -> None:
    (entry,) = [e for e in entry_points(group="opentelemetry_instrumentor") if e.name == "sglang_hicache"]
    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor

    assert entry.load() is SGLangHiCacheInstrumentor


@pytest.mark.skipif(not INSTRUMENT.exists(), reason="opentelemetry-instrument is not installed in this venv")
@pytest.mark.skipif(importlib.util.find_spec("opentelemetry.distro") is None, reason="needs opentelemetry-distro")
def test_opentelemetry_instrument_exports_hicache_spans_and_metrics_over_otlp(cpu_sglang: None) -> None:
    with OtlpReceiver() as receiver:
        env = {
            **os.environ,
            "OTEL_SERVICE_NAME": "sglang-hicache-app",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_METRIC_EXPORT_INTERVAL": "1000",
        }
        run = subprocess.run(
            [str(INSTRUMENT), sys.executable, str(APP)], env=env, capture_output=True, text=True, timeout=240
        )
        assert run.returncode == 0, run.stderr[-4000:]
        assert "round trip ok" in run.stdout

        # The app's export process exports the last window when the app exits (it may outlive it by a moment).
        wanted = {sc.SPAN_NAMES[sc.TransferOperation.BACKUP], sc.SPAN_NAMES[sc.TransferOperation.LOAD_BACK]}
        assert receiver.wait_for(lambda: wanted <= {span.name for span in receiver.spans()}, 30)
        assert receiver.wait_for(
            lambda: _nonzero_tokens(receiver) == {("backup", "kv"): TOKENS, ("load_back", "kv"): TOKENS}, 30
        )
        spans = {span.name: span for span in receiver.spans()}
        tokens = receiver.latest_metric(sc.METRIC_TRANSFER_TOKENS)
        size = receiver.latest_metric(sc.METRIC_TRANSFER_SIZE)

    for op in (sc.TransferOperation.BACKUP, sc.TransferOperation.LOAD_BACK):
        span = spans[sc.SPAN_NAMES[op]]
        attrs = attributes(span.attributes)
        assert attrs[sc.ATTR_TOKENS] == TOKENS
        assert attrs[f"{sc.ATTR_POOL_TOKENS}.kv"] == TOKENS
        assert attrs[sc.ATTR_BYTES] > 0

    assert tokens is not None and size is not None, "no hicache metrics arrived"
    sizes: dict[str, int] = {}
    for p in size.sum.data_points:  # one series per timing source (untimed on a CPU)
        op = attributes(p.attributes)[sc.ATTR_OPERATION]
        sizes[op] = sizes.get(op, 0) + p.as_int
    assert sizes["backup"] == sizes["load_back"] == attrs[sc.ATTR_BYTES]


def _nonzero_tokens(receiver: OtlpReceiver) -> dict[tuple[str, str], int]:
    """The latest cumulative hicache.transfer.tokens points that are not zero, by (operation, pool)."""
    tokens = receiver.latest_metric(sc.METRIC_TRANSFER_TOKENS)
    if tokens is None:
        return {}
    points = {
        (attributes(p.attributes)[sc.ATTR_OPERATION], attributes(p.attributes)[sc.ATTR_POOL]): p.as_int
        for p in tokens.sum.data_points
    }
    return {k: v for k, v in points.items() if v}


def test_instrument_imports_nothing_of_sglang_or_torch_and_patches_sglang_when_it_is_imported() -> None:
    program = (
        "import sys\n"
        "from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor\n"
        "SGLangHiCacheInstrumentor().instrument()\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'sglang', 'torch'}))\n"
        "from sglang.srt.managers.cache_controller import HiCacheController\n"
        "print(hasattr(vars(HiCacheController)['start_writing'], '__wrapped__'))\n"
    )
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split() == ["[]", "True"]
