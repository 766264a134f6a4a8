"""OTel-backed metric classes for SGLang's ``stat_loggers`` hook.

SGLang's ``*MetricsCollector`` classes build every ``sglang:*`` series through the class attributes
``_counter_cls`` / ``_gauge_cls`` / ``_histogram_cls`` / ``_summary_cls`` (``None`` = prometheus_client), and
``resolve_collector_class(role, default)`` picks a collector subclass from ``ServerArgs.stat_loggers``. The classes
here keep SGLang's prometheus_client series exactly as they are (SGLang's ``/metrics`` endpoint is unchanged) and
*also* send each update to an OpenTelemetry instrument, so the same series flow over OTLP.

Naming: ``sglang:evicted_tokens_total`` becomes the OTel instrument ``sglang.evicted_tokens`` (``:`` is not allowed
in an OTel name; a counter's ``_total`` is dropped because exporters add it back). Labels are SGLang's labels.

No double counting: the ``sglang:*`` series listed in :data:`.semconv.SGLANG_SERIES` are exported by
the instrumentor's own ``hicache.*`` instruments (from the wrappers), so their OTel side is not created here unless
``include_hicache_series=True`` (use that only without the instrumentor's wrappers). Their prometheus_client side
always stays.

State: each :class:`OTelStatLoggers` binds its own metric classes to its own meter, so two of them (say, two
instrumented set-ups with different meter providers) never share one; nothing is kept at module level.

Use without the instrumentor (embedded engine)::

    from otel_hicache.integrations.sglang.stat_loggers import build_otel_stat_loggers
    server_args = ServerArgs(..., stat_loggers=build_otel_stat_loggers())
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry import metrics

from otel_hicache.integrations.sglang.semconv import SGLANG_SERIES
from otel_hicache.version import __version__

#: The stat-logger roles these classes serve.
ROLES: tuple[str, ...] = ("scheduler", "storage", "radix_cache")
METER_NAME = "otel_hicache.sglang"

#: ``sglang:*`` metric names whose quantity the instrumentor's wrappers already export as ``hicache.*``.
HICACHE_SERIES: frozenset[str] = frozenset(name.split("{", 1)[0] for name, _ in SGLANG_SERIES)


def otel_name(prometheus_name: str, counter: bool = False) -> str:
    """``sglang:hicache_backup_tokens_total`` -> ``sglang.hicache_backup_tokens`` (counter)."""
    name = prometheus_name.replace(":", ".", 1)
    name = re.sub(r"[^A-Za-z0-9_./-]", "_", name)
    if counter and name.endswith("_total"):
        name = name[: -len("_total")]
    return name


class _Metric(ABC):
    """prometheus_client's API surface (``labels`` + the kind's update method) over both backends."""

    #: Set on the subclasses :class:`OTelStatLoggers` creates: the meter the OTel side reports through.
    _meter: metrics.Meter
    _include_hicache_series = False

    def __init__(self, name: str, documentation: str = "", labelnames: Iterable[str] = (), **kwargs: Any) -> None:
        self._labelnames = tuple(labelnames)
        self._prom = self._prometheus(name, documentation, self._labelnames, **kwargs)
        self._otel = None
        if self._include_hicache_series or name not in HICACHE_SERIES:
            self._otel = self._instrument(name, documentation or "", **kwargs)
        self._attributes: dict[str, str] = {}

    @abstractmethod
    def _prometheus(self, name: str, documentation: str, labelnames: Sequence[str], **kwargs: Any) -> Any:
        """SGLang's own prometheus_client metric of this kind."""

    @abstractmethod
    def _instrument(self, name: str, description: str, **kwargs: Any) -> Any:
        """The OTel instrument of this kind."""

    def labels(self, *values: Any, **labels: Any) -> _Metric:
        child = object.__new__(type(self))
        child._labelnames = self._labelnames
        child._prom = self._prom.labels(*values, **labels)
        child._otel = self._otel
        if values:
            labels = dict(zip(self._labelnames, values, strict=False))
        child._attributes = {str(k): str(v) for k, v in labels.items()}
        return child


class OTelCounter(_Metric):
    """``prometheus_client.Counter`` that also adds to an OTel ``Counter``."""

    def _prometheus(self, name: str, documentation: str, labelnames: Sequence[str], **kwargs: Any) -> Any:
        from prometheus_client import Counter

        return Counter(name, documentation, labelnames, **kwargs)

    def _instrument(self, name: str, description: str, **kwargs: Any) -> Any:
        return self._meter.create_counter(otel_name(name, counter=True), description=description)

    def inc(self, amount: float = 1) -> None:
        self._prom.inc(amount)
        if self._otel is not None and amount:
            self._otel.add(amount, self._attributes)


class OTelGauge(_Metric):
    """``prometheus_client.Gauge`` that also sets an OTel synchronous ``Gauge`` (last value wins)."""

    def _prometheus(self, name: str, documentation: str, labelnames: Sequence[str], **kwargs: Any) -> Any:
        from prometheus_client import Gauge

        return Gauge(name, documentation, labelnames, **kwargs)

    def _instrument(self, name: str, description: str, **kwargs: Any) -> Any:
        return self._meter.create_gauge(otel_name(name), description=description)

    def set(self, value: float) -> None:
        self._prom.set(value)
        if self._otel is not None:
            self._otel.set(value, self._attributes)

    def inc(self, amount: float = 1) -> None:
        self._prom.inc(amount)
        self._sync()

    def dec(self, amount: float = 1) -> None:
        self._prom.dec(amount)
        self._sync()

    def set_to_current_time(self) -> None:
        self._prom.set_to_current_time()
        self._sync()

    def _sync(self) -> None:
        if self._otel is not None:  # relative updates: report the value prometheus_client now holds
            self._otel.set(self._prom._value.get(), self._attributes)


class OTelHistogram(_Metric):
    """``prometheus_client.Histogram`` that also records into an OTel ``Histogram`` with the same buckets."""

    def _prometheus(self, name: str, documentation: str, labelnames: Sequence[str], **kwargs: Any) -> Any:
        from prometheus_client import Histogram

        return Histogram(name, documentation, labelnames, **kwargs)

    def _instrument(self, name: str, description: str, **kwargs: Any) -> Any:
        buckets = kwargs.get("buckets")
        advisory = [float(b) for b in buckets if b != float("inf")] if buckets else None
        return self._meter.create_histogram(
            otel_name(name), description=description, explicit_bucket_boundaries_advisory=advisory
        )

    def observe(self, amount: float, *args: Any, **kwargs: Any) -> None:
        self._prom.observe(amount, *args, **kwargs)
        if self._otel is not None:
            self._otel.record(amount, self._attributes)


class OTelSummary(OTelHistogram):
    """``prometheus_client.Summary`` that also records into an OTel ``Histogram`` (OTel has no summary)."""

    def _prometheus(self, name: str, documentation: str, labelnames: Sequence[str], **kwargs: Any) -> Any:
        from prometheus_client import Summary

        return Summary(name, documentation, labelnames, **kwargs)


class OTelStatLoggers:
    """SGLang's collector classes for the ``scheduler``, ``storage`` and ``radix_cache`` roles, with every series
    also sent to ``meter_provider`` (the global provider when ``None``)."""

    def __init__(
        self, meter_provider: metrics.MeterProvider | None = None, include_hicache_series: bool = False
    ) -> None:
        meter = metrics.get_meter(METER_NAME, __version__, meter_provider)
        bound = {"_meter": meter, "_include_hicache_series": include_hicache_series}
        #: SGLang's metric-class attributes (``_counter_cls``, ...) -> our classes, bound to this meter provider.
        self.metric_classes = {
            attribute: type(cls.__name__, (cls,), {**bound, "__module__": __name__})
            for attribute, cls in (
                ("_counter_cls", OTelCounter),
                ("_gauge_cls", OTelGauge),
                ("_histogram_cls", OTelHistogram),
                ("_summary_cls", OTelSummary),
            )
        }
        self._collectors: dict[str, type] | None = None

    def collector_classes(self) -> dict[str, type]:
        """Role -> an OTel-backed subclass of SGLang's collector for that role (imports SGLang on first use)."""
        if self._collectors is None:
            from sglang.srt.observability.metrics_collector import (
                RadixCacheMetricsCollector,
                SchedulerMetricsCollector,
                StorageMetricsCollector,
            )

            def otel_subclass(base: type) -> type:
                namespace = {
                    "__module__": __name__,
                    "__doc__": f"``{base.__name__}`` whose series also flow over OpenTelemetry.",
                    **self.metric_classes,
                }
                return type(f"OTel{base.__name__}", (base,), namespace)

            self._collectors = {
                "scheduler": otel_subclass(SchedulerMetricsCollector),
                "storage": otel_subclass(StorageMetricsCollector),
                "radix_cache": otel_subclass(RadixCacheMetricsCollector),
            }
        return self._collectors

    def resolve_collector_class(
        self, wrapped: Callable[..., type], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> type:
        """Wrapper for SGLang's ``resolve_collector_class``: where the user registered nothing for one of our roles,
        hand out the OTel-backed subclass of SGLang's default; a user's own class always wins."""
        cls = wrapped(*args, **kwargs)
        try:
            role, default = _resolve_arguments(*args, **kwargs)
            if cls is default and role in ROLES:
                otel_cls = self.collector_classes()[role]
                if issubclass(otel_cls, default):
                    return otel_cls
        except Exception:  # never break SGLang's start-up over telemetry
            pass
        return cls


def build_otel_stat_loggers(
    meter_provider: metrics.MeterProvider | None = None, include_hicache_series: bool = False
) -> dict[str, type]:
    """The ``ServerArgs.stat_loggers`` map for the ``scheduler``, ``storage`` and ``radix_cache`` roles."""
    return dict(OTelStatLoggers(meter_provider, include_hicache_series).collector_classes())


def _resolve_arguments(role: str, default_cls: type) -> tuple[str, type]:
    return role, default_cls
