"""Capacity answers on SGLang's real HiCache classes, checked the only honest way: by re-running.

A seeded workload is served once at today's sizes (:class:`~otel_hicache.testing.sglang_serving.Served`: SGLang's own
prefix match, admission, load back, allocation with eviction and release, instrumented), and the predictions
``hicache.capacity.hit_ratio`` are read. Then the same workload is served again, uninstrumented, with one tier at 0.5x
and 2x its size (the host also at 4x), the other unchanged: each prediction must be within 3 points of what SGLang's
own per-tier counters observe in that re-run, and the prediction at 1x within 2 points of the first run's. Workloads
with a spread of reuse distances (:mod:`otel_hicache.testing.workloads`): multi-turn chats on shared system prompts,
questions over Zipf-popular documents, and a cyclic scan larger than the device tier (which LRU serves nothing of until
the tier holds the whole cycle).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("sglang")

from opentelemetry.instrumentation.utils import suppress_instrumentation

from otel_hicache import semconv as sc
from otel_hicache.records import PrefixSplit
from otel_hicache.testing.sdk import Sdk
from otel_hicache.testing.sglang_serving import Served
from otel_hicache.testing.workloads import chats, documents, scan

pytestmark = pytest.mark.sglang

PAGE = 16
DEVICE, HOST = 4096, 8192  # tokens today
REQUESTS = 800
#: Each workload sized so that its curve moves across the sizes tried (the scan's cycle, ~6,000 tokens, lies between
#: the device tier and twice it).
WORKLOADS = {
    "chats": lambda: chats(seed=7, active=32),
    "documents": lambda: documents(seed=7, count=96),
    "scan": lambda: scan(seed=7, count=36),
}
#: Re-runs: (tier, factor) -> (device, host) tokens.
RERUNS = {
    ("device", "0.5"): (DEVICE // 2, HOST),
    ("device", "2"): (2 * DEVICE, HOST),
    ("host", "0.5"): (DEVICE, HOST // 2),
    ("host", "2"): (DEVICE, 2 * HOST),
    ("host", "4"): (DEVICE, 4 * HOST),
}


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread: the KV copies of these small pools only contend on a busy machine with more."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def serving(policy: str, device: int, host: int, page: int = PAGE) -> Iterator[Served]:
    """A served cache, closed at the end. Predictions are read while it lives: the host tier is sized by its pool's
    reading, which goes with the cache (as in a server, where the cache lives as long as the process)."""
    served = Served(policy, device, host, page_size=page)
    try:
        yield served
    finally:
        served.close()


def serve(policy: str, device: int, host: int, prompts: list[list[int]], page: int = PAGE) -> PrefixSplit:
    with serving(policy, device, host, page) as served:
        return served.serve(prompts)


def observed(split: PrefixSplit, tier: str) -> float:
    """The share of prompt tokens SGLang served from ``tier`` or a faster one."""
    hits = split.device_hit + (split.host_hit if tier == "host" else 0)
    return hits / (split.input_tokens + split.device_hit + split.host_hit + split.storage_hit)


def predictions(otel: Sdk) -> dict[tuple[str, str], float]:
    otel.counters()  # every queued lookup is in the model
    points = otel.points(sc.METRIC_CAPACITY_HIT_RATIO)
    return {(dict(key)[sc.ATTR_TIER], dict(key)[sc.ATTR_CAPACITY_FACTOR]): point.value for key, point in points.items()}


@pytest.mark.parametrize(
    ("workload", "policy", "page"),
    [
        ("chats", "write_through", PAGE),
        ("documents", "write_through", PAGE),
        ("scan", "write_through", PAGE),
        ("documents", "write_back", PAGE),
        # the host holds only what the device hit twice: not modelled (one info line), the device is
        ("chats", "write_through_selective", PAGE),
        # SGLang's default page of one token: prompts of 72 to 360 pages, keyed per page below 96 pages and with numpy
        # from there (otel_hicache.prefix_keys), their shared documents the same keys either way
        ("documents", "write_through", 1),
    ],
)
def test_each_prediction_is_what_rerunning_sglang_at_that_size_observes(
    workload: str, policy: str, page: int, instrumented: Sdk, one_thread: None, caplog: pytest.LogCaptureFixture
) -> None:
    prompts = list(itertools.islice(WORKLOADS[workload](), REQUESTS))
    with caplog.at_level(logging.INFO, logger="otel_hicache"), serving(policy, DEVICE, HOST, page) as served:
        today = served.serve(prompts)
        predicted = predictions(instrumented)
    said = [r.getMessage() for r in caplog.records if sc.METRIC_CAPACITY_HIT_RATIO in r.getMessage()]
    modelled = ("device",) if policy == "write_through_selective" else ("device", "host")
    assert {tier for tier, _ in predicted} == set(modelled)
    assert {factor for _, factor in predicted} == set(sc.CAPACITY_FACTORS)
    assert len(said) == (2 - len(modelled)) and all(policy in line and "no host points" in line for line in said)

    errors: dict[tuple[str, str], float] = {}
    for tier in modelled:
        errors[tier, "1"] = predicted[tier, "1"] - observed(today, tier)
    with suppress_instrumentation():  # the re-runs feed nothing
        for (tier, factor), (device, host) in RERUNS.items():
            if tier in modelled:
                rerun = serve(policy, device, host, prompts, page)
                errors[tier, factor] = predicted[tier, factor] - observed(rerun, tier)
    report = {key: round(100 * error, 1) for key, error in errors.items()}
    assert all(abs(error) <= 0.02 for (_, factor), error in errors.items() if factor == "1"), report
    assert all(abs(error) <= 0.03 for error in errors.values()), report
    if workload == "scan":  # LRU serves nothing of a cycle larger than the tier, all of one it holds
        assert predicted["device", "1"] == 0.0 < predicted["device", "2"]


def test_the_curve_is_fed_once_per_admitted_request(instrumented: Sdk, one_thread: None) -> None:
    """Served twice, a prompt is one cold lookup then one hit: the ceiling is the share of the second (its full pages;
    SGLang's own split says the same of the device)."""
    prompt = list(range(1, 10 * PAGE + 5))  # 10 full pages and a partial one
    with serving("write_through", DEVICE, HOST) as served:
        split = served.serve([prompt, prompt])
        predicted = predictions(instrumented)
    paged = 10 * PAGE / (2 * len(prompt))
    assert predicted["device", "inf"] == pytest.approx(paged)
    assert predicted["device", "1"] == pytest.approx(paged)
    assert split.device_hit == 10 * PAGE  # SGLang's: the same full pages (its partial page is recomputed)


def test_retracted_requests_are_not_lookups(instrumented: Sdk, one_thread: None, cpu_sglang: Any) -> None:
    """A retracted request coming back is not counted by SGLang's per-tier counters, nor by the estimator."""
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.managers.scheduler_components.metrics_reporter import PrefillStats

    from otel_hicache.testing.sglang import make_request

    with serving("write_through", DEVICE, HOST) as served:
        served.serve([list(range(1, 4 * PAGE + 1))])
        retracted = make_request(list(range(1, 4 * PAGE + 1)), "retracted", retracted=True)
        retracted.init_next_round_input(served.cache)
        adder = PrefillAdder(PAGE, served.cache, served.allocator, None, 1.0, 1 << 20, None)
        adder.add_one_req(retracted, False, None)
        PrefillStats.from_adder(adder, running_reqs=[])  # its batch's stats, as the scheduler builds them
        predicted = predictions(instrumented)
    assert predicted["device", "inf"] == 0.0  # one lookup only: the first, cold


def test_a_scheduler_exports_the_curve_of_both_tiers_over_otlp(cpu_sglang: Any, one_thread: None) -> None:
    """Over OTLP (the export process of :func:`otel_hicache.sdk.configure`) into the in-process receiver: every tier and
    factor of the closed sets, ratios that never fall as a tier grows, and the capacities they are for beside them."""
    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor
    from otel_hicache.sdk import configure
    from otel_hicache.testing.otlp_receiver import OtlpReceiver, attributes

    expected = {(tier, factor) for tier in ("device", "host") for factor in sc.CAPACITY_FACTORS}

    with OtlpReceiver() as receiver:
        setup = configure(endpoint=receiver.grpc_endpoint, protocol="grpc", service_name="sglang-capacity", env={})
        instrumentor = SGLangHiCacheInstrumentor()
        instrumentor.instrument(telemetry=setup.telemetry, stat_loggers=False)
        try:
            with serving("write_through", DEVICE, HOST) as served:
                served.serve(list(itertools.islice(WORKLOADS["documents"](), 200)))
                setup.telemetry.snapshot()  # every lookup is in the model
                setup.force_flush()
                assert receiver.wait_for(lambda: set(receiver.capacity_curve()) == expected, timeout_s=30)
        finally:
            instrumentor.uninstrument()
            setup.shutdown()
    curve = receiver.capacity_curve()
    for tier in ("device", "host"):
        ratios = [curve[tier, factor] for factor in sc.CAPACITY_FACTORS]
        assert 0 < ratios[0] and ratios == sorted(ratios) and ratios[-1] < 1
    limit = receiver.latest_metric(sc.METRIC_POOL_LIMIT)
    assert limit is not None
    host = [p for p in limit.sum.data_points if attributes(p.attributes)[sc.ATTR_TIER] == "host"]
    assert [p.as_int for p in host] == [HOST + PAGE]  # SGLang's host pool: ratio x device, plus its padding page


def test_a_chunked_request_is_one_admission_however_many_batches_its_chunks_take(instrumented: Sdk) -> None:
    """The estimator is fed from each prefill batch's list, where a chunked request's next chunks come back: fed
    again, the second lookup of its prompt would count its own pages as hits."""
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.managers.scheduler_components.metrics_reporter import PrefillStats

    from otel_hicache.testing.sglang import build_hicache, make_request

    cache, allocator, _ = build_hicache("write_through", kv_size=1024, page_size=PAGE)
    req = make_request(list(range(1, 101)), "long")
    req.init_next_round_input(cache)
    chunk = 32
    adder = PrefillAdder(cache.page_size, cache, allocator, None, 1.0, 4096, chunk)
    adder.add_one_req(req, False, None)
    assert adder.new_chunked_req is req  # admitted: its first chunk runs in this batch
    PrefillStats.from_adder(adder, running_reqs=[])
    for _ in range(2):  # its next chunks, a batch each, as the scheduler adds them (``add_chunked_req``)
        adder = PrefillAdder(cache.page_size, cache, allocator, None, 1.0, 4096, chunk)
        adder.add_chunked_req(req)
        assert adder.can_run_list == [req]
        PrefillStats.from_adder(adder, running_reqs=[])

    predicted = predictions(instrumented)
    assert predicted  # the request was fed
    assert set(predicted.values()) == {0.0}  # once: a prompt never seen before hits nothing at any size


def test_a_new_request_reusing_a_finished_ones_rid_is_a_new_admission(instrumented: Sdk) -> None:
    """A rid is not a request: SGLang's PD prefill server gets a retracted request's rebootstrap as a new ``Req`` with
    the old rid, and clients may reuse their own rids once a request finished. Fed again, the same prompt hits."""
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.managers.scheduler_components.metrics_reporter import PrefillStats

    from otel_hicache.testing.sglang import build_hicache, make_request

    cache, allocator, _ = build_hicache("write_through", kv_size=1024, page_size=PAGE)
    prompt = list(range(1, 65))
    for _ in range(2):
        req = make_request(prompt, "reused")
        req.init_next_round_input(cache)
        adder = PrefillAdder(cache.page_size, cache, allocator, None, 1.0, 4096, None)
        adder.add_one_req(req, False, None)
        PrefillStats.from_adder(adder, running_reqs=[])

    assert predictions(instrumented)["device", "inf"] > 0  # the second lookup of the prompt hit its pages


def test_requests_in_other_cache_namespaces_share_no_page(cpu_sglang: Any) -> None:
    """SGLang's radix tree keys a request's prompt in its ``extra_key`` and ``cache_salt``: the same tokens under
    another salt are other pages, in the estimator too; at one-token pages, numpy's keys (a long prompt) and the
    per-page ones (a short prompt that starts it) agree."""
    from otel_hicache.integrations.sglang.capacity import request_keys
    from otel_hicache.prefix_keys import VECTOR_PAGES, VectorKeys
    from otel_hicache.testing.sglang import make_request

    tokens = list(range(1, 4 * VECTOR_PAGES))

    def keys(tokens: list[int], salt: str | None = None, page: int = 1) -> list[Any]:
        req = make_request(tokens, "r")
        req.cache_salt = salt
        return list(request_keys(req, page))

    req = make_request(tokens, "r")
    keyed = request_keys(req, 1)
    assert isinstance(keyed, VectorKeys)  # SGLang's array('q')
    req.origin_input_ids.append(7)  # the engine may still resize its array: ours is a copy
    assert list(keyed) == keys(tokens)
    for page in (1, PAGE):
        plain, salted = keys(tokens, page=page), keys(tokens, "salt", page)
        assert not set(plain) & set(salted)
        assert keys(tokens, "salt", page) == salted
        assert keys(tokens[: 10 * page], "salt", page) == salted[:10]


def test_a_hybrid_models_tree_gets_no_curve_and_one_info_line(
    instrumented: Sdk, one_thread: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A tree that keeps sliding-window state beside its KV (SGLang's SWA hybrid cache, its real classes serving the
    documents workload) is not what the model describes: no points rather than a curve of the wrong cache."""
    prompts = list(itertools.islice(documents(seed=7, count=12), 40))
    with caplog.at_level(logging.INFO, logger="otel_hicache"):
        for _ in range(2):  # said once per process
            with serving_hybrid() as served:
                served.serve(prompts)
                assert served.split.device_hit > 0  # the hybrid tree served prefixes
                assert predictions(instrumented) == {}
    said = [r.getMessage() for r in caplog.records if sc.METRIC_CAPACITY_HIT_RATIO in r.getMessage()]
    assert len(said) == 1 and "swa" in said[0] and "no points" in said[0]


@contextlib.contextmanager
def serving_hybrid() -> Iterator[Served]:
    served = Served("write_through", 2048, 4096, page_size=1, hybrid_swa=True)  # SGLang's SWA allocator: 1-token pages
    try:
        yield served
    finally:
        served.close()
