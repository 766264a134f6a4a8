"""Exact accumulation: every counter series, pool gauge and histogram series in a fixed table of 8-byte slots.

The attribute values are closed sets (operations, pools, reasons, ...), so every series an instrument can ever have is
known up front and gets its slots: the table's layout is derived from :data:`otel_hicache.semconv.INSTRUMENTS` and the
pool list alone, and the host and the export process compute the same layout from the same pools. A counter series is
one int64; a histogram series is a block: its sum (a float64, added in the order the host recorded the values) and one
int64 count per bucket of its row (the OTel SDK's explicit-bucket rule: bucket ``i`` holds ``bounds[i-1] < v <=
bounds[i]``); its count is the buckets' sum, so a reader never sees a count its buckets disagree with. Min and max are
not kept. The table lives in memory both can see (:mod:`otel_hicache._internal.shared.channel`): the host adds into it
under its lock, the exporter reads it at each collection, and what the host counted is there to export even after the
host or the exporter was SIGKILLed.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from otel_hicache import semconv as sc

Key = tuple[Any, ...]  # attribute values in the instrument's attribute order; None = attribute absent

#: Gauge slots per (tier, pool): used, limit, and whether any source reported the pool in the last reading.
GAUGE_USED, GAUGE_LIMIT, GAUGE_PRESENT = 0, 1, 2
_GAUGE_WIDTH = 3
#: Capacity slots per tier: whether a curve is reported, today's capacity in tokens, the lookups and sampled pages
#: behind it, then the predicted hit ratio at each factor of ``semconv.CAPACITY_FACTORS``, in parts per
#: :data:`RATIO_SCALE` (the table holds integers).
CAPACITY_PRESENT, CAPACITY_TOKENS, CAPACITY_LOOKUPS, CAPACITY_SAMPLED, CAPACITY_RATIOS = 0, 1, 2, 3, 4
_CAPACITY_WIDTH = CAPACITY_RATIOS + len(sc.CAPACITY_FACTORS)
RATIO_SCALE = 1_000_000_000


class CapacityReading(NamedTuple):
    """One tier's curve as the table holds it: capacity today, its warmth, and the ratio per factor (in the order of
    ``semconv.CAPACITY_FACTORS``)."""

    tokens: int
    lookups: int
    sampled_pages: int
    ratios: Sequence[float]

    @classmethod
    def of(cls, curve: Any) -> CapacityReading:
        """From a :class:`~otel_hicache.capacity.TierCurve`."""
        return cls(curve.tokens, curve.lookups, curve.sampled_pages, [curve.hit_ratio[f] for f in sc.CAPACITY_FACTORS])


#: A histogram series' block: the sum at its first slot, the bucket counts from the next one on.
HISTOGRAM_SUM, HISTOGRAM_BUCKETS = 0, 1


def _domains(pools: Sequence[str]) -> dict[str, tuple[Any, ...]]:
    """The closed values of every attribute a series key holds, in a fixed order."""
    return {
        sc.ATTR_OPERATION: tuple(op.value for op in sc.TransferOperation),
        sc.ATTR_POOL: tuple(pools),
        sc.ATTR_TIMING_SOURCE: tuple(t.value for t in sc.TimingSource),
        sc.ATTR_ERROR_TYPE: (*sorted(sc.TRANSFER_ERRORS), sc.OTHER_ERROR),
        sc.ATTR_DROP_REASON: tuple(r.value for r in sc.DropReason),
        sc.ATTR_TIER: tuple(t.value for t in sc.Tier),
        sc.ATTR_EVICTION_REUSED: (True, False),
        sc.ATTR_PREFILL_MODE: tuple(m.value for m in sc.PrefillMode),
        sc.ATTR_RECORD_KIND: tuple(k.value for k in sc.RecordKind),
        sc.ATTR_PROBLEM: tuple(p.value for p in sc.Problem),
        sc.ATTR_INSTRUMENT: tuple(spec.name for spec in sc.INSTRUMENTS),
        sc.ATTR_SLOT_STATE: tuple(state.value for state in sc.SlotState),
        sc.ATTR_CAPACITY_FACTOR: sc.CAPACITY_FACTORS,
    }


class Layout:
    """Where each series lives: ``slots[metric][key]`` is an index into the int64 table.

    ``pools`` is every pool name a record may carry after validation (``other`` included), in a fixed order;
    ``seed_pools`` are the pools whose series are reported at 0 from the start. Each counter of
    :data:`~otel_hicache.semconv.INSTRUMENTS` gets a slot per combination of its attributes' values (None too for an
    attribute its row says is ``optional``); its row's ``seeds`` say which series are reported before they count.
    ``domains`` are the closed values of each attribute.
    """

    def __init__(self, pools: Sequence[str], seed_pools: Sequence[str], first_slot: int = 0) -> None:
        self.pools = tuple(pools)
        self.seed_pools = tuple(p for p in seed_pools if p in self.pools)
        self.domains = domains = _domains(self.pools)
        self.specs = {spec.name: spec for spec in sc.INSTRUMENTS if spec.feed is sc.Feed.COUNTERS}
        self.slots: dict[str, dict[Key, int]] = {}
        self.seeded: dict[str, frozenset[Key]] = {}
        slot = first_slot
        for name, spec in self.specs.items():
            values = [(None, *domains[a]) if a in spec.optional else domains[a] for a in spec.attributes]
            table = {}
            for key in itertools.product(*values):
                table[key] = slot
                slot += 1
            self.slots[name] = table
            seeds = [self.seed_pools if seed is sc.SEED_POOLS else seed for seed in spec.seeds]
            self.seeded[name] = frozenset(itertools.product(*seeds)) if seeds else frozenset()
        self.gauge_base = slot
        self.tiers = domains[sc.ATTR_TIER]
        self.gauges = {
            (tier, pool): slot + i * _GAUGE_WIDTH
            for i, (tier, pool) in enumerate(itertools.product(self.tiers, self.pools))
        }
        slot += len(self.gauges) * _GAUGE_WIDTH
        #: Histograms: ``histograms[name][key]`` is the first slot of the series' block (:data:`HISTOGRAM_SUM`, then
        #: the bucket counts from :data:`HISTOGRAM_BUCKETS` on); ``bounds[name]`` the row's bucket boundaries.
        self.histogram_specs = {spec.name: spec for spec in sc.INSTRUMENTS if spec.kind == "histogram"}
        self.histograms: dict[str, dict[Key, int]] = {}
        self.bounds: dict[str, tuple[float, ...]] = {}
        for name, spec in self.histogram_specs.items():
            bounds = self.bounds[name] = tuple(spec.buckets or ())
            table = {}
            for key in itertools.product(*(domains[a] for a in spec.attributes)):
                table[key] = slot
                slot += HISTOGRAM_BUCKETS + len(bounds) + 1
            self.histograms[name] = table
        self.end = slot
        # the capacity curve per tier, after everything else
        self.capacity = {tier: self.end + i * _CAPACITY_WIDTH for i, tier in enumerate(self.tiers)}
        self.end += len(self.capacity) * _CAPACITY_WIDTH

    def attributes(self, name: str, key: Key) -> dict[str, Any]:
        spec = self.specs.get(name) or self.histogram_specs[name]
        return {attr: value for attr, value in zip(spec.attributes, key, strict=True) if value is not None}

    def bucket_counts(self, name: str, values: Sequence[float]) -> list[int]:
        """How many of ``values`` fall in each bucket of histogram ``name`` (to add to a series in one go)."""
        bounds = self.bounds[name]
        counts = [0] * (len(bounds) + 1)
        for value in values:
            counts[bisect_left(bounds, value)] += 1
        return counts


@dataclass(frozen=True)
class HistogramSeries:
    """One histogram series as the table holds it now: its attributes, bucket counts, count and sum."""

    attributes: dict[str, Any]
    bucket_counts: tuple[int, ...]
    count: int
    sum: float


class Counters:
    """Reads and writes the table through an int64 and a float64 memoryview of the same memory (``ints``,
    ``floats``) that :class:`Layout` indexes."""

    def __init__(self, layout: Layout, ints: memoryview, floats: memoryview[float]) -> None:
        self.layout = layout
        self.ints = ints
        self.floats = floats
        self._attributes: dict[tuple[str, Key], dict[str, Any]] = {}

    def values(self, name: str) -> dict[Key, int]:
        """Every series of ``name`` that is non-zero or pre-seeded."""
        ints, seeded = self.ints, self.layout.seeded[name]
        return {key: ints[slot] for key, slot in self.layout.slots[name].items() if ints[slot] or key in seeded}

    def observations(self, name: str) -> list[tuple[int, dict[str, Any]]]:
        return [(value, self._attributes_of(name, key)) for key, value in self.values(name).items()]

    def histogram(self, name: str) -> list[HistogramSeries]:
        """Every series of histogram ``name`` that has counted something, cumulative since the table's start."""
        ints, floats, width = self.ints, self.floats, len(self.layout.bounds[name]) + 1
        out = []
        for key, base in self.layout.histograms[name].items():
            first = base + HISTOGRAM_BUCKETS
            counts = tuple(ints[first : first + width])
            total = sum(counts)
            if total:
                out.append(HistogramSeries(self._attributes_of(name, key), counts, total, floats[base + HISTOGRAM_SUM]))
        return out

    def _attributes_of(self, name: str, key: Key) -> dict[str, Any]:
        attrs = self._attributes.get((name, key))
        if attrs is None:
            attrs = self._attributes[(name, key)] = self.layout.attributes(name, key)
        return attrs

    def snapshot(self) -> dict[str, dict[Key, int]]:
        return {name: self.values(name) for name in self.layout.specs}

    # ------------------------------------------------------------------ pool gauges
    def set_pools(self, readings: dict[tuple[str, str], tuple[int, int]]) -> None:
        """Replace the pool gauges with one complete reading: ``(tier, pool) -> (used, limit)``."""
        ints = self.ints
        for key, base in self.layout.gauges.items():
            used, limit = readings.get(key, (0, 0))
            ints[base + GAUGE_USED], ints[base + GAUGE_LIMIT] = used, limit
            ints[base + GAUGE_PRESENT] = key in readings

    def pools(self) -> list[tuple[str, str, int, int]]:
        """``(tier, pool, used, limit)`` of every pool in the last reading."""
        ints = self.ints
        return [
            (tier, pool, ints[base + GAUGE_USED], ints[base + GAUGE_LIMIT])
            for (tier, pool), base in self.layout.gauges.items()
            if ints[base + GAUGE_PRESENT]
        ]

    # ------------------------------------------------------------------ capacity curves
    def set_capacity(self, curves: Mapping[str, CapacityReading]) -> None:
        """Replace the capacity block with one complete reading by tier."""
        ints = self.ints
        for tier, base in self.layout.capacity.items():
            tokens, lookups, sampled, ratios = curves.get(tier, (0, 0, 0, ()))
            ints[base + CAPACITY_TOKENS] = tokens
            ints[base + CAPACITY_LOOKUPS] = lookups
            ints[base + CAPACITY_SAMPLED] = sampled
            for i in range(len(sc.CAPACITY_FACTORS)):
                ints[base + CAPACITY_RATIOS + i] = round(ratios[i] * RATIO_SCALE) if i < len(ratios) else 0
            ints[base + CAPACITY_PRESENT] = tier in curves

    def capacity(self) -> list[tuple[str, CapacityReading]]:
        """``(tier, reading)`` of every tier in the last reading."""
        ints = self.ints
        return [
            (
                tier,
                CapacityReading(
                    ints[base + CAPACITY_TOKENS],
                    ints[base + CAPACITY_LOOKUPS],
                    ints[base + CAPACITY_SAMPLED],
                    [ints[base + CAPACITY_RATIOS + i] / RATIO_SCALE for i in range(len(sc.CAPACITY_FACTORS))],
                ),
            )
            for tier, base in self.layout.capacity.items()
            if ints[base + CAPACITY_PRESENT]
        ]
