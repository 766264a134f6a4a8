"""Providers from :class:`~otel_hicache.config.Settings`: one builder for ``configure()`` and the export process.

``configure()`` (:mod:`otel_hicache.sdk`) builds this process's providers with :func:`build`, and the export process
(:mod:`otel_hicache._internal.export.main`) builds its providers for the host's spans and metrics with the same call:
same Views, Resource rules, sampler, span limits, exemplar filter and exporters. Each exporter (or metric reader) a
name of ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` means comes from one call of :mod:`.exporters`; what a
build that fails half-way had started is stopped, bounded, by :mod:`.shutdown`.
"""

from __future__ import annotations

import collections
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from opentelemetry import metrics
from opentelemetry.sdk.metrics import (
    AlwaysOffExemplarFilter,
    AlwaysOnExemplarFilter,
    MeterProvider,
    TraceBasedExemplarFilter,
)
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import View
from opentelemetry.sdk.resources import (
    SERVICE_INSTANCE_ID,
    SERVICE_NAME,
    TELEMETRY_SDK_LANGUAGE,
    TELEMETRY_SDK_NAME,
    TELEMETRY_SDK_VERSION,
    Resource,
)
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.version import __version__ as sdk_version

from otel_hicache import semconv as sc
from otel_hicache._internal.emit.exporters import PROMETHEUS, exporter, prometheus_reader
from otel_hicache._internal.emit.shutdown import bounded
from otel_hicache.config import (
    DEFAULT_CARDINALITY_LIMIT,
    EMBEDDED,
    METRICS_GROUP,
    NONE,
    TRACES_GROUP,
    ConfigError,
    Settings,
    key_values,
)

DEFAULT_SERVICE_NAME = "otel-hicache"


class RecentSpans(SpanExporter):
    """Keeps the latest ``maxlen`` finished spans in memory (the embedded default's trace store) and counts all."""

    def __init__(self, maxlen: int = 2048) -> None:
        # No lock: deque.extend and deque.copy are atomic under the GIL, and a lock could be inherited held by fork.
        self._spans: collections.deque[ReadableSpan] = collections.deque(maxlen=maxlen)
        self.total = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._spans.extend(spans)
        self.total += len(spans)  # one exporting thread (the span processor's)
        return SpanExportResult.SUCCESS

    def spans(self) -> list[ReadableSpan]:
        return list(self._spans.copy())

    def shutdown(self) -> None:
        return None


class MetricsSide(NamedTuple):
    meter_provider: MeterProvider
    memory_reader: InMemoryMetricReader | None  # the embedded default's
    prometheus_address: tuple[str, int] | None
    closers: list[Any]  # what stops with the provider (the Prometheus server)
    push_readers: list[MetricReader]


class TracesSide(NamedTuple):
    tracer_provider: TracerProvider
    recent_spans: RecentSpans | None  # the embedded default's
    span_exporters: list[SpanExporter]  # handed back to the owner of a ``collect`` processor, who drives them itself


def views(cardinality_limit: int = DEFAULT_CARDINALITY_LIMIT) -> list[View]:
    """One View per instrument the SDK aggregates: closed attribute keys and a series cap. (The histograms are
    aggregated by the host in shared memory and handed to the readers as they are: ``_internal/emit/histograms.py``.)"""
    return [
        View(
            instrument_name=spec.name,
            meter_name=sc.INSTRUMENTATION_SCOPE,
            attribute_keys=set(spec.attributes),
            aggregation_cardinality_limit=cardinality_limit,
        )
        for spec in sc.INSTRUMENTS
        if spec.kind != "histogram"
    ]


def build_resource(
    service_name: str | None = None,
    ranks: Mapping[str, int] | None = None,
    attributes: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Resource:
    """The Resource: ``OTEL_RESOURCE_ATTRIBUTES`` / ``OTEL_SERVICE_NAME`` of ``env`` (``os.environ`` by default) win
    over ``attributes``, ranks and defaults (``host.name``, ``process.pid``, a random ``service.instance.id``, the
    SDK's ``telemetry.sdk.*``); ``service_name`` wins over everything."""
    env = os.environ if env is None else env
    merged: dict[str, Any] = {
        TELEMETRY_SDK_LANGUAGE: "python",
        TELEMETRY_SDK_NAME: "opentelemetry",
        TELEMETRY_SDK_VERSION: sdk_version,
        "host.name": socket.gethostname(),
        "process.pid": os.getpid(),
    }
    for rank, value in (ranks or {}).items():
        key = {"tp": sc.RESOURCE_TP_RANK, "pp": sc.RESOURCE_PP_RANK, "dp": sc.RESOURCE_DP_RANK}.get(rank)
        if key is None:
            raise ConfigError(f"unknown rank {rank!r}: expected tp, pp or dp")
        merged[key] = int(value)
    merged.update(attributes or {})
    merged.update(key_values(env, "OTEL_RESOURCE_ATTRIBUTES"))
    from_env = env.get("OTEL_SERVICE_NAME", "").strip()
    if service_name is not None:
        merged[SERVICE_NAME] = service_name
    elif from_env:
        merged[SERVICE_NAME] = from_env
    elif not merged.get(SERVICE_NAME):
        merged[SERVICE_NAME] = DEFAULT_SERVICE_NAME
    merged.setdefault(SERVICE_INSTANCE_ID, str(uuid.uuid4()))
    return Resource(merged)


def _sampler(settings: Settings) -> sampling.Sampler:
    rate = 1.0 if settings.sampler_arg is None else settings.sampler_arg
    return {
        "always_on": lambda: sampling.ALWAYS_ON,
        "always_off": lambda: sampling.ALWAYS_OFF,
        "traceidratio": lambda: sampling.TraceIdRatioBased(rate),
        "parentbased_always_on": lambda: sampling.DEFAULT_ON,
        "parentbased_always_off": lambda: sampling.DEFAULT_OFF,
        "parentbased_traceidratio": lambda: sampling.ParentBasedTraceIdRatio(rate),
    }[settings.sampler]()


def _span_limits(settings: Settings) -> SpanLimits:
    """The SDK's span limits from ``env`` (every limit given, so the SDK reads none from the process environment):
    a specific limit wins over the general one, which wins over the SDK's default (128; no length limit)."""
    given = settings.span_limits

    def limit(name: str, general: str | None, default: int | None) -> int:
        for key in (name, general):
            if key is not None and key in given:
                value = given[key]
                return SpanLimits.UNSET if value is None else value
        return SpanLimits.UNSET if default is None else default

    count, length = "OTEL_ATTRIBUTE_COUNT_LIMIT", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT"
    return SpanLimits(
        max_attributes=limit(count, None, 128),
        max_events=limit("OTEL_SPAN_EVENT_COUNT_LIMIT", None, 128),
        max_links=limit("OTEL_SPAN_LINK_COUNT_LIMIT", None, 128),
        max_span_attributes=limit("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", count, 128),
        max_event_attributes=limit("OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT", count, 128),
        max_link_attributes=limit("OTEL_LINK_ATTRIBUTE_COUNT_LIMIT", count, 128),
        max_attribute_length=limit(length, None, None),
        max_span_attribute_length=limit("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", length, None),
    )


_EXEMPLAR_FILTERS: dict[str, type[TraceBasedExemplarFilter | AlwaysOnExemplarFilter | AlwaysOffExemplarFilter]] = {
    "trace_based": TraceBasedExemplarFilter,
    "always_on": AlwaysOnExemplarFilter,
    "always_off": AlwaysOffExemplarFilter,
}


def build(
    settings: Settings,
    resource: Resource,
    prometheus_port: int | None = None,
    *,
    collect: SpanProcessor | None = None,
    id_generator: IdGenerator | None = None,
) -> tuple[MetricsSide, TracesSide]:
    """Both providers for ``settings``; with ``collect``, spans go to that processor and the span exporters are handed
    back (the export process sends them itself)."""
    side = metrics_side(settings, resource, prometheus_port)
    try:
        return side, traces_side(settings, resource, side.meter_provider, collect=collect, id_generator=id_generator)
    except BaseException:
        bounded(side.closers, 5.0)
        raise


def metrics_side(settings: Settings, resource: Resource, prometheus_port: int | None = None) -> MetricsSide:
    """The meter provider and its readers. The Prometheus port is bound first (the one step that can fail on a
    value); if anything after it fails, the server is stopped before the error propagates."""
    closers: list[Any] = []
    readers: list[MetricReader] = []
    address = None
    if prometheus_port is not None:
        address, reader, stop = prometheus_reader(settings.prometheus_host, prometheus_port)
        readers.append(reader)
        closers.append(stop)
    try:
        memory_reader: InMemoryMetricReader | None = None
        interval, timeout = settings.metric_export_interval_ms, settings.metric_export_timeout_ms
        for name in settings.metrics_exporters:
            if name == EMBEDDED:
                memory_reader = InMemoryMetricReader()
                readers.append(memory_reader)
            elif name not in (NONE, PROMETHEUS):
                made = exporter(METRICS_GROUP, name, settings.metrics, settings, None)
                readers.append(
                    made if isinstance(made, MetricReader) else PeriodicExportingMetricReader(made, interval, timeout)
                )
        meter_provider = MeterProvider(
            metric_readers=readers,
            resource=resource,
            views=views(settings.cardinality_limit),
            exemplar_filter=_EXEMPLAR_FILTERS[settings.exemplar_filter](),
            shutdown_on_exit=False,
        )
    except BaseException:
        bounded(closers, 5.0)
        raise
    push = [r for r in readers if isinstance(r, PeriodicExportingMetricReader)]
    return MetricsSide(meter_provider, memory_reader, address, closers, list(push))


def traces_side(
    settings: Settings,
    resource: Resource,
    meter_provider: metrics.MeterProvider,
    *,
    collect: SpanProcessor | None = None,
    id_generator: IdGenerator | None = None,
) -> TracesSide:
    """The tracer provider and its processors (their own metrics go to ``meter_provider``)."""
    tracer_provider = TracerProvider(
        sampler=_sampler(settings),
        resource=resource,
        shutdown_on_exit=False,
        id_generator=id_generator,
        span_limits=_span_limits(settings),
    )
    batching = {
        "max_queue_size": settings.bsp_max_queue_size,
        "schedule_delay_millis": settings.bsp_schedule_delay_ms,
        "max_export_batch_size": settings.bsp_max_export_batch_size,
        "export_timeout_millis": settings.bsp_export_timeout_ms,
    }
    recent: RecentSpans | None = None
    handed_back: list[SpanExporter] = []
    for name in settings.traces_exporters:
        if name == NONE:
            continue
        if name == EMBEDDED:
            recent = RecentSpans()
            tracer_provider.add_span_processor(SimpleSpanProcessor(recent))
            continue
        span_exporter = exporter(TRACES_GROUP, name, settings.traces, settings, meter_provider)
        if collect is None:
            tracer_provider.add_span_processor(
                BatchSpanProcessor(span_exporter, **batching, meter_provider=meter_provider)
            )
        else:
            handed_back.append(span_exporter)
    if collect is not None and handed_back:
        tracer_provider.add_span_processor(collect)
    return TracesSide(tracer_provider, recent, handed_back)
