"""Capacity answers: each tier's hit ratio at other sizes, predicted from the live prefix lookups.

The contract, for a producer (an engine adapter, the reference cache):

* **Set up once**: ``feed = telemetry.capacity_feed(page_tokens, tiers, keys=...)`` - one feed per telemetry (one
  process, one cache: a new feed replaces the last). ``tiers`` are :class:`TierCapacity` rows, fastest first (device,
  then host, then storage), each with today's capacity in tokens and how it relates to the faster tiers:
  ``inclusive=True`` a tier that holds what the faster ones hold (a write-through host, an L3 store fed from the host),
  ``inclusive=False`` one that holds what they evicted (a write-back host); for the latter ``reclaims_copies=True``
  when it drops its copy of a page the faster tiers load back (SGLang's ``write_back`` host: the tier and the faster
  ones form one exclusive LRU of their summed size), ``False`` (the default) when it keeps that copy until they evict
  the page again (the reference cache's). ``tokens=None`` takes today's capacity
  from the last pool reading (``hicache.pool.limit`` of that tier and ``pool``, see
  :meth:`~otel_hicache.telemetry.HiCacheTelemetry.add_pool_usage_source`); a tier whose capacity is not known yet is
  not reported. :meth:`CapacityFeed.set_tiers` changes them later (a resized pool).
* **Per admitted request, on the scheduler thread** (about 0.2 us, no Python frame): hand over a *reference*::

      feed.put((next(feed.seq), payload, prompt_tokens))

  ``payload`` must not change afterwards where it matters (a list the engine only appends to is fine: at most
  ``prompt_tokens // page_tokens`` keys are read). ``keys(payload)`` runs later on the telemetry's host thread and
  returns the request's page keys in prompt order, first page first: hashable values equal exactly when the prefixes
  up to that page are equal (vLLM's block hashes; :func:`page_keys` computes a chain for engines without them, such as
  SGLang's radix tree, :mod:`otel_hicache.prefix_keys`). The default ``keys`` is the payload itself. A bounded queue
  (``max_queue`` of the telemetry) sheds the oldest lookups past its bound and counts them
  (``otel_hicache.records.rejected{record.kind=capacity, problem=queue_full}``); ``keys`` that raises is counted as
  ``build_failed``. Never raises, never waits.
* **Free room, optionally** (a radix tree, which evicts whole nodes): ``feed.report_free(tier, free_tokens)`` beside
  a lookup's ``put``, once that tier has started evicting. Such a tier frees more than it needs and holds its
  capacity less the mean of these; the curve takes that mean off its sizes (below). The reference cache reports it.
* **Or, given as token ids** (SGLang's prompts): ``feed.put_ids(ids, prompt_tokens, seed)``, keyed by
  :func:`page_keys` with ``seed`` (a namespace). Exporting over OTLP the ids are copied into the id ring for the export
  process, which keys them at once and runs the model there (``docs/architecture.md``, "Token ids": the only place ids
  go); the curve is then the export process's, and :meth:`CapacityFeed.curve` here holds none of those lookups. A full
  ring drops the lookup (``queue_full``). Without an export process they are queued like ``put``'s.
* **Or, given as digests** (vLLM's block hashes): ``feed.put_hashes(hashes, prompt_tokens)``, the engine's own page
  keys as ``bytes`` of 8-byte words (16 or 32 bytes each); exporting over OTLP they are joined into the id ring and
  the export process runs the model on their first 8 bytes; otherwise queued by reference like ``put``'s. A feed is
  given one of the three ways, not several.
* **What leaves the process**: only ``hicache.capacity.hit_ratio`` per tier and factor (a gauge, unit ``1``) - the
  predicted share of prompt tokens served by that tier or a faster one if it held ``factor`` times its capacity today,
  the other tiers unchanged; factor ``inf`` is the ceiling (``1 - inf``: tokens seen for the first time). No key, token
  id or prompt text is kept beyond a 64-bit Python hash of the key (salted per process for ``str`` and ``bytes``),
  and none reaches a span or a metric. :meth:`CapacityFeed.curve` reads the same curve in the process.
* **Cost**: the host thread pays a ``hash`` and a compare per page (numpy's, for a long prompt of small pages keyed
  by :func:`page_keys`: ~0.1 ms for 4,096 one-token pages, keys and model, against ~0.75 ms per page in Python), and
  the model's work per *sampled* page only. A long lookup (a prompt of thousands of pages) pauses as the host thread's
  rounds do once its round has held the GIL 200 us: the scheduler thread never waits for the GIL for a whole lookup.
  ``keys`` may return an iterator: it is read a piece at a time, so computing the keys is paced too. The memory is
  fixed whatever the traffic: :data:`MAX_SAMPLED_KEYS` pages at most, at most :data:`FOOTPRINT_BYTES` (2 MiB) per feed
  (one feed serves every tier of the process) and :data:`SIMULATION_BYTES` (6 MiB) more per exclusive tier that keeps
  copies (``reclaims_copies=False``). The sampling error stays within :data:`ERROR_BOUND` (2 points) of an exact LRU.

The model. One stream of page accesses, each request's lookup in order, feeds a reuse-distance histogram (Mattson's
stack algorithm: a page is a hit in an LRU cache of ``C`` pages iff fewer than ``C`` distinct pages were used since
its last use). Sampling is fixed-size SHARDS (Waldspurger et al., FAST 2015): a page is sampled when its hash is below
a threshold, the same pages every time (spatial sampling), its distance among sampled pages is scaled by ``1 / R``
(``R`` the sampling rate), and once more than :data:`MAX_SAMPLED_KEYS` pages are sampled the threshold drops to the
largest sampled hash, which leaves the set; each sample is weighed ``1 / R`` of its time. A request is a prefix
lookup: every page's distance is read before any page of the request is touched (the lookup happens before the
insert), then its pages are touched last page first, so a parent is always more recent than its children and the
LRU stack evicts leaves first, as the radix tree does; the pages an LRU of any size holds are then always a set of
whole prefixes (a page is a hit only with all its ancestors). Tokens: ``page_tokens`` per page; tokens past the last
full page are never cached and count as misses. The ratio is SHARDS_adj's: the exact number of pages looked up is the
denominator, and what the sample over- or under-counts is taken as hits at the shortest distance (a sample that holds
one very popular page would otherwise overstate every hit ratio).

Each tier is modelled by its policy over that one stream, at every factor ``x`` of its capacity ``C`` today, the
faster tiers' effective size today ``E`` unchanged: the device is an LRU of ``x * C`` (the radix tree evicts its
least recently used leaves); an inclusive tier an LRU of ``max(x * C, E)`` (it holds what the faster ones hold). A
tier that reports free room ``F`` (pages, the mean of :meth:`CapacityFeed.report_free`) holds ``C - F`` today and is
read at ``x * C - F``: what a whole-node eviction frees beyond its need is the size of the nodes, not of the tier, so
a tier of any size leaves the same room free (the re-runs measured 0.8 to 1.2 of today's room at 0.5x; checked by the
re-runs below; ``E`` counts the faster tiers' free room too). Left out, the reference cache's device is
predicted 2.5 to 4 points above a re-run at 1x and 0.5x (``docs/capacity.md``). An
exclusive tier is written when the faster ones evict. One that reclaims its copy of a page they load back
(``reclaims_copies=True``, SGLang's ``write_back`` host) holds, with them, ``E + x * C`` distinct pages, the least
recently used leaving first: an LRU of ``E + x * C``, read from the same histogram. One that keeps that copy until the
page leaves the faster tiers again (the reference cache's ``write_back`` host) holds less than ``E + x * C`` distinct
pages, by an amount the stack cannot tell: it is a miniature simulation of that policy (Waldspurger et al., ATC 2017)
over the pages of a smaller, nested fixed-size sample (:data:`MAX_SIMULATED_KEYS`), whole radix nodes moving together.
With a store behind it that keeps every page it was written (``store_behind``, the reference cache's L3 file store),
the simulation prefetches a lookup's next pages the store has into it before they go to the faster tiers: those are
the store's hits, and they take this tier's room (left out, 5 points too high at 1x under the demo's L3).
Checked by re-running the engine at each size (``tests/cache/test_capacity.py`` for the reference cache,
``tests/sglang/test_capacity.py`` for SGLang: every prediction within 3 points, 1x within 2); the sampling error
against an exact LRU and the memory bound by ``tests/core/test_capacity.py``.

    >>> from otel_hicache.capacity import CapacityModel, TierCapacity
    >>> from otel_hicache.semconv import Tier
    >>> model = CapacityModel(page_tokens=16)
    >>> for _ in range(3):  # a cyclic scan of 4 one-page prompts: LRU of fewer than 4 pages never hits
    ...     for doc in "abcd":
    ...         model.access([doc], 16)
    >>> curve = model.curve([TierCapacity(Tier.DEVICE, 32), TierCapacity(Tier.HOST, 32, inclusive=False)])
    >>> curve["device"].hit_ratio["1"], curve["host"].hit_ratio["1"], curve["device"].hit_ratio["inf"]
    (0.0, 0.6666666666666666, 0.6666666666666666)
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import threading
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from otel_hicache import semconv as sc
from otel_hicache.prefix_keys import VectorKeys, unpaced
from otel_hicache.prefix_keys import page_keys as page_keys  # part of this module's contract
from otel_hicache.semconv import Tier

#: Sampled pages the estimator tracks at most (SHARDS' ``s_max``): the bound on its memory and on its work per page.
MAX_SAMPLED_KEYS = 8192
#: What the estimator holds at most, every structure counted, whatever the traffic (``tests/core/test_capacity.py``
#: measures it over 10 million unique pages) ...
FOOTPRINT_BYTES = 2 * 1024 * 1024
#: ... and what the simulations of one exclusive tier that keeps copies add (six sizes, up to
#: :data:`MAX_SIMULATED_KEYS` pages each in ordered dicts: about 500 bytes a page).
SIMULATION_BYTES = 6 * 1024 * 1024
#: The sampling error against an exact LRU on streams with a known curve (a cyclic scan, a Zipf over pages), in
#: points of hit ratio (SHARDS reports a mean error under 1 point at this sample size).
ERROR_BOUND = 0.02
#: Linear histogram bins (distances below this, in pages, are kept exactly), then this many bins per octave up to
#: 2**_OCTAVES pages: ~2 % wide, interpolated within.
_LINEAR = 1024
_PER_OCTAVE = 32
_OCTAVES = 40
_BINS = _LINEAR + _PER_OCTAVE * (_OCTAVES - _LINEAR.bit_length() + 1)
#: A page's sampling hash is Python's hash of the 1-tuple of its key (one C call; the tuple hash mixes the bits, and an
#: int key hashes to itself): a signed 64-bit value, sampled while below the threshold.
_LOWEST = -(1 << 63)
_SPACE = 1 << 64
#: Keys the write-back simulations track at most, all of them together (a subset of the sampled pages: those whose
#: hash is below their own, lower threshold).
MAX_SIMULATED_KEYS = 2048
#: Sampled pages a lookup's model work handles between two calls of its ``pace`` (~0.7 us a page, ~45 us a piece on
#: the host thread): a lookup of a long prompt (a 4,096-page one costs ~0.6 ms) pauses as the host thread's rounds do
#: once its round has held the GIL 200 us, instead of holding it throughout. Its keys are read in pieces of four times
#: as many pages (a page's key costs a quarter to a half of that, and smaller pieces cost more per key than they save).
PACE_PAGES = 64
#: Every weight of the model (reuse distances, first uses, pages and tokens looked up, the simulations' hits) halves
#: after this many lookups: a workload that changes is followed, the old one weighing an eighth of the curve three
#: half-lives later. The curve's warmth, ``lookups``, is the same decayed count (``hicache.capacity.lookups``).
HALF_LIFE_LOOKUPS = 10_000
#: Lookups behind a curve (decayed) before the alerts read it (``collector-config/rules``): fewer, and a tier's share
#: at another size rests on a few reuses.
WARM_LOOKUPS = 1_000

Keys = Callable[[Any], Iterable[Hashable]]


class Queue(Protocol):
    """The bounded queue a feed hands lookups through (the telemetry's ``DeferredQueue``)."""

    @property
    def put(self) -> Callable[[tuple[Any, ...]], None]: ...
    @property
    def seq(self) -> Iterator[int]: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class TierCapacity:
    """One tier as the model sees it: today's capacity in tokens (None: from the last pool reading of ``pool``),
    whether it holds what the faster tiers hold (``inclusive``) or what they evicted, and for the latter whether it
    drops its copy of a page they load back (``reclaims_copies``: one exclusive LRU with them) or keeps it."""

    tier: Tier
    tokens: int | None
    inclusive: bool = True
    pool: str = sc.DEFAULT_POOL
    reclaims_copies: bool = False
    #: For an exclusive tier that keeps copies: a store behind it keeps every page this tier was written (the
    #: reference cache's L3 file store) and a lookup that misses the faster tiers and this one but finds its next
    #: pages there prefetches them into this tier, where they take room (they are the store's hits, not this tier's).
    #: Modelled for lookups given by ``put`` (the id ring does not describe it to the export process's model).
    store_behind: bool = False

    @property
    def simulated(self) -> bool:
        """Modelled by a miniature simulation (an exclusive tier that keeps copies), not read from the histogram."""
        return not self.inclusive and not self.reclaims_copies


@dataclass(frozen=True)
class TierCurve:
    """A tier's capacity today (tokens) and its predicted hit ratio by factor (:data:`~otel_hicache.semconv.
    CAPACITY_FACTORS`): the share of prompt tokens that tier or a faster one would serve at that size."""

    tokens: int
    hit_ratio: dict[str, float]
    #: How warm the curve is: the lookups behind it (decayed, :data:`HALF_LIFE_LOOKUPS`) and the pages it samples.
    lookups: int
    sampled_pages: int


def check_tiers(tiers: Iterable[TierCapacity]) -> tuple[TierCapacity, ...]:
    """``tiers`` as a tuple, or ValueError: fastest first, each tier once, capacities whole and not negative."""
    out = tuple(tiers)
    order = list(Tier)
    ranks = []
    for row in out:
        if not isinstance(row, TierCapacity) or row.tier not in order:
            raise ValueError(f"capacity tiers: {row!r} is not a TierCapacity of a known tier")
        if row.tokens is not None and (type(row.tokens) is not int or row.tokens < 0):
            raise ValueError(f"capacity tiers: {row.tier.value}: tokens must be an int >= 0 or None")
        if row.inclusive and row.reclaims_copies:
            raise ValueError(f"capacity tiers: {row.tier.value}: reclaims_copies is for an exclusive tier")
        if row.store_behind and not row.simulated:
            raise ValueError(
                f"capacity tiers: {row.tier.value}: store_behind is for an exclusive tier that keeps copies"
            )
        ranks.append(order.index(Tier(row.tier)))
    if ranks != sorted(set(ranks)):
        raise ValueError("capacity tiers: each tier once, fastest first (device, host, storage)")
    return out


class CapacityModel:
    """The fixed-size SHARDS estimator of one page-access stream and the tier models over it (see the module
    docstring). Not thread-safe: a :class:`CapacityFeed` serializes it."""

    def __init__(self, page_tokens: int, max_keys: int = MAX_SAMPLED_KEYS) -> None:
        if page_tokens < 1 or max_keys < 1:
            raise ValueError("page_tokens and max_keys must be >= 1")
        self.page_tokens = page_tokens
        self.max_keys = max_keys
        self.threshold = -_LOWEST  # a page is sampled iff its hash is below: R = (threshold - _LOWEST) / _SPACE
        self.sim_threshold = self.threshold  # ... and simulated iff below this one
        self._simulated: set[int] = set()
        self._sim_by_hash: list[int] = []  # -hash of each simulated page
        self._last: dict[int, int] = {}  # sampled page -> the clock of its last use
        # The LRU stack: the clocks of the sampled pages' last uses, ascending (a page's distance is the number of
        # clocks after its own: two C-level bisections, where a tree of counts would take Python loops).
        self._clocks = array("q")
        self._clock = 0
        # -hash of each sampled page, the largest leaves first when the rate drops: built when the sample first
        # overflows (a sample that never fills needs none), kept up to date from then on
        self._by_hash: list[int] | None = None
        self._hist = array("d", bytes(8 * _BINS))  # sample weight by scaled distance (pages)
        self._below_bin: array[float] | None = None  # per bin, the weight of the bins below it (None: to be summed)
        self.cold = 0.0  # sample weight of first uses
        self.sampled = 0.0  # sample weight of all sampled uses
        self._sims: dict[tuple[int, int, bool], _WriteBack] = {}  # (faster pages, pages, store behind) -> sim
        self.prompt_tokens = 0.0  # exact but for the halvings: every token of every lookup
        self.paged_tokens = 0.0  # ... and the tokens of the full pages looked up
        self.lookups = 0.0  # lookups behind the curve, halved with the rest (its warmth)
        self._until_halving = HALF_LIFE_LOOKUPS

    # ------------------------------------------------------------------ the stream
    @property
    def sampled_keys(self) -> int:
        """Pages the sample tracks now (at most ``max_keys``)."""
        return len(self._last)

    def access(self, keys: Iterable[Hashable], prompt_tokens: int, pace: Callable[[], None] = unpaced) -> None:
        """One request's prefix lookup: its page keys, first page first, and its prompt's length in tokens. ``pace``
        is called between pieces of the lookup (:data:`PACE_PAGES`), where a long one may pause."""
        looked, sampled = self.sample(keys, prompt_tokens, pace)
        self.prompt_tokens += prompt_tokens
        self.paged_tokens += looked * self.page_tokens
        self.lookups += 1
        if sampled:
            self._lookup(sampled, pace)
            if self._sims:
                self._simulate(sampled, pace)
            self._touch(sampled, pace)
        self._until_halving -= 1
        if not self._until_halving:
            self._halve()

    def _halve(self) -> None:
        """Every weight halves (:data:`HALF_LIFE_LOOKUPS`); the LRU stack stays: the pages are still where they were."""
        self._until_halving = HALF_LIFE_LOOKUPS
        hist = self._hist
        for i, weight in enumerate(hist):
            if weight:
                hist[i] = weight / 2
        self._below_bin = None
        self.cold /= 2
        self.sampled /= 2
        self.prompt_tokens /= 2
        self.paged_tokens /= 2
        self.lookups /= 2
        for sim in self._sims.values():
            sim.hits /= 2
            sim.sampled /= 2

    def sample(
        self, keys: Iterable[Hashable], prompt_tokens: int, pace: Callable[[], None] = unpaced
    ) -> tuple[int, list[int]]:
        """Of one lookup's first ``prompt_tokens // page_tokens`` keys: how many there were, and the sampling hashes
        (``hash((key,))``) of those the sample holds, in order. Read a piece at a time; a long prompt of small pages
        keyed by numpy (:class:`~otel_hicache.prefix_keys.VectorKeys`) is sampled by numpy too."""
        wanted, threshold = prompt_tokens // self.page_tokens, self.threshold
        if isinstance(keys, VectorKeys):
            return keys.sampled(threshold, wanted, pace)
        pending = iter(keys)
        piece = list(itertools.islice(pending, wanted if wanted <= 4 * PACE_PAGES else 4 * PACE_PAGES))
        looked = len(piece)
        sampled = [h for h in map(hash, zip(piece)) if h < threshold]
        while piece and looked < wanted:  # a long prompt: its other keys, a piece at a time
            pace()
            piece = list(itertools.islice(pending, min(4 * PACE_PAGES, wanted - looked)))
            looked += len(piece)
            sampled += [h for h in map(hash, zip(piece)) if h < threshold]
        return looked, sampled

    def _simulate(self, sampled: list[int], pace: Callable[[], None]) -> None:
        """Run the write-back simulations on the pages below their threshold (a fixed-size sample of their own)."""
        simulated, by_hash = self._simulated, self._sim_by_hash
        pages = [h for h in sampled if h < self.sim_threshold]
        for h in pages:
            if h not in simulated:
                simulated.add(h)
                heapq.heappush(by_hash, -h)
        while len(simulated) > MAX_SIMULATED_KEYS:
            self.sim_threshold = -by_hash[0]
            self._unsimulate(self.sim_threshold)
        pages = [h for h in pages if h < self.sim_threshold]
        if pages:
            rate = (self.sim_threshold - _LOWEST) / _SPACE
            for sim in self._sims.values():
                sim.access(pages, rate)
                pace()

    def _unsimulate(self, h: int) -> None:
        """``h``, the simulated page of largest hash, leaves the simulations."""
        if self._sim_by_hash and self._sim_by_hash[0] == -h:
            heapq.heappop(self._sim_by_hash)
        self._simulated.discard(h)
        for sim in self._sims.values():
            sim.forget(h)

    def _lookup(self, sampled: list[int], pace: Callable[[], None]) -> None:
        """Each sampled page's distance before the request touches any (the lookup precedes the insert)."""
        weight = _SPACE / (self.threshold - _LOWEST)
        last, hist, clocks = self._last, self._hist, self._clocks
        live = len(clocks)
        for piece in _pieces(sampled, pace):
            for h in piece:
                self.sampled += weight
                used = last.get(h)
                if used is None:
                    self.cold += weight
                    continue
                distance = (live - bisect_right(clocks, used)) * weight  # distinct pages used since
                hist[_bin(distance)] += weight
        self._below_bin = None

    def _touch(self, sampled: list[int], pace: Callable[[], None]) -> None:
        """Last page first: a parent ends up more recent than its children."""
        last, clocks = self._last, self._clocks
        for piece in _pieces(sampled, pace, last_first=True):
            for h in piece:
                if h >= self.threshold:  # left the sample while this request was touched
                    continue
                self._clock += 1
                used = last.get(h)
                last[h] = self._clock
                clocks.append(self._clock)  # the latest: the stack stays sorted
                if used is not None:
                    del clocks[bisect_left(clocks, used)]
                else:
                    if self._by_hash is not None:
                        heapq.heappush(self._by_hash, -h)
                    if len(last) > self.max_keys:
                        self._lower()

    def _lower(self) -> None:
        """Drop the sampled page of largest hash; sample below it from now on (fixed-size SHARDS)."""
        if self._by_hash is None:
            self._by_hash = [-h for h in self._last]
            heapq.heapify(self._by_hash)
        h = -heapq.heappop(self._by_hash)
        del self._clocks[bisect_left(self._clocks, self._last.pop(h))]
        self.threshold = h
        if h < self.sim_threshold:  # the simulations sample a subset of these pages
            self.sim_threshold = h
            self._unsimulate(h)

    # ------------------------------------------------------------------ the curve
    def hit_ratio(self, pages: float) -> float:
        """Predicted share of prompt tokens an LRU of ``pages`` pages serves (``math.inf``: the ceiling)."""
        return self._share(self.sampled - self.cold if math.isinf(pages) else self._below(pages), self.sampled)

    def _below(self, pages: float) -> float:
        """Sample weight of distances below ``pages`` (interpolated within the bin that holds it)."""
        full = _bin(pages)
        lo, hi = _edges(full)
        partial = self._hist[full] * (pages - lo) / (hi - lo) if full < _BINS - 1 else self._hist[full]
        if self._below_bin is None:  # summed once per change, not once per size read (a curve reads a dozen)
            self._below_bin = array("d", itertools.accumulate(self._hist, initial=0.0))
        return self._below_bin[full] + partial

    def curve(
        self,
        tiers: Sequence[TierCapacity],
        limits: Mapping[tuple[str, str], int] = {},
        free: Mapping[str, float] = {},
    ) -> dict[str, TierCurve]:
        """The predicted ratio of each tier whose capacity is known (``tokens``, else ``limits[(tier, pool)]``) at
        every factor, the faster tiers at their size today. ``free``: by tier, the pages it leaves free on average
        once it evicts (:meth:`CapacityFeed.report_free`), taken off each of its sizes read from the LRU stack."""
        out: dict[str, TierCurve] = {}
        ceiling = self.hit_ratio(math.inf)
        held = 0.0  # what the faster tiers hold today, in pages: their capacity less the room they leave free
        for row, tokens, faster in _sizes(tiers, limits, self.page_tokens):
            pages = tokens / self.page_tokens
            unused = free.get(Tier(row.tier).value, 0.0)
            ratios = {}
            for name, factor in sc.CAPACITY_FACTOR_VALUES.items():
                if math.isinf(factor):
                    ratios[name] = ceiling
                    continue
                size = math.floor(factor * pages)
                sim = self._sims.get((faster, size, row.store_behind)) if row.simulated else None
                if sim is not None:  # its own sample: never above the ceiling of the larger one
                    ratios[name] = min(self._share(sim.hits, sim.sampled), ceiling)
                else:  # inclusive, one exclusive LRU, or a simulation not started yet (as if it held no copy)
                    own = max(size - unused, 0.0)
                    ratios[name] = self.hit_ratio(max(own, held) if row.inclusive else held + own)
            out[Tier(row.tier).value] = TierCurve(tokens, ratios, round(self.lookups), len(self._last))
            own = max(tokens // self.page_tokens - unused, 0.0)
            held = max(own, held) if row.inclusive else held + own
        return out

    def simulate(self, tiers: Sequence[TierCapacity], limits: Mapping[tuple[str, str], int] = {}) -> None:
        """Keep a miniature simulation for every size of every exclusive tier that keeps copies the curve reports (new
        ones start empty; those no longer needed go)."""
        wanted = {
            (faster, math.floor(factor * tokens / self.page_tokens), row.store_behind)
            for row, tokens, faster in _sizes(tiers, limits, self.page_tokens)
            if row.simulated
            for factor in sc.CAPACITY_FACTOR_VALUES.values()
            if not math.isinf(factor)
        }
        self._sims = {size: self._sims.get(size) or _WriteBack(*size) for size in wanted}
        if not self._sims:
            self._simulated.clear()
            self._sim_by_hash.clear()

    def _share(self, hits: float, sampled: float) -> float:
        """Share of prompt tokens from the sample weight of hits and of all pages looked up, SHARDS_adj: the sample
        holds more (or fewer) page uses than there were when it happens to hold a page used very often (or seldom),
        and the difference is counted as (or taken from) hits at the shortest distance."""
        pages = self.paged_tokens / self.page_tokens  # exact
        if not sampled or not pages:
            return 0.0
        return min(max(hits + pages - sampled, 0.0) / pages, 1.0) * self.paged_tokens / self.prompt_tokens


def _sizes(
    tiers: Sequence[TierCapacity], limits: Mapping[tuple[str, str], int], page_tokens: int
) -> Iterator[tuple[TierCapacity, int, int]]:
    """Each tier whose capacity is known, its tokens, and the faster tiers' effective size today in pages (a tier of
    unknown size ends the list: the slower ones' sizes depend on it)."""
    faster = 0
    for row in tiers:
        tokens = row.tokens if row.tokens is not None else limits.get((Tier(row.tier).value, row.pool))
        if tokens is None:
            return
        yield row, tokens, faster
        pages = tokens // page_tokens
        faster = max(pages, faster) if row.inclusive else faster + pages


def _pieces(pages: list[int], pace: Callable[[], None], last_first: bool = False) -> Iterable[Iterable[int]]:
    """``pages`` (``last_first``: in reverse) in pieces of :data:`PACE_PAGES`, ``pace`` called between two."""
    if len(pages) <= PACE_PAGES:  # the common case: one piece, no copy, no generator
        return (reversed(pages) if last_first else pages,)
    return _paced(pages[::-1] if last_first else pages, pace)


def _paced(pages: list[int], pace: Callable[[], None]) -> Iterator[list[int]]:
    for start in range(0, len(pages), PACE_PAGES):
        if start:
            pace()
        yield pages[start : start + PACE_PAGES]


def _bin(distance: float) -> int:
    if distance < _LINEAR:
        return int(distance)
    return min(_LINEAR + int(_PER_OCTAVE * math.log2(distance / _LINEAR)), _BINS - 1)


def _edges(index: int) -> tuple[float, float]:
    if index < _LINEAR:
        return float(index), float(index + 1)
    octave = (index - _LINEAR) / _PER_OCTAVE
    return _LINEAR * 2.0**octave, _LINEAR * 2.0 ** (octave + 1 / _PER_OCTAVE)


class _WriteBack:
    """A miniature simulation (Waldspurger et al., ATC 2017: the real policy on the sampled pages, sizes scaled by
    the sampling rate) of a tier that takes what the faster ones evict and keeps its copy of a page they load back
    until the page leaves them again, the reference cache's ``write_back`` host: its copies of pages the
    faster tiers hold cannot be evicted and take room, so it holds fewer than ``faster + pages`` distinct pages.

    Like a radix tree it moves whole nodes: the pages one request inserted together, split where a later lookup
    stops inside them. ``hits``: sample weight of pages served by it or a faster tier (an LRU of ``faster`` pages).
    ``store``: with a store behind it (:attr:`TierCapacity.store_behind`), the pages ever written here, which the
    store keeps: a lookup's pages past what the tiers hold that the store has are prefetched here first, taking room.
    """

    __slots__ = ("_faster", "_nodes", "_pages", "_serial", "hits", "lower", "node", "sampled", "store", "upper")

    def __init__(self, faster: int, pages: int, store: bool = False) -> None:
        self._faster, self._pages = faster, pages
        self.store: set[int] | None = set() if store else None
        self.upper: collections.OrderedDict[int, None] = collections.OrderedDict()  # the faster tiers, LRU first
        self.lower: collections.OrderedDict[int, None] = collections.OrderedDict()  # this tier, LRU first
        self.node: dict[int, int] = {}  # page (in either) -> its node
        self._nodes: dict[int, list[int]] = {}  # node -> its pages in either (a few: lists are smaller than sets)
        self._serial = itertools.count()
        self.hits = 0.0
        self.sampled = 0.0  # sample weight of every page looked up

    def access(self, sampled: list[int], rate: float) -> None:
        upper, lower, node = self.upper, self.lower, self.node
        weight = 1 / rate
        held = sum(1 for h in sampled if h in node)  # the lookup, before any insert: whole prefixes are held
        self.hits += weight * held
        self.sampled += weight * len(sampled)
        stored = self.store
        fetched = list(itertools.takewhile(stored.__contains__, sampled[held:])) if stored else []
        renamed: dict[int | None, int] = {}  # a lookup that ends inside a node splits it: its part gets a new one
        for h in sampled:
            old = node.get(h)
            new = renamed.get(old)
            if new is None:
                new = renamed[old] = next(self._serial)
            if old is not None:
                self._nodes[old].remove(h)
            node[h] = new
            self._nodes.setdefault(new, []).append(h)
        for old in renamed:
            if old is not None and not self._nodes[old]:
                del self._nodes[old]
        upper_size, lower_size = round(self._faster * rate), round(self._pages * rate)
        if fetched:  # prefetched from the store into this tier (the lookup's pages cannot go to make room)
            for h in fetched:
                lower[h] = None
            if not self._room(lower_size, set(sampled)):  # no room: not prefetched, computed instead
                for h in fetched:
                    del lower[h]
        for h in reversed(sampled):
            if h in lower:
                lower.move_to_end(h)  # loaded back: its copy stays
            upper[h] = None
            upper.move_to_end(h)
        while len(upper) > upper_size:
            self._demote(node[next(iter(upper))], lower_size)

    def _demote(self, evicted: int, lower_size: int) -> None:
        """The faster tiers evict node ``evicted``: its pages without a copy are written here, room made by evicting
        whole nodes the faster tiers do not hold; a write that finds no room is dropped."""
        upper, lower = self.upper, self.lower
        pages = [h for h in self._nodes[evicted] if h in upper]
        for h in pages:
            del upper[h]
        written = {h for h in pages if h not in lower}
        for h in written:
            lower[h] = None
        if not self._room(lower_size, written):  # every copy is held above too, or was just written: dropped
            for h in written:
                del lower[h]
                self._leave(h)
        elif self.store is not None:
            self.store |= written

    def _room(self, lower_size: int, kept: set[int]) -> bool:
        """Evict whole nodes the faster tiers do not hold, none of ``kept``, until this tier holds ``lower_size``
        pages; False when nothing more can go."""
        upper, lower = self.upper, self.lower
        while len(lower) > lower_size:
            victim = next((v for v in lower if v not in upper and v not in kept), None)
            if victim is None:
                return False
            for h in [h for h in self._nodes[self.node[victim]] if h in lower and h not in upper and h not in kept]:
                del lower[h]
                self._leave(h)
        return True

    def _leave(self, h: int) -> None:
        """``h`` is in neither tier any more."""
        owner = self.node.pop(h)
        members = self._nodes[owner]
        members.remove(h)
        if not members:
            del self._nodes[owner]

    def forget(self, h: int) -> None:
        """``h`` left the sample."""
        self.upper.pop(h, None)
        self.lower.pop(h, None)
        if self.store is not None:
            self.store.discard(h)
        if h in self.node:
            self._leave(h)


class TokenIds(NamedTuple):
    """A queued lookup's payload given as token ids (:meth:`CapacityFeed.put_ids`): keyed by :func:`page_keys`."""

    ids: Sequence[int]
    seed: int


#: Where a feed hands a lookup to the export process: ``(feed, ids, prompt_tokens, seed, stride)``, the prompt's token
#: ids (``stride`` 0) or ``bytes`` of the engine's page keys, ``stride`` 8-byte words each; False when there is none now
#: (the lookup is queued for the host thread instead).
IdSink = Callable[["CapacityFeed", Any, int, int, int], bool]


class CapacityFeed:
    """A producer's handle on the estimator (see the module docstring): ``put`` and ``seq`` are the bounded queue's
    (``put((next(seq), payload, prompt_tokens))``), drained on the telemetry's host thread, each lookup paced by
    ``pace`` (the host thread's); :meth:`put_ids` hands a prompt's token ids to the export process where there is
    one (``ids``)."""

    def __init__(
        self,
        page_tokens: int,
        tiers: Iterable[TierCapacity],
        keys: Keys | None,
        queue: Callable[[Callable[[tuple[Any, ...]], None]], Queue],
        *,
        max_keys: int = MAX_SAMPLED_KEYS,
        pace: Callable[[], None] = unpaced,
        ids: IdSink | None = None,
    ) -> None:
        self._model = CapacityModel(page_tokens, max_keys)
        self._tiers = check_tiers(tiers)
        self._ids = ids
        self.generation = 0  # moves on with every change of the tiers (an id sink describes them again)
        self._keys = keys
        self._pace = pace
        self._lock = threading.Lock()  # the host thread feeds the model; curve() reads it from any thread
        self._limits: Mapping[tuple[str, str], int] = {}
        # By tier: [free tokens summed, lookups] of report_free (written on the engine's thread, a fixed set of keys)
        self._free: dict[str, list[int]] = {t.value: [0, 0] for t in Tier}
        self._model.simulate(self._tiers)
        self._queue = queue(self.build)  # the telemetry's bounded queue, built with build() on its host thread
        self.put = self._queue.put
        self.seq = self._queue.seq

    def set_tiers(self, tiers: Iterable[TierCapacity]) -> None:
        """Today's capacities from now on (a resized pool). ValueError for rows that are not fastest first."""
        checked = check_tiers(tiers)
        with self._lock:
            self._tiers = checked
            self._forget_free()
            self._model.simulate(checked, self._limits)
            self.generation += 1

    def report_free(self, tier: Tier, tokens: int) -> None:
        """The free room of ``tier``, in tokens, at a lookup once that tier has started evicting (on the engine's
        thread, beside the lookup's ``put``; about 0.2 us). A radix tree evicts whole nodes and frees more than it
        needs: it holds its capacity less the mean of these on average, and the curve takes that mean off every size
        of the tier it reads from the LRU stack (an exclusive tier that keeps copies is simulated, whole nodes
        included, and takes none off). Only lookups given by ``put`` are modelled with it (the export process's
        model, fed by :meth:`put_ids`, has none). Never raises."""
        room = self._free.get(tier)
        if room is not None and type(tokens) is int:
            room[0] += tokens
            room[1] += 1

    def _forget_free(self) -> None:
        for room in self._free.values():
            room[:] = [0, 0]

    def _free_pages(self) -> dict[str, float]:
        page = self._model.page_tokens
        return {tier: total / count / page for tier, (total, count) in list(self._free.items()) if count}

    @property
    def page_tokens(self) -> int:
        return self._model.page_tokens

    @property
    def tiers(self) -> tuple[TierCapacity, ...]:
        return self._tiers

    def put_ids(self, ids: Sequence[int], prompt_tokens: int, seed: int = 0) -> None:
        """One admitted request's lookup given as its prompt's token ids (``seed``: its cache namespace, see
        :func:`page_keys`), on the engine's thread. Exporting over OTLP they are copied into the id ring for the
        export process, which keys them and runs the model there (a full ring drops the lookup and counts it);
        otherwise queued by reference for the host thread, as :attr:`put` does. Never raises."""
        sink = self._ids
        if sink is None or not sink(self, ids, prompt_tokens, seed, 0):
            self.put((next(self.seq), TokenIds(ids, seed), prompt_tokens))

    def put_hashes(self, hashes: Sequence[bytes], prompt_tokens: int) -> None:
        """One admitted request's lookup given as the engine's own page keys, digests of the prefix up to each page
        (vLLM's ``Request.block_hashes``: 16 or 32 bytes each), on the engine's thread. Exporting over OTLP they are
        joined (one ``bytes`` copy) into the id ring for the export process, which keys each page by the digest's
        first 8 bytes; otherwise (or for digests not a whole number of 8-byte words) queued by reference, as
        :attr:`put` does. Never raises."""
        sink = self._ids
        if sink is not None:
            try:
                width = len(hashes[0]) if hashes else 8
                data = b"".join(hashes)
            except (TypeError, IndexError, KeyError):
                data, width = b"", 0
            if width and not width % 8 and len(data) == width * len(hashes):
                if sink(self, data, prompt_tokens, 0, width // 8):
                    return
        self.put((next(self.seq), hashes, prompt_tokens))

    def curve(self, limits: Mapping[tuple[str, str], int] | None = None) -> dict[str, TierCurve]:
        """Each tier's predicted ratios now (what the gauge reports); ``limits``: the pool reading by ``(tier, pool)``
        that sizes the tiers given as ``tokens=None`` (None: the last one given). Lookups still queued are not in it:
        read :meth:`~otel_hicache.telemetry.HiCacheTelemetry.snapshot` first, which waits for them."""
        with self._lock:
            if limits is not None and limits != self._limits:  # sizes from a new reading: simulated from now on
                self._limits = dict(limits)
                self._model.simulate(self._tiers, self._limits)
            return self._model.curve(self._tiers, self._limits, self._free_pages())

    def close(self) -> None:
        """The producer is done: the gauge keeps its last values; the queue goes once drained."""
        self._queue.close()

    def restart(self) -> None:
        """Start from zero (a forked child, which counts as a process of its own)."""
        self._lock = threading.Lock()
        self._model = CapacityModel(self._model.page_tokens, self._model.max_keys)
        self._forget_free()
        self._model.simulate(self._tiers, self._limits)

    def build(self, entry: tuple[Any, ...]) -> None:
        """The host thread's: feed one queued lookup ``(seq, payload, prompt_tokens)`` to the model."""
        _, payload, prompt_tokens = entry
        keys: Iterable[Hashable]
        if type(payload) is TokenIds:
            keys = page_keys(payload.ids, self._model.page_tokens, payload.seed)
        else:
            keys = payload if self._keys is None else self._keys(payload)
        with self._lock:  # held while a long lookup pauses: a reader of the curve waits for the whole lookup
            self._model.access(keys, int(prompt_tokens), self._pace)
