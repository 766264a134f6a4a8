"""Provider set-up from the standard ``OTEL_*`` environment, with an embedded default.

:func:`configure` builds a :class:`HiCacheTelemetry` and what it exports through:

* **OTLP** when an endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT`` or the per-signal
  ``..._TRACES_ENDPOINT`` / ``..._METRICS_ENDPOINT``, or ``endpoint=``): the telemetry's spans and metrics are built
  and exported by its export process (:mod:`otel_hicache._internal.export_process`); this process runs no exporter, span
  processor or metric reader of ours. ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc`` or ``http/protobuf``) picks the
  exporter; headers, TLS (``..._CERTIFICATE``, ``..._INSECURE``), compression and timeouts come from the same
  variables.
* **Embedded** otherwise: metrics are kept by an in-process reader and the latest spans in a bounded buffer, so
  :mod:`otel_hicache.summary` can print what happened instead of the data vanishing.
* **Prometheus** scrape endpoint on request (``prometheus_port=`` or ``prometheus`` in ``OTEL_METRICS_EXPORTER``,
  with ``OTEL_EXPORTER_PROMETHEUS_HOST`` / ``_PORT``), alongside either of the above (in-process then, OTLP too).
  So are ``console`` exporters, which write to this process's standard output.

Also from the environment: ``OTEL_SDK_DISABLED``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER`` / ``_ARG``, ``OTEL_METRIC_EXPORT_INTERVAL`` / ``_TIMEOUT``, the span limits and
``OTEL_BSP_*``, ``OTEL_METRICS_EXEMPLAR_FILTER``, ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``
(``otlp``, ``console``, ``none`` or a comma-separated list; ``prometheus`` for metrics; both ``none``: mode
``"none"``, counted and exported nowhere). A bad value raises :class:`ConfigError` naming the variable, before
anything is built. Everything is read from the ``env`` mapping :func:`configure` is given (``os.environ`` by
default), which it never changes; where ``env`` does not name a value, the OTel SDK's own default holds (the SDK still
reads a handful of variables from the process environment itself, such as
``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED``, for the providers of this process).

Views install the bucket boundaries, allow only each instrument's closed attribute keys, and cap every metric
stream at ``cardinality_limit`` series. The SDK's own pipeline metrics (export failures: ``otel.sdk.*``) are turned
on in the export process unless ``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED`` says otherwise.

Every :class:`TelemetrySetup` exports under a Resource of its own: a ``service.instance.id`` (a random UUID) unless
``OTEL_RESOURCE_ATTRIBUTES`` or ``resource_attributes=`` pins one, so two telemetries in one process never report
the same series. A pinned identity already used by an open setup of this process is refused (:class:`ConfigError`):
reuse that setup, or shut it down first.
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
import uuid
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import (
    AlwaysOffExemplarFilter,
    AlwaysOnExemplarFilter,
    MeterProvider,
    TraceBasedExemplarFilter,
)
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    InMemoryMetricReader,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import (
    SERVICE_INSTANCE_ID,
    SERVICE_NAME,
    SERVICE_NAMESPACE,
    TELEMETRY_SDK_LANGUAGE,
    TELEMETRY_SDK_NAME,
    TELEMETRY_SDK_VERSION,
    Resource,
)
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider, sampling
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.version import __version__ as sdk_version

from otel_hicache import semconv as sc
from otel_hicache._internal.export_process import ExportProcess
from otel_hicache._internal.plan import ExportPlan
from otel_hicache.config import DEFAULT_CARDINALITY_LIMIT, ConfigError, Settings, SignalSettings, key_values, validate
from otel_hicache.telemetry import HiCacheTelemetry

DEFAULT_SERVICE_NAME = "otel-hicache"
#: The most ``TelemetrySetup.shutdown()`` (and the exit of a process that never called it) takes by default.
DEFAULT_SHUTDOWN_TIMEOUT_S = 2.0
_INTERNAL_METRICS_ENV = "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED"
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


class _Metrics(NamedTuple):
    meter_provider: MeterProvider
    memory_reader: InMemoryMetricReader | None
    prometheus_address: tuple[str, int] | None
    closers: list[Any]
    push_readers: list[MetricReader]


class _Traces(NamedTuple):
    tracer_provider: TracerProvider
    recent_spans: RecentSpans | None
    span_exporter: SpanExporter | None  # the OTLP span exporter a ``collect`` processor's owner drives itself


class TelemetrySetup:
    """What :func:`configure` built. ``shutdown()`` flushes everything within a bounded time.

    ``mode`` is ``"otlp"`` (spans and metrics of the telemetry built and exported by the export process),
    ``"embedded"``, ``"console"``, ``"prometheus"`` (in-process), ``"none"`` (both exporters ``none``: counted, exported
    nowhere) or ``"disabled"``. ``tracer_provider`` and ``meter_provider`` are this process's providers, exporting the
    same way, for your own spans and metrics (and SGLang's request spans and stat-logger series); in ``otlp`` and
    ``none`` modes each is built when first asked for (or by ``configure(set_global=True)``), from the same ``env``,
    so a process that never asks runs no exporter, processor or reader of ours; the telemetry's own spans never go
    through them there.
    """

    def __init__(
        self,
        telemetry: HiCacheTelemetry,
        mode: str,
        sides: tuple[_Metrics, _Traces] | None = None,
        app: tuple[Settings, Resource] | None = None,
    ) -> None:
        self.telemetry = telemetry
        self.mode = mode
        self._metrics: _Metrics | None = None if sides is None else sides[0]
        self._traces: _Traces | None = None if sides is None else sides[1]
        self._app = app  # what the app's providers are built from on first use (otlp and none modes)
        self._app_lock = threading.RLock()
        self._closed = False
        self._identity: tuple[Any, ...] | None = None

    @property
    def metric_reader(self) -> InMemoryMetricReader | None:
        """Embedded mode: read metrics in-process."""
        return None if self._metrics is None else self._metrics.memory_reader

    @property
    def recent_spans(self) -> RecentSpans | None:
        """Embedded mode: the latest spans."""
        return None if self._traces is None else self._traces.recent_spans

    @property
    def prometheus_address(self) -> tuple[str, int] | None:
        return None if self._metrics is None else self._metrics.prometheus_address

    @property
    def meter_provider(self) -> metrics.MeterProvider:
        return self._meter_side().meter_provider

    @property
    def tracer_provider(self) -> trace.TracerProvider:
        with self._app_lock:
            if self._traces is None:
                assert self._app is not None, "shut down"
                self._traces = _traces_side(*self._app, self._meter_side().meter_provider)
            return self._traces.tracer_provider

    def _meter_side(self) -> _Metrics:
        with self._app_lock:
            if self._metrics is None:
                assert self._app is not None, "shut down"
                self._metrics = _metrics_side(*self._app)
            return self._metrics

    def force_flush(self, timeout_s: float = 5.0) -> None:
        """Create queued spans, export them, and push metrics now.

        Only push readers are flushed: a collection on the Prometheus reader would be queued and served twice by the
        next scrape (the exporter keeps every collection until scraped).
        """
        deadline = time.monotonic() + timeout_s
        self.telemetry.flush(timeout_s)
        remaining = max(0.0, deadline - time.monotonic())
        millis = int(remaining * 1000)
        flushers: list[Any] = []
        if self._traces is not None:
            flushers.append(getattr(self._traces.tracer_provider, "force_flush", None))  # a no-op provider has none
        if self._metrics is not None:
            flushers += [r.force_flush for r in self._metrics.push_readers]
        _bounded([functools.partial(flush, millis) for flush in flushers if flush is not None], remaining)

    def shutdown(self, timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Hand the last records over and stop everything, in at most about ``timeout_s`` whatever the collector
        does (the SDK's own shutdown waits up to 30 s for a dead collector; here it is cut off)."""
        if self._closed:
            return
        self._closed = True
        if self._identity is not None:
            _IDENTITIES.pop(self._identity, None)
        deadline = time.monotonic() + timeout_s
        self.telemetry.shutdown(timeout_s * 0.6)
        with self._app_lock:
            self._app = None  # what was not built by now never is
            providers = [side[0] for side in (self._traces, self._metrics) if side is not None]
            closers = [] if self._metrics is None else list(self._metrics.closers)
        remaining = max(0.0, deadline - time.monotonic())
        jobs = [
            lambda p=provider: _shutdown_provider(p, remaining)
            for provider in providers
            if hasattr(provider, "shutdown")
        ]
        _bounded(jobs + closers, remaining)


def _shutdown_provider(provider: Any, timeout_s: float) -> None:
    try:
        provider.shutdown(timeout_millis=int(timeout_s * 1000))
    except TypeError:  # TracerProvider.shutdown() takes no timeout: _bounded cuts it off
        provider.shutdown()


def _bounded(jobs: Sequence[Any], timeout_s: float) -> bool:
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


# ---------------------------------------------------------------------- exporters and providers from Settings
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


def _otlp_span_exporter(settings: Settings, meter_provider: metrics.MeterProvider) -> SpanExporter:
    signal = settings.traces
    if signal.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpan

        return GrpcSpan(**_grpc_options(signal, settings, "traces"), meter_provider=meter_provider)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpan

    return HttpSpan(**_http_options(signal, "traces"), meter_provider=meter_provider)


def _otlp_metric_exporter(settings: Settings) -> Any:
    signal = settings.metrics
    preferences = _metric_preferences(settings)
    if signal.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetric

        return GrpcMetric(**_grpc_options(signal, settings, "metrics"), **preferences)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetric

    return HttpMetric(**_http_options(signal, "metrics"), **preferences)


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


def _build(
    settings: Settings,
    resource: Resource,
    prometheus_port: int | None = None,
    *,
    collect: SpanProcessor | None = None,
    id_generator: IdGenerator | None = None,
) -> tuple[_Metrics, _Traces]:
    """Both providers for ``settings``; with ``collect``, OTLP spans go to that processor and the exporter is handed
    back (the export process sends them itself)."""
    side = _metrics_side(settings, resource, prometheus_port)
    try:
        return side, _traces_side(settings, resource, side.meter_provider, collect=collect, id_generator=id_generator)
    except BaseException:
        _bounded(side.closers, 5.0)
        raise


def _metrics_side(settings: Settings, resource: Resource, prometheus_port: int | None = None) -> _Metrics:
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
        for kind in settings.metrics_exporters:
            if kind == "otlp":
                readers.append(PeriodicExportingMetricReader(_otlp_metric_exporter(settings), interval, timeout))
            elif kind == "console":
                readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(out=sys.stdout), interval, timeout))
            elif kind == "embedded":
                memory_reader = InMemoryMetricReader()
                readers.append(memory_reader)
        meter_provider = MeterProvider(metric_readers=readers, resource=resource,
                                       views=views(settings.cardinality_limit),
                                       exemplar_filter=_EXEMPLAR_FILTERS[settings.exemplar_filter](),
                                       shutdown_on_exit=False)  # fmt: skip
    except BaseException:
        _bounded(closers, 5.0)
        raise
    push = [r for r in readers if isinstance(r, PeriodicExportingMetricReader)]
    return _Metrics(meter_provider, memory_reader, address, closers, list(push))


def _traces_side(
    settings: Settings,
    resource: Resource,
    meter_provider: metrics.MeterProvider,
    *,
    collect: SpanProcessor | None = None,
    id_generator: IdGenerator | None = None,
) -> _Traces:
    """The tracer provider and its processors (their own metrics go to ``meter_provider``)."""
    tracer_provider = TracerProvider(sampler=_sampler(settings), resource=resource, shutdown_on_exit=False,
                                     id_generator=id_generator, span_limits=_span_limits(settings))  # fmt: skip
    batching = {
        "max_queue_size": settings.bsp_max_queue_size,
        "schedule_delay_millis": settings.bsp_schedule_delay_ms,
        "max_export_batch_size": settings.bsp_max_export_batch_size,
        "export_timeout_millis": settings.bsp_export_timeout_ms,
    }
    recent: RecentSpans | None = None
    handed_back: SpanExporter | None = None
    for kind in settings.traces_exporters:
        if kind == "otlp":
            span_exporter = _otlp_span_exporter(settings, meter_provider)
            if collect is not None:
                tracer_provider.add_span_processor(collect)
                handed_back = span_exporter
            else:
                tracer_provider.add_span_processor(
                    BatchSpanProcessor(span_exporter, **batching, meter_provider=meter_provider)
                )
        elif kind == "console":
            tracer_provider.add_span_processor(
                BatchSpanProcessor(ConsoleSpanExporter(out=sys.stdout), **batching, meter_provider=meter_provider)
            )
        elif kind == "embedded":
            recent = RecentSpans()
            tracer_provider.add_span_processor(SimpleSpanProcessor(recent))
    return _Traces(tracer_provider, recent, handed_back)


def export_providers(
    plan: ExportPlan, collect: SpanProcessor, id_generator: IdGenerator
) -> tuple[TracerProvider, MeterProvider, SpanExporter | None, Settings]:
    """The export process's providers: the host's settings (its ``OTEL_*`` variables are this process's environment,
    its arguments in ``plan``) and Resource; spans go to ``collect``, the OTLP span exporter is handed back."""
    settings = validate(os.environ, endpoint=plan.endpoint, protocol=plan.protocol,
                        cardinality_limit=plan.cardinality_limit)  # fmt: skip
    side, traces = _build(settings, Resource(plan.resource), collect=collect, id_generator=id_generator)
    return traces.tracer_provider, side.meter_provider, traces.span_exporter, settings


# ---------------------------------------------------------------------- configure()
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
    """Build a :class:`HiCacheTelemetry` and its providers from arguments, then the ``OTEL_*`` variables of ``env``
    (``os.environ`` by default; never changed).

    Arguments win over the environment. Every value is checked before anything is built: a bad one raises
    :class:`ConfigError` with no thread started and no port bound. Exporting over OTLP (and nothing in-process such as
    a Prometheus endpoint or a console exporter), the telemetry's spans and metrics are built and exported by an
    export process of its own, which exists before this returns: whatever happens to this process afterwards (an
    exit, SIGKILL), what it counted is exported. ``set_global=True`` also installs this process's providers as the OTel
    globals. ``token_metrics=False`` leaves out the instruments counted in tokens (on all but one rank of a
    tensor-parallel group: see :class:`HiCacheTelemetry`).
    """
    env = os.environ if env is None else env
    settings = validate(
        env, service_name=service_name, endpoint=endpoint, protocol=protocol, prometheus_port=prometheus_port,
        prometheus_host=prometheus_host, ranks=ranks, resource_attributes=resource_attributes, pools=pools,
        extra_pools=extra_pools, cardinality_limit=cardinality_limit, set_global=set_global,
    )  # fmt: skip
    if settings.disabled:
        noop: Any = (metrics.NoOpMeterProvider(), trace.NoOpTracerProvider())
        sides = (_Metrics(noop[0], None, None, [], []), _Traces(noop[1], None, None))
        return _without_export(pools, extra_pools, token_metrics, "disabled", sides=sides)

    resource = build_resource(service_name, ranks, resource_attributes, env)
    pinned = SERVICE_INSTANCE_ID in {**key_values(env, "OTEL_RESOURCE_ATTRIBUTES"), **(resource_attributes or {})}
    identity = _claim_identity(resource, pinned)
    kinds = {*settings.traces_exporters, *settings.metrics_exporters} - {"prometheus"}
    in_process = settings.prometheus_port is not None or bool(kinds & {"console", "embedded"})
    app = (settings, resource)
    if not in_process and kinds == {"none"}:
        setup = _without_export(pools, extra_pools, token_metrics, "none", app=app)
    elif not in_process:
        plan = ExportPlan(
            environment=_exporter_environment(env),
            resource=dict(resource.attributes),
            endpoint=endpoint,
            protocol=protocol,
            cardinality_limit=cardinality_limit,
            spans="otlp" in settings.traces_exporters,
            token_metrics=token_metrics,
        )
        consumer = functools.partial(ExportProcess, plan=plan)
        telemetry = HiCacheTelemetry(pools=pools, extra_pools=extra_pools, consumer=consumer)
        setup = TelemetrySetup(telemetry, "otlp", app=app)
    else:
        sides = _build(settings, resource, settings.prometheus_port)
        telemetry = HiCacheTelemetry(sides[1].tracer_provider, sides[0].meter_provider, pools=pools,
                                     extra_pools=extra_pools, token_metrics=token_metrics)  # fmt: skip
        mode = next((k for k in ("otlp", "embedded", "console") if k in kinds), "prometheus")
        setup = TelemetrySetup(telemetry, mode, sides)
    if identity is not None:
        setup._identity = identity
        _IDENTITIES[identity] = setup
    if set_global:
        trace.set_tracer_provider(setup.tracer_provider)
        metrics.set_meter_provider(setup.meter_provider)
    _AT_EXIT.add(setup)
    return setup


def _without_export(
    pools: Sequence[str],
    extra_pools: Sequence[str],
    token_metrics: bool,
    mode: str,
    sides: tuple[_Metrics, _Traces] | None = None,
    app: tuple[Settings, Resource] | None = None,
) -> TelemetrySetup:
    """A telemetry that counts (``snapshot()`` is exact) and builds and exports nothing."""
    telemetry = HiCacheTelemetry(trace.NoOpTracerProvider(), metrics.NoOpMeterProvider(), pools=pools,
                                 extra_pools=extra_pools, spans=False, token_metrics=token_metrics)  # fmt: skip
    return TelemetrySetup(telemetry, mode, sides, app)


def _exporter_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The ``OTEL_*`` variables the export process runs with: ``env``'s, with the SDK's own pipeline metrics on."""
    out = {key: value for key, value in env.items() if key.startswith("OTEL_")}
    out.setdefault(_INTERNAL_METRICS_ENV, "true")
    return out


#: Open setups whose ``service.instance.id`` was pinned, by (pid, namespace, name, instance id).
_IDENTITIES: weakref.WeakValueDictionary[tuple[Any, ...], TelemetrySetup] = weakref.WeakValueDictionary()


def _claim_identity(resource: Resource, pinned: bool) -> tuple[Any, ...] | None:
    """The key of a pinned identity (None for a generated one: unique by construction); ConfigError if an open setup
    of this process exports under it already."""
    if not pinned:
        return None
    attrs = resource.attributes
    identity = (os.getpid(), attrs.get(SERVICE_NAMESPACE), attrs.get(SERVICE_NAME), attrs[SERVICE_INSTANCE_ID])
    if identity in _IDENTITIES:
        raise ConfigError(
            f"service.instance.id={attrs[SERVICE_INSTANCE_ID]!r} is already the identity of an open telemetry of this "
            "process (two would report clashing series); reuse that setup, shut it down first, or leave "
            "service.instance.id unset (each telemetry then gets its own)"
        )
    return identity


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
