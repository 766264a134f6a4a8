"""Histograms from the shared table, handed to every metric reader of a meter provider.

Our histograms are aggregated by the host, exactly, in the table both processes map
(:mod:`otel_hicache._internal.shared.accumulation`): bucket counts and sums, cumulative since the table was made. The
OTel Python SDK (1.45) aggregates only the measurements it records itself and has no public way to give its readers
pre-aggregated points (no ``MetricProducer``), so this module does it at the one place every reader's collection passes
through: the collect callback a ``MeterProvider`` gives each of its readers (``MetricReader._collect``, set by
``_set_collect_callback``). :func:`attach` wraps that callback once per provider - for the readers registered now and,
through the provider's measurement consumer, for any added later (periodic OTLP readers, the Prometheus reader, the
in-memory reader of the embedded default and of the tests) - so that the ``MetricsData`` each reader receives holds our
histograms too, under our instrumentation scope and the provider's Resource. It is the package's only use of the SDK's
private attributes; the tests read every kind of reader through it, so an SDK that changes them fails there.

Each reader gets the temporality it prefers for histograms: cumulative readers the table's totals, starting at the
table's creation (the same start for a replacement exporter: the time is in the shared header); delta readers the
difference from what that reader received last. Min, max and exemplars are not reported (the table keeps neither).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics._internal.instrument import _Histogram
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricReader,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from otel_hicache import semconv as sc
from otel_hicache._internal.shared.accumulation import HistogramSeries
from otel_hicache.version import __version__

_log = logging.getLogger(__name__)

#: Min and max are optional in OTLP; the table does not keep them, and None leaves them out of the export.
_NOT_KEPT: Any = None


class Histograms(NamedTuple):
    """What a source holds now: when its table started (epoch ns) and, per histogram row, its series."""

    start_ns: int
    series: list[tuple[sc.InstrumentSpec, list[HistogramSeries]]]


Source = Callable[[], Histograms]
_Collect = Callable[..., MetricsData | None]


def attach(meter_provider: Any, source: Source) -> bool:
    """Have every reader of ``meter_provider`` receive the histograms ``source()`` returns at each collection, for as
    long as ``source`` lives (it is held weakly: a bound method of its owner). False when ``meter_provider`` is not
    the SDK's (then it has no readers of ours to feed)."""
    if not isinstance(meter_provider, MeterProvider):
        return False
    with _attach_lock:
        merger = _mergers.get(meter_provider)
        if merger is None:
            try:
                merger = _mergers[meter_provider] = _Merger(meter_provider)
            except AttributeError:  # an SDK whose internals moved: say so once, export the rest
                _log.warning("otel_hicache: this OpenTelemetry SDK cannot be given histograms; they are not exported")
                return False
        merger.add(source)
    return True


_attach_lock = threading.Lock()
_mergers: weakref.WeakKeyDictionary[MeterProvider, _Merger] = weakref.WeakKeyDictionary()


class _Merger:
    """The histograms of one provider's sources, merged into each collection of each of its readers."""

    def __init__(self, provider: MeterProvider) -> None:
        consumer = provider._measurement_consumer
        self._resource = provider._sdk_config.resource
        self._sources: list[weakref.WeakMethod[Source]] = []
        self._last: weakref.WeakKeyDictionary[MetricReader, _Delta] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        collect: _Collect = consumer.collect
        merge = self.merge

        def collect_and_merge(reader: MetricReader, timeout_millis: float = 10_000) -> MetricsData | None:
            return merge(reader, collect(reader, timeout_millis=timeout_millis))

        # A reader added later is given this one. (The SDK types the callback's second argument as a temporality; it
        # is the timeout.)
        consumer.collect = collect_and_merge  # type: ignore[method-assign,assignment]
        for reader in list(consumer._reader_storages):
            reader._set_collect_callback(collect_and_merge)  # type: ignore[arg-type]

    def add(self, source: Source) -> None:
        self._sources = [ref for ref in self._sources if ref() is not None] + [weakref.WeakMethod(source)]

    def merge(self, reader: MetricReader, data: MetricsData | None) -> MetricsData | None:
        try:
            metrics = self._metrics(reader)
        except Exception:  # never break the reader's collection of everything else
            _log.debug("otel_hicache: reading the histograms failed", exc_info=True)
            return data
        if not metrics:
            return data
        resource_metrics = list(data.resource_metrics) if data is not None else []
        if not resource_metrics:
            resource_metrics = [ResourceMetrics(self._resource, [], "")]
        first = resource_metrics[0]
        scopes = list(first.scope_metrics)
        for i, scope in enumerate(scopes):
            if scope.scope.name == sc.INSTRUMENTATION_SCOPE:
                scopes[i] = ScopeMetrics(scope.scope, [*scope.metrics, *metrics], scope.schema_url)
                break
        else:
            scopes.append(ScopeMetrics(InstrumentationScope(sc.INSTRUMENTATION_SCOPE, __version__), metrics, ""))
        resource_metrics[0] = ResourceMetrics(first.resource, scopes, first.schema_url)
        return MetricsData(resource_metrics)

    def _metrics(self, reader: MetricReader) -> list[Metric]:
        """Our histograms as ``reader`` wants them (cumulative, or the delta since its last collection)."""
        start_ns, totals = self._totals()
        now = time.time_ns()
        temporality = reader._instrument_class_temporality.get(_Histogram, AggregationTemporality.CUMULATIVE)
        delta = temporality is AggregationTemporality.DELTA
        previous: dict[tuple[str, frozenset[Any]], _Series] = {}
        if delta:
            with self._lock:
                last = self._last.get(reader)
                self._last[reader] = _Delta(now, {(spec.name, k): s for spec, ss in totals for k, s in ss.items()})
            if last is not None:
                start_ns, previous = last.time_ns, last.series
        out = []
        for spec, by_attributes in totals:
            points = []
            for key, series in by_attributes.items():
                if delta:
                    series = series.minus(previous.get((spec.name, key)))
                count = sum(series.bucket_counts)
                if not count:
                    continue
                points.append(
                    HistogramDataPoint(
                        attributes=series.attributes,
                        start_time_unix_nano=start_ns,
                        time_unix_nano=now,
                        count=count,
                        sum=series.sum,
                        bucket_counts=series.bucket_counts,
                        explicit_bounds=spec.buckets or (),
                        min=_NOT_KEPT,
                        max=_NOT_KEPT,
                    )
                )
            if points:
                data = Histogram(data_points=points, aggregation_temporality=temporality)
                out.append(Metric(name=spec.name, description=spec.description, unit=spec.unit, data=data))
        return out

    def _totals(self) -> tuple[int, list[tuple[sc.InstrumentSpec, dict[frozenset[Any], _Series]]]]:
        """Every live source's histograms, series by series (telemetries sharing a provider: summed), and the
        earliest start among them."""
        totals: dict[str, tuple[sc.InstrumentSpec, dict[frozenset[Any], _Series]]] = {}
        starts = []
        for ref in self._sources:
            source = ref()
            if source is None:
                continue
            histograms = source()
            starts.append(histograms.start_ns)
            for spec, series in histograms.series:
                by_attributes = totals.setdefault(spec.name, (spec, {}))[1]
                for one in series:
                    key = frozenset(one.attributes.items())
                    known = by_attributes.get(key)
                    by_attributes[key] = (
                        _Series(one.attributes, one.bucket_counts, one.sum) if known is None else known.plus(one)
                    )
        return min(starts, default=0), list(totals.values())


class _Series(NamedTuple):
    attributes: dict[str, Any]
    bucket_counts: tuple[int, ...]
    sum: float

    def plus(self, other: HistogramSeries) -> _Series:
        counts = tuple(a + b for a, b in zip(self.bucket_counts, other.bucket_counts, strict=True))
        return _Series(self.attributes, counts, self.sum + other.sum)

    def minus(self, earlier: _Series | None) -> _Series:
        """The difference from ``earlier``; all of this series when there is none or it is not earlier (a table that
        went away or started again)."""
        if earlier is None:
            return self
        counts = tuple(a - b for a, b in zip(self.bucket_counts, earlier.bucket_counts, strict=True))
        if min(counts) < 0:
            return self
        return _Series(self.attributes, counts, self.sum - earlier.sum)


class _Delta(NamedTuple):
    """What a delta reader received last: when, and every series' cumulative state then."""

    time_ns: int
    series: dict[tuple[str, frozenset[Any]], _Series]
