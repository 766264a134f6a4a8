"""Exporters from :class:`~otel_hicache.config.Settings`, behind one call: :func:`exporter` makes the exporter (or, for
metrics, possibly a reader) one name of ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` means, for the providers
(:mod:`.providers`) of ``configure()`` and of the export process alike.

Exporters are chosen the SDK's way (``opentelemetry.sdk._configuration``): each name is an entry point of the group
``opentelemetry_traces_exporter`` / ``opentelemetry_metrics_exporter`` (``otlp`` is ``otlp_proto_grpc`` or
``otlp_proto_http``, by the signal's protocol); a metrics entry point may be a push exporter (read by a periodic
reader) or a reader itself. :data:`EXPORTERS` holds the arguments of those built from the checked settings
(``configure(env=...)``, never the process environment) and says which must run in this process (:func:`in_process`);
any other installed exporter is built with no arguments (it reads its own variables), as ``opentelemetry-instrument``
builds it, and runs where OTLP runs. Adding an exporter is installing its entry point, plus one entry in
:data:`EXPORTERS` when it takes settings or writes to this process. ``prometheus`` (:data:`PROMETHEUS`) is the scrape
endpoint ``configure()`` serves itself (:attr:`~otel_hicache.config.Settings.prometheus_port`), with the reader and
server :func:`prometheus_reader` makes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NamedTuple

from opentelemetry import metrics
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation

from otel_hicache.config import EMBEDDED, METRICS_GROUP, TRACES_GROUP, ConfigError, Settings, SignalSettings


class ExporterKind(NamedTuple):
    """How :func:`exporter` makes one exporter an entry point names: ``arguments(settings, meter_provider)`` are the
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
PROMETHEUS = "prometheus"  # the scrape endpoint configure() serves itself, on Settings.prometheus_port


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


def exporter(group: str, name: str, signal: SignalSettings, settings: Settings, meter_provider: Any) -> Any:
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


def prometheus_reader(host: str, port: int) -> tuple[tuple[str, int], MetricReader, Any]:
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
