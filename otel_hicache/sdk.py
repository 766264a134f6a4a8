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

import atexit
import collections
import functools
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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
from otel_hicache.channel import Channel
from otel_hicache.config import DEFAULT_CARDINALITY_LIMIT, ConfigError, validate
from otel_hicache.export_process import ExportProcess, quiet_exporters
from otel_hicache.telemetry import HiCacheTelemetry

DEFAULT_SERVICE_NAME = "otel-hicache"
#: The most ``TelemetrySetup.shutdown()`` (and the exit of a process that never called it) takes by default.
DEFAULT_SHUTDOWN_TIMEOUT_S = 2.0
_INTERNAL_METRICS_ENV = "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED"


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


@dataclass(eq=False)  # identity: setups are kept in a weak set
class TelemetrySetup:
    """What :func:`configure` built. ``shutdown()`` flushes everything within a bounded time.

    ``mode`` is ``"otlp"`` (spans and metrics of the telemetry built and exported by the export process),
    ``"embedded"``, ``"console"``, ``"prometheus"`` (in-process) or ``"disabled"``. ``tracer_provider`` and
    ``meter_provider`` are this process's providers, exporting the same way, for your own spans and metrics (and
    SGLang's request spans and stat-logger series); the telemetry's own spans never go through them in ``otlp`` mode.
    """

    telemetry: HiCacheTelemetry
    tracer_provider: trace.TracerProvider
    meter_provider: metrics.MeterProvider
    mode: str
    metric_reader: InMemoryMetricReader | None = None  # embedded mode: read metrics in-process
    recent_spans: RecentSpans | None = None  # embedded mode: the latest spans
    prometheus_address: tuple[str, int] | None = None
    _closers: list[Any] = field(default_factory=list)
    _push_readers: list[MetricReader] = field(default_factory=list)
    _closed: bool = False

    def force_flush(self, timeout_s: float = 5.0) -> None:
        """Create queued spans, export them, and push metrics now.

        Only push readers are flushed: a collection on the Prometheus reader would be queued and served twice by the
        next scrape (the exporter keeps every collection until scraped).
        """
        deadline = time.monotonic() + timeout_s
        self.telemetry.flush(timeout_s)
        remaining = max(0.0, deadline - time.monotonic())
        millis = int(remaining * 1000)
        flushers: list[Any] = [
            getattr(self.tracer_provider, "force_flush", None),
            *(r.force_flush for r in self._push_readers),
        ]
        _bounded([functools.partial(flush, millis) for flush in flushers if flush is not None], remaining)

    def shutdown(self, timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Hand the last records over and stop everything, in at most about ``timeout_s`` whatever the collector
        does (the SDK's own shutdown waits up to 30 s for a dead collector; here it is cut off)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s
        self.telemetry.shutdown(timeout_s * 0.6)
        remaining = max(0.0, deadline - time.monotonic())
        jobs = [
            lambda p=provider: _shutdown_provider(p, remaining)
            for provider in (self.tracer_provider, self.meter_provider)
            if hasattr(provider, "shutdown")
        ]
        _bounded(jobs + list(self._closers), remaining)


def _shutdown_provider(provider: Any, timeout_s: float) -> None:
    try:
        provider.shutdown(timeout_millis=int(timeout_s * 1000))
    except TypeError:  # TracerProvider.shutdown() takes no timeout: _bounded cuts it off
        provider.shutdown()


def _bounded(jobs: Sequence[Any], timeout_s: float) -> bool:
    """Run ``jobs`` concurrently on daemon threads and wait at most ``timeout_s`` for all of them. A job that
    outlives the budget (an exporter retrying a dead collector) is abandoned; the caller goes on."""
    threads = [threading.Thread(target=_quietly, args=(job,), daemon=True, name="otel-hicache-close") for job in jobs]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)


def _quietly(job: Any) -> None:
    try:
        job()
    except Exception:
        logging.getLogger(__name__).debug("otel_hicache: a shutdown step failed", exc_info=True)


def views(cardinality_limit: int = DEFAULT_CARDINALITY_LIMIT) -> list[View]:
    """One View per instrument: closed attribute keys, a series cap, and explicit buckets for histograms."""
    out = []
    for spec in sc.INSTRUMENTS:
        aggregation = None if spec.buckets is None else ExplicitBucketHistogramAggregation(spec.buckets)
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
    extra_pools: Sequence[str] = (),
    cardinality_limit: int = DEFAULT_CARDINALITY_LIMIT,
    token_metrics: bool = True,
    set_global: bool = False,
    env: Mapping[str, str] | None = None,
) -> TelemetrySetup:
    """Build providers and a :class:`HiCacheTelemetry` from arguments, then the ``OTEL_*`` environment.

    Arguments win over the environment. Every value is checked before anything is built: a bad one raises
    :class:`ConfigError` with no thread started and no port bound. ``set_global=True`` also installs this process's
    providers as the OTel globals. Exporting over OTLP (and nothing in-process such as a Prometheus endpoint), the
    telemetry's spans and metrics are built and exported by an export process of its own, started on first use.
    ``token_metrics=False`` leaves out the instruments counted in tokens (on all but one rank of a tensor-parallel
    group: see :class:`HiCacheTelemetry`).
    """
    env = os.environ if env is None else env
    settings = validate(
        env, service_name=service_name, endpoint=endpoint, protocol=protocol, prometheus_port=prometheus_port,
        prometheus_host=prometheus_host, ranks=ranks, resource_attributes=resource_attributes, pools=pools,
        cardinality_limit=cardinality_limit, set_global=set_global,
    )  # fmt: skip
    if settings.disabled:
        noop_t, noop_m = trace.NoOpTracerProvider(), metrics.NoOpMeterProvider()
        telemetry = HiCacheTelemetry(noop_t, noop_m, pools=pools, extra_pools=extra_pools, spans=False,
                                     token_metrics=token_metrics)  # fmt: skip
        return TelemetrySetup(telemetry, noop_t, noop_m, "disabled")

    traces_kind, metrics_kind = settings.traces_exporter, settings.metrics_exporter
    protocol_traces, protocol_metrics = settings.traces.protocol, settings.metrics.protocol
    prometheus_port, prometheus_host = settings.prometheus_port, settings.prometheus_host
    if metrics_kind == "prometheus":
        metrics_kind = "none"  # the Prometheus reader is the metrics exporter
    if env is os.environ:
        os.environ.setdefault(_INTERNAL_METRICS_ENV, "true")

    if "otlp" in (traces_kind, metrics_kind):
        quiet_exporters()
    resource = build_resource(service_name, ranks, resource_attributes)
    plan = {
        "resource": dict(resource.attributes),
        "traces": traces_kind,
        "metrics": metrics_kind,
        "protocol_traces": protocol_traces,
        "protocol_metrics": protocol_metrics,
        "endpoint": endpoint,
        "cardinality_limit": cardinality_limit,
        "spans": True,
        "token_metrics": token_metrics,
    }
    built = _build(plan, prometheus_host, prometheus_port)
    if set_global:
        trace.set_tracer_provider(built.tracer_provider)
        metrics.set_meter_provider(built.meter_provider)
    if "otlp" in (traces_kind, metrics_kind) and prometheus_port is None:
        consumer = functools.partial(_export_process, plan=plan, env=env)
        telemetry = HiCacheTelemetry(pools=pools, extra_pools=extra_pools, consumer=consumer)
        mode = "otlp"
    else:
        telemetry = HiCacheTelemetry(built.tracer_provider, built.meter_provider, pools=pools, extra_pools=extra_pools,
                                     token_metrics=token_metrics)  # fmt: skip
        mode = next((k for k in ("otlp", "embedded", "console") if k in (traces_kind, metrics_kind)), "prometheus")
    setup = TelemetrySetup(telemetry, built.tracer_provider, built.meter_provider, mode, built.memory_reader,
                           built.recent_spans, built.prometheus_address, built.closers, built.push_readers)  # fmt: skip
    _AT_EXIT.add(setup)
    return setup


def _export_process(channel: Channel, *, plan: dict[str, Any], env: Mapping[str, str]) -> ExportProcess:
    layout = channel.layout
    config = {**plan, "pools": list(layout.pools), "seed_pools": list(layout.seed_pools), "capacity": channel.capacity}
    return ExportProcess(channel, config, env)


class _Built(NamedTuple):
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    memory_reader: InMemoryMetricReader | None
    recent_spans: RecentSpans | None
    prometheus_address: tuple[str, int] | None
    closers: list[Any]
    push_readers: list[MetricReader]


def _build(plan: Mapping[str, Any], prometheus_host: str, prometheus_port: int | None) -> _Built:
    """This process's providers for ``plan``. The Prometheus port is bound first (the one step that can fail on a
    value); if anything after it fails, the server is stopped before the error propagates."""
    closers: list[Any] = []
    prometheus = None
    if prometheus_port is not None:
        prometheus = _prometheus_reader(prometheus_host, prometheus_port)
        closers.append(prometheus[2])
    try:
        return _providers(plan, prometheus, closers)
    except BaseException:
        _bounded(closers, 5.0)
        raise


def _providers(plan: Mapping[str, Any], prometheus: tuple[Any, MetricReader, Any] | None, closers: list[Any]) -> _Built:
    resource = Resource(plan["resource"])
    readers: list[MetricReader] = [] if prometheus is None else [prometheus[1]]
    memory_reader: InMemoryMetricReader | None = None
    metrics_kind, traces_kind = plan["metrics"], plan["traces"]
    if metrics_kind == "otlp":
        readers.append(PeriodicExportingMetricReader(_otlp_metric_exporter(plan["protocol_metrics"], plan["endpoint"])))
    elif metrics_kind == "console":
        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(out=sys.stdout)))
    elif metrics_kind == "embedded":
        memory_reader = InMemoryMetricReader()
        readers.append(memory_reader)
    meter_provider = MeterProvider(metric_readers=readers, resource=resource, views=views(plan["cardinality_limit"]),
                                   shutdown_on_exit=False)  # fmt: skip
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    recent: RecentSpans | None = None
    if traces_kind == "otlp":
        span_exporter = _otlp_span_exporter(plan["protocol_traces"], plan["endpoint"], meter_provider)
        queue = plan.get("span_queue")
        tracer_provider.add_span_processor(
            BatchSpanProcessor(span_exporter, max_queue_size=queue, meter_provider=meter_provider)
        )
    elif traces_kind == "console":
        tracer_provider.add_span_processor(
            BatchSpanProcessor(ConsoleSpanExporter(out=sys.stdout), meter_provider=meter_provider)
        )
    elif traces_kind == "embedded":
        recent = RecentSpans()
        tracer_provider.add_span_processor(SimpleSpanProcessor(recent))
    push: list[MetricReader] = [r for r in readers if isinstance(r, PeriodicExportingMetricReader)]
    address = None if prometheus is None else prometheus[0]
    return _Built(tracer_provider, meter_provider, memory_reader, recent, address, closers, push)


def export_providers(config: Mapping[str, Any]) -> tuple[TracerProvider, MeterProvider]:
    """The export process's providers: the host's plan, the host's Resource, a span queue as deep as the ring."""
    env_queue = os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE")
    plan = {**config, "span_queue": None if env_queue else max(2048, int(config["capacity"]))}
    built = _build(plan, "127.0.0.1", None)
    return built.tracer_provider, built.meter_provider


class _AtExit:
    """Shuts down, bounded, every setup still open when the interpreter exits (the SDK's own exit handlers are off:
    they wait up to 30 s on a dead collector). Weak: a dropped setup is not kept alive."""

    def __init__(self) -> None:
        self._setups: weakref.WeakSet[TelemetrySetup] = weakref.WeakSet()
        atexit.register(self._close_all)

    def add(self, setup: TelemetrySetup) -> None:
        self._setups.add(setup)

    def _close_all(self) -> None:
        setups = list(self._setups)
        _bounded([lambda s=s: s.shutdown(DEFAULT_SHUTDOWN_TIMEOUT_S) for s in setups], DEFAULT_SHUTDOWN_TIMEOUT_S)


_AT_EXIT = _AtExit()


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
