"""Shared fixtures: an SDK wired to in-memory exporters, and a way to read metric points by name and attributes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Sampler

from otel_hicache.sdk import views
from otel_hicache.telemetry import HiCacheTelemetry


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@dataclass
class Sdk:
    telemetry: HiCacheTelemetry
    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    tracer_provider: TracerProvider
    meter_provider: MeterProvider

    def finished_spans(self) -> list[Any]:
        self.telemetry.flush()
        return list(self.spans.get_finished_spans())

    def metrics(self) -> dict[str, Any]:
        """Metric name -> the SDK Metric (after draining the telemetry queue)."""
        self.telemetry.flush()
        data = self.reader.get_metrics_data()
        out: dict[str, Any] = {}
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    out[metric.name] = metric
        return out

    def points(self, name: str) -> dict[frozenset[tuple[str, Any]], Any]:
        """Attribute set -> data point of metric ``name`` (empty dict when the metric has no points)."""
        metric = self.metrics().get(name)
        if metric is None:
            return {}
        return {frozenset(p.attributes.items()): p for p in metric.data.data_points}

    def value(self, name: str, attributes: dict[str, str]) -> Any:
        point = self.points(name).get(frozenset(attributes.items()))
        return None if point is None else point.value


def make_sdk(sampler: Sampler | None = None, **telemetry_kwargs: Any) -> Sdk:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider(sampler=sampler) if sampler is not None else TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], views=views())
    telemetry = HiCacheTelemetry(tracer_provider, meter_provider, **telemetry_kwargs)
    return Sdk(telemetry, spans, reader, tracer_provider, meter_provider)


@pytest.fixture
def sdk() -> Iterator[Sdk]:
    made = make_sdk()
    yield made
    made.telemetry.shutdown()
    made.meter_provider.shutdown()
    made.tracer_provider.shutdown()
