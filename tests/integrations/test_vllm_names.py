"""vLLM's names and entry points, checked where vLLM is not installed (the project's .venv): the porting table maps
onto the core vocabulary (transfers by operation, prompt tokens by prefill mode), both entry points resolve, and the
plugin leaves a process without vLLM alone."""

from __future__ import annotations

import importlib.util
import logging
import re
from importlib.metadata import entry_points

import pytest

from otel_hicache import semconv as sc
from otel_hicache.integrations.vllm import VLLMOffloadInstrumentor
from otel_hicache.integrations.vllm.plugin import register
from otel_hicache.integrations.vllm.semconv import ENTRY_POINT, VLLM_SERIES

INSTRUMENT_SERIES = {
    "hicache_transfer_size_bytes_total": sc.METRIC_TRANSFER_SIZE,
    "hicache_transfer_duration_seconds_sum": sc.METRIC_TRANSFER_DURATION,
    "hicache_transfer_duration_seconds_count": sc.METRIC_TRANSFER_DURATION,
    "hicache_transfer_failures_total": sc.METRIC_TRANSFER_FAILURES,
}


def test_every_vllm_series_maps_onto_a_core_instrument_and_operation_or_prefill_mode() -> None:
    operations = {op.value for op in sc.TransferOperation}
    modes = {mode.value for mode in sc.PrefillMode}
    for vllm, ours in VLLM_SERIES:
        name, labels = re.fullmatch(r"([a-z_]+)\{(.*)\}", ours).groups()  # type: ignore[union-attr]
        if vllm.startswith("vllm:prompt_tokens_"):  # vLLM's prompt tokens by source: our prefill split
            mode = re.fullmatch(r'hicache_prefill_mode="(\w+)"', labels)
            assert name == "hicache_prefill_tokens_total" and mode and mode.group(1) in modes, ours
            continue
        assert vllm.startswith("vllm:kv_offload_"), vllm
        assert name in INSTRUMENT_SERIES, ours
        operation = re.search(r'hicache_operation="(\w+)"', labels)
        assert operation and operation.group(1) in operations, ours
        direction = "backup" if ("store" in vllm or "GPU_to_CPU" in vllm or "failure" in vllm) else "load_back"
        assert operation.group(1) == direction, (vllm, ours)


def test_the_instrumentor_and_the_vllm_plugin_are_entry_points() -> None:
    (instrumentor,) = [e for e in entry_points(group="opentelemetry_instrumentor") if e.name == ENTRY_POINT]
    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == ENTRY_POINT]
    assert instrumentor.load() is VLLMOffloadInstrumentor and plugin.load() is register


def test_the_plugin_without_vllm_warns_once_and_patches_nothing(caplog: pytest.LogCaptureFixture) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with caplog.at_level(logging.WARNING, logger="otel_hicache"):
        register()
    assert not VLLMOffloadInstrumentor().is_instrumented_by_opentelemetry
    assert [r.getMessage() for r in caplog.records if "not instrumented" in r.getMessage()] != []
