"""An OTel SDK reading into memory with the production Views, and a :class:`HiCacheTelemetry` reporting through it.

The one SDK fixture of the test suites (core, cache, SGLang) and of the benchmarks: the same aggregation users get
from :func:`otel_hicache.configure` (:func:`otel_hicache.sdk.views`), with spans and metric points kept in memory.

    >>> from otel_hicache.records import EvictionRecord
    >>> from otel_hicache.semconv import Tier
    >>> sdk = make_sdk()
    >>> sdk.telemetry.record_eviction(EvictionRecord(tier=Tier.DEVICE, num_tokens=64, duration_s=0.001, time_ns=1))
    >>> sdk.value("hicache.eviction.tokens", {"hicache.tier": "device"})
    64
    >>> sdk.shutdown()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Sampler

from otel_hicache.sdk import views
from otel_hicache.telemetry import HiCacheTelemetry


@dataclass
class Sdk:
    """Providers reading into memory and the telemetry reporting through them; read with the methods below."""

    telemetry: HiCacheTelemetry
    span_exporter: InMemorySpanExporter
    reader: InMemoryMetricReader
    tracer_provider: TracerProvider
    meter_provider: MeterProvider

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        """Finished spans (named ``name`` when given), after draining the telemetry queue."""
        self.telemetry.flush()
        return [s for s in self.span_exporter.get_finished_spans() if name is None or s.name == name]

    def counters(self) -> dict[str, dict[tuple[Any, ...], int]]:
        """The telemetry's cumulative counters (:meth:`HiCacheTelemetry.snapshot`)."""
        return self.telemetry.snapshot()

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

    def value(self, name: str, attributes: dict[str, Any]) -> Any:
        point = self.points(name).get(frozenset(attributes.items()))
        return None if point is None else point.value

    def shutdown(self) -> None:
        self.telemetry.shutdown()
        self.meter_provider.shutdown()
        self.tracer_provider.shutdown()


def attributes_of(item: Any) -> dict[str, Any]:
    """The attributes of a finished span, a span link or a metric point as a plain dict (the SDK's may be None)."""
    return dict(item.attributes or {})


def times_of(span: ReadableSpan) -> tuple[int, int]:
    """A finished span's start and end times (ns); the SDK types them optional, a finished span has both."""
    start, end = span.start_time, span.end_time
    assert start is not None and end is not None, span.name
    return start, end


def make_sdk(sampler: Sampler | None = None, **telemetry_kwargs: Any) -> Sdk:
    """A fresh :class:`Sdk`; ``telemetry_kwargs`` go to :class:`HiCacheTelemetry` (``pools=...``, ``spans=...``)."""
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider(sampler=sampler) if sampler is not None else TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], views=views())
    telemetry = HiCacheTelemetry(tracer_provider, meter_provider, **telemetry_kwargs)
    return Sdk(telemetry, exporter, reader, tracer_provider, meter_provider)
