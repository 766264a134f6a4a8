"""The SGLang HiCache instrumentor against SGLang 0.5.23's real classes on a CPU.

Every OTel value is checked against what SGLang's own prometheus collector holds for the same run.
"""

from __future__ import annotations

import contextlib
import logging
from array import array
from importlib.metadata import version
from typing import Any

import pytest

pytest.importorskip("sglang")

from prometheus_client import REGISTRY

from otel_hicache import semconv as sc
from otel_hicache.summary import by_first
from otel_hicache.testing.sdk import Sdk, attributes_of, times_of
from otel_hicache.testing.sglang import build_hicache

pytestmark = pytest.mark.sglang

LABELS = {"cache_type": "UnifiedRadixCache", "tp_rank": "0"}
SEQ_A = list(range(1, 21))
SEQ_B = list(range(100, 130))


def prom(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {**LABELS, **labels}) or 0.0


def sglang_values() -> dict[str, float]:
    """The HiCache series SGLang's radix-cache collector holds now."""
    return {
        "backup_kv": prom("sglang:hicache_backup_tokens_total", pool="kv"),
        "backup_bytes": prom("sglang:hicache_backup_bytes_total"),
        "load_back_kv": prom("sglang:load_back_tokens_total", pool="kv"),
        "load_back_bytes": prom("sglang:load_back_bytes_total"),
        "evicted": prom("sglang:evicted_tokens_total"),
        "dropped_host_pressure": prom("sglang:hicache_dropped_tokens_total", reason="host_pressure", pool="kv"),
        "dropped_unbacked": prom(
            "sglang:hicache_dropped_tokens_total", reason="write_through_unbacked_eviction", pool="kv"
        ),
    }


def otel_values(otel: Sdk) -> dict[str, float]:
    snap = otel.counters()
    tokens, size = snap[sc.METRIC_TRANSFER_TOKENS], snap[sc.METRIC_TRANSFER_SIZE]
    dropped = snap[sc.METRIC_DROPPED_TOKENS]
    return {
        "backup_kv": tokens.get(("backup", "kv"), 0),
        "backup_bytes": size.get(("backup", None, "none"), 0),
        "load_back_kv": tokens.get(("load_back", "kv"), 0),
        "load_back_bytes": size.get(("load_back", None, "none"), 0),
        "evicted": by_first(snap[sc.METRIC_EVICTION_TOKENS]).get("device", 0),
        "dropped_host_pressure": dropped.get(("host_pressure", "kv"), 0),
        "dropped_unbacked": dropped.get(("write_through_unbacked_eviction", "kv"), 0),
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


class Tree:
    """Drives one real UnifiedRadixCache the way the scheduler does, and keeps every ack it consumed."""

    def __init__(self, write_policy: str, metrics: Any, kv_size: int = 64) -> None:
        self.cache, self.allocator, _ = build_hicache(write_policy, metrics=metrics, kv_size=kv_size)
        self.cc = self.cache.cache_controller
        self.kv = self.allocator.get_kvcache()
        self.consumed: list[Any] = []
        log_write_ack = self.cache._log_write_ack_metrics

        def consumed_write_ack(ack: Any) -> None:  # SGLang calls this once per consumed write ack, on every path
            self.consumed.append(ack)
            log_write_ack(ack)

        self.cache._log_write_ack_metrics = consumed_write_ack

    def insert(self, tokens: list[int]) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        indices = self.allocator.alloc(len(tokens))
        marker = self._marker(tokens)
        self.kv.get_key_buffer(0)[indices] = marker
        self.kv.get_value_buffer(0)[indices] = marker + 1
        self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=indices))
        return indices

    def _marker(self, tokens: list[int]) -> Any:
        import torch

        rows = torch.tensor(tokens, dtype=torch.float32).view(-1, 1, 1)
        return rows.expand(-1, self.kv.head_num, self.kv.head_dim).to(self.kv.dtype)

    def match(self, tokens: list[int]) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))

    def step(self) -> None:
        """One scheduler step's HiCache work: submit pending backups, reap finished acks."""
        self.cache.flush_pending_backups()
        self.consumed += self.cc.ack_load_queue[:]
        self.cache.writing_check()
        self.cache.loading_check()

    def evict(self, num_tokens: int) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return self.cache.evict(EvictParams(num_tokens=num_tokens))

    def load_back(self, tokens: list[int]) -> Any:
        match = self.match(tokens)
        assert match.host_hit_length > 0
        assert self.cache.load_back(match.best_match_node)
        self.cache.ready_to_load_host_cache()
        self.step()
        match = self.match(tokens)
        assert match.device_prefix_len == len(tokens)
        return match

    def device_rows(self, tokens: list[int]) -> Any:
        match = self.match(tokens)
        assert match.device_prefix_len == len(tokens)
        root = self.cache.root_node_handle()
        indices = self.cache.tree_core.collect_full_device_indices(match.last_device_node, root)
        return self.kv.get_key_buffer(0)[indices].clone(), self.kv.get_value_buffer(0)[indices].clone()


def backed_up(tree: Tree, policy: str) -> None:
    """Get SEQ_A and SEQ_B onto the host the way ``policy`` does it."""
    tree.insert(SEQ_A)
    tree.insert(SEQ_B)
    if policy == "write_through_selective":  # a second hit triggers the backup
        tree.match(SEQ_A)
        tree.match(SEQ_B)
        tree.insert(SEQ_A)
        tree.insert(SEQ_B)
    if policy != "write_back":
        tree.step()


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_round_trip_matches_sglang_metrics_and_acks(policy: str, instrumented: Sdk, sglang_metrics: Any) -> None:
    before = sglang_values()
    tree = Tree(policy, sglang_metrics, kv_size=128)
    backed_up(tree, policy)
    expected_a = tree.device_rows(SEQ_A)

    evicted = tree.evict(len(SEQ_A) + len(SEQ_B))  # write_back: the blocking backup happens here
    assert evicted.num_tokens_evicted == len(SEQ_A) + len(SEQ_B)
    tree.load_back(SEQ_A)
    tree.step()

    loaded_a = tree.device_rows(SEQ_A)
    for expected, loaded in zip(expected_a, loaded_a, strict=True):  # the data round-trips unchanged
        assert (expected == loaded).all()

    sglang = delta(sglang_values(), before)
    assert sglang["backup_kv"] == len(SEQ_A) + len(SEQ_B)
    assert sglang["load_back_kv"] == len(SEQ_A)
    assert otel_values(instrumented) == sglang

    # One span per consumed ack, carrying exactly the ack's per-pool tokens and bytes.
    acks = {id(a): a for a in tree.consumed}.values()
    spans = instrumented.spans(sc.SPAN_NAMES[sc.TransferOperation.BACKUP]) + instrumented.spans(
        sc.SPAN_NAMES[sc.TransferOperation.LOAD_BACK]
    )

    def per_pool_tokens(span: Any) -> list[tuple[str, Any]]:
        prefix = f"{sc.ATTR_POOL_TOKENS}."
        return sorted((k.rsplit(".", 1)[1], v) for k, v in attributes_of(span).items() if k.startswith(prefix))

    from_spans = sorted(
        (per_pool_tokens(s), attributes_of(s)[sc.ATTR_BYTES], attributes_of(s)[sc.ATTR_NODES]) for s in spans
    )
    from_acks = sorted((sorted(a.num_tokens_by_pool.items()), a.num_bytes, len(a.node_ids)) for a in acks)
    assert from_spans == from_acks
    for span in spans:  # CPU events cannot time: no duration rather than a made-up one
        assert attributes_of(span)[sc.ATTR_TIMING_SOURCE] == "none"
        assert sc.ATTR_COPY_DURATION not in attributes_of(span)
        start, end = times_of(span)
        assert start <= end


def test_merged_backups_become_one_span_with_the_merged_op_count(instrumented: Sdk, sglang_metrics: Any) -> None:
    tree = Tree("write_through", sglang_metrics)
    tree.insert(SEQ_A)
    tree.insert(SEQ_B)
    assert len(tree.cc.write_queue) == 2  # UnifiedRadixCache defers submission so node backups merge
    tree.step()

    (span,) = instrumented.spans("hicache.backup")
    assert attributes_of(span)[sc.ATTR_MERGED_OPS] == 2
    assert attributes_of(span)[sc.ATTR_NODES] == 2
    assert attributes_of(span)[sc.ATTR_TOKENS] == len(SEQ_A) + len(SEQ_B)
    assert attributes_of(span)[sc.ATTR_WRITE_POLICY] == "write_through"
    assert attributes_of(span)[sc.ATTR_IO_BACKEND] == "direct"


def test_host_pressure_drop_under_write_back_matches_sglang(instrumented: Sdk, sglang_metrics: Any) -> None:
    before = sglang_values()
    tree = Tree("write_back", sglang_metrics)
    tree.insert(SEQ_A)
    host = tree.cc.mem_pool_host
    hog = host.alloc(host.available_size())  # the host pool is full: the write-back backup cannot land
    assert hog is not None and host.available_size() == 0

    evicted = tree.evict(len(SEQ_A))

    sglang = delta(sglang_values(), before)
    assert evicted.num_tokens_evicted == len(SEQ_A)
    assert sglang["dropped_host_pressure"] == len(SEQ_A)
    assert otel_values(instrumented) == sglang
    assert instrumented.spans("hicache.backup") == []  # nothing was copied
    host.free(hog)


def test_controller_write_and_load_round_trip_and_report_only_consumed_acks(
    instrumented: Sdk, sglang_metrics: Any
) -> None:
    import torch

    tree = Tree("write_through", sglang_metrics)
    cc = tree.cc
    device = tree.allocator.alloc(12)
    tree.kv.get_key_buffer(0)[device] = tree._marker(list(range(12)))
    host_a = cc.write(device[:5], node_id=-1, flush=False)
    host_b = cc.write(device[5:], node_id=-1, flush=False)
    cc.start_writing()
    assert len(cc.ack_write_queue) == 1
    cc.ack_write_queue[0].finish_event.synchronize()

    loaded = cc.load(torch.cat([host_a, host_b]), node_id=-1)
    cc.start_loading()
    cc.ack_load_queue[0].finish_event.synchronize()
    assert (tree.kv.get_key_buffer(0)[loaded] == tree.kv.get_key_buffer(0)[device]).all()
    # Submission alone is not a completed transfer: nothing is reported until SGLang consumes the acks.
    assert instrumented.spans() == []
    assert otel_values(instrumented)["backup_kv"] == 0
    cc.ack_write_queue.clear()
    cc.ack_load_queue.clear()


def test_uninstrument_restores_every_original_and_instrumenting_twice_wraps_once(cpu_sglang: None, otel: Sdk) -> None:
    import importlib

    from otel_hicache.integrations._base import ProcessSink
    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor
    from otel_hicache.integrations.sglang.hooks import HiCacheHooks
    from otel_hicache.integrations.sglang.instrumentor import _STAT_LOGGER_MODULES, hicache_patches

    targets = [target for target, _ in hicache_patches(HiCacheHooks(ProcessSink(sc.Engine.SGLANG)))]
    owners = [getattr(importlib.import_module(t.module), t.owner) for t in targets]
    originals = [vars(owner)[t.attribute] for owner, t in zip(owners, targets, strict=True)]
    modules = [importlib.import_module(m) for m in _STAT_LOGGER_MODULES]
    original_resolvers = [m.resolve_collector_class for m in modules]

    instrumentor = SGLangHiCacheInstrumentor()
    instrumentor.instrument(telemetry=otel.telemetry)
    instrumentor.instrument(telemetry=otel.telemetry)
    for owner, t, original in zip(owners, targets, originals, strict=True):
        assert vars(owner)[t.attribute] is not original
        assert vars(owner)[t.attribute].__wrapped__ is original  # one layer, not two
    assert all(m.resolve_collector_class is not r for m, r in zip(modules, original_resolvers, strict=True))
    instrumentor.uninstrument()

    for owner, t, original in zip(owners, targets, originals, strict=True):
        assert vars(owner)[t.attribute] is original
    assert [m.resolve_collector_class for m in modules] == original_resolvers


def test_unsupported_sglang_warns_once_and_patches_nothing(
    cpu_sglang: None, otel: Sdk, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.managers.cache_controller import HiCacheController

    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor

    monkeypatch.setattr(SGLangHiCacheInstrumentor, "instrumentation_dependencies", lambda self: ("sglang >= 99.0",))
    original = vars(HiCacheController)["start_writing"]
    with caplog.at_level(logging.WARNING):
        SGLangHiCacheInstrumentor().instrument(telemetry=otel.telemetry)
        SGLangHiCacheInstrumentor().instrument(telemetry=otel.telemetry)
    assert not SGLangHiCacheInstrumentor().is_instrumented_by_opentelemetry
    assert vars(HiCacheController)["start_writing"] is original
    warnings = [r for r in caplog.records if "not instrumented" in r.getMessage()]
    assert len(warnings) == 1 and f"found sglang {version('sglang')}" in warnings[0].getMessage()


def test_suppressed_instrumentation_reports_nothing_and_sglang_runs_unchanged(
    instrumented: Sdk, sglang_metrics: Any
) -> None:
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    before = sglang_values()
    with suppress_instrumentation():
        tree = Tree("write_through", sglang_metrics)
        backed_up(tree, "write_through")
    assert delta(sglang_values(), before)["backup_kv"] == len(SEQ_A) + len(SEQ_B)
    assert otel_values(instrumented)["backup_kv"] == 0 and instrumented.spans() == []


class _BrokenSink:
    """A telemetry sink that fails on every record: the fault a wrapper must survive."""

    def __getattr__(self, name: str) -> Any:
        def fail(*_a: Any, **_k: Any) -> None:
            raise RuntimeError("sink is broken")

        return fail


def test_a_failing_wrapper_logs_once_and_sglang_runs_unchanged(
    cpu_sglang: None, sglang_metrics: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor

    before = sglang_values()
    instrumentor = SGLangHiCacheInstrumentor()
    instrumentor.instrument(telemetry=_BrokenSink(), stat_loggers=False)
    try:
        with caplog.at_level(logging.WARNING):
            tree = Tree("write_through", sglang_metrics)
            backed_up(tree, "write_through")
            expected = tree.device_rows(SEQ_A)
            tree.evict(len(SEQ_A) + len(SEQ_B))
            tree.load_back(SEQ_A)
            assert all((e == g).all() for e, g in zip(expected, tree.device_rows(SEQ_A), strict=True))
    finally:
        instrumentor.uninstrument()
    sglang = delta(sglang_values(), before)
    assert sglang["backup_kv"] == len(SEQ_A) + len(SEQ_B)  # SGLang still counted everything
    assert sglang["load_back_kv"] == len(SEQ_A)
    failures = [r for r in caplog.records if "runs unchanged" in r.getMessage()]
    hooks = []
    for record in failures:
        assert isinstance(record.args, tuple)  # logged with %-style arguments: (engine, hook)
        hooks.append(record.args[1])
    assert len(hooks) == len(set(hooks)) >= 2  # each failing hook said so exactly once


def test_stat_logger_classes_send_sglang_series_over_otel_without_the_hicache_ones(
    cpu_sglang: None, otel: Sdk, prometheus_collector: Any
) -> None:
    from sglang.srt.observability.metrics_collector import StorageMetricsCollector

    from otel_hicache.integrations.sglang.stat_loggers import build_otel_stat_loggers

    roles = build_otel_stat_loggers(meter_provider=otel.meter_provider)
    assert set(roles) == {"scheduler", "storage", "radix_cache"}
    storage = prometheus_collector(roles["storage"], labels={"storage_backend": "file"})
    assert isinstance(storage, StorageMetricsCollector)
    storage.log_storage_prefetch_hit_tokens(64)
    storage.log_backuped_tokens(32)  # a HiCache series the instrumentor's wrappers already export

    # SGLang's prometheus series are untouched...
    labels = {"storage_backend": "file"}
    assert REGISTRY.get_sample_value("sglang:storage_prefetch_hit_tokens_total", labels) == 64
    assert REGISTRY.get_sample_value("sglang:backuped_tokens_total", labels) == 32
    # ...and over OTel the same value arrives, except for the series the wrappers own.
    metrics = otel.metrics()
    prefetch = metrics["sglang.storage_prefetch_hit_tokens"].data.data_points
    assert [(attributes_of(p), p.value) for p in prefetch] == [(labels, 64)]
    assert not any("backuped_tokens" in name for name in metrics)


def test_acks_queued_before_instrumenting_are_reported_once_consumed(
    cpu_sglang: None, otel: Sdk, sglang_metrics: Any
) -> None:
    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor

    before = sglang_values()
    tree = Tree("write_through", sglang_metrics)
    tree.insert(SEQ_A)
    tree.cache.flush_pending_backups()  # this ack was submitted with no instrumentation: no submission time known
    assert len(tree.cc.ack_write_queue) == 1
    instrumentor = SGLangHiCacheInstrumentor()
    instrumentor.instrument(telemetry=otel.telemetry, stat_loggers=False)
    try:
        tree.insert(SEQ_B)
        tree.step()  # consumes the unknown ack and the one submitted while instrumented
        tree.insert(list(range(200, 210)))
        tree.step()  # the queue is mirrored again: the fast path
    finally:
        instrumentor.uninstrument()

    assert delta(sglang_values(), before)["backup_kv"] == otel_values(otel)["backup_kv"] == 20 + 30 + 10
    spans = sorted(otel.spans("hicache.backup"), key=lambda s: attributes_of(s)[sc.ATTR_TOKENS])
    assert [attributes_of(s)[sc.ATTR_TOKENS] for s in spans] == [10, 20, 30]
    unknown = spans[1]  # SEQ_A's ack: its span starts when it was seen complete
    assert unknown.start_time == unknown.end_time
    assert all(start < end for start, end in map(times_of, (spans[0], spans[2])))


def test_every_pool_name_of_this_sglang_is_counted_under_its_own_name(cpu_sglang: None, otel: Sdk) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor
    from otel_hicache.integrations.sglang.semconv import SGLANG_POOLS
    from otel_hicache.records import TransferRecord

    assert {p.value for p in PoolName} <= set(SGLANG_POOLS) | sc.POOLS  # every release's names are declared
    instrumentor = SGLangHiCacheInstrumentor()
    instrumentor.instrument(tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    try:
        assert instrumentor.telemetry is None  # built at the process's first HiCache event
        build_hicache("write_through")
        telemetry = instrumentor.telemetry
        assert telemetry is not None and telemetry is not otel.telemetry
        tokens = {p.value: 1 for p in PoolName}
        telemetry.record_transfer(
            TransferRecord(
                operation=sc.TransferOperation.BACKUP,
                tokens_by_pool=tokens,
                num_bytes=0,
                submit_time_ns=1,
                complete_time_ns=2,
            )
        )
        counted = {pool for (_, pool), n in telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS].items() if n}
    finally:
        instrumentor.uninstrument()
    assert counted == set(tokens)


def test_reset_forgets_queued_acks_even_when_suppressed_and_reports_none_of_them(
    instrumented: Sdk, sglang_metrics: Any
) -> None:
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    for suppressed in (False, True):
        tree = Tree("write_through", sglang_metrics)
        tree.insert(SEQ_A)
        tree.cache.flush_pending_backups()
        assert len(tree.cc.ack_write_queue) == 1  # submitted, never consumed
        with suppress_instrumentation() if suppressed else contextlib.nullcontext():
            tree.cc.reset()
        assert tree.cc.ack_write_queue == [] and tree.cc.ack_write_queue.reporter.submitted == {}
    assert otel_values(instrumented)["backup_kv"] == 0 and instrumented.spans() == []


def test_adopted_queues_stay_lists_stop_reporting_when_uninstrumented_and_report_again_when_reinstrumented(
    cpu_sglang: None, otel: Sdk, sglang_metrics: Any
) -> None:
    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor
    from otel_hicache.integrations.sglang.ack_queues import AckQueue

    instrumentor = SGLangHiCacheInstrumentor()
    instrumentor.instrument(telemetry=otel.telemetry, stat_loggers=False)
    tree = Tree("write_through", sglang_metrics)
    try:
        tree.insert(SEQ_A)
        tree.step()
        queue = tree.cc.ack_write_queue
        assert isinstance(queue, AckQueue) and queue.reporter is not None  # adopted at the first submission (a list)
        assert "start_writing" in vars(tree.cc)  # its later submissions call SGLang's method, not our wrapper
        instrumentor.uninstrument()
        assert queue.reporter is None and "start_writing" not in vars(tree.cc)
        tree.insert(SEQ_B)
        tree.step()  # consumed while uninstrumented: SGLang runs on, nothing is reported
        instrumentor.instrument(telemetry=otel.telemetry, stat_loggers=False)
        tree.insert(list(range(200, 210)))
        tree.step()
        assert tree.cc.ack_write_queue is queue and queue.reporter is not None  # the same list, reporting again
    finally:
        instrumentor.uninstrument()
    assert [ack.num_tokens for ack in tree.consumed] == [20, 30, 10]
    assert otel_values(otel)["backup_kv"] == 20 + 10
    assert sorted(s.attributes[sc.ATTR_TOKENS] for s in otel.spans("hicache.backup")) == [10, 20]


def test_instrumenting_again_and_again_keeps_one_reporter_per_queue_alive(
    cpu_sglang: None, otel: Sdk, sglang_metrics: Any
) -> None:
    import gc

    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor
    from otel_hicache.integrations.sglang.ack_queues import AckReporter

    def reporters() -> int:
        gc.collect()
        return sum(type(o) is AckReporter for o in gc.get_objects())

    tree = Tree("write_through", sglang_metrics, kv_size=128)
    instrumentor = SGLangHiCacheInstrumentor()
    alive = []
    for tokens in (SEQ_A, SEQ_B, list(range(200, 210)), list(range(210, 220))):
        instrumentor.instrument(telemetry=otel.telemetry, stat_loggers=False)
        tree.insert(tokens)
        tree.step()
        instrumentor.uninstrument()
        assert otel.telemetry.flush()
        alive.append(reporters())
    assert alive[-1] == alive[0]  # an uninstrument/instrument cycle leaves nothing of the last one behind
