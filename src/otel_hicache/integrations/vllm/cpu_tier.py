"""The CPU tier (tier ``host``) of vLLM's CPU offloading, in the scheduler (engine-core) process: its occupancy and
capacity, and its evictions with what says whether it is the right size and which stores were wasted.

vLLM's ``CPUOffloadingManager`` (built by ``CPUOffloadingSpec.get_manager``) hands out chunks of a fixed capacity by
id. Per chunk id the adapter keeps two numbers in arrays of that capacity (bounded by construction; no map, nothing
to age out): when the chunk was last used - written (``prepare_store`` allocated it to a store) or read
(``prepare_load`` chose it for a load) - and whether a load read it since it was written. The chunks an eviction pass
frees (``CPUOffloadingManager._free_chunk`` inside ``prepare_store``) each become one
:class:`~otel_hicache.records.EvictedEntry`: its tokens, its idle time, ``reused`` = read, and when unread the bytes
its store wrote (``hicache.wasted.size{operation=backup}``). A chunk's bytes are those of one block of every worker
(``worker_kv_bytes_per_block`` x blocks per chunk x workers holding a copy); with several KV cache groups, whose
chunks hold one group's pages each, the bytes are not known and are not reported (ages and reuse are).

The tier's capacity (``hicache.pool.limit``) is what vLLM itself states where it does (vLLM >= 0.33: the manager's
``config_info()``, its ``vllm:kv_offload_config_info`` series: chunks x blocks per chunk), else the manager's chunks;
a self-check compares the two (``otel_hicache.engine.mismatch{hicache.pool.limit}``). vLLM >= 0.33 guards its manager
with a ``lock`` its scheduler holds for a whole step: nothing here takes it. The wrappers of the manager's methods run
under it (vLLM calls them there) and only note a few numbers (an eviction pass is counted on the telemetry's host
thread, from a patient queue); the occupancy is read at collection, on our own thread, from two integers and a list
length, without the lock.

Each tier's eviction policy (the spec's ``eviction_policy``: ``lru``, vLLM's default, ``arc``, or an out-of-tree
name) is kept for the capacity estimator (:meth:`CpuTierHooks.policies`), which models LRU only.
"""

from __future__ import annotations

import threading
import time
import weakref
from array import array
from collections.abc import Callable
from functools import partial
from typing import Any

from otel_hicache.integrations._base import EngineHooks, ProcessSink, Ranks, WeakPoolSource
from otel_hicache.records import EvictedEntry, EvictionRecord, PoolUsage
from otel_hicache.semconv import DEFAULT_POOL, METRIC_POOL_LIMIT, RecordKind, Tier, TransferOperation
from otel_hicache.telemetry import DeferredQueue, HiCacheTelemetry
from otel_hicache.timing import now_ns

#: How long a process waits at the engine's start for its export process to be up (its imports and exporters).
EXPORT_READY_S = 10.0
_WRITTEN, _READ = 1, 2  # a chunk's state: written by a store and not read since, or read by a load


class _CpuTier:
    """One CPU tier's queue of eviction passes, its chunk size in tokens and bytes, and per chunk id its last use and
    state."""

    __slots__ = (
        "__weakref__",
        "chunk_bytes",
        "evicting",
        "evictions",
        "last_use_ns",
        "policy",
        "state",
        "tokens_per_chunk",
    )

    def __init__(
        self, evictions: DeferredQueue, chunks: int, tokens_per_chunk: int, chunk_bytes: int, policy: str
    ) -> None:
        self.evictions = evictions  # counted on the host thread (_count_evictions)
        self.policy = policy  # the spec's eviction_policy ("" where the spec states none)
        self.tokens_per_chunk = tokens_per_chunk
        self.chunk_bytes = chunk_bytes
        self.last_use_ns = array("q", bytes(8 * chunks))
        self.state = bytearray(chunks)
        self.evicting: list[EvictedEntry] | None = None  # the entries of the eviction pass under way

    def used(self, chunk_ids: Any, state: int, when_ns: int) -> None:
        for chunk in _ids(chunk_ids):
            if 0 <= chunk < len(self.state):
                self.last_use_ns[chunk] = when_ns
                self.state[chunk] = state

    def evicted(self, chunk: int, when_ns: int) -> EvictedEntry:
        known = 0 <= chunk < len(self.state) and self.state[chunk] != 0
        if not known:  # never seen written (cannot happen for chunks allocated through prepare_store)
            return EvictedEntry(self.tokens_per_chunk)
        reused = self.state[chunk] == _READ
        return EvictedEntry(
            tokens=self.tokens_per_chunk,
            idle_s=max(0, when_ns - self.last_use_ns[chunk]) / 1e9,
            reused=reused,
            unread_bytes=0 if reused else self.chunk_bytes,
            written_by=TransferOperation.BACKUP,
        )


class CpuTierHooks(EngineHooks):
    """The wrappers of vLLM's CPU spec and manager."""

    def __init__(self, sink: ProcessSink, ranks: Callable[[Any], Ranks]) -> None:
        super().__init__(sink, ranks)
        self._tiers: weakref.WeakKeyDictionary[Any, _CpuTier] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get_manager(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``CPUOffloadingSpec.get_manager``: report the CPU tier of the manager it built, from now on."""
        manager = wrapped(*args, **kwargs)
        self.adopt(instance, manager)
        return manager

    def adopt(self, spec: Any, manager: Any) -> None:
        """Report ``manager`` (a ``CPUOffloadingManager``, or the CPU primary tier of vLLM's tiering) built by
        ``spec`` as the CPU tier, from now on (once)."""
        with self._lock:
            new = manager not in self._tiers
        evictions = self._patient(RecordKind.EVICTION, _count_evictions, spec) if new else None
        sink = self.telemetry  # built with the queue
        if evictions is not None and sink is not None:
            config = spec.config
            tokens_per_chunk = config.groups[0].tokens_per_block * config.cache.blocks_per_chunk
            copies = 1 if spec.replicated_layout else config.parallel.world_size
            chunk_bytes = (
                config.worker_kv_bytes_per_block * config.cache.blocks_per_chunk * copies
                if len(config.groups) == 1
                else 0
            )
            with self._lock:
                policy = str(getattr(spec, "eviction_policy", "") or "")
                self._tiers[manager] = _CpuTier(evictions, manager._num_chunks, tokens_per_chunk, chunk_bytes, policy)
            stated = _stated_capacity(manager, config.groups[0].tokens_per_block)
            capacity = manager._num_chunks * tokens_per_chunk if stated is None else stated
            usage = partial(_cpu_tier_usage, tokens_per_chunk, capacity)
            sink.add_pool_usage_source(WeakPoolSource(manager, usage, sink, self.sink.switch))
            if stated is not None:
                sink.add_engine_check(
                    _CapacityCheck(manager, tokens_per_chunk, stated, sink), self.sink.switch.mismatched
                )
            await_export_process(self.sink)  # the engine core builds its CPU tier while it starts

    def policies(self) -> set[str]:
        """The eviction policies of the CPU tiers this process built and still holds."""
        with self._lock:
            return {tier.policy for tier in self._tiers.values()}

    def prepare_store(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``CPUOffloadingManager.prepare_store``: the chunks it evicts to make room are one eviction pass on the CPU
        tier, timed on the host around the call; the chunks it allocates are written now."""
        tier = self._tiers.get(instance)
        if tier is None:
            return wrapped(*args, **kwargs)
        start = time.perf_counter()
        tier.evicting = []
        try:
            result = wrapped(*args, **kwargs)
        finally:
            entries, tier.evicting = tier.evicting, None
        evicted = len(result.evicted_keys) if result is not None else 0
        if evicted:
            duration = time.perf_counter() - start
            queue = tier.evictions
            queue.put((next(queue.seq), evicted * tier.tokens_per_chunk, duration, now_ns(), entries[:evicted]))
        if result is not None:
            tier.used(result.store_spec.block_ids, _WRITTEN, time.monotonic_ns())
        return result

    def free_chunk(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``CPUOffloadingManager._free_chunk(chunk)``: inside ``prepare_store``, a chunk evicted to make room."""
        tier = self._tiers.get(instance)
        evicting = tier.evicting if tier is not None else None
        if evicting is not None:
            chunk = args[0] if args else kwargs["chunk"]
            evicting.append(tier.evicted(int(chunk.chunk_id), time.monotonic_ns()))  # type: ignore[union-attr]
        return wrapped(*args, **kwargs)

    def prepare_load(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``CPUOffloadingManager.prepare_load``: the chunks a load reads are used now, and reused."""
        result = wrapped(*args, **kwargs)
        tier = self._tiers.get(instance)
        if tier is not None:
            tier.used(result.block_ids, _READ, time.monotonic_ns())
        return result


def _count_evictions(
    telemetry: HiCacheTelemetry, entries: list[tuple[int, int, float, int, list[EvictedEntry]]]
) -> None:
    """Host thread: the CPU tier's eviction passes since its last round (:meth:`CpuTierHooks.prepare_store`)."""
    for _, tokens, duration, when_ns, evicted in entries:
        telemetry.record_eviction(EvictionRecord(Tier.HOST, tokens, duration, when_ns, evicted))


def await_export_process(sink: ProcessSink) -> None:
    """Called where the engine builds its offloading (the worker's KV caches, the scheduler's CPU tier), once the
    process's telemetry is built: wait, at most :data:`EXPORT_READY_S`, until its export process has attached, so that
    its start-up is over before the engine serves its first request instead of competing with it for the CPU."""
    setup, telemetry = sink.setup, sink.telemetry
    if setup is None or telemetry is None or setup.mode != "otlp":
        return  # no export process: in-process exporters, or a telemetry of the caller's
    deadline = time.monotonic() + EXPORT_READY_S
    while telemetry.export_pid is None and time.monotonic() < deadline:
        time.sleep(0.01)


def _ids(chunk_ids: Any) -> list[int]:
    return [int(c) for c in (chunk_ids.tolist() if hasattr(chunk_ids, "tolist") else chunk_ids)]


def _cpu_tier_usage(tokens_per_chunk: int, capacity: int, manager: Any) -> list[PoolUsage]:
    """The CPU tier's chunks holding KV (cached or in flight), in tokens, read at collection, and its capacity."""
    held = manager._num_allocated_chunks - len(manager._free_list)
    return [PoolUsage(tier=Tier.HOST, pool=DEFAULT_POOL, used=held * tokens_per_chunk, limit=capacity)]


def _stated_capacity(manager: Any, tokens_per_block: int) -> int | None:
    """The tier's capacity in tokens as vLLM states it (``config_info()``, vLLM >= 0.33: one series per cache the
    manager holds; vLLM's CPU manager holds one), or None where it states none."""
    config_info = getattr(manager, "config_info", None)
    series: list[Any] = list(config_info()) if callable(config_info) else []
    if len(series) != 1 or "cpu_num_chunks" not in series[0]:
        return None
    info = series[0]
    return int(info["cpu_num_chunks"]) * int(info["cpu_blocks_per_chunk"]) * tokens_per_block


class _CapacityCheck:
    """The engine check of one CPU tier: the capacity vLLM states (what ``hicache.pool.limit`` reports) against the
    chunks its manager holds; a difference is one mismatch."""

    __slots__ = ("_manager", "_reported", "_sink", "_stated", "_tokens_per_chunk")

    def __init__(self, manager: Any, tokens_per_chunk: int, stated: int, sink: HiCacheTelemetry) -> None:
        self._manager = weakref.ref(manager)
        self._tokens_per_chunk = tokens_per_chunk
        self._stated = stated
        self._sink = sink
        self._reported = False

    def __call__(self) -> list[str]:
        manager = self._manager()
        if manager is None:  # the tier is gone
            self._sink.remove_engine_check(self)
            return []
        if self._reported or manager._num_chunks * self._tokens_per_chunk == self._stated:
            return []
        self._reported = True
        return [METRIC_POOL_LIMIT]
