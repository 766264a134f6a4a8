"""SGLang changes under the adapter: its real classes, with what a later release might change done to them.

Each scenario is a change SGLang could ship (its ack queue becomes a ``deque``, acks leave it by slicing, a method
takes other parameters, a new drop reason, a renamed prefill counter); the rule is that SGLang keeps running, nothing
is lost silently (reported, counted under ``other``, or caught by the self-check against SGLang's own collector), and
a problem is said once.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("sglang")

from otel_hicache import semconv as sc
from otel_hicache.testing.sdk import Sdk
from otel_hicache.testing.sglang import build_hicache, make_request

pytestmark = pytest.mark.sglang

SEQ = list(range(1, 21))


def insert(cache: Any, allocator: Any, tokens: list[int]) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=allocator.alloc(len(tokens))))


def submitted_backup(sglang_metrics: Any) -> tuple[Any, Any]:
    """A cache with one backup ack submitted and complete, not yet consumed: (cache, the ack queue)."""
    cache, allocator, _ = build_hicache("write_through", metrics=sglang_metrics)
    insert(cache, allocator, SEQ)
    cache.flush_pending_backups()
    queue = cache.cache_controller.ack_write_queue
    (ack,) = queue
    ack.finish_event.synchronize()
    return cache, queue


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def mismatches(otel: Sdk) -> dict[tuple[Any, ...], int]:
    return {k: v for k, v in otel.counters()[sc.METRIC_ENGINE_MISMATCH].items() if v}


LAG_S = 0.2


@pytest.fixture
def short_lag(monkeypatch: pytest.MonkeyPatch) -> None:
    """The self-check's window (a difference must outlast it to be real), short for the tests."""
    from otel_hicache.integrations.sglang import self_check

    monkeypatch.setattr(self_check, "CHECK_LAG_S", LAG_S)


def checked_for(otel: Sdk, seconds: float) -> dict[tuple[Any, ...], int]:
    """Run the self-check (each snapshot runs it) for ``seconds``; the mismatches counted by then."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = mismatches(otel)
        time.sleep(LAG_S / 4)
    return found


def test_a_deque_ack_queue_stays_a_deque_with_one_warning_and_the_self_check_counts_what_is_missed(
    instrumented: Sdk, sglang_metrics: Any, caplog: pytest.LogCaptureFixture, short_lag: None
) -> None:
    cache, allocator, _ = build_hicache("write_through", metrics=sglang_metrics)
    cc = cache.cache_controller
    cc.ack_write_queue = deque(cc.ack_write_queue)  # a later SGLang's queue
    with caplog.at_level(logging.WARNING):
        for tokens in (SEQ, list(range(100, 110))):
            insert(cache, allocator, tokens)
            cache.flush_pending_backups()
            assert type(cc.ack_write_queue) is deque
            ack = cc.ack_write_queue.popleft()  # how that SGLang would consume it, and count it
            ack.finish_event.synchronize()
            cache._log_write_ack_metrics(ack)
        missed = checked_for(instrumented, 3 * LAG_S)
    (warning,) = warnings_of(caplog, "ack_write_queue")
    assert "is a deque, not a list" in warning
    assert instrumented.spans("hicache.backup") == []  # not reported: left as it is
    # ...but not silently: SGLang counted tokens and bytes we did not, once each while it lasted
    assert missed == {(sc.METRIC_TRANSFER_TOKENS,): 1, (sc.METRIC_TRANSFER_SIZE,): 1}
    assert len(warnings_of(caplog, sc.METRIC_ENGINE_MISMATCH)) == 2


REMOVALS: dict[str, Callable[[Any], None]] = {
    "del q[:1]": lambda q: q.__delitem__(slice(None, 1)),
    "del q[0]": lambda q: q.__delitem__(0),
    "q[:] = q[1:]": lambda q: q.__setitem__(slice(None), q[1:]),
    "q[0] = None": lambda q: q.__setitem__(0, None),
    "q.remove(q[0])": lambda q: q.remove(q[0]),
    "q *= 0": lambda q: q.__imul__(0),
}


@pytest.mark.parametrize("remove", list(REMOVALS.values()), ids=list(REMOVALS))
def test_an_ack_leaving_the_queue_any_way_a_list_allows_is_reported_once(
    instrumented: Sdk, sglang_metrics: Any, remove: Callable[[Any], None]
) -> None:
    _cache, queue = submitted_backup(sglang_metrics)
    remove(queue)
    assert not [ack for ack in queue if ack is not None]
    (span,) = instrumented.spans("hicache.backup")
    assert span.attributes is not None and span.attributes[sc.ATTR_TOKENS] == len(SEQ)
    assert instrumented.counters()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == len(SEQ)


def test_a_failed_removal_raises_what_a_list_raises(instrumented: Sdk, sglang_metrics: Any) -> None:
    _, queue = submitted_backup(sglang_metrics)
    for remove, error in ((lambda: queue.remove(object()), ValueError), (lambda: queue.__delitem__(5), IndexError)):
        with pytest.raises(error) as ours:
            remove()
        with pytest.raises(error) as plain:
            (list(queue).remove(object()) if error is ValueError else list(queue).__delitem__(5))
        assert str(ours.value) == str(plain.value)
    assert len(queue) == 1 and instrumented.spans("hicache.backup") == []


def test_a_method_with_other_parameters_is_left_unpatched_with_one_warning(
    cpu_sglang: None, otel: Sdk, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor

    original = UnifiedRadixCache._record_dropped_tokens

    def record_dropped_tokens(self: Any, reason: str, dropped_tokens: int) -> None:  # a release that swapped them
        original(self, dropped_tokens, reason)

    monkeypatch.setattr(UnifiedRadixCache, "_record_dropped_tokens", record_dropped_tokens)
    instrumentor = SGLangHiCacheInstrumentor()
    with caplog.at_level(logging.WARNING):
        instrumentor.instrument(telemetry=otel.telemetry, stat_loggers=False)
    try:
        assert vars(UnifiedRadixCache)["_record_dropped_tokens"] is record_dropped_tokens
        assert hasattr(vars(UnifiedRadixCache)["_evict"], "__wrapped__")  # the rest is instrumented
    finally:
        instrumentor.uninstrument()
    (warning,) = warnings_of(caplog, "left unpatched")
    assert "UnifiedRadixCache._record_dropped_tokens (parameters (reason, dropped_tokens)" in warning


def test_this_sglang_has_every_target_in_the_shape_its_wrapper_reads(
    cpu_sglang: None, otel: Sdk, caplog: pytest.LogCaptureFixture
) -> None:
    """Run against another release, this is the first test to say what changed."""
    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor

    instrumentor = SGLangHiCacheInstrumentor()
    with caplog.at_level(logging.WARNING):
        instrumentor.instrument(telemetry=otel.telemetry)
    instrumentor.uninstrument()
    assert warnings_of(caplog, "otel_hicache") == []


def test_a_drop_reason_sglang_added_is_counted_as_other_every_time(instrumented: Sdk, sglang_metrics: Any) -> None:
    cache, _, _ = build_hicache("write_through", metrics=sglang_metrics)
    for tokens in (18, 8):
        cache._record_dropped_tokens(tokens, "host_tier_full")  # a reason this adapter does not know
    assert instrumented.counters()[sc.METRIC_DROPPED_TOKENS][("other", "kv")] == 18 + 8


@pytest.fixture
def host_hit_tokens_renamed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A release that counts host hits under a new name (``log_l2_hit_tokens``)."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    original = PrefillAdder._account_prefill_cache_admission

    def account(self: Any, req: Any, prefix_len: int) -> None:
        original(self, req, prefix_len)
        self.log_l2_hit_tokens = getattr(self, "log_l2_hit_tokens", 0) + self.log_host_hit_tokens
        self.log_host_hit_tokens = 0

    monkeypatch.setattr(PrefillAdder, "_account_prefill_cache_admission", account)
    yield


def test_hits_under_a_prefill_counter_sglang_renamed_are_counted_as_other_every_time(
    cpu_sglang: None, host_hit_tokens_renamed: None, otel: Sdk, sglang_metrics: Any
) -> None:
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.managers.scheduler_components.metrics_reporter import PrefillStats
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor

    instrumentor = SGLangHiCacheInstrumentor()
    instrumentor.instrument(telemetry=otel.telemetry, stat_loggers=False)  # wraps the renamed release's method
    try:
        cache, allocator, _ = build_hicache("write_through", metrics=sglang_metrics, kv_size=128)
        prefixes = [list(range(1, 17)), list(range(100, 124))]
        for prefix in prefixes:
            insert(cache, allocator, prefix)
        cache.flush_pending_backups()
        cache.writing_check()
        assert cache.evict(EvictParams(num_tokens=16 + 24)).num_tokens_evicted == 16 + 24  # both on the host only
        adder = PrefillAdder(cache.page_size, cache, allocator, None, 1.0, 4096, None)
        for n, prefix in enumerate(prefixes):
            req = make_request([*prefix, 7, 7, 7], f"r{n}")
            req.init_next_round_input(cache)
            assert req.host_hit_length == len(prefix)
            assert adder.add_one_req(req, False, None) is AddReqResult.CONTINUE
        PrefillStats.from_adder(adder, running_reqs=[])  # the batch's stats, as the scheduler builds them
        assert adder.log_l2_hit_tokens == 16 + 24 and adder.log_host_hit_tokens == 0
        prefill = otel.counters()[sc.METRIC_PREFILL_TOKENS]
    finally:
        instrumentor.uninstrument()
    assert prefill.get(("other",)) == 16 + 24 and not prefill.get(("host_hit",))
    assert prefill[("input",)] == 2 * 3


def test_the_self_check_finds_nothing_when_both_count_the_same(
    instrumented: Sdk, sglang_metrics: Any, short_lag: None
) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache, allocator, _ = build_hicache("write_through", metrics=sglang_metrics)
    insert(cache, allocator, SEQ)
    cache.flush_pending_backups()
    cache.writing_check()
    cache.evict(EvictParams(num_tokens=len(SEQ)))
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", SEQ))))
    assert cache.load_back(match.best_match_node)
    cache.ready_to_load_host_cache()
    cache.loading_check()
    snap = instrumented.counters()
    assert snap[sc.METRIC_TRANSFER_TOKENS][("load_back", "kv")] == len(SEQ)  # there was something to compare
    assert checked_for(instrumented, 3 * LAG_S) == {}


def test_a_mismatch_on_a_release_above_the_tested_range_turns_the_adapter_off_with_one_warning(
    cpu_sglang: None,
    otel: Sdk,
    sglang_metrics: Any,
    caplog: pytest.LogCaptureFixture,
    short_lag: None,
    installed_as: Callable[[str, str], str],
) -> None:
    """An untested release whose ack queue is a ``deque`` (our consumption hook sees no ack) while SGLang's collector
    counts each backup: the self-check's first mismatch turns the adapter off in this process."""
    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor

    release = installed_as("sglang", "0.9.0")
    instrumentor = SGLangHiCacheInstrumentor()
    with caplog.at_level(logging.INFO, logger="otel_hicache"):
        instrumentor.instrument(telemetry=otel.telemetry, stat_loggers=False)
        try:
            cache, allocator, _ = build_hicache("write_through", metrics=sglang_metrics)
            cc = cache.cache_controller
            cc.ack_write_queue = deque(cc.ack_write_queue)
            insert(cache, allocator, SEQ)
            cache.flush_pending_backups()
            ack = cc.ack_write_queue.popleft()
            ack.finish_event.synchronize()
            cache._log_write_ack_metrics(ack)  # SGLang counts it; we never saw it
            counted = checked_for(otel, 3 * LAG_S)
            assert counted == {(sc.METRIC_TRANSFER_TOKENS,): 1, (sc.METRIC_TRANSFER_SIZE,): 1}

            _, queue = submitted_backup(sglang_metrics)  # a list queue: the backup our hooks report when on
            REMOVALS["del q[0]"](queue)
            assert otel.spans("hicache.backup") == []  # off: our wrappers pass straight through
            assert otel.counters()[sc.METRIC_TRANSFER_TOKENS].get(("backup", "kv"), 0) == 0
            assert checked_for(otel, 3 * LAG_S) == counted  # its check ended
        finally:
            instrumentor.uninstrument()
    off = [r.getMessage() for r in caplog.records if "off in this process" in r.getMessage()]
    assert len(off) == 1 and release in off[0]
    assert f"{sc.METRIC_TRANSFER_SIZE}, {sc.METRIC_TRANSFER_TOKENS}" in off[0]
