"""The capacity estimator: exact LRU over prefix lookups while every page is sampled, each tier's policy as an LRU of
its effective size, and a producer's feed through the telemetry into ``hicache.capacity.hit_ratio``."""

from __future__ import annotations

import bisect
import collections
import gc
import hashlib
import itertools
import math
import random
import sys
import threading
import time
import types
from array import array
from collections.abc import Hashable, Iterator, Sequence

import pytest

from otel_hicache import semconv as sc
from otel_hicache._internal.host.worker import HOST_THREAD_NAME
from otel_hicache._internal.shared.ids import ARENA_BYTES
from otel_hicache.capacity import (
    ERROR_BOUND,
    FOOTPRINT_BYTES,
    HALF_LIFE_LOOKUPS,
    MAX_SAMPLED_KEYS,
    PACE_PAGES,
    SIMULATION_BYTES,
    CapacityModel,
    TierCapacity,
    page_keys,
)
from otel_hicache.records import PoolUsage
from otel_hicache.sdk import configure
from otel_hicache.semconv import Problem, RecordKind, Tier
from otel_hicache.testing.otlp_receiver import OtlpReceiver, attributes
from otel_hicache.testing.sdk import Sdk, make_sdk

PAGE = 16
Lookup = tuple[Sequence[Hashable], int]


def exact_lru(lookups: Sequence[Lookup], pages: int) -> float:
    """Share of prompt tokens an LRU cache of ``pages`` pages serves: the hit is the longest cached prefix, then the
    request's pages are cached (evicting the least recently used). Each lookup weighs what the model's halvings leave
    of it (:data:`HALF_LIFE_LOOKUPS`): half for every halving after it."""
    lru: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
    hits = total = 0.0
    halvings = len(lookups) // HALF_LIFE_LOOKUPS
    for i, (keys, tokens) in enumerate(lookups):
        weight = 0.5 ** (halvings - i // HALF_LIFE_LOOKUPS)
        total += tokens * weight
        for key in keys:
            if key not in lru:
                break
            hits += PAGE * weight
        for key in reversed(keys):
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > pages:
            lru.popitem(last=False)
    return hits / total


def documents_workload(seed: int, requests: int, documents: int) -> list[Lookup]:
    """Prefixes of documents of 2-30 pages, a Zipf-like popularity, and a partial last page now and then."""
    rng = random.Random(seed)
    tokens = [[rng.randrange(50_000) for _ in range(PAGE * rng.randint(2, 30))] for _ in range(documents)]
    out: list[Lookup] = []
    for _ in range(requests):
        doc = tokens[min(int(rng.paretovariate(1.0)) - 1, documents - 1)]
        prompt = doc[: rng.randint(1, len(doc))]
        out.append((list(page_keys(prompt, PAGE)), len(prompt)))
    return out


def cyclic(pages: int, rounds: int) -> list[Lookup]:
    """One-page prompts in a loop: LRU of fewer pages than the loop never hits, one of as many always does."""
    return [([page], PAGE) for _ in range(rounds) for page in range(pages)]


def model_of(lookups: Sequence[Lookup], **kwargs: int) -> CapacityModel:
    model = CapacityModel(PAGE, **kwargs)
    for keys, tokens in lookups:
        model.access(keys, tokens)
    return model


class TestTheModel:
    def test_while_every_page_is_sampled_the_curve_is_exact_lru_over_prefixes(self) -> None:
        lookups = documents_workload(seed=1, requests=3000, documents=60)
        model = model_of(lookups)
        assert model.threshold == 1 << 63  # every page sampled
        for pages in (1, 5, 20, 50, 100, 200, 400, 800, 2000):
            assert model.hit_ratio(pages) == pytest.approx(exact_lru(lookups, pages), abs=1e-9), pages

    def test_the_ceiling_is_every_token_but_first_uses_and_partial_pages(self) -> None:
        lookups = [([1, 2], 40), ([1, 2], 40), ([1, 3], 32)]  # 8 tokens of each of the first two: no full page
        model = model_of(lookups)
        assert model.hit_ratio(float("inf")) == pytest.approx((32 + 16) / 112)
        assert model.hit_ratio(1) == pytest.approx(32 / 112)  # one page: the first page, most recent by design

    def test_a_lookup_reads_at_most_its_prompts_full_pages_of_keys(self) -> None:
        growing = list(range(100))  # an engine's list of block hashes that grows while the request decodes
        model = model_of([(growing, 3 * PAGE), (growing, 3 * PAGE)])
        assert model.paged_tokens == 6 * PAGE
        assert model.hit_ratio(float("inf")) == pytest.approx(0.5)

    def test_a_long_lookup_is_paced_every_few_pages_and_predicts_what_an_unpaced_one_does(self) -> None:
        read = [0]  # keys the lookup has read so far
        between: list[int] = []  # keys read between two calls of pace

        def keys(prompt: list[int]) -> Iterator[int]:
            for key in page_keys(prompt, 1):
                read[0] += 1
                yield key

        def pace() -> None:
            between.append(read[0] - sum(between))

        prompts = [list(range(n)) for n in (4096, 3000, 4096)]  # shared prefixes: hits at every distance
        paced, unpaced = CapacityModel(1), CapacityModel(1)
        for prompt in prompts:
            paced.access(keys(prompt), len(prompt), pace)
            unpaced.access(page_keys(prompt, 1), len(prompt))
        keys_per_piece = 4 * PACE_PAGES  # a page's key costs a quarter to a half of a sampled page's model work
        assert max(between) <= keys_per_piece  # reading the keys: never more than a piece without a pause
        key_pieces = sum(math.ceil(len(prompt) / keys_per_piece) for prompt in prompts)
        model_pieces = sum(math.ceil(len(prompt) / PACE_PAGES) for prompt in prompts)
        # between pieces: of the keys read, then of the lookup and of the touch of the pages read (all sampled here)
        assert len(between) == key_pieces + 2 * model_pieces - 3 * len(prompts)
        for pages in (1, 100, 3000, 4096, 8000):
            assert paced.hit_ratio(pages) == unpaced.hit_ratio(pages), pages

    def test_a_ratio_read_between_lookups_follows_the_next_lookup(self) -> None:
        model = model_of([([1, 2], 2 * PAGE)])
        assert model.hit_ratio(2) == 0.0  # read (and summed) before the repeat ...
        model.access([1, 2], 2 * PAGE)
        assert model.hit_ratio(2) == pytest.approx(0.5)  # ... and read again after it: both pages hit

    def test_each_tier_is_an_lru_of_its_effective_size(self) -> None:
        # a loop of 12 pages hits in an LRU of >= 12 pages only: each factor shows which effective size is >= 12
        model = model_of(cyclic(pages=12, rounds=4))
        reuse = model.hit_ratio(float("inf"))
        assert reuse == pytest.approx(0.75)

        def hits(tiers: list[TierCapacity]) -> dict[str, dict[str, float]]:
            return {tier: curve.hit_ratio for tier, curve in model.curve(tiers).items()}

        device = TierCapacity(Tier.DEVICE, 6 * PAGE)
        inclusive = hits([device, TierCapacity(Tier.HOST, 6 * PAGE)])
        assert inclusive["device"] == dict.fromkeys(sc.CAPACITY_FACTORS, reuse) | {"0.25": 0, "0.5": 0, "1": 0}
        # inclusive: max(x * 6, 6) >= 12 from 2x on
        assert inclusive["host"] == dict.fromkeys(sc.CAPACITY_FACTORS, reuse) | {"0.25": 0, "0.5": 0, "1": 0}
        # exclusive: 6 + x * 6 >= 12 from 1x on
        exclusive = hits([device, TierCapacity(Tier.HOST, 6 * PAGE, inclusive=False)])
        assert exclusive["host"] == dict.fromkeys(sc.CAPACITY_FACTORS, reuse) | {"0.25": 0, "0.5": 0}
        # one exclusive LRU with the device (reclaims_copies): the same 6 + x * 6, read from the histogram, never from
        # a simulation (one started now would have served nothing)
        one_lru = [device, TierCapacity(Tier.HOST, 6 * PAGE, inclusive=False, reclaims_copies=True)]
        model.simulate(one_lru)
        assert hits(one_lru)["host"] == exclusive["host"]
        # storage behind an exclusive host: max(x * 8, 6 + 6) >= 12 at every factor
        three = hits([device, TierCapacity(Tier.HOST, 6 * PAGE, False), TierCapacity(Tier.STORAGE, 8 * PAGE)])
        assert three["storage"] == dict.fromkeys(sc.CAPACITY_FACTORS, reuse)
        assert model.curve([device])["device"].tokens == 6 * PAGE

    def test_the_room_a_tier_leaves_free_is_taken_off_its_sizes_and_off_what_it_holds_for_the_tiers_behind(
        self,
    ) -> None:
        model = model_of(cyclic(pages=12, rounds=4))  # hits in an LRU of >= 12 pages only
        reuse = model.hit_ratio(float("inf"))
        device = TierCapacity(Tier.DEVICE, 12 * PAGE)
        full = model.curve([device])["device"].hit_ratio
        assert full["1"] == reuse and full["0.5"] == 0
        # one page free on average: it holds 11 of its 12 pages, 23 of 24 at 2x (no loop of 12 fits at 1x)
        short = model.curve([device], free={"device": 1.0})["device"].hit_ratio
        assert short == full | {"1": 0.0}
        # what the device holds bounds an inclusive host's (max(x * 12, 11)) and adds to an exclusive one's (11 + x * 6)
        inclusive = model.curve([device, TierCapacity(Tier.HOST, 12 * PAGE)], free={"device": 1.0})["host"]
        assert inclusive.hit_ratio["1"] == reuse and inclusive.hit_ratio["0.5"] == 0
        behind = [
            TierCapacity(Tier.DEVICE, 6 * PAGE),
            TierCapacity(Tier.HOST, 6 * PAGE, inclusive=False, reclaims_copies=True),
        ]
        assert model.curve(behind)["host"].hit_ratio["1"] == reuse
        assert model.curve(behind, free={"device": 1.0})["host"].hit_ratio["1"] == 0

    def test_pages_a_store_behind_a_write_back_host_prefetches_take_the_room_of_pages_it_would_serve(self) -> None:
        # device 1 page, host 2 (keeps copies): a b c a b c. Without a store the second c is a host hit; with one,
        # the b it prefetches (a store hit, not the host's) takes c's room, and c comes from the store too
        served = {}
        for store in (False, True):
            tiers = [TierCapacity(Tier.DEVICE, PAGE), TierCapacity(Tier.HOST, 2 * PAGE, False, store_behind=store)]
            model = CapacityModel(PAGE)
            model.simulate(tiers)
            for page in "abcabc":
                model.access([page], PAGE)
            served[store] = model.curve(tiers)["host"].hit_ratio["1"]
        assert served == {False: pytest.approx(2 / 6), True: pytest.approx(1 / 6)}

    def test_a_tier_of_unknown_size_and_those_behind_it_are_left_out(self) -> None:
        model = model_of(cyclic(pages=4, rounds=2))
        tiers = [TierCapacity(Tier.DEVICE, 64), TierCapacity(Tier.HOST, None), TierCapacity(Tier.STORAGE, 1 << 20)]
        assert set(model.curve(tiers)) == {"device"}
        assert set(model.curve(tiers, {("host", "kv"): 128})) == {"device", "host", "storage"}

    @pytest.mark.parametrize(
        "tiers",
        [
            [TierCapacity(Tier.HOST, 8), TierCapacity(Tier.DEVICE, 8)],  # not fastest first
            [TierCapacity(Tier.DEVICE, 8), TierCapacity(Tier.DEVICE, 8)],
            [TierCapacity(Tier.DEVICE, -1)],
            [TierCapacity(Tier.DEVICE, 1.5)],  # type: ignore[arg-type]
            [TierCapacity(Tier.DEVICE, 8), TierCapacity(Tier.HOST, 8, reclaims_copies=True)],  # inclusive: no copies
            [TierCapacity(Tier.DEVICE, 8), TierCapacity(Tier.HOST, 8, store_behind=True)],  # inclusive: not simulated
            [("device", 8)],
        ],
    )
    def test_tiers_that_are_not_fastest_first_with_whole_sizes_are_refused_at_setup(self, tiers: list[object]) -> None:
        sdk = make_sdk()
        try:
            with pytest.raises(ValueError):
                sdk.telemetry.capacity_feed(PAGE, tiers)  # type: ignore[arg-type]
        finally:
            sdk.shutdown()


class TestTheFeed:
    TIERS = (TierCapacity(Tier.DEVICE, 4 * PAGE), TierCapacity(Tier.HOST, 8 * PAGE, inclusive=False))

    def test_lookups_put_on_the_queue_become_the_gauge_per_tier_and_factor(self, sdk: Sdk) -> None:
        tokens = [random.Random(3).randrange(1000) for _ in range(8 * PAGE + 5)]  # 8 pages and a partial one
        tiers = [TierCapacity(Tier.DEVICE, 4 * PAGE), TierCapacity(Tier.HOST, 6 * PAGE)]
        feed = sdk.telemetry.capacity_feed(PAGE, tiers, keys=lambda ids: page_keys(ids, PAGE))
        for _ in range(3):
            feed.put((next(feed.seq), tokens, len(tokens)))
        points = sdk.points(sc.METRIC_CAPACITY_HIT_RATIO)
        assert {frozenset(dict(k)) for k in points} == {frozenset({sc.ATTR_TIER, sc.ATTR_CAPACITY_FACTOR})}
        got = {(dict(k)[sc.ATTR_TIER], dict(k)[sc.ATTR_CAPACITY_FACTOR]): p.value for k, p in points.items()}
        reused = 2 * 8 * PAGE / (3 * len(tokens))  # the 8 pages of the 2nd and 3rd request
        # the device holds 4 of the 8 pages (and the prefix rule keeps the first 4 at 1x), at 2x all 8
        assert got[("device", "1")] == pytest.approx(reused / 2, abs=1e-9)
        assert got[("device", "2")] == pytest.approx(reused, abs=1e-9)
        assert got[("host", "0.25")] == pytest.approx(reused / 2, abs=1e-9)  # inclusive: what the device holds
        assert got[("host", "1")] == pytest.approx(reused * 6 / 8, abs=1e-9)
        assert got[("host", "inf")] == pytest.approx(reused, abs=1e-9)
        assert feed.curve()["host"].hit_ratio["0.25"] == pytest.approx(got[("host", "0.25")], abs=1e-9)
        assert sdk.metrics()[sc.METRIC_CAPACITY_HIT_RATIO].unit == "1"

    def test_the_free_room_reported_at_lookups_shrinks_the_tier_by_its_mean_until_the_tiers_change(
        self, sdk: Sdk
    ) -> None:
        device = [TierCapacity(Tier.DEVICE, 4 * PAGE)]
        feed = sdk.telemetry.capacity_feed(PAGE, device)
        for keys, tokens in cyclic(pages=4, rounds=3):
            feed.put((next(feed.seq), keys, tokens))
        sdk.telemetry.snapshot()
        assert feed.curve()["device"].hit_ratio["1"] == pytest.approx(2 / 3)
        feed.report_free(Tier.DEVICE, 0)
        feed.report_free(Tier.DEVICE, 2 * PAGE)  # a page free on average: 3 of its 4 pages hold the loop of 4
        feed.report_free(Tier.DEVICE, "16")  # type: ignore[arg-type]  # not a count: ignored, never raised
        feed.report_free("nvme", PAGE)  # type: ignore[arg-type]  # not a tier: ignored
        assert feed.curve()["device"].hit_ratio["1"] == 0.0
        feed.set_tiers(device)  # a resized pool: its old free room says nothing of the new size
        assert feed.curve()["device"].hit_ratio["1"] == pytest.approx(2 / 3)

    def test_no_key_or_token_id_reaches_a_metric_or_span(self, sdk: Sdk) -> None:
        feed = sdk.telemetry.capacity_feed(PAGE, self.TIERS)
        secret = "page-of-a-secret-prompt"
        feed.put((next(feed.seq), [secret], PAGE))
        feed.put((next(feed.seq), [secret], PAGE))
        exported = repr(sdk.metrics()) + repr(sdk.spans())
        assert sc.METRIC_CAPACITY_HIT_RATIO in exported and secret not in exported

    def test_capacity_from_the_pool_reading_when_the_producer_gives_none(self, sdk: Sdk) -> None:
        sdk.telemetry.add_pool_usage_source(lambda: [PoolUsage(Tier.DEVICE, "kv", 0, 2 * PAGE)])
        feed = sdk.telemetry.capacity_feed(PAGE, [TierCapacity(Tier.DEVICE, None)])
        for keys in ([1], [2], [1], [2]):
            feed.put((next(feed.seq), keys, PAGE))
        today = {sc.ATTR_TIER: "device", sc.ATTR_CAPACITY_FACTOR: "1"}
        assert sdk.value(sc.METRIC_CAPACITY_HIT_RATIO, today) == 0.5
        assert feed.curve({("device", "kv"): 2 * PAGE})["device"].tokens == 2 * PAGE

    def test_no_gauge_before_a_lookup_or_without_a_known_capacity(self, sdk: Sdk) -> None:
        sdk.telemetry.capacity_feed(PAGE, [TierCapacity(Tier.DEVICE, None)])
        assert sdk.points(sc.METRIC_CAPACITY_HIT_RATIO) == {}

    def test_one_feed_per_telemetry_the_last_replaces_the_one_before(self, sdk: Sdk) -> None:
        first = sdk.telemetry.capacity_feed(PAGE, self.TIERS)
        for _ in range(2):
            first.put((next(first.seq), [1], PAGE))
        second = sdk.telemetry.capacity_feed(PAGE, [TierCapacity(Tier.DEVICE, PAGE)])
        for _ in range(4):
            second.put((next(second.seq), [2], PAGE))
        points = sdk.points(sc.METRIC_CAPACITY_HIT_RATIO)
        assert {dict(k)[sc.ATTR_TIER] for k in points} == {"device"}
        assert sdk.value(sc.METRIC_CAPACITY_HIT_RATIO, {sc.ATTR_TIER: "device", sc.ATTR_CAPACITY_FACTOR: "1"}) == 0.75

    def test_a_full_queue_sheds_the_oldest_lookups_and_counts_them_never_blocking(self) -> None:
        sdk = make_sdk(max_queue=4)
        gate = threading.Event()
        try:
            feed = sdk.telemetry.capacity_feed(PAGE, self.TIERS, keys=lambda keys: (gate.wait(5), keys)[1])
            for _ in range(10):  # the host thread waits in the first build: the rest queue past the bound
                feed.put((next(feed.seq), [1], PAGE))
            gate.set()
            rejected = sdk.telemetry.snapshot()[sc.METRIC_RECORDS_REJECTED]
            shed = rejected[(RecordKind.CAPACITY.value, Problem.QUEUE_FULL.value)]
            assert 5 <= shed <= 6  # at most 4 queued (one may have been taken before the others were put)
            assert not [key for key in rejected if key[0] == RecordKind.TRANSFER.value]
        finally:
            gate.set()
            sdk.shutdown()

    def test_the_host_thread_pauses_within_a_long_lookup_as_its_rounds_do(
        self, sdk: Sdk, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        sleep = time.sleep
        feed = sdk.telemetry.capacity_feed(1, self.TIERS, keys=lambda ids: page_keys(ids, 1))
        paused: list[tuple[str, bool]] = []  # (thread, inside the lookup: the feed's lock held)

        def timed(seconds: float) -> None:
            paused.append((threading.current_thread().name, feed._lock.locked()))
            sleep(seconds)

        monkeypatch.setattr(time, "sleep", timed)
        prompt = list(range(32_768))  # one-token pages: a lookup of milliseconds, ~0.2 us a page on any machine
        feed.put((next(feed.seq), prompt, len(prompt)))
        sdk.telemetry.snapshot()  # waits for the lookup, at the host thread's pace
        # one lookup, many slices long: the host thread paused in the middle of it, the GIL handed over meanwhile
        assert (HOST_THREAD_NAME, True) in paused
        assert feed.curve()["device"].hit_ratio["inf"] == 0.0  # counted whole: every page seen for the first time

    def test_keys_that_raise_are_counted_and_the_feed_goes_on(self, sdk: Sdk) -> None:
        feed = sdk.telemetry.capacity_feed(PAGE, self.TIERS, keys=lambda keys: [k / 1 for k in keys])
        feed.put((next(feed.seq), ["not a number"], PAGE))
        feed.put((next(feed.seq), [1], PAGE))
        feed.put((next(feed.seq), [1], PAGE))
        rejected = sdk.telemetry.snapshot()[sc.METRIC_RECORDS_REJECTED]
        assert rejected[(RecordKind.CAPACITY.value, Problem.BUILD_FAILED.value)] == 1
        assert feed.curve()["device"].hit_ratio["1"] == 0.5


def footprint(root: object) -> int:
    """Bytes of every object reachable from ``root`` (classes, modules and functions aside), each counted once."""
    seen: set[int] = set()
    stack, total = [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


class TestTheBound:
    def test_ten_million_unique_pages_keep_the_estimator_within_its_footprint(self) -> None:
        model = CapacityModel(PAGE)  # with the simulations of an exclusive tier, the larger footprint
        model.simulate([TierCapacity(Tier.DEVICE, 1 << 24), TierCapacity(Tier.HOST, 1 << 26, inclusive=False)])
        pages, largest = 256, 0  # 4,096-token prompts, no page ever seen twice
        for lookup in range(10_000_000 // pages):
            model.access(range(lookup * pages, (lookup + 1) * pages), pages * PAGE)
            if lookup % 3000 == 0:
                largest = max(largest, footprint(model))
        assert model.sampled_keys == MAX_SAMPLED_KEYS and model.threshold < 0  # sampling well below half the pages
        assert largest <= FOOTPRINT_BYTES + SIMULATION_BYTES
        assert footprint(model) - footprint(model._sims) <= FOOTPRINT_BYTES  # the stack model alone
        assert model.hit_ratio(math.inf) == pytest.approx(0.0, abs=0.001)  # nothing reused: all cold

    def test_a_cyclic_scan_larger_than_the_sample_is_a_step_at_its_length(self) -> None:
        documents, pages, rounds = 2500, 16, 3  # 40,000 distinct pages, ~5x the sample
        lookups = [
            ([d * pages + p for p in range(pages)], pages * PAGE) for _ in range(rounds) for d in range(documents)
        ]
        model = model_of(lookups)
        assert model.sampled_keys == MAX_SAMPLED_KEYS
        loop = documents * pages
        assert model.hit_ratio(0.9 * loop) <= ERROR_BOUND  # LRU: nothing survives a loop longer than the cache
        assert model.hit_ratio(1.1 * loop) == pytest.approx((rounds - 1) / rounds, abs=ERROR_BOUND)
        assert model.hit_ratio(math.inf) == pytest.approx((rounds - 1) / rounds, abs=ERROR_BOUND)

    def test_a_zipf_over_pages_is_within_the_bound_of_an_exact_lru(self) -> None:
        rng = random.Random(5)
        weights = list(itertools.accumulate(1 / (rank + 1) ** 0.9 for rank in range(100_000)))
        lookups: list[Lookup] = [([bisect.bisect(weights, rng.random() * weights[-1])], PAGE) for _ in range(400_000)]
        model = model_of(lookups)
        assert model.sampled_keys == MAX_SAMPLED_KEYS  # sampling at ~10 %: the popular pages matter most
        for pages in (1_000, 10_000, 50_000):
            assert model.hit_ratio(pages) == pytest.approx(exact_lru(lookups, pages), abs=ERROR_BOUND), pages


class TestWarmthAndChange:
    def test_a_changed_workload_is_followed_within_three_half_lives(self) -> None:
        """A cyclic scan of 20 pages (an LRU of 32 serves it all) then one of 60 (an LRU of 32 serves none): three
        half-lives later the old scan weighs an eighth, and the curve is within that of the new scan's own."""
        old = [([page], PAGE) for _ in range(HALF_LIFE_LOOKUPS // 20) for page in range(20)]
        new = [([1_000 + page], PAGE) for _ in range(3 * HALF_LIFE_LOOKUPS // 60 + 1) for page in range(60)]
        new = new[: 3 * HALF_LIFE_LOOKUPS]
        changed, alone = model_of(old + new), model_of(new)
        assert model_of(old).hit_ratio(32) == pytest.approx(1.0, abs=0.01)
        assert alone.hit_ratio(32) == 0.0
        assert changed.hit_ratio(32) <= 1 / 8 + ERROR_BOUND  # without the halvings: a quarter (10,000 of 40,000)
        assert changed.hit_ratio(64) == pytest.approx(alone.hit_ratio(64), abs=1 / 8 + ERROR_BOUND)

    def test_the_curve_says_how_many_lookups_and_sampled_pages_it_rests_on(self) -> None:
        model = model_of([([page % 50], PAGE) for page in range(HALF_LIFE_LOOKUPS - 1)])
        (curve,) = model.curve([TierCapacity(Tier.DEVICE, 8 * PAGE)]).values()
        assert (curve.lookups, curve.sampled_pages) == (HALF_LIFE_LOOKUPS - 1, 50)
        model.access([7], PAGE)  # the lookup that completes a half-life halves every weight, this one's included
        (curve,) = model.curve([TierCapacity(Tier.DEVICE, 8 * PAGE)]).values()
        assert curve.lookups == HALF_LIFE_LOOKUPS // 2

    def test_its_warmth_is_exported_per_tier_beside_the_curve(self) -> None:
        sdk = make_sdk(spans=False)
        try:
            feed = sdk.telemetry.capacity_feed(
                PAGE, [TierCapacity(Tier.DEVICE, 2 * PAGE), TierCapacity(Tier.HOST, 4 * PAGE)]
            )
            for keys in ([1], [2], [3], [1], [2]):
                feed.put((next(feed.seq), keys, PAGE))
            lookups = sdk.points(sc.METRIC_CAPACITY_LOOKUPS)
            pages = sdk.points(sc.METRIC_CAPACITY_SAMPLED_PAGES)
        finally:
            sdk.shutdown()
        assert {dict(k)[sc.ATTR_TIER]: p.value for k, p in lookups.items()} == {"device": 5, "host": 5}
        assert {dict(k)[sc.ATTR_TIER]: p.value for k, p in pages.items()} == {"device": 3, "host": 3}


def test_the_export_process_exports_the_curve_over_otlp_from_the_shared_table() -> None:
    """Over OTLP the curve leaves from the export process, which reads the capacity block of the shared table."""
    with OtlpReceiver() as rx:
        setup = configure(env={}, endpoint=rx.grpc_endpoint, protocol="grpc")
        try:
            feed = setup.telemetry.capacity_feed(PAGE, [TierCapacity(Tier.DEVICE, 2 * PAGE)])
            for keys in ([1], [2], [1], [2]):
                feed.put((next(feed.seq), keys, PAGE))
            setup.force_flush()

            def today() -> float | None:
                metric = rx.latest_metric(sc.METRIC_CAPACITY_HIT_RATIO)
                points = (
                    {}
                    if metric is None
                    else {
                        attributes(p.attributes)[sc.ATTR_CAPACITY_FACTOR]: p.as_double for p in metric.gauge.data_points
                    }
                )
                return points.get("1")

            assert rx.wait_for(lambda: today() == 0.5, timeout_s=20), today()
            metric = rx.latest_metric(sc.METRIC_CAPACITY_HIT_RATIO)
            assert metric is not None and metric.unit == "1"
            assert {attributes(p.attributes)[sc.ATTR_TIER] for p in metric.gauge.data_points} == {"device"}
            assert setup.telemetry.export_pid is not None  # exported from another process
        finally:
            setup.shutdown()


def test_token_ids_given_over_otlp_are_modelled_by_the_export_process_as_this_process_would() -> None:
    """``put_ids`` over OTLP: the ids go through the id ring, the export process keys them and runs the model, and
    the curve it exports is the one a model fed the same keys here predicts, at every factor of every tier (a tier
    sized by the pool reading included); the host's own model sees none of them."""
    rng = random.Random(5)
    docs = [[rng.randrange(1, 32_000) for _ in range(rng.randint(2, 12) * PAGE)] for _ in range(40)]
    prompts = [rng.choice(docs) + [rng.randrange(32_000) for _ in range(5)] for _ in range(400)]
    tiers = [TierCapacity(Tier.DEVICE, 8 * PAGE), TierCapacity(Tier.HOST, None, inclusive=True)]
    expected_model = CapacityModel(PAGE)
    for prompt in prompts:
        expected_model.access(page_keys(prompt, PAGE, 11), len(prompt))
    expected = expected_model.curve(tiers, {("host", sc.DEFAULT_POOL): 32 * PAGE})

    want = {(tier, f): c.hit_ratio[f] for tier, c in expected.items() for f in sc.CAPACITY_FACTORS}
    with OtlpReceiver() as rx:
        setup = configure(env={}, endpoint=rx.grpc_endpoint, protocol="grpc")
        try:
            setup.telemetry.add_pool_usage_source(lambda: [PoolUsage(Tier.HOST, sc.DEFAULT_POOL, 0, 32 * PAGE)])
            feed = setup.telemetry.capacity_feed(PAGE, tiers)
            for i, prompt in enumerate(prompts):
                feed.put_ids(array("q", prompt) if i % 2 else prompt, len(prompt), 11)  # SGLang's array, or a list
            setup.force_flush()
            assert rx.wait_for(lambda: rx.capacity_curve().keys() == want.keys(), timeout_s=20), rx.capacity_curve()
            assert rx.wait_for(lambda: rx.capacity_curve() == pytest.approx(want, abs=1e-9), timeout_s=20), (
                rx.capacity_curve()
            )
            assert feed.curve()["device"].hit_ratio["inf"] == 0.0  # nothing was modelled in the host
        finally:
            setup.shutdown()


def block_hashes(prompt: list[int], width: int) -> list[bytes]:
    """vLLM-like block hashes of ``prompt``: a digest of ``width`` bytes chained over each full page."""
    hashes: list[bytes] = []
    for start in range(0, len(prompt) - PAGE + 1, PAGE):
        parent = hashes[-1] if hashes else b""
        hashes.append(hashlib.sha256(parent + array("q", prompt[start : start + PAGE]).tobytes()).digest()[:width])
    return hashes


@pytest.mark.parametrize("width", [32, 16])  # vLLM's sha256 digests, and xxhash's 128-bit ones
def test_block_hashes_given_over_otlp_are_modelled_by_the_export_process_as_they_are_in_process(width: int) -> None:
    """``put_hashes`` over OTLP: the digests go through the id ring, the export process keys each page by its first 8
    bytes, and the curve it exports is the one an in-process telemetry fed the same lists predicts (queued by
    reference, keyed by the digests themselves: the sample holds every page, so the keys' spelling cannot matter), at
    every factor of every tier; the host's own model sees none of them."""
    rng = random.Random(6)
    docs = [[rng.randrange(1, 32_000) for _ in range(rng.randint(2, 12) * PAGE)] for _ in range(40)]
    prompts = [rng.choice(docs) + [rng.randrange(32_000) for _ in range(5)] for _ in range(400)]
    tiers = [TierCapacity(Tier.DEVICE, 8 * PAGE), TierCapacity(Tier.HOST, 32 * PAGE, inclusive=True)]
    local = make_sdk()
    try:
        local_feed = local.telemetry.capacity_feed(PAGE, tiers)
        for prompt in prompts:
            local_feed.put_hashes(block_hashes(prompt, width), len(prompt))
        local.telemetry.snapshot()  # waits for the host thread's lookups
        expected = local_feed.curve()
    finally:
        local.shutdown()
    want = {(tier, f): c.hit_ratio[f] for tier, c in expected.items() for f in sc.CAPACITY_FACTORS}
    assert 0 < want[("device", "1")] < want[("host", "1")] < 1  # a curve that says something

    with OtlpReceiver() as rx:
        setup = configure(env={}, endpoint=rx.grpc_endpoint, protocol="grpc")
        try:
            feed = setup.telemetry.capacity_feed(PAGE, tiers)
            for prompt in prompts:
                feed.put_hashes(block_hashes(prompt, width), len(prompt))
            setup.force_flush()
            assert rx.wait_for(lambda: rx.capacity_curve() == pytest.approx(want, abs=1e-9), timeout_s=20), (
                rx.capacity_curve(),
                want,
            )
            assert feed.curve()["device"].hit_ratio["inf"] == 0.0  # nothing was modelled in the host
        finally:
            setup.shutdown()


def test_token_ids_the_id_ring_cannot_take_are_dropped_and_counted() -> None:
    """A lookup the id ring has no room for (here: a prompt larger than the whole ring) is dropped and counted as
    ``queue_full``, and ids that are not 64-bit integers as ``build_failed``; neither raises into the engine."""
    setup = configure(env={}, endpoint="http://127.0.0.1:9", protocol="grpc")
    try:
        feed = setup.telemetry.capacity_feed(PAGE, [TierCapacity(Tier.DEVICE, 8 * PAGE)])
        feed.put_ids(array("q", bytes(ARENA_BYTES)), ARENA_BYTES // 8)
        feed.put_ids([1, 2**64], 2)
        rejected = setup.telemetry.snapshot()[sc.METRIC_RECORDS_REJECTED]
        assert rejected[(RecordKind.CAPACITY.value, Problem.QUEUE_FULL.value)] == 1
        assert rejected[(RecordKind.CAPACITY.value, Problem.BUILD_FAILED.value)] == 1
    finally:
        setup.shutdown(timeout_s=1)
