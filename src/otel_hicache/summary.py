"""What a run did, computed from the telemetry it produced: the numbers ``otel-hicache demo`` prints.

:func:`summarize` reads the embedded set-up (:attr:`TelemetrySetup.metric_reader` and
:attr:`TelemetrySetup.recent_spans`), so the summary shows exactly what an exporter would have sent. Where a run
exported over OTLP instead (no in-process reader), the exact counters come from
:meth:`HiCacheTelemetry.snapshot` and the duration figures are left out; :class:`Delivery` then says what the
collector took (:meth:`HiCacheTelemetry.span_delivery`: spans delivered and dropped, and where they went).

    >>> from otel_hicache import configure, TransferRecord, TransferOperation, now_ns
    >>> from otel_hicache.summary import summarize
    >>> setup = configure()
    >>> t0 = now_ns()
    >>> setup.telemetry.record_transfer(TransferRecord(
    ...     operation=TransferOperation.BACKUP, tokens_by_pool={"kv": 256}, num_bytes=1 << 20,
    ...     submit_time_ns=t0, complete_time_ns=t0 + 2_000_000, copy_duration_s=0.001, timing_source="host_clock"))
    >>> s = summarize(setup)
    >>> s.bytes_by_operation["backup"], round(s.bandwidth_bytes_per_s["backup"])
    (1048576, 1048576000)
    >>> setup.shutdown()

Definitions (the same as the dashboard's and the alert rules'):

* **hit rate** of a tier: prefill tokens hit in that tier / all prefill tokens (computed + hit);
* **L2 bandwidth** of an operation: the bytes of its timed transfers / the sum of their copy durations (device-timed
  where CUDA events were available, host clock otherwise). Untimed transfers are in neither (``hicache.transfer.size``
  carries ``hicache.timing.source``, ``none`` for them);
* **p50 / p99** copy duration: exact, from the recorded spans, when they cover every timed transfer of the
  operation; otherwise estimated from the histogram buckets the way Prometheus's ``histogram_quantile`` does;
* **KV wait** p50 / p99 per tier: how long requests' prefills waited for their KV from that tier
  (``hicache.request.kv_wait``, bucket estimates; requests that waited for nothing are not in it);
* **never-reused share** of a tier: evicted tokens that served no hit while in that tier / evicted tokens whose reuse
  is known (``hicache.eviction.tokens`` by ``hicache.eviction.reused``); with the idle time of the evicted entries
  (``hicache.eviction.age``, p50 / p99), it says whether the tier is the right size;
* **wasted share** of an operation: bytes it wrote into a tier that were evicted unread (``hicache.wasted.size``) /
  all bytes it wrote (``hicache.transfer.size``);
* **load seconds per token** of an operation (``load_back``; ``storage_prefetch``, which a storage hit pays before
  its load back): the copy seconds of its timed transfers per byte, times its bytes per token (``kv`` pool) - the
  dashboard's and the recording rule's definition. Against a **recompute** cost (the prefill seconds per token the
  caller gives: the demo has no model, so it cannot measure one), ``load_vs_recompute`` is their ratio: under 1,
  loading is faster than recomputing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.metrics.export import HistogramDataPoint, MetricsData

from otel_hicache import semconv as sc
from otel_hicache.sdk import TelemetrySetup
from otel_hicache.telemetry import SpanDelivery

_HIT_MODES = {
    sc.Tier.DEVICE.value: sc.PrefillMode.DEVICE_HIT.value,
    sc.Tier.HOST.value: sc.PrefillMode.HOST_HIT.value,
    sc.Tier.STORAGE.value: sc.PrefillMode.STORAGE_HIT.value,
}


@dataclass(frozen=True)
class DurationStats:
    """Copy durations of one operation."""

    count: int
    total_s: float
    p50_s: float | None
    p99_s: float | None
    source: str  # "spans" (exact) or "histogram" (bucket estimate)
    timing_sources: tuple[str, ...] = ()  # how the copies were timed: cuda_event, host_clock


@dataclass(frozen=True)
class TierSizing:
    """Evictions from one tier."""

    evicted_tokens: int
    never_reused_tokens: int  # evicted without serving a hit while in the tier
    reuse_known_tokens: int  # evicted tokens whose producer knew whether they were reused
    never_reused_share: float | None  # never_reused_tokens / reuse_known_tokens (None: nothing known)
    age: DurationStats | None  # idle time of the evicted entries since their last use (None: not measured)


@dataclass(frozen=True)
class PoolStats:
    tier: str
    pool: str
    used: int
    limit: int

    @property
    def fraction_used(self) -> float | None:
        return self.used / self.limit if self.limit else None


@dataclass(frozen=True)
class Delivery:
    """What became of a run's spans exported from another process (the OTLP mode of :func:`configure`).

    ``exported``: taken by the collector (delivered); ``failed``: sent and not taken (unreachable, erroring or too
    slow); ``shed``: never sent, the queue full. Both of the last are dropped. ``complete``: the flush before the
    summary finished within ``waited_s``, so nothing was still in flight."""

    endpoint: str | None  # where the spans went, without userinfo (None: the exporter's default)
    exported: int
    failed: int
    shed: int
    complete: bool
    waited_s: float

    @property
    def dropped(self) -> int:
        return self.failed + self.shed


@dataclass(frozen=True)
class SizeDecision:
    """Resizing one tier by one factor in the operator's units (the recording rules ``hicache:capacity_memory_bytes``
    and ``hicache:capacity_prefill_seconds_per_second``, for the run): the memory it takes (+) or frees (-), and the
    prompt tokens per second it would serve more (+) or fewer (-), with their prefill seconds where the recompute cost
    is known."""

    tier: str
    factor: str
    memory_bytes: float  # (factor - 1) x the tier's kv capacity today x the bytes kept per kv token
    prefill_tokens_per_s: float  # (predicted share at factor - at 1x) x prompt tokens per second
    prefill_seconds_per_s: float | None  # those tokens x the prefill seconds per token (None: not given)


def size_decisions(
    summary: Summary,
    capacity: Mapping[str, Mapping[str, Any]],
    seconds: float,
    factors: Sequence[str] = ("0.5", "2", "4"),
) -> list[SizeDecision]:
    """Each tier of ``capacity`` (tier -> ``tokens`` today and ``hit_ratio`` by factor: the curve) at each of
    ``factors``, for a run of ``seconds``: its memory from the bytes its backups and load backs moved per kv token
    (every pool's bytes over the kv tokens: sidecars and state slots included, as the pools keep them), its prefill
    from the share it would gain and the run's prompt tokens per second. Nothing without such transfers or time."""
    ops = (sc.TransferOperation.BACKUP.value, sc.TransferOperation.LOAD_BACK.value)
    kv_tokens = sum(summary.tokens.get((op, "kv"), 0) for op in ops)
    if not kv_tokens or seconds <= 0:
        return []
    per_token = sum(summary.bytes_by_operation.get(op, 0) for op in ops) / kv_tokens
    prompt_rate, cost = summary.prefill_total / seconds, summary.prefill_seconds_per_token
    out = []
    for tier, curve in capacity.items():
        ratios = curve["hit_ratio"]
        for factor in factors:
            tokens = (ratios[factor] - ratios["1"]) * prompt_rate
            out.append(
                SizeDecision(
                    tier,
                    factor,
                    (float(factor) - 1) * curve["tokens"] * per_token,
                    tokens,
                    None if cost is None else tokens * cost,
                )
            )
    return out


@dataclass(frozen=True)
class Summary:
    """Everything :func:`summarize` computes. Mappings are keyed by semconv attribute values."""

    prefill_tokens: dict[str, int]  # prefill mode -> tokens
    tokens: dict[tuple[str, str], int]  # (operation, pool) -> tokens
    bytes_by_operation: dict[str, int]  # operation -> bytes (all pools)
    bytes_by_pool: dict[tuple[str, str], int]  # (operation, pool) -> bytes, where the producer split them
    bandwidth_bytes_per_s: dict[str, float]  # operation -> bytes / copy seconds
    durations: dict[str, DurationStats]  # operation -> copy durations
    drops: dict[tuple[str, str], int]  # (reason, pool) -> tokens
    failures: dict[tuple[str, str], int]  # (operation, error.type) -> transfers
    evictions: dict[str, int]  # tier -> tokens
    tier_sizing: dict[str, TierSizing]  # tier -> reuse and age of what it evicted
    kv_waits: dict[str, DurationStats]  # tier -> how long requests waited for KV from it
    wasted_bytes: dict[str, int]  # operation -> bytes it wrote that were evicted unread
    wasted_shares: dict[str, float | None]  # operation -> wasted / all bytes it wrote
    load_seconds_per_token: dict[str, float]  # load_back / storage_prefetch -> copy seconds per token
    prefill_seconds_per_token: float | None  # the recompute cost the caller gave (None: unknown)
    load_vs_recompute: dict[str, float]  # operation -> load seconds per token / prefill seconds per token
    pools: list[PoolStats]
    pipeline: dict[str, int]  # rejected / normalized / dropped_spans -> records
    spans_recorded: int  # spans the embedded store received (0 when exporting elsewhere)
    source: str  # "metric_reader" or "snapshot"
    notes: list[str] = field(default_factory=list)
    delivery: Delivery | None = None  # exported from another process: what the collector took

    @property
    def prefill_total(self) -> int:
        return sum(self.prefill_tokens.values())

    @property
    def hit_rates(self) -> dict[str, float | None]:
        """Tier -> fraction of all prefill tokens that were hits in that tier (None before any prefill)."""
        total = self.prefill_total
        return {
            tier: (self.prefill_tokens.get(mode, 0) / total if total else None) for tier, mode in _HIT_MODES.items()
        }

    @property
    def dropped_total(self) -> int:
        return sum(self.drops.values())


def summarize(
    setup: TelemetrySetup, prefill_seconds_per_token: float | None = None, delivery_wait_s: float = 5.0
) -> Summary:
    """Compute the :class:`Summary` of everything ``setup`` has recorded so far (queued records first: flushed into the
    in-process reader; when exporting elsewhere the exact counters are read, and the export process is given up to
    ``delivery_wait_s`` to send what is queued, so the delivery counts are final when the collector answers).

    ``prefill_seconds_per_token``: what recomputing a token costs on the caller's engine, to compare loads with."""
    if setup.metric_reader is not None or setup.recent_spans is not None:
        setup.telemetry.flush()
    sent, complete = setup.telemetry.span_delivery(), True
    if sent is not None:  # exported from another process: what the collector took, once what is queued was sent
        complete = setup.telemetry.flush(delivery_wait_s)
        sent = setup.telemetry.span_delivery()
    notes: list[str] = []
    histograms: dict[str, list[HistogramDataPoint]] = {}
    pools: list[PoolStats] = []
    if setup.metric_reader is not None:
        counters, histograms, pools = _read_metrics(setup.metric_reader.get_metrics_data())
        source = "metric_reader"
    else:
        counters = {
            name: {_strs(k): v for k, v in values.items()} for name, values in setup.telemetry.snapshot().items()
        }
        source = "snapshot"
        notes.append(
            "durations, bandwidth, KV waits, eviction ages and pool usage are in the exporting backend, not in this "
            "process"
        )

    tokens = {(op, pool): v for (op, pool), v in _pairs(counters.get(sc.METRIC_TRANSFER_TOKENS, {})).items()}
    bytes_by_operation: dict[str, int] = {}
    bytes_by_pool: dict[tuple[str, str], int] = {}
    timed_bytes: dict[str, int] = {}  # bytes of the transfers that have a copy duration
    for (op, pool, timing), value in counters.get(sc.METRIC_TRANSFER_SIZE, {}).items():
        bytes_by_operation[op] = bytes_by_operation.get(op, 0) + value
        if pool is not None and value:
            bytes_by_pool[(op, pool)] = bytes_by_pool.get((op, pool), 0) + value
        if timing != sc.TimingSource.NONE.value:
            timed_bytes[op] = timed_bytes.get(op, 0) + value

    spans = setup.recent_spans.spans() if setup.recent_spans is not None else []
    span_durations = _span_durations(spans)
    durations: dict[str, DurationStats] = {}
    bandwidth: dict[str, float] = {}
    for op, points in _by_attribute(histograms.get(sc.METRIC_TRANSFER_DURATION, []), sc.ATTR_OPERATION).items():
        count = sum(p.count for p in points)
        if not count:
            continue
        total_s = sum(p.sum for p in points)
        exact = span_durations.get(op, [])
        if len(exact) == count:  # the kept spans are every timed transfer: exact percentiles
            stats = DurationStats(count, total_s, _percentile(exact, 0.5), _percentile(exact, 0.99), "spans")
        else:
            merged = _merge_buckets(points)
            stats = DurationStats(
                count, total_s, _bucket_quantile(0.5, *merged), _bucket_quantile(0.99, *merged), "histogram"
            )
        timing = tuple(sorted({str((p.attributes or {}).get(sc.ATTR_TIMING_SOURCE)) for p in points if p.count}))
        durations[op] = dataclasses.replace(stats, timing_sources=timing)
        if total_s > 0:
            bandwidth[op] = timed_bytes.get(op, 0) / total_s
    load_seconds: dict[str, float] = {}
    for op in (sc.TransferOperation.LOAD_BACK.value, sc.TransferOperation.STORAGE_PREFETCH.value):
        d, tokens_moved = durations.get(op), tokens.get((op, sc.DEFAULT_POOL), 0)
        if d is not None and timed_bytes.get(op) and tokens_moved:
            load_seconds[op] = d.total_s / timed_bytes[op] * bytes_by_operation[op] / tokens_moved
    wasted = by_first(counters.get(sc.METRIC_WASTED_SIZE, {}))

    pipeline = {
        "rejected": sum(counters.get(sc.METRIC_RECORDS_REJECTED, {}).values()),
        "normalized": sum(counters.get(sc.METRIC_RECORDS_NORMALIZED, {}).values()),
        "dropped_spans": sum(counters.get(sc.METRIC_RECORDS_DROPPED, {}).values()),
    }
    return Summary(
        prefill_tokens={k[0]: v for k, v in counters.get(sc.METRIC_PREFILL_TOKENS, {}).items()},
        tokens=tokens,
        bytes_by_operation=bytes_by_operation,
        bytes_by_pool=bytes_by_pool,
        bandwidth_bytes_per_s=bandwidth,
        durations=durations,
        drops=_pairs(counters.get(sc.METRIC_DROPPED_TOKENS, {})),
        failures=_pairs(counters.get(sc.METRIC_TRANSFER_FAILURES, {})),
        evictions=by_first(counters.get(sc.METRIC_EVICTION_TOKENS, {})),
        tier_sizing=_tier_sizing(counters.get(sc.METRIC_EVICTION_TOKENS, {}), histograms.get(sc.METRIC_EVICTION_AGE)),
        kv_waits=_bucket_stats(histograms.get(sc.METRIC_REQUEST_KV_WAIT, [])),
        wasted_bytes=wasted,
        wasted_shares={
            op: n / bytes_by_operation[op] if bytes_by_operation.get(op) else None for op, n in wasted.items()
        },
        load_seconds_per_token=load_seconds,
        prefill_seconds_per_token=prefill_seconds_per_token,
        load_vs_recompute=(
            {op: seconds / prefill_seconds_per_token for op, seconds in load_seconds.items()}
            if prefill_seconds_per_token
            else {}
        ),
        pools=pools,
        pipeline=pipeline,
        spans_recorded=setup.recent_spans.total if setup.recent_spans is not None else 0,
        source=source,
        notes=notes,
        delivery=None if sent is None else _delivery(setup.endpoint, sent, counters, complete, delivery_wait_s),
    )


def _delivery(
    endpoint: str | None, sent: SpanDelivery, counters: _Counters, complete: bool, waited_s: float
) -> Delivery:
    """The export process's tally, and the spans the host shed (``records.dropped{transfer}`` holds both)."""
    dropped = counters.get(sc.METRIC_RECORDS_DROPPED, {}).get((sc.RecordKind.TRANSFER.value,), 0)
    return Delivery(endpoint, sent.exported, sent.failed, max(0, dropped - sent.failed), complete, waited_s)


# --------------------------------------------------------------------------- reading the exported data
_Counters = dict[str, dict[tuple[Any, ...], int]]

#: The attribute keys that make up each counter's key, in order (the instrument's closed attribute set).
_KEYS: dict[str, tuple[str, ...]] = {spec.name: spec.attributes for spec in sc.INSTRUMENTS}
_HISTOGRAMS = frozenset(spec.name for spec in sc.INSTRUMENTS if spec.kind == "histogram")


def _tier_sizing(
    tokens: Mapping[tuple[Any, ...], int], ages: Sequence[HistogramDataPoint] | None
) -> dict[str, TierSizing]:
    """Per tier: evicted tokens by reuse (``(tier, reused)`` keys; reused None: unknown) and the ages' percentiles."""
    by_tier: dict[str, dict[bool | None, int]] = {}
    for (tier, reused), n in tokens.items():
        by_tier.setdefault(str(tier), {})
        by_tier[str(tier)][reused] = by_tier[str(tier)].get(reused, 0) + n
    age_stats = _bucket_stats(ages or [])
    out = {}
    for tier, counts in sorted(by_tier.items()):
        never, known = counts.get(False, 0), counts.get(False, 0) + counts.get(True, 0)
        if sum(counts.values()) or tier in age_stats:
            out[tier] = TierSizing(
                sum(counts.values()), never, known, never / known if known else None, age_stats.get(tier)
            )
    return out


def _bucket_stats(points: Sequence[HistogramDataPoint]) -> dict[str, DurationStats]:
    """Per tier: count, sum and bucket-estimated p50 / p99 of a histogram recorded by ``hicache.tier``."""
    out = {}
    for tier, series in sorted(_by_attribute(points, sc.ATTR_TIER).items()):
        count = sum(p.count for p in series)
        if count:
            merged = _merge_buckets(series)
            out[tier] = DurationStats(
                count,
                sum(p.sum for p in series),
                _bucket_quantile(0.5, *merged),
                _bucket_quantile(0.99, *merged),
                "histogram",
            )
    return out


def _by_attribute(points: Iterable[HistogramDataPoint], key: str) -> dict[str, list[HistogramDataPoint]]:
    out: dict[str, list[HistogramDataPoint]] = {}
    for p in points:
        out.setdefault(str((p.attributes or {}).get(key)), []).append(p)
    return out


def _read_metrics(data: MetricsData | None) -> tuple[_Counters, dict[str, list[HistogramDataPoint]], list[PoolStats]]:
    counters: _Counters = {}
    histograms: dict[str, list[HistogramDataPoint]] = {}
    usage: dict[tuple[str, str], dict[str, int]] = {}
    limits: dict[tuple[str, str], int] = {}
    for rm in data.resource_metrics if data is not None else ():
        for sm in rm.scope_metrics:
            if sm.scope.name != sc.INSTRUMENTATION_SCOPE:
                continue
            for metric in sm.metrics:
                name, points = metric.name, list[Any](metric.data.data_points)
                if name in _HISTOGRAMS:
                    histograms.setdefault(name, []).extend(p for p in points if isinstance(p, HistogramDataPoint))
                elif name == sc.METRIC_POOL_USAGE:
                    for p in points:
                        a = p.attributes or {}
                        key = (str(a.get(sc.ATTR_TIER)), str(a.get(sc.ATTR_POOL)))
                        usage.setdefault(key, {})[str(a.get(sc.ATTR_SLOT_STATE))] = int(getattr(p, "value", 0))
                elif name == sc.METRIC_POOL_LIMIT:
                    for p in points:
                        a = p.attributes or {}
                        limits[(str(a.get(sc.ATTR_TIER)), str(a.get(sc.ATTR_POOL)))] = int(getattr(p, "value", 0))
                elif name in _KEYS and metric.data.__class__.__name__ == "Sum":
                    keys = _KEYS[name]
                    values = counters.setdefault(name, {})
                    for p in points:
                        a = p.attributes or {}
                        values[tuple(a.get(k) for k in keys)] = int(getattr(p, "value", 0))
    pools = [
        PoolStats(tier, pool, usage.get((tier, pool), {}).get(sc.SlotState.USED.value, 0), limit)
        for (tier, pool), limit in sorted(limits.items())
    ]
    return counters, histograms, pools


def _strs(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """A snapshot key with the values an exporter would send: enum members as their strings, booleans kept."""
    return tuple(part if part is None or isinstance(part, bool) else str(part) for part in key)


def by_first(values: Mapping[tuple[Any, ...], int]) -> dict[str, int]:
    """Series summed by their first attribute (eviction tokens by tier, whatever their reuse)."""
    out: dict[str, int] = {}
    for key, value in values.items():
        out[str(key[0])] = out.get(str(key[0]), 0) + value
    return out


def _pairs(values: Mapping[tuple[Any, ...], int]) -> dict[tuple[str, str], int]:
    return {(str(k[0]), str(k[1])): v for k, v in values.items() if len(k) >= 2}


def _span_durations(spans: Iterable[Any]) -> dict[str, list[float]]:
    """Copy durations of the timed transfer spans, per operation."""
    durations: dict[str, list[float]] = {}
    for span in spans:
        attrs = span.attributes or {}
        duration = attrs.get(sc.ATTR_COPY_DURATION)
        op = attrs.get(sc.ATTR_OPERATION)
        if duration is not None and op is not None:
            durations.setdefault(str(op), []).append(float(duration))
    return durations


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (a value that occurred, never an interpolation)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def _merge_buckets(points: Sequence[HistogramDataPoint]) -> tuple[Sequence[float], list[int]]:
    bounds = points[0].explicit_bounds
    counts = [0] * (len(bounds) + 1)
    for p in points:
        if list(p.explicit_bounds) != list(bounds):  # Views give every series the same buckets; be safe anyway
            continue
        for i, c in enumerate(p.bucket_counts):
            counts[i] += c
    return bounds, counts


def _bucket_quantile(q: float, bounds: Sequence[float], counts: Sequence[int]) -> float | None:
    """``histogram_quantile`` semantics: linear interpolation inside the bucket holding the rank."""
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    seen = 0
    for i, c in enumerate(counts):
        if seen + c >= rank and c > 0:
            if i == len(bounds):  # the +Inf bucket: the best statement is its lower bound
                return float(bounds[-1])
            lower = 0.0 if i == 0 else float(bounds[i - 1])
            upper = float(bounds[i])
            return lower + (upper - lower) * (rank - seen) / c
        seen += c
    return float(bounds[-1]) if bounds else None
