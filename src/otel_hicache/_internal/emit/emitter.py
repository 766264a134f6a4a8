"""The export side: OTel instruments over the table, and spans from the ring's transfers.

:class:`Emitter` is the policy half of the pipeline (the ring in :mod:`otel_hicache._internal.shared.channel` is the
mechanism, as the OTel SDK separates ``BatchProcessor`` from ``BatchSpanProcessor``). It runs wherever the records are
consumed: in the export process (:mod:`otel_hicache._internal.export.handle`, the default when exporting over OTLP) or
on a consumer thread of the host (the embedded default, and providers handed to
:class:`~otel_hicache.telemetry.HiCacheTelemetry`).

Every instrument comes from one table, :data:`otel_hicache.semconv.INSTRUMENTS`, and is read from the shared table as
its row's ``feed`` says: counters are observable counters over their exact slots, pool gauges read the last pool
reading, histograms are handed to every reader as the table holds them (:mod:`otel_hicache._internal.emit.histograms`).
Nothing a metric reports depends on this process's memory: the records only become spans. No instrument is special
here beyond what its row declares.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Link

from otel_hicache import semconv as sc
from otel_hicache._internal.emit import histograms
from otel_hicache._internal.shared.channel import ChannelCounters
from otel_hicache.records import TransferRecord
from otel_hicache.version import __version__

_log = logging.getLogger(__name__)
#: What a tier's curve rests on, by instrument: the field of its capacity reading.
_WARMTH_FIELDS = {
    sc.METRIC_CAPACITY_TOKENS: "tokens",
    sc.METRIC_CAPACITY_LOOKUPS: "lookups",
    sc.METRIC_CAPACITY_SAMPLED_PAGES: "sampled_pages",
}


class Emitter:
    """Creates the instruments on ``meter_provider``, hands it the table's histograms, and turns transfers into spans.

    ``before_collect`` runs at the start of each collection (the in-process consumer uses it to count deferred
    records and read the pool sources first, so a collection is exact). ``token_metrics=False`` leaves out the
    instruments counted in tokens (unit ``{token}``: logical flows, the same on every tensor-parallel rank), so that
    only one rank of a TP group reports them and no sum across ranks multiplies them; bytes, durations and spans are
    per rank and always reported.
    """

    def __init__(
        self,
        counters: ChannelCounters,
        tracer_provider: trace.TracerProvider | None,
        meter_provider: metrics.MeterProvider | None,
        *,
        spans: bool = True,
        token_metrics: bool = True,
        before_collect: Callable[[], None] | None = None,
    ) -> None:
        self._counters = counters
        self._tracer = trace.get_tracer(sc.INSTRUMENTATION_SCOPE, __version__, tracer_provider)
        self._spans = spans
        self._before_collect = before_collect
        meter = metrics.get_meter(sc.INSTRUMENTATION_SCOPE, __version__, meter_provider)
        self._histogram_specs = [spec for spec in sc.INSTRUMENTS if spec.kind == "histogram"]
        # the global provider may still be a proxy: then its SDK provider is looked for again at each collection
        self._global = meter_provider is None
        self._attached = histograms.attach(
            metrics.get_meter_provider() if self._global else meter_provider, self.histograms
        )
        # unbound, so that the emitter holds no reference to itself (a dropped telemetry is freed at once)
        self._observers: dict[str, Callable[[Emitter, str], list[Observation]]] = {}
        observers = {
            sc.Feed.COUNTERS: Emitter._counted,
            sc.Feed.POOL_USAGE: Emitter._usage,
            sc.Feed.POOL_LIMIT: Emitter._limit,
            sc.Feed.CAPACITY: Emitter._capacity,
            sc.Feed.CAPACITY_WARMTH: Emitter._warmth,
        }
        for spec in sc.INSTRUMENTS:
            if spec.unit == sc.UNIT_TOKEN and not token_metrics:
                continue
            if spec.kind == "histogram":
                continue  # read from the table at each collection (histograms.attach)
            self._observers[spec.name] = observers[spec.feed]
            callback = _weak_callback(self, spec.name)
            if spec.kind == "counter":
                meter.create_observable_counter(spec.name, [callback], spec.unit, spec.description)
            elif spec.kind == "observable_gauge":
                meter.create_observable_gauge(spec.name, [callback], spec.unit, spec.description)
            else:
                meter.create_observable_up_down_counter(spec.name, [callback], spec.unit, spec.description)
        #: The SDK calls the callbacks in the order the instruments were created: the first settles for all.
        self._first = next(iter(self._observers), None)

    # ------------------------------------------------------------------ metrics read at collection
    def observe(self, name: str) -> list[Observation]:
        """The points of instrument ``name`` now (the callbacks of the observable instruments)."""
        if name == self._first:
            if self._before_collect is not None:
                try:
                    self._before_collect()
                except Exception:
                    _log.debug("otel_hicache: preparing a collection failed", exc_info=True)
            if not self._attached and self._global:  # the global provider was set after this emitter was made
                self._attached = histograms.attach(metrics.get_meter_provider(), self.histograms)
        return self._observers[name](self, name)

    def histograms(self) -> histograms.Histograms:
        """Every histogram series of the table now (cumulative since the table's start)."""
        counters = self._counters
        return histograms.Histograms(
            counters.start_ns, [(spec, counters.histogram(spec.name)) for spec in self._histogram_specs]
        )

    def _counted(self, name: str) -> list[Observation]:
        return [Observation(value, attrs) for value, attrs in self._counters.observations(name)]

    def _usage(self, name: str) -> list[Observation]:
        out = []
        for tier, pool, used, limit in self._counters.pools():
            base = {sc.ATTR_TIER: tier, sc.ATTR_POOL: pool}
            out.append(Observation(used, {**base, sc.ATTR_SLOT_STATE: sc.SlotState.USED.value}))
            out.append(Observation(limit - used, {**base, sc.ATTR_SLOT_STATE: sc.SlotState.FREE.value}))
        return out

    def _limit(self, name: str) -> list[Observation]:
        return [Observation(limit, {sc.ATTR_TIER: t, sc.ATTR_POOL: p}) for t, p, _, limit in self._counters.pools()]

    def _capacity(self, name: str) -> list[Observation]:
        return [
            Observation(ratio, {sc.ATTR_TIER: tier, sc.ATTR_CAPACITY_FACTOR: factor})
            for tier, reading in self._counters.capacity()
            for factor, ratio in zip(sc.CAPACITY_FACTORS, reading.ratios, strict=True)
        ]

    def _warmth(self, name: str) -> list[Observation]:
        field = _WARMTH_FIELDS[name]
        readings = self._counters.capacity()
        return [Observation(getattr(reading, field), {sc.ATTR_TIER: tier}) for tier, reading in readings]

    # ------------------------------------------------------------------ records
    def emit(self, record: TransferRecord) -> None:
        """One span per transfer."""
        if not self._spans:
            return
        span = self._tracer.start_span(
            sc.SPAN_NAMES[record.operation],
            kind=trace.SpanKind.INTERNAL,
            start_time=record.submit_time_ns,
            links=[Link(ctx) for ctx in record.links],
            attributes=transfer_span_attributes(record),
            context=trace.set_span_in_context(trace.INVALID_SPAN),  # a transfer is a root, not a request child
        )
        span.end(end_time=record.complete_time_ns)


def _weak_callback(emitter: Emitter, name: str) -> Callable[[CallbackOptions], list[Observation]]:
    """A callback that does not keep the emitter alive: a provider outlives telemetries (the OTel API has no way to
    unregister an instrument), and a dropped telemetry must free its memory; its instruments then report nothing."""
    ref = weakref.ref(emitter)

    def callback(_options: CallbackOptions) -> list[Observation]:
        live = ref()
        return [] if live is None else live.observe(name)

    return callback


def transfer_span_attributes(record: TransferRecord) -> dict[str, Any]:
    """The attributes of a transfer span: totals, per-pool tokens and bytes, counts, timing."""
    tokens = sum(record.tokens_by_pool.values())
    attrs: dict[str, Any] = {
        sc.ATTR_OPERATION: record.operation.value,
        sc.ATTR_TOKENS: tokens,
        sc.ATTR_MERGED_OPS: record.merged_ops,
        sc.ATTR_NODES: record.node_count,
        sc.ATTR_TIMING_SOURCE: record.timing_source.value,
    }
    if record.num_bytes or not tokens:  # tokens moved in no bytes: a size the engine did not tell, not 0
        attrs[sc.ATTR_BYTES] = record.num_bytes
    for pool, n in record.tokens_by_pool.items():
        attrs[f"{sc.ATTR_POOL_TOKENS}.{pool}"] = n
    if record.bytes_by_pool is not None:
        for pool, n in record.bytes_by_pool.items():
            attrs[f"{sc.ATTR_POOL_BYTES}.{pool}"] = n
    if record.copy_duration_s is not None and not math.isnan(record.copy_duration_s):
        attrs[sc.ATTR_COPY_DURATION] = record.copy_duration_s
    if record.write_policy is not None:
        attrs[sc.ATTR_WRITE_POLICY] = record.write_policy
    if record.io_backend is not None:
        attrs[sc.ATTR_IO_BACKEND] = record.io_backend
    return attrs
