"""The table's histograms reach every reader of a provider (``_internal.emit.histograms``), as each reader wants them.

Cumulative readers get the totals since the table's start (one start time, whichever collection); delta readers the
difference from what they received last; a reader added to the provider later gets them too; the rest of a
collection is untouched.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, Histogram, InMemoryMetricReader

from otel_hicache import semconv as sc
from otel_hicache.records import KvWait
from otel_hicache.sdk import views
from otel_hicache.semconv import Tier
from otel_hicache.telemetry import HiCacheTelemetry


def waits(reader: InMemoryMetricReader) -> Any:
    """The one point of ``hicache.request.kv_wait{tier=host}`` this collection of ``reader`` holds, or None."""
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == sc.METRIC_REQUEST_KV_WAIT:
                    assert sm.scope.name == sc.INSTRUMENTATION_SCOPE and isinstance(metric.data, Histogram)
                    (point,) = metric.data.data_points
                    return metric.data.aggregation_temporality, point
    return None


def test_cumulative_and_delta_readers_each_get_the_table_their_way_and_a_later_reader_too() -> None:
    cumulative = InMemoryMetricReader()
    delta = InMemoryMetricReader(preferred_temporality={HistogramInstrument: AggregationTemporality.DELTA})
    provider = MeterProvider(metric_readers=[cumulative, delta], views=views())
    telemetry = HiCacheTelemetry(None, provider)
    try:
        for seconds in (0.002, 0.03):
            telemetry.record_kv_wait(KvWait(Tier.HOST, seconds, 1))
        first_c, first_d = waits(cumulative), waits(delta)
        telemetry.record_kv_wait(KvWait(Tier.HOST, 0.5, 1))
        second_c, second_d = waits(cumulative), waits(delta)

        assert first_c[0] is second_c[0] is AggregationTemporality.CUMULATIVE
        assert (first_c[1].count, first_c[1].sum, second_c[1].count, second_c[1].sum) == (2, 0.032, 3, 0.532)
        assert first_c[1].start_time_unix_nano == second_c[1].start_time_unix_nano  # the table's start
        assert first_d[0] is second_d[0] is AggregationTemporality.DELTA
        assert (first_d[1].count, second_d[1].count, second_d[1].sum) == (2, 1, 0.532 - 0.032)
        assert second_d[1].start_time_unix_nano == first_d[1].time_unix_nano  # since the last collection
        assert waits(delta) is None  # nothing new: no point

        later = InMemoryMetricReader()
        provider.add_metric_reader(later)
        assert waits(later)[1].count == 3
        data = cumulative.get_metrics_data()
        assert data is not None
        names = {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
        assert {sc.METRIC_TRANSFER_TOKENS, sc.METRIC_REQUEST_KV_WAIT} <= names  # counters and histograms together
        assert sc.METRIC_TRANSFER_DURATION not in names  # no transfer was timed: no series
    finally:
        telemetry.shutdown()
        provider.shutdown()
