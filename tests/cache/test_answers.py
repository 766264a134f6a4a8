"""The reference cache answers the operator's questions: how long each request waited for its KV, per tier; whether
evicted entries were ever reused and how long they sat idle; which backed-up bytes were evicted unread.

Each scripted workload's answers are derived here, from the script and from clocks read around its steps, and every
new series must equal them (counts and tokens exactly, times within the bounds the clocks give).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from opentelemetry.sdk.trace import ReadableSpan

from otel_hicache import semconv as sc
from otel_hicache.cache.hicache import HiCache
from otel_hicache.summary import by_first
from otel_hicache.testing.sdk import Sdk
from tests.cache.support import POOLS, run_workload, small_config

A = list(range(100, 132))  # 32 tokens, 8 pages of 4
B = list(range(200, 232))
HOST = {sc.ATTR_TIER: "host"}
STORAGE = {sc.ATTR_TIER: "storage"}
DEVICE = {sc.ATTR_TIER: "device"}
REUSED = sc.ATTR_EVICTION_REUSED
T = TypeVar("T")


def node_bytes(tokens: int, with_state: bool = True) -> int:
    """What a backup of one node of ``tokens`` writes: every per-token pool (the draft sidecar too), one mamba state."""
    return sum(
        (1 if spec.per_node else tokens) * spec.bytes_per_slot for spec in POOLS if with_state or not spec.per_node
    )


def timed(step: Callable[[], T]) -> tuple[T, int, int]:
    """``step()``, with the monotonic clock read just before and just after it."""
    before = time.monotonic_ns()
    out = step()
    return out, before, time.monotonic_ns()


def serve(cache: HiCache, prompt: list[int]) -> None:
    """One request, start to end, its transfers settled."""
    cache.release(cache.admit(prompt))
    cache.flush()


def waits(sdk: Sdk, tier: dict[str, str]) -> Any:
    return sdk.points(sc.METRIC_REQUEST_KV_WAIT).get(frozenset(tier.items()))


def ages(sdk: Sdk, tier: dict[str, str]) -> Any:
    return sdk.points(sc.METRIC_EVICTION_AGE)[frozenset(tier.items())]


def evicted(sdk: Sdk, tier: str) -> dict[bool | None, int]:
    return {reused: n for (t, reused), n in sdk.counters()[sc.METRIC_EVICTION_TOKENS].items() if t == tier}


def copy_s(span: ReadableSpan) -> float:
    return float((span.attributes or {})[sc.ATTR_COPY_DURATION])  # type: ignore[arg-type]


def s(ns: int) -> float:
    return ns / 1e9


@pytest.fixture
def through(csdk: Sdk) -> Iterator[HiCache]:
    cache = HiCache(small_config(None, "write_through"), csdk.telemetry)
    yield cache
    cache.close()


class TestDeviceEviction:
    def test_an_entry_hit_again_is_reused_and_its_age_runs_from_that_hit(self, csdk: Sdk, through: HiCache) -> None:
        _, b_before, b_after = timed(lambda: through.release(through.admit(B)))  # B: computed once, never hit
        through.release(through.admit(A))
        _, a_before, a_after = timed(lambda: through.release(through.admit(A)))  # A: hit on the device
        through.flush()
        freed, evict_start, evict_end = timed(lambda: through.evict_device(10_000))

        assert freed == 64
        assert evicted(csdk, "device") == {None: 0, True: 32, False: 32}
        point = ages(csdk, DEVICE)
        assert point.count == 2  # one age per evicted entry
        # B idle since it was computed, A since its hit: each use lies between the clock readings around its step.
        assert s(evict_start - a_after) + s(evict_start - b_after) <= point.sum
        assert point.sum <= s(evict_end - a_before) + s(evict_end - b_before)
        assert waits(csdk, HOST) is None and waits(csdk, STORAGE) is None  # nobody waited for KV
        assert sum(csdk.counters()[sc.METRIC_WASTED_SIZE].values()) == 0  # demoted: the host copies stay

    def test_a_device_copy_made_by_a_load_back_starts_unused(self, csdk: Sdk, through: HiCache) -> None:
        through.release(through.admit(A))
        through.flush()
        through.evict_device(10_000)
        through.release(through.admit(A))  # a host hit: loaded back, read by this request's forward only
        through.flush()
        through.evict_device(10_000)
        assert evicted(csdk, "device") == {None: 0, True: 0, False: 64}


class TestHostEviction:
    def test_a_write_through_backup_evicted_unread_is_wasted_and_one_loaded_back_is_reused(
        self, csdk: Sdk, through: HiCache
    ) -> None:
        through.release(through.admit(A))
        _, b_before, b_after = timed(lambda: serve(through, B))  # B backed up
        through.evict_device(10_000)  # both demoted: host copies only
        _, a_before, a_after = timed(lambda: serve(through, A))  # A loaded back
        through.evict_device(10_000)
        freed, evict_start, evict_end = timed(lambda: through.evict_host(10_000))

        assert through.controller.stats.bytes[("backup", "kv")] == 2 * 32 * POOLS[0].bytes_per_slot
        assert freed == 64
        assert evicted(csdk, "host") == {None: 0, True: 32, False: 32}
        assert csdk.counters()[sc.METRIC_WASTED_SIZE] == {("backup",): node_bytes(32), ("storage_backup",): 0}
        point = ages(csdk, HOST)
        assert point.count == 2
        # B idle since its backup was written, A since it was loaded back.
        assert s(evict_start - a_after) + s(evict_start - b_after) <= point.sum
        assert point.sum <= s(evict_end - a_before) + s(evict_end - b_before)

    def test_a_prefetch_nothing_loads_back_is_wasted_by_the_prefetch(self, csdk: Sdk, tmp_path: Path) -> None:
        # 8 tokens: enough to prefetch (threshold 4), too few to load back (threshold 10), so the request recomputes
        # them and the prefetched host copy is never read.
        cache = HiCache(small_config(tmp_path, "write_through", load_back_threshold=10), csdk.telemetry)
        try:
            short = A[:8]
            cache.release(cache.admit(short))
            cache.flush()  # backed up and stored
            cache.evict_device(10_000)
            cache.evict_host(10_000)  # in L3 only
            admission = cache.admit(short)
            assert admission.split == (8, 0, 0, 0)
            cache.release(admission)
            cache.flush()
            cache.evict_device(10_000)
            cache.evict_host(10_000)
        finally:
            cache.close()
        assert csdk.counters()[sc.METRIC_WASTED_SIZE] == {
            ("backup",): node_bytes(8),  # the first backup, evicted unread
            ("storage_backup",): 0,
            ("storage_prefetch",): node_bytes(8, with_state=False),  # L3 keeps per-token pools only
        }
        assert waits(csdk, STORAGE).count == 1  # the request did wait for the prefetch it then could not use
        assert waits(csdk, HOST) is None


class TestKvWait:
    def test_a_request_waits_for_its_prefetch_then_its_load_back(self, csdk: Sdk, tmp_path: Path) -> None:
        cache = HiCache(small_config(tmp_path, "write_through"), csdk.telemetry)
        request = csdk.tracer_provider.get_tracer("engine").start_span("request")
        try:
            cache.release(cache.admit(A))
            cache.release(cache.admit(B))  # waits for nothing
            cache.flush()
            cache.evict_device(10_000)
            cache.evict_host(10_000)  # A is in L3 only
            admission, before, after = timed(lambda: cache.admit(A, request_span=request))
            assert admission.split == (0, 0, 0, 32)
            cache.flush()  # the load's ack is seen complete here
            cache.release(admission)
        finally:
            request.end()
            cache.close()

        (prefetch,) = csdk.spans("hicache.storage_prefetch")
        (load,) = csdk.spans("hicache.load_back")
        (finished,) = csdk.spans("request")
        points = csdk.points(sc.METRIC_REQUEST_KV_WAIT)
        storage, host = points[frozenset(STORAGE.items())], points[frozenset(HOST.items())]
        assert storage.count == 1 and host.count == 1  # one request waited, once per tier; A's first time and B never
        # Each wait holds the copy it waited for and lies inside the admission that waited.
        assert copy_s(prefetch) <= storage.sum <= s(after - before)
        assert copy_s(load) <= host.sum <= s(after - before)
        assert storage.sum + host.sum <= s(after - before)  # one after the other
        # The request span carries both waits and its split; the transfers it waited for link to it.
        attributes = finished.attributes or {}
        assert attributes[f"{sc.ATTR_KV_WAIT}.storage"] == storage.sum
        assert attributes[f"{sc.ATTR_KV_WAIT}.host"] == host.sum
        assert attributes[f"{sc.ATTR_PREFIX_TOKENS}.storage_hit"] == 32
        context = request.get_span_context()
        for transfer in (prefetch, load):
            assert [link.context.span_id for link in transfer.links] == [context.span_id]
        assert {span.name: len(span.links) for span in csdk.spans("hicache.backup")} == {"hicache.backup": 0}

    def test_a_skipped_or_impossible_load_back_is_no_wait(self, csdk: Sdk, through: HiCache) -> None:
        short = A[:8]  # under the 10-token load-back threshold: recomputed, nothing waited for
        through.release(through.admit(short))
        through.flush()
        through.evict_device(10_000)
        through.release(through.admit(short))
        through.flush()
        assert through.stats.load_back_skipped == 1
        assert waits(csdk, HOST) is None


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_chat_workload_stays_in_the_closed_sets_and_adds_up(csdk: Sdk, tmp_path: Path, policy: str) -> None:
    cache = HiCache(small_config(tmp_path, policy, host_tokens=160), csdk.telemetry)
    try:
        run_workload(cache, 120)
    finally:
        cache.close()
    counters = csdk.counters()
    tokens = {key: n for key, n in counters[sc.METRIC_EVICTION_TOKENS].items() if n}
    assert {tier for tier, _ in tokens} == {"device", "host"}
    assert all(reused in (True, False) for _, reused in tokens)  # every reference entry knows its reuse
    assert {tier: n for tier, n in by_first(tokens).items()} == dict(cache.stats.evicted)
    for tier in ("device", "host"):
        assert ages(csdk, {sc.ATTR_TIER: tier}).count > 0
    wasted = {op: n for (op,), n in counters[sc.METRIC_WASTED_SIZE].items() if n}
    assert set(wasted) <= {"backup", "storage_prefetch"} and wasted.get("backup", 0) > 0
    written = sum(n for (op, _, _), n in counters[sc.METRIC_TRANSFER_SIZE].items() if op == "backup")
    assert wasted["backup"] <= written  # never more wasted than was written
    waited = {dict(key)[sc.ATTR_TIER]: p.count for key, p in csdk.points(sc.METRIC_REQUEST_KV_WAIT).items()}
    # On a CPU a load back is a synchronous copy the request waits for: one wait per merged load.
    assert waited["host"] == cache.controller.stats.transfers["load_back"] > 0
    assert waited["storage"] >= len(csdk.spans("hicache.storage_prefetch")) > 0
    assert not any(counters[sc.METRIC_RECORDS_REJECTED].values())
