"""Providers from :class:`~otel_hicache.config.Settings`: one builder for ``configure()`` and the export process.

``configure()`` (:mod:`otel_hicache.sdk`) builds this process's providers with :func:`build`, and the export process
(:mod:`otel_hicache._internal.export.main`) builds its providers for the host's spans and metrics with the same call:
same Views, Resource rules, sampler, span limits, exemplar filter and exporters.

Exporters are chosen the SDK's way (``opentelemetry.sdk._configuration``): each name in ``OTEL_TRACES_EXPORTER`` /
``OTEL_METRICS_EXPORTER`` is an entry point of the group ``opentelemetry_traces_exporter`` /
``opentelemetry_metrics_exporter`` (``otlp`` is ``otlp_proto_grpc`` or ``otlp_proto_http``, by the signal's protocol);
a metrics entry point may be a push exporter (read by a periodic reader) or a reader itself. :data:`EXPORTERS` holds
the arguments of those built from the checked settings (``configure(env=...)``, never the process environment) and says
which must run in this process; any other installed exporter is built with no arguments (it reads its own variables),
as ``opentelemetry-instrument`` builds it, and runs where OTLP runs. Adding an exporter is installing its entry point,
plus one entry in :data:`EXPORTERS` when it takes settings or writes to this process. ``prometheus`` is the scrape
endpoint ``configure()`` serves itself (:attr:`~otel_hicache.config.Settings.prometheus_port`).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NamedTuple

from opentelemetry import metrics
from opentelemetry.sdk.metrics import (
    AlwaysOffExemplarFilter,
    AlwaysOnExemplarFilter,
    MeterProvider,
    TraceBasedExemplarFilter,
)
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
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
from otel_hicache.config import (
    DEFAULT_CARDINALITY_LIMIT,
    EMBEDDED,
    METRICS_GROUP,
    NONE,
    TRACES_GROUP,
    ConfigError,
    Settings,
    SignalSettings,
    key_values,
)

DEFAULT_SERVICE_NAME = "otel-hicache"
_log = logging.getLogger(__name__)


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


# ---------------------------------------------------------------------- exporters
class ExporterKind(NamedTuple):
    """How :func:`build` makes one exporter an entry point names: ``arguments(settings, meter_provider)`` are the
    keyword arguments of the entry point's class (the SDK's ``exporter_args_map``); ``in_process``: it writes to this
    process (its standard output), so a setup that uses it exports in-process, never from the export process."""

    arguments: Callable[[Settings, metrics.MeterProvider], dict[str, Any]]
    in_process: bool = False


def _stdout(settings: Settings, meter_provider: metrics.MeterProvider) -> dict[str, Any]:
    return {"out": sys.stdout}  # this process's stdout now (the exporters' default is the one at their import)


#: Exporters built from the settings, by (entry-point group, name). Any other entry point: no arguments, not in-process.
EXPORTERS: dict[tuple[str, str], ExporterKind] = {
    (TRACES_GROUP, "otlp_proto_grpc"): ExporterKind(
        lambda s, meter_provider: {**_grpc_options(s.traces, s, "traces"), "meter_provider": meter_provider}
    ),
    (TRACES_GROUP, "otlp_proto_http"): ExporterKind(
        lambda s, meter_provider: {**_http_options(s.traces, "traces"), "meter_provider": meter_provider}
    ),
    (TRACES_GROUP, "console"): ExporterKind(_stdout, in_process=True),
    (METRICS_GROUP, "otlp_proto_grpc"): ExporterKind(
        lambda s, _: {**_grpc_options(s.metrics, s, "metrics"), **_metric_preferences(s)}
    ),
    (METRICS_GROUP, "otlp_proto_http"): ExporterKind(
        lambda s, _: {**_http_options(s.metrics, "metrics"), **_metric_preferences(s)}
    ),
    (METRICS_GROUP, "console"): ExporterKind(_stdout, in_process=True),
}
_OTLP_BY_PROTOCOL = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}
_PROMETHEUS = "prometheus"  # the scrape endpoint configure() serves itself, on Settings.prometheus_port


def entry_point_name(name: str, signal: SignalSettings) -> str:
    """The entry point an exporter name means: ``otlp`` is the OTLP exporter of the signal's protocol."""
    return _OTLP_BY_PROTOCOL[signal.protocol] if name == "otlp" else name


def in_process(settings: Settings) -> bool:
    """Whether some exporter of ``settings`` must run in this process (the embedded store, a scrape endpoint, an
    exporter writing to standard output): then the telemetry exports in-process, else from its export process."""
    if settings.prometheus_port is not None:
        return True
    for group, names, signal in _signals(settings):
        for name in names:
            if name == EMBEDDED or EXPORTERS.get((group, entry_point_name(name, signal)), _PLAIN).in_process:
                return True
    return False


def _signals(settings: Settings) -> tuple[tuple[str, tuple[str, ...], SignalSettings], ...]:
    return (
        (TRACES_GROUP, settings.traces_exporters, settings.traces),
        (METRICS_GROUP, settings.metrics_exporters, settings.metrics),
    )


def _plain(settings: Settings, meter_provider: metrics.MeterProvider) -> dict[str, Any]:
    return {}


_PLAIN = ExporterKind(_plain)


def _exporter(group: str, name: str, signal: SignalSettings, settings: Settings, meter_provider: Any) -> Any:
    """The exporter (or, for metrics, possibly a reader) the entry point ``name`` of ``group`` makes."""
    point = entry_point_name(name, signal)
    found = list(entry_points(group=group, name=point))
    if not found:  # config.validate() checked the name; the distribution went away since
        raise ConfigError(f"no {group} entry point named {point!r} is installed")
    try:
        factory = found[0].load()
    except Exception as exc:
        raise ConfigError(f"the {point} exporter ({group}) cannot be loaded: {exc!r}") from None
    return factory(**EXPORTERS.get((group, point), _PLAIN).arguments(settings, meter_provider))


def _default_endpoint(signal: SignalSettings, name: str) -> str:
    if signal.endpoint is not None:
        return signal.endpoint
    return "http://localhost:4317" if signal.protocol == "grpc" else f"http://localhost:4318/v1/{name}"


def _grpc_options(signal: SignalSettings, settings: Settings, name: str) -> dict[str, Any]:
    import grpc

    endpoint = _default_endpoint(signal, name)
    scheme = endpoint.partition(":")[0]
    insecure = False if scheme == "https" else signal.insecure if signal.insecure is not None else scheme == "http"
    credentials = None
    if not insecure:
        credentials = grpc.ssl_channel_credentials(
            _read(signal.certificate), _read(signal.client_key), _read(signal.client_certificate)
        )
    codes = None
    if settings.retryable_error_codes is not None:
        codes = [grpc.StatusCode[code] for code in settings.retryable_error_codes]
    return {
        "endpoint": endpoint,
        "insecure": insecure,
        "credentials": credentials,
        "headers": dict(signal.headers) or None,
        "timeout": 10.0 if signal.timeout_s is None else signal.timeout_s,
        "compression": grpc.Compression.Gzip if signal.compression == "gzip" else grpc.Compression.NoCompression,
        "retryable_error_codes": codes,
    }


def _http_options(signal: SignalSettings, name: str) -> dict[str, Any]:
    from opentelemetry.exporter.otlp.proto.http import Compression

    verify: Any = signal.certificate if signal.certificate is not None else True
    return {
        "endpoint": _default_endpoint(signal, name),
        "certificate_file": verify,
        "client_key_file": signal.client_key,
        "client_certificate_file": signal.client_certificate,
        "headers": dict(signal.headers) or None,
        "timeout": 10.0 if signal.timeout_s is None else signal.timeout_s,
        "compression": Compression(signal.compression or "none"),
    }


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def _metric_preferences(settings: Settings) -> dict[str, Any]:
    """Temporality and histogram aggregation as ``OTEL_EXPORTER_OTLP_METRICS_*`` of ``env`` say (the SDK's table)."""
    from opentelemetry.sdk.metrics import (
        Counter,
        Histogram,
        ObservableCounter,
        ObservableGauge,
        ObservableUpDownCounter,
        UpDownCounter,
    )
    from opentelemetry.sdk.metrics.export import AggregationTemporality
    from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation

    preference = settings.temporality_preference or "cumulative"
    delta = {"delta": {Counter, Histogram, ObservableCounter}, "lowmemory": {Counter, Histogram}}.get(preference, set())
    classes = (Counter, UpDownCounter, Histogram, ObservableCounter, ObservableUpDownCounter, ObservableGauge)
    temporality = {
        cls: AggregationTemporality.DELTA if cls in delta else AggregationTemporality.CUMULATIVE for cls in classes
    }
    exponential = settings.histogram_aggregation == "base2_exponential_bucket_histogram"
    aggregation = ExponentialBucketHistogramAggregation() if exponential else ExplicitBucketHistogramAggregation()
    return {"preferred_temporality": temporality, "preferred_aggregation": {Histogram: aggregation}}


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
        address, reader, stop = _prometheus_reader(settings.prometheus_host, prometheus_port)
        readers.append(reader)
        closers.append(stop)
    try:
        memory_reader: InMemoryMetricReader | None = None
        interval, timeout = settings.metric_export_interval_ms, settings.metric_export_timeout_ms
        for name in settings.metrics_exporters:
            if name == EMBEDDED:
                memory_reader = InMemoryMetricReader()
                readers.append(memory_reader)
            elif name not in (NONE, _PROMETHEUS):
                made = _exporter(METRICS_GROUP, name, settings.metrics, settings, None)
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
        span_exporter = _exporter(TRACES_GROUP, name, settings.traces, settings, meter_provider)
        if collect is None:
            tracer_provider.add_span_processor(
                BatchSpanProcessor(span_exporter, **batching, meter_provider=meter_provider)
            )
        else:
            handed_back.append(span_exporter)
    if collect is not None and handed_back:
        tracer_provider.add_span_processor(collect)
    return TracesSide(tracer_provider, recent, handed_back)


def shutdown_provider(provider: Any, timeout_s: float) -> None:
    try:
        provider.shutdown(timeout_millis=int(timeout_s * 1000))
    except TypeError:  # TracerProvider.shutdown() takes no timeout: bounded() cuts it off
        provider.shutdown()


def bounded(jobs: Sequence[Any], timeout_s: float) -> bool:
    """Run ``jobs`` concurrently on daemon threads and wait at most ``timeout_s`` for all of them. A job that
    outlives the budget (an exporter retrying a dead collector) is abandoned; the caller goes on. A job no thread can
    be started for (the process is at its thread limit) is skipped, with one log line: never run here unbounded."""
    threads = []
    for job in jobs:
        thread = threading.Thread(target=_quietly, args=(job,), daemon=True, name="otel-hicache-close")
        try:
            thread.start()
        except RuntimeError as exc:  # can't start new thread
            _log.warning("otel_hicache: a shutdown step was skipped: %s", exc)
            continue
        threads.append(thread)
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return len(threads) == len(jobs) and not any(thread.is_alive() for thread in threads)


def _quietly(job: Any) -> None:
    try:
        job()
    except Exception:
        _log.debug("otel_hicache: a shutdown step failed", exc_info=True)


def _prometheus_reader(host: str, port: int) -> tuple[tuple[str, int], MetricReader, Any]:
    """A Prometheus exporter reader and an HTTP server for it (port 0 picks a free one)."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry, start_http_server

    # A registry of our own, so servers do not mix; the reader (un)registers itself there.
    registry = CollectorRegistry()
    reader = PrometheusMetricReader(registry=registry)
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve Prometheus metrics on {host}:{port}: {exc.strerror or exc}") from None

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return (host, server.server_port), reader, stop
