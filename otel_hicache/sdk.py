"""Provider set-up from the standard ``OTEL_*`` environment, with an embedded default.

:func:`configure` builds a ``TracerProvider`` and a ``MeterProvider`` and a :class:`HiCacheTelemetry` on them:

* **OTLP** when an endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT`` or the per-signal
  ``..._TRACES_ENDPOINT`` / ``..._METRICS_ENDPOINT``, or ``endpoint=``). ``OTEL_EXPORTER_OTLP_PROTOCOL``
  (``grpc`` or ``http/protobuf``) picks the exporter; headers, TLS (``..._CERTIFICATE``, ``..._INSECURE``),
  compression and timeouts are read by the OTel exporters themselves from the standard variables.
* **Embedded** otherwise: metrics are kept by an in-process reader and the latest spans in a bounded buffer, so
  :mod:`otel_hicache.summary` can print what happened instead of the data vanishing.
* **Prometheus** scrape endpoint on request (``prometheus_port=`` or ``OTEL_METRICS_EXPORTER=prometheus`` with
  ``OTEL_EXPORTER_PROMETHEUS_HOST`` / ``_PORT``), alongside either of the above.

Also from the environment: ``OTEL_SDK_DISABLED``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER`` / ``_ARG``, ``OTEL_METRIC_EXPORT_INTERVAL``, ``OTEL_TRACES_EXPORTER`` /
``OTEL_METRICS_EXPORTER`` (``otlp``, ``console``, ``none``; ``prometheus`` for metrics). A bad value raises
:class:`ConfigError` naming the variable, before anything is built.

Views install the bucket boundaries, allow only each instrument's closed attribute keys, and cap every metric
stream at ``cardinality_limit`` series. The SDK's own pipeline metrics (spans dropped by a full queue, export
failures: ``otel.sdk.*``) are turned on unless ``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED`` says otherwise.
"""

from __future__ import annotations

import collections
import os
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    InMemoryMetricReader,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from otel_hicache import semconv as sc
from otel_hicache.config import DEFAULT_CARDINALITY_LIMIT, ConfigError, validate
from otel_hicache.telemetry import HiCacheTelemetry

DEFAULT_SERVICE_NAME = "otel-hicache"
_INTERNAL_METRICS_ENV = "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED"


class RecentSpans(SpanExporter):
    """Keeps the latest ``maxlen`` finished spans in memory (the embedded default's trace store) and counts all."""

    def __init__(self, maxlen: int = 2048) -> None:
        self._spans: collections.deque[ReadableSpan] = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self.total = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            self._spans.extend(spans)
            self.total += len(spans)
        return SpanExportResult.SUCCESS

    def spans(self) -> list[ReadableSpan]:
        with self._lock:
            return list(self._spans)

    def shutdown(self) -> None:
        return None


@dataclass
class TelemetrySetup:
    """What :func:`configure` built. ``shutdown()`` flushes everything within a bounded time."""

    telemetry: HiCacheTelemetry
    tracer_provider: trace.TracerProvider
    meter_provider: metrics.MeterProvider
    mode: str  # "otlp", "embedded", "console", "disabled"
    metric_reader: InMemoryMetricReader | None = None  # embedded mode: read metrics in-process
    recent_spans: RecentSpans | None = None  # embedded mode: the latest spans
    prometheus_address: tuple[str, int] | None = None
    _closers: list[Any] = field(default_factory=list)
    _push_readers: list[MetricReader] = field(default_factory=list)

    def force_flush(self, timeout_s: float = 5.0) -> None:
        """Create queued spans, export them, and push metrics now.

        Only push readers are flushed: a collection on the Prometheus reader would be queued and served twice by the
        next scrape (the exporter keeps every collection until scraped).
        """
        self.telemetry.flush(timeout_s)
        flush = getattr(self.tracer_provider, "force_flush", None)
        if flush is not None:
            flush(int(timeout_s * 1000))
        for reader in self._push_readers:
            reader.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.telemetry.shutdown(timeout_s)
        for provider in (self.tracer_provider, self.meter_provider):
            close = getattr(provider, "shutdown", None)
            if close is not None:
                try:
                    close(timeout_millis=int(timeout_s * 1000))
                except TypeError:  # TracerProvider.shutdown() takes no timeout
                    close()
        for closer in self._closers:
            closer()


def views(cardinality_limit: int = DEFAULT_CARDINALITY_LIMIT) -> list[View]:
    """One View per instrument: closed attribute keys, a series cap, and explicit buckets for histograms."""
    out = []
    for spec in sc.INSTRUMENTS:
        aggregation = None
        if spec.name == sc.METRIC_TRANSFER_DURATION:
            aggregation = ExplicitBucketHistogramAggregation(sc.TRANSFER_DURATION_BUCKETS)
        elif spec.name == sc.METRIC_EVICTION_DURATION:
            aggregation = ExplicitBucketHistogramAggregation(sc.EVICTION_DURATION_BUCKETS)
        out.append(
            View(
                instrument_name=spec.name,
                meter_name=sc.INSTRUMENTATION_SCOPE,
                attribute_keys=set(spec.attributes),
                aggregation=aggregation,
                aggregation_cardinality_limit=cardinality_limit,
            )
        )
    return out


def build_resource(
    service_name: str | None = None,
    ranks: Mapping[str, int] | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> Resource:
    """The Resource: ``OTEL_RESOURCE_ATTRIBUTES`` / ``OTEL_SERVICE_NAME`` win over defaults; host and ranks added."""
    defaults: dict[str, Any] = {"host.name": socket.gethostname(), "process.pid": os.getpid()}
    for rank, value in (ranks or {}).items():
        key = {"tp": sc.RESOURCE_TP_RANK, "pp": sc.RESOURCE_PP_RANK, "dp": sc.RESOURCE_DP_RANK}.get(rank)
        if key is None:
            raise ConfigError(f"unknown rank {rank!r}: expected tp, pp or dp")
        defaults[key] = int(value)
    defaults.update(attributes or {})
    from_env = Resource.create()
    resource = Resource(defaults).merge(from_env)
    name = str(resource.attributes.get(SERVICE_NAME, ""))
    if service_name is not None:
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    elif name.startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


def _otlp_span_exporter(protocol: str, endpoint: str | None, meter_provider: metrics.MeterProvider) -> SpanExporter:
    """With ``endpoint`` None the exporter reads every OTEL_EXPORTER_OTLP_* variable itself."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpan

        return GrpcSpan(endpoint=endpoint, meter_provider=meter_provider)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpan

    return HttpSpan(endpoint=None if endpoint is None else endpoint.rstrip("/") + "/v1/traces",
                    meter_provider=meter_provider)  # fmt: skip


def _otlp_metric_exporter(protocol: str, endpoint: str | None) -> Any:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetric

        return GrpcMetric(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetric

    return HttpMetric(endpoint=None if endpoint is None else endpoint.rstrip("/") + "/v1/metrics")


def configure(
    *,
    service_name: str | None = None,
    endpoint: str | None = None,
    protocol: str | None = None,
    prometheus_port: int | None = None,
    prometheus_host: str = "127.0.0.1",
    ranks: Mapping[str, int] | None = None,
    resource_attributes: Mapping[str, Any] | None = None,
    pools: Sequence[str] = (sc.DEFAULT_POOL,),
    cardinality_limit: int = DEFAULT_CARDINALITY_LIMIT,
    set_global: bool = False,
    env: Mapping[str, str] | None = None,
) -> TelemetrySetup:
    """Build providers and a :class:`HiCacheTelemetry` from arguments, then the ``OTEL_*`` environment.

    Arguments win over the environment. ``set_global=True`` also installs the providers as the OTel globals (what
    auto-instrumentation and the SGLang instrumentor use by default).
    """
    env = os.environ if env is None else env
    settings = validate(
        env, service_name=service_name, endpoint=endpoint, protocol=protocol, prometheus_port=prometheus_port,
        prometheus_host=prometheus_host, ranks=ranks, resource_attributes=resource_attributes, pools=pools,
        cardinality_limit=cardinality_limit, set_global=set_global,
    )  # fmt: skip
    if settings.disabled:
        noop_t, noop_m = trace.NoOpTracerProvider(), metrics.NoOpMeterProvider()
        return TelemetrySetup(HiCacheTelemetry(noop_t, noop_m, pools=pools, spans=False), noop_t, noop_m, "disabled")

    traces_kind, metrics_kind = settings.traces_exporter, settings.metrics_exporter
    protocol_traces, protocol_metrics = settings.traces.protocol, settings.metrics.protocol
    prometheus_port, prometheus_host = settings.prometheus_port, settings.prometheus_host
    if env is os.environ:
        os.environ.setdefault(_INTERNAL_METRICS_ENV, "true")

    resource = build_resource(service_name, ranks, resource_attributes)
    readers: list[MetricReader] = []
    memory_reader: InMemoryMetricReader | None = None
    closers: list[Any] = []
    if metrics_kind == "otlp":
        readers.append(PeriodicExportingMetricReader(_otlp_metric_exporter(protocol_metrics, endpoint)))
    elif metrics_kind == "console":
        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(out=sys.stdout)))
    elif metrics_kind == "embedded":
        memory_reader = InMemoryMetricReader()
        readers.append(memory_reader)
    prometheus_address = None
    if prometheus_port is not None:
        prometheus_address, reader, stop = _prometheus_reader(prometheus_host, prometheus_port)
        readers.append(reader)
        closers.append(stop)
    meter_provider = MeterProvider(metric_readers=readers, resource=resource, views=views(cardinality_limit))

    tracer_provider = TracerProvider(resource=resource)
    recent: RecentSpans | None = None
    if traces_kind == "otlp":
        span_exporter = _otlp_span_exporter(protocol_traces, endpoint, meter_provider)
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter, meter_provider=meter_provider))
    elif traces_kind == "console":
        tracer_provider.add_span_processor(
            BatchSpanProcessor(ConsoleSpanExporter(out=sys.stdout), meter_provider=meter_provider)
        )
    elif traces_kind == "embedded":
        recent = RecentSpans()
        tracer_provider.add_span_processor(SimpleSpanProcessor(recent))

    if set_global:
        trace.set_tracer_provider(tracer_provider)
        metrics.set_meter_provider(meter_provider)
    telemetry = HiCacheTelemetry(tracer_provider, meter_provider, pools=pools)
    mode = "otlp" if "otlp" in (traces_kind, metrics_kind) else (
        "embedded" if "embedded" in (traces_kind, metrics_kind) else traces_kind
    )  # fmt: skip
    push = [r for r in readers if isinstance(r, PeriodicExportingMetricReader)]
    return TelemetrySetup(
        telemetry, tracer_provider, meter_provider, mode, memory_reader, recent, prometheus_address, closers, push
    )


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
