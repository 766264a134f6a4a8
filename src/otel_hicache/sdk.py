"""Provider set-up from the standard ``OTEL_*`` environment, with an embedded default.

:func:`configure` builds a :class:`HiCacheTelemetry` and what it exports through:

* **OTLP** when an endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT`` or the per-signal
  ``..._TRACES_ENDPOINT`` / ``..._METRICS_ENDPOINT``, or ``endpoint=``): the telemetry's spans and metrics are built
  and exported by its export process (:mod:`otel_hicache._internal.export.handle`); this process runs no exporter, span
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

Views allow only each instrument's closed attribute keys and cap every metric stream at ``cardinality_limit``
series; the histograms keep their rows' buckets (the host aggregates them in shared memory). The SDK's own pipeline
metrics (export failures: ``otel.sdk.*``) are turned on in the export process unless
``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED`` says otherwise.

Every :class:`TelemetrySetup` exports under a Resource of its own: a ``service.instance.id`` (a random UUID) unless
``OTEL_RESOURCE_ATTRIBUTES`` or ``resource_attributes=`` pins one, so two telemetries in one process never report
the same series. A pinned identity already used by an open setup of this process is refused (:class:`ConfigError`):
reuse that setup, or shut it down first.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, SERVICE_NAMESPACE, Resource

from otel_hicache._internal.emit.exporters import in_process
from otel_hicache._internal.emit.providers import (
    DEFAULT_SERVICE_NAME,
    MetricsSide,
    RecentSpans,
    TracesSide,
    build,
    build_resource,
    metrics_side,
    traces_side,
    views,
)
from otel_hicache._internal.emit.shutdown import bounded, shutdown_provider
from otel_hicache._internal.export.handle import ExportProcess
from otel_hicache._internal.shared.plan import ExportPlan
from otel_hicache.config import (
    DEFAULTS,
    NONE,
    Arguments,
    ConfigError,
    Settings,
    key_values,
    validate,
    without_userinfo,
)
from otel_hicache.telemetry import HiCacheTelemetry

__all__ = [
    "DEFAULT_SERVICE_NAME",
    "ConfigError",
    "RecentSpans",
    "TelemetrySetup",
    "build_resource",
    "configure",
    "views",
]

#: The most ``TelemetrySetup.shutdown()`` (and the exit of a process that never called it) takes by default.
DEFAULT_SHUTDOWN_TIMEOUT_S = 2.0
_INTERNAL_METRICS_ENV = "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED"
_log = logging.getLogger(__name__)


class TelemetrySetup:
    """What :func:`configure` built. ``shutdown()`` flushes everything within a bounded time.

    ``mode`` is ``"otlp"`` (spans and metrics of the telemetry built and exported by the export process),
    ``"embedded"``, ``"console"``, ``"prometheus"`` (in-process), ``"none"`` (both exporters ``none``: counted, exported
    nowhere) or ``"disabled"``. ``tracer_provider`` and ``meter_provider`` are this process's providers, exporting the
    same way, for your own spans and metrics (and SGLang's request spans and stat-logger series); in ``otlp`` and
    ``none`` modes each is built when first asked for (or by ``configure(set_global=True)``), from the same ``env``,
    so a process that never asks runs no exporter, processor or reader of ours; the telemetry's own spans never go
    through them there. ``endpoint`` is where the telemetry's spans go over OTLP, as messages may show it (without
    userinfo; None when not exporting over OTLP or the exporter's default endpoint is used).
    """

    def __init__(
        self,
        telemetry: HiCacheTelemetry,
        mode: str,
        sides: tuple[MetricsSide, TracesSide] | None = None,
        app: tuple[Settings, Resource] | None = None,
    ) -> None:
        self.telemetry = telemetry
        self.mode = mode
        self._metrics: MetricsSide | None = None if sides is None else sides[0]
        self._traces: TracesSide | None = None if sides is None else sides[1]
        self._app = app  # what the app's providers are built from on first use (otlp and none modes)
        self._app_lock = threading.RLock()
        self._closed = False
        self._identity: tuple[Any, ...] | None = None
        self.endpoint: str | None = None

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
                self._traces = traces_side(*self._app, self._meter_side().meter_provider)
            return self._traces.tracer_provider

    def _meter_side(self) -> MetricsSide:
        with self._app_lock:
            if self._metrics is None:
                assert self._app is not None, "shut down"
                self._metrics = metrics_side(*self._app)
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
        bounded([functools.partial(flush, millis) for flush in flushers if flush is not None], remaining)

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
            lambda p=provider: shutdown_provider(p, remaining)
            for provider in providers
            if hasattr(provider, "shutdown")
        ]
        bounded(jobs + closers, remaining)


# ---------------------------------------------------------------------- configure()
def configure(
    *,
    service_name: str | None = DEFAULTS.service_name,
    endpoint: str | None = DEFAULTS.endpoint,
    protocol: str | None = DEFAULTS.protocol,
    prometheus_port: int | None = DEFAULTS.prometheus_port,
    prometheus_host: str = DEFAULTS.prometheus_host,
    ranks: Mapping[str, int] | None = DEFAULTS.ranks,
    resource_attributes: Mapping[str, Any] | None = DEFAULTS.resource_attributes,
    pools: Sequence[str] = DEFAULTS.pools,
    extra_pools: Sequence[str] = DEFAULTS.extra_pools,
    cardinality_limit: int = DEFAULTS.cardinality_limit,
    token_metrics: bool = DEFAULTS.token_metrics,
    set_global: bool = DEFAULTS.set_global,
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
    arguments = Arguments(
        service_name=service_name,
        endpoint=endpoint,
        protocol=protocol,
        prometheus_port=prometheus_port,
        prometheus_host=prometheus_host,
        ranks=ranks,
        resource_attributes=resource_attributes,
        pools=pools,
        extra_pools=extra_pools,
        cardinality_limit=cardinality_limit,
        token_metrics=token_metrics,
        set_global=set_global,
    )
    env = os.environ if env is None else env
    settings = validate(env, arguments)
    if settings.disabled:
        noop: Any = (metrics.NoOpMeterProvider(), trace.NoOpTracerProvider())
        sides = (MetricsSide(noop[0], None, None, [], []), TracesSide(noop[1], None, []))
        return _without_export(pools, extra_pools, token_metrics, "disabled", sides=sides)

    resource = build_resource(arguments.service_name, arguments.ranks, arguments.resource_attributes, env)
    pinned = SERVICE_INSTANCE_ID in {
        **key_values(env, "OTEL_RESOURCE_ATTRIBUTES"),
        **(arguments.resource_attributes or {}),
    }
    identity = _claim_identity(resource, pinned)
    kinds = {*settings.traces_exporters, *settings.metrics_exporters}
    here = in_process(settings)
    app = (settings, resource)
    if not here and kinds == {NONE}:
        setup = _without_export(pools, extra_pools, token_metrics, "none", app=app)
    elif not here:
        plan = ExportPlan(
            environment=_exporter_environment(env),
            resource=dict(resource.attributes),
            endpoint=arguments.endpoint,
            protocol=arguments.protocol,
            cardinality_limit=arguments.cardinality_limit,
            spans=settings.traces_exporters != (NONE,),
            token_metrics=token_metrics,
        )
        consumer = functools.partial(ExportProcess, plan=plan)
        telemetry = HiCacheTelemetry(pools=pools, extra_pools=extra_pools, consumer=consumer)
        setup = TelemetrySetup(telemetry, "otlp", app=app)
    else:
        sides = build(settings, resource, settings.prometheus_port)
        telemetry = HiCacheTelemetry(
            sides[1].tracer_provider,
            sides[0].meter_provider,
            pools=pools,
            extra_pools=extra_pools,
            token_metrics=token_metrics,
        )
        mode = next((k for k in ("otlp", "embedded", "console") if k in kinds), "prometheus")
        setup = TelemetrySetup(telemetry, mode, sides)
    if "otlp" in settings.traces_exporters and settings.traces.endpoint is not None:
        setup.endpoint = without_userinfo(settings.traces.endpoint)
    if identity is not None:
        setup._identity = identity
        _IDENTITIES[identity] = setup
    if arguments.set_global:
        trace.set_tracer_provider(setup.tracer_provider)
        metrics.set_meter_provider(setup.meter_provider)
    _AT_EXIT.add(setup)
    return setup


def _without_export(
    pools: Sequence[str],
    extra_pools: Sequence[str],
    token_metrics: bool,
    mode: str,
    sides: tuple[MetricsSide, TracesSide] | None = None,
    app: tuple[Settings, Resource] | None = None,
) -> TelemetrySetup:
    """A telemetry that counts (``snapshot()`` is exact) and builds and exports nothing."""
    telemetry = HiCacheTelemetry(
        trace.NoOpTracerProvider(),
        metrics.NoOpMeterProvider(),
        pools=pools,
        extra_pools=extra_pools,
        spans=False,
        token_metrics=token_metrics,
    )
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
        bounded([lambda s=s: s.shutdown(DEFAULT_SHUTDOWN_TIMEOUT_S) for s in setups], DEFAULT_SHUTDOWN_TIMEOUT_S)


_AT_EXIT = _AtExit()
