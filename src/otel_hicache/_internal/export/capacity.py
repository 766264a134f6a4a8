"""The capacity estimator, run in the export process from the id ring (:mod:`~otel_hicache._internal.shared.ids`).

Each record read is turned into page keys at once (:func:`otel_hicache.prefix_keys.page_keys`, seeded by the request's
namespace; a record of the engine's own keys, vLLM's block hashes, is keyed by the first 8 bytes of each), its ids
dropped and its bytes in the ring already zeroed; the model (:class:`~otel_hicache.capacity.
CapacityModel`) keeps keys and sampled hashes only. About once a second the curve is written into the table's capacity
slots, of which this process is then the only writer (the host writes none while its channel has an id ring). A
replacement exporter starts a model of its own from the next unread record: the curve is an estimate, and every
lookup it lost was already taken by its predecessor.
"""

from __future__ import annotations

import time

from otel_hicache._internal.shared.accumulation import CapacityReading
from otel_hicache._internal.shared.channel import Channel
from otel_hicache._internal.shared.ids import IdRing, TierRow
from otel_hicache.capacity import CapacityModel, TierCapacity, page_keys
from otel_hicache.semconv import Tier

#: How often the curve is written (the host's pool reading, which sizes some tiers, has the same pace).
PUBLISH_INTERVAL_S = 1.0
_TIERS = list(Tier)


class RingEstimator:
    """The model over ``channel``'s id ring (which must have one)."""

    def __init__(self, channel: Channel, ring: IdRing) -> None:
        self._channel = channel
        self._ring = ring
        self._generation = 0
        self._model: CapacityModel | None = None
        self._tiers: tuple[TierCapacity, ...] = ()
        self._limits: dict[tuple[str, str], int] = {}
        self._next_publish = 0.0

    def drain(self) -> None:
        """Feed every unread record to the model (taking up a new description of the feed first), and write the curve
        when it is due."""
        self._describe()
        for lookup in self._ring.take():
            model = self._model
            if model is not None and lookup.prompt_tokens >= 0:
                keys = lookup.keys()  # the engine's own (vLLM's block hashes), or keys computed from token ids
                model.access(
                    page_keys(lookup.ids, model.page_tokens, lookup.seed) if keys is None else keys,
                    lookup.prompt_tokens,
                )
        now = time.monotonic()
        if now >= self._next_publish:
            self._next_publish = now + PUBLISH_INTERVAL_S
            self.publish()

    def _describe(self) -> None:
        generation, page_tokens, rows = self._ring.tiers()
        if generation == self._generation or page_tokens < 1:
            return
        self._generation = generation
        pools = self._channel.layout.pools
        self._tiers = tuple(_tier(row, pools) for row in rows)
        if self._model is None or self._model.page_tokens != page_tokens:
            self._model = CapacityModel(page_tokens)
        self._model.simulate(self._tiers, self._limits)

    def publish(self) -> None:
        """Write the curve (sized by the table's last pool reading for tiers given without tokens)."""
        model = self._model
        if model is None:
            return
        counters = self._channel.counters
        limits = {(tier, pool): limit for tier, pool, _, limit in counters.pools()}
        if limits != self._limits:
            self._limits = limits
            model.simulate(self._tiers, limits)
        curve = model.curve(self._tiers, limits)
        counters.set_capacity({t: CapacityReading.of(c) for t, c in curve.items()})


def _tier(row: TierRow, pools: tuple[str, ...]) -> TierCapacity:
    return TierCapacity(
        _TIERS[row.tier],
        None if row.tokens < 0 else row.tokens,
        inclusive=row.inclusive,
        pool=pools[row.pool],
        reclaims_copies=row.reclaims_copies,
    )
