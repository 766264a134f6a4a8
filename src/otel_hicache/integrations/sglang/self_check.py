"""The engine self-check: our counts against SGLang's own radix-cache collector in the same process.

:class:`CountersCheck` is an engine check (:meth:`~otel_hicache.telemetry.HiCacheTelemetry.add_engine_check`) the
hooks start at ``init_hicache`` where SGLang keeps its collector (``--enable-metrics``); it runs on the telemetry's
host thread, never on SGLang's.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from typing import Any

from otel_hicache.integrations._patching import AdapterSwitch
from otel_hicache.semconv import (
    METRIC_DROPPED_TOKENS,
    METRIC_EVICTION_TOKENS,
    METRIC_TRANSFER_SIZE,
    METRIC_TRANSFER_TOKENS,
    Tier,
    TransferOperation,
)
from otel_hicache.telemetry import HiCacheTelemetry

#: How long a difference between SGLang's count and ours must last to be real: our record of an ack is counted on
#: the telemetry's host thread within a tick (50 ms) of the ack leaving its queue, and SGLang counts right after it
#: left; a difference that outlasts both is an ack one of us never counted.
CHECK_LAG_S = 1.0
#: What the self-check compares: our instrument, the part of it (by its first attribute value), and the attribute of
#: SGLang's ``RadixCacheMetricsCollector`` counting the same (summed over its pools / reasons).
_COMPARED: tuple[tuple[str, str | None, str], ...] = (
    (METRIC_TRANSFER_TOKENS, TransferOperation.BACKUP.value, "backup_num_tokens"),
    (METRIC_TRANSFER_TOKENS, TransferOperation.LOAD_BACK.value, "load_back_num_tokens"),
    (METRIC_TRANSFER_SIZE, TransferOperation.BACKUP.value, "backup_num_bytes"),
    (METRIC_TRANSFER_SIZE, TransferOperation.LOAD_BACK.value, "load_back_num_bytes"),
    (METRIC_EVICTION_TOKENS, Tier.DEVICE.value, "eviction_num_tokens"),
    (METRIC_DROPPED_TOKENS, None, "hicache_dropped_tokens"),
)
_Sample = tuple[float, tuple[float, ...], tuple[float, ...]]  # (monotonic time, ours, SGLang's)


class SelfCheck:
    """The one :class:`CountersCheck` of a set of hooks: compared while every cache reporting through them counts
    into one SGLang collector; a cache without one (or with another) ends the comparison for good."""

    def __init__(self, switch: AdapterSwitch) -> None:
        self._switch = switch  # the adapter's: an untested release's mismatch turns it off
        self._check: CountersCheck | None = None
        self._incomparable = False  # a cache counts into no collector, or into another: no self-check

    def add(self, telemetry: HiCacheTelemetry, cache: Any) -> None:
        """``cache`` reports through ``telemetry`` (after its ``init_hicache``)."""
        collector = getattr(cache, "metrics_collector", None)
        check = self._check
        if check is None and collector is not None and not self._incomparable:
            self._check = check = CountersCheck(telemetry, collector)
            telemetry.add_engine_check(check, self._switch.mismatched)
        if check is not None and check.collector is collector:
            check.caches.add(cache)
            return
        self._incomparable = True
        self.end()

    def end(self) -> None:
        check, self._check = self._check, None
        if check is not None:
            check.telemetry.remove_engine_check(check)


class CountersCheck:
    """Our backup and load-back tokens and bytes, evicted and dropped tokens against SGLang's radix-cache collector
    in this process, counted from when the check began. A difference is real when ours is below what SGLang had
    counted :data:`CHECK_LAG_S` earlier, or was above what SGLang holds now that long after: each such finding is
    reported once (the comparison then starts again from there). Quantities SGLang's collector does not have are
    skipped."""

    def __init__(self, telemetry: HiCacheTelemetry, collector: Any) -> None:
        self.telemetry = telemetry
        self.collector = collector
        self.caches: weakref.WeakSet[Any] = weakref.WeakSet()  # while one lives, its counts go to the collector
        self._samples: deque[_Sample] = deque(maxlen=64)
        self._base = self._read()

    def __call__(self) -> list[str]:
        if not self.caches:  # every cache went away
            self.telemetry.remove_engine_check(self)
            return []
        now = time.monotonic()
        ours, theirs = self._read()
        ours = tuple(n - b for n, b in zip(ours, self._base[0], strict=True))
        theirs = tuple(n - b for n, b in zip(theirs, self._base[1], strict=True))
        samples = self._samples
        samples.append((now, ours, theirs))
        while len(samples) > 1 and now - samples[1][0] >= CHECK_LAG_S:
            samples.popleft()
        then, ours_then, theirs_then = samples[0]
        if now - then < CHECK_LAG_S:
            return []
        mismatched = {
            name
            for (name, _, _), *counts in zip(_COMPARED, ours, theirs, ours_then, theirs_then, strict=True)
            if counts[0] < counts[3] or counts[2] > counts[1]
        }
        if mismatched:  # reported once: compare from here on
            self._base = self._read()
            samples.clear()
        return sorted(mismatched)

    def _read(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        snapshot = self.telemetry.snapshot()
        ours, theirs = [], []
        for name, part, attribute in _COMPARED:
            ours.append(sum(n for key, n in snapshot.get(name, {}).items() if part is None or key[0] == part))
            theirs.append(_sglang_total(self.collector, attribute))
        return tuple(ours), tuple(theirs)


def _sglang_total(collector: Any, attribute: str) -> float:
    """The total of one of SGLang's counters (its samples of this collector's labels); 0 where it has none."""
    metric = getattr(collector, attribute, None)
    metric = getattr(metric, "_prom", metric)  # our OTel-backed stat-logger classes keep SGLang's metric there
    if metric is None:
        return 0.0
    labels = getattr(collector, "labels", {})
    return sum(
        sample.value
        for family in metric.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and all(sample.labels.get(k) == v for k, v in labels.items())
    )
