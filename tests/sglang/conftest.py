"""Fixtures for running SGLang's real HiCache classes on a CPU (run in .venv-sglang; .venv-sglang-0.5.22 for 0.5.22).

The CPU shims, the cache builder and the file L3 backend live in :mod:`otel_hicache.testing.sglang` (the benchmarks
use the same); the SDK is :func:`otel_hicache.testing.sdk.make_sdk`, with the production Views.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_hicache.testing.sdk import Sdk
from otel_hicache.testing.sglang import FileStorage, file_storage, install_cpu_shims
from tests.integrations.support import fresh_warnings

__all__ = ["fresh_warnings"]


@pytest.fixture(scope="session")
def cpu_sglang() -> Iterator[None]:
    """Install the CPU shims for the whole session (restored at the end)."""
    pytest.importorskip("sglang")
    restore = install_cpu_shims()
    yield
    restore()


@pytest.fixture(scope="session")
def sglang_metrics(cpu_sglang: None) -> Any:
    """SGLang's own prometheus collector for the radix cache (one per process: prometheus_client's registry
    refuses a second). Tests read deltas from it."""
    from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector

    return RadixCacheMetricsCollector(labels={"cache_type": "UnifiedRadixCache", "tp_rank": "0"})


@pytest.fixture
def instrumented(cpu_sglang: None, otel: Sdk) -> Iterator[Sdk]:
    """SGLang instrumented for one test, reporting into ``otel``; uninstrumented afterwards."""
    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor

    instrumentor = SGLangHiCacheInstrumentor()
    instrumentor.instrument(telemetry=otel.telemetry, stat_loggers=False)
    assert instrumentor.is_instrumented_by_opentelemetry
    yield otel
    instrumentor.uninstrument()


@pytest.fixture(name="file_storage")
def file_storage_fixture(cpu_sglang: None, tmp_path: Path) -> Iterator[FileStorage]:
    with file_storage(tmp_path / "l3") as storage:
        yield storage


@pytest.fixture
def prometheus_collector(cpu_sglang: None) -> Iterator[Callable[..., Any]]:
    """Build SGLang collectors for one test: prometheus_client's registry refuses a second series of one name, so
    every series a collector registered is unregistered at the end."""
    from prometheus_client import REGISTRY
    from prometheus_client.metrics import MetricWrapperBase

    built: list[Any] = []

    def make(cls: type, *args: Any, **kwargs: Any) -> Any:
        collector = cls(*args, **kwargs)
        built.append(collector)
        return collector

    yield make
    for collector in built:
        for value in vars(collector).values():
            metric = getattr(value, "_prom", value)  # our OTel-backed classes keep the prometheus metric in _prom
            if isinstance(metric, MetricWrapperBase):
                with contextlib.suppress(KeyError):
                    REGISTRY.unregister(metric)
