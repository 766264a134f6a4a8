"""``HiCache``: the tiered cache's policies over the radix tree, after SGLang's ``UnifiedRadixCache``.

Per admitted request: match the prefix (device / host / storage hit lengths), prefetch a storage hit into host
memory, load the host part back (all or nothing, skipped under ``load_back_threshold``), compute and insert the
rest, apply the write policy, and report the prefix split. Eviction demotes backed-up device leaves; unbacked
leaves are backed up first under ``write_back`` (a blocking D->H inside eviction) or deleted under the write-through
family, with drops counted as SGLang defines them:

* ``host_pressure``: ``write_back`` could not get host room for the backup, so the leaf is dropped;
* ``write_through_unbacked_eviction``: an unbacked leaf deleted under exactly ``write_through``.

What the operator asks next, from bookkeeping on the tree's own nodes (bounded by the tree, gone with the node):

* ``hicache.request.kv_wait``: tier ``host``, from when an admitted request needed its host KV (the load back was
  decided) until the merged H->D copy's finish event, read when the load's ack is seen complete (see
  :mod:`.controller`); tier ``storage``, from the decision to prefetch until the prefetch let the request go on
  (done, or given up after ``prefetch_timeout_s``). A request that needed neither records nothing.
* per evicted entry (a node's copy on that tier): ``idle_s`` since its last use there (device: computed, loaded back
  or hit; host: written by a backup or prefetch, or loaded back), ``reused`` (device: matched as a device hit since
  the copy was made; host: loaded back since it was written) and, on the host, ``unread_bytes``: the bytes of a
  host copy nothing loaded back, by the transfer that wrote it (``backup`` or ``storage_prefetch``). Device copies
  are read by the forward that made them: no unread bytes.
* The L3 file store never evicts (its files stay until a backup rewrites them or a bad entry is withdrawn), so there
  is no storage-tier eviction, age or ``storage_backup`` waste to report, and none is made up. Host copies deleted
  together with a dropped device ancestor are part of the drop, not a host eviction (as in SGLang).

Everything is reported through :class:`HiCacheTelemetry`; ``stats`` keeps independent ground truth for tests.
"""

from __future__ import annotations

import collections
import heapq
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from opentelemetry.trace import Span

from otel_hicache.cache.content import page_content, page_hashes
from otel_hicache.cache.controller import CacheController, KvWaiter, span_links
from otel_hicache.cache.pools import PoolGroup, PoolSpec, Value, value_slots
from otel_hicache.cache.radix import Node, RadixTree
from otel_hicache.cache.storage import FileStore, StorageJob
from otel_hicache.capacity import TierCapacity
from otel_hicache.records import (
    DropRecord,
    EvictedEntry,
    EvictionRecord,
    KvWait,
    PoolUsage,
    PrefixSplit,
    TransferFailure,
)
from otel_hicache.semconv import DropReason, Tier, TransferOperation, WritePolicy
from otel_hicache.telemetry import HiCacheTelemetry
from otel_hicache.timing import now_ns

#: Hits before a node is backed up, per write-through policy (SGLang's write_through_threshold).
WRITE_THROUGH_THRESHOLD = {WritePolicy.WRITE_THROUGH: 1, WritePolicy.WRITE_THROUGH_SELECTIVE: 2}


@dataclass(frozen=True)
class CacheConfig:
    pools: tuple[PoolSpec, ...] = (PoolSpec("kv", layers=2, heads=2, head_dim=16),)
    page_size: int = 16
    device_tokens: int = 2048
    host_tokens: int = 4096
    device_states: int = 64  # slots of per-node pools (mamba)
    host_states: int = 128
    write_policy: str = WritePolicy.WRITE_THROUGH.value
    load_back_threshold: int = 10  # tokens; smaller host hits are recomputed (SGLang's default)
    prefetch_threshold: int = 16  # tokens; smaller storage hits are recomputed
    storage_dir: str | os.PathLike[str] | None = None  # None: no L3
    storage_queue: int = 64
    prefetch_timeout_s: float = 10.0
    device: str = "cpu"
    seed: int = 0  # of the stand-in model's KV content

    def __post_init__(self) -> None:
        policies = [p.value for p in WritePolicy]
        if self.write_policy not in policies:
            raise ValueError(f"write_policy must be one of {policies}, not {self.write_policy!r}")
        if self.page_size < 1 or self.device_tokens < self.page_size or self.host_tokens < self.page_size:
            raise ValueError("page_size must be >= 1 and each tier must hold at least one page")


class PrefixMatch(NamedTuple):
    """Cached prefix of a prompt by tier: on device, then host only, then (beyond the tree) in L3."""

    device_len: int
    host_len: int
    storage_len: int


class Admission(NamedTuple):
    """An admitted request: its split, and the node it holds a lock on until :meth:`HiCache.release`."""

    split: PrefixSplit
    node: Node
    nodes: list[Node]  # the cached path serving it, root excluded


class CacheStats:
    """Ground truth kept by the cache (transfers are counted at the copy sites: controller.stats, store.stats)."""

    def __init__(self) -> None:
        self.requests = 0
        self.prefix: collections.Counter[str] = collections.Counter()  # by prefill mode
        self.dropped: collections.Counter[tuple[str, str]] = collections.Counter()  # (reason, pool) -> slots
        self.evicted: collections.Counter[str] = collections.Counter()  # tier -> tokens
        self.evictions: collections.Counter[str] = collections.Counter()  # tier -> passes
        self.load_back_skipped = 0
        self.uncached = 0  # requests served without caching their KV (no device room: has_room said so)


class HiCache:
    def __init__(self, config: CacheConfig, telemetry: HiCacheTelemetry) -> None:
        self.config, self.telemetry = config, telemetry
        self.policy = WritePolicy(config.write_policy)
        ps = config.page_size
        host_device = "cpu"
        self.device = PoolGroup(
            Tier.DEVICE,
            config.pools,
            token_slots=config.device_tokens // ps * ps,
            node_slots=config.device_states,
            page_size=ps,
            device=config.device,
        )
        self.host = PoolGroup(
            Tier.HOST,
            config.pools,
            token_slots=config.host_tokens // ps * ps,
            node_slots=config.host_states,
            page_size=ps,
            device=host_device,
        )
        self.per_node = frozenset(s.name for s in config.pools if s.per_node)
        self.tree = RadixTree(ps, self.per_node)
        self.controller = CacheController(self.device, self.host, telemetry, write_policy=self.policy.value)
        # The stand-in model's KV is a function of its seed: that is its identity in the L3 namespace.
        model = f"otel-hicache-stand-in/seed={config.seed}"
        self.store = (
            FileStore(config.storage_dir, self.host, telemetry, model=model, queue_size=config.storage_queue)
            if config.storage_dir is not None
            else None
        )
        # In-flight L3 backups: the job, the deepest node it reads and its token count. A split node keeps the
        # lower half, so walking up that many tokens finds every part that holds a host_lock for the job.
        self._storage_jobs: dict[int, tuple[StorageJob, Node, int]] = {}
        self._abandoned: dict[int, tuple[StorageJob, Value]] = {}  # timed-out prefetches still writing host pages
        self.stats = CacheStats()
        # Each prefix lookup feeds the capacity estimator: the host is inclusive under the write-through family (it
        # backs up what the device holds), exclusive under write_back (it holds what the device evicted); there the
        # L3 store's prefetches take host room. Each tier's free room at a lookup, once it evicts, goes with it.
        inclusive = self.policy is not WritePolicy.WRITE_BACK
        self.capacity = telemetry.capacity_feed(
            ps,
            [
                TierCapacity(Tier.DEVICE, config.device_tokens // ps * ps),
                TierCapacity(
                    Tier.HOST,
                    config.host_tokens // ps * ps,
                    inclusive=inclusive,
                    store_behind=not inclusive and self.store is not None,
                ),
            ],
        )
        telemetry.add_pool_usage_source(self.pool_usage)
        self._closed = False

    # ------------------------------------------------------------------ requests
    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        """Where the cached prefix of ``tokens`` lies (no transfer, no lock; nodes may be split at the match end)."""
        ps = self.config.page_size
        key = list(tokens[: len(tokens) // ps * ps])
        names = page_hashes(key, ps)
        match = self.tree.match(key, names)
        pos = match.device_len + match.host_len
        storage = self.store.hit_pages(names[pos // ps :]) * ps if self.store is not None else 0
        return PrefixMatch(match.device_len, match.host_len, storage)

    def has_room(self, tokens: Sequence[int]) -> bool:
        """Whether the device can hold this prompt's KV now, evicting what no request in flight holds: what a
        scheduler asks before it admits a request (SGLang's ``PrefillAdder`` counts free and evictable tokens). A
        prompt admitted without room still runs, but its KV is not cached."""
        ps = self.config.page_size
        full = len(tokens) // ps * ps
        need = full - self.tree.pinned_device_prefix(list(tokens[:full]))
        anchor = self.device.pools[self.device.anchor]
        evictable = sum(n.num_tokens for n in self.tree.nodes.values() if n.device is not None and not n.lock)
        return need <= anchor.free_slots + evictable

    def admit(self, tokens: Sequence[int], request_span: Span | None = None) -> Admission:
        """Serve one prefill: reuse every cached tier, compute and cache the rest. Hold the path until release().

        ``request_span``: the request's span, which gets the prefix split and the KV waits (``hicache.kv_wait.<tier>``,
        the host one once the load is seen complete, if the span is still open) and which the load back and
        prefetch serving it link to."""
        self.step()
        self.stats.requests += 1
        ps = self.config.page_size
        full = len(tokens) // ps * ps
        key = list(tokens[:full])
        names = page_hashes(key, ps)
        for tier, group in ((Tier.DEVICE, self.device), (Tier.HOST, self.host)):
            if self.stats.evictions[tier.value]:
                self.capacity.report_free(tier, group.pools[group.anchor].free_slots)
        self.capacity.put((next(self.capacity.seq), names, len(tokens)))
        match = self.tree.match(key, names)
        now = time.monotonic_ns()
        for hit in match.device_nodes:
            hit.device_used_ns, hit.device_reused = now, True
        last = match.last or self.tree.root
        self.tree.inc_lock(last)
        host_nodes = list(match.host_nodes)
        pos = match.device_len + match.host_len
        storage_len = 0
        if self.store is not None and pos < full:
            pages = self.store.hit_pages(names[pos // ps :])
            if pages * ps >= self.config.prefetch_threshold:
                node = self._prefetch(last, key, names, pos, pages, request_span)
                if node is not None:
                    last = self._move_lock(last, node)
                    host_nodes.append(node)
                    storage_len = node.num_tokens
                    pos += storage_len
        host_len = sum(n.num_tokens for n in host_nodes) - storage_len
        if host_nodes and not self._load_back(host_nodes, request_span):
            # Not loaded: those tokens are computed again and the host-only nodes revived with the new KV.
            host_len = storage_len = 0
            self._revive(host_nodes)
        prefix_len = match.device_len + host_len + storage_len
        path = match.device_nodes + [n for n in host_nodes if n.device is not None]
        if len(path) == len(match.device_nodes) + len(host_nodes) and pos < full:  # the whole cached path is on device
            node = self._insert(path[-1] if path else self.tree.root, key[pos:], names[pos // ps :])
            if node is not None:
                last = self._move_lock(last, node)
                path.append(node)
        self._apply_write_policy(path)
        split = PrefixSplit(
            input_tokens=len(tokens) - prefix_len,
            device_hit=match.device_len,
            host_hit=host_len,
            storage_hit=storage_len,
        )
        self.telemetry.record_prefix_split(split, request_span)
        for mode, n in split.by_mode().items():
            self.stats.prefix[mode.value] += n
        return Admission(split, last, path)

    def release(self, admission: Admission) -> None:
        self.tree.dec_lock(admission.node)

    def step(self) -> None:
        """Scheduler-loop poll: completed write / load acks (FIFO) and finished storage jobs."""
        self._on_writes(self.controller.poll_writes())
        self._on_loads(self.controller.poll_loads())
        self._drain_storage()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait for every in-flight transfer and storage job and process their completions."""
        self._on_writes(self.controller.wait_writes())
        self._on_loads(self.controller.wait_loads())
        deadline = time.monotonic() + timeout_s
        for job, *_ in list(self._storage_jobs.values()) + list(self._abandoned.values()):
            job.done.wait(max(0.0, deadline - time.monotonic()))
        self._drain_storage()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        if self.store is not None:
            self.store.shutdown()
        self.telemetry.remove_pool_usage_source(self.pool_usage)
        self.capacity.close()

    def pool_usage(self) -> list[PoolUsage]:
        return [*self.device.usage(), *self.host.usage()]

    # ------------------------------------------------------------------ insert and the stand-in model
    def _insert(self, parent: Node, key: Sequence[int], names: list[str]) -> Node | None:
        pages = len(names)
        value = self._alloc_device(pages, bool(self.per_node))
        if value is None:
            self.stats.uncached += 1
            return None  # the request still runs; its KV is just not cached
        node = self.tree.add_child(parent, key, names)
        node.device = value
        self._compute(node)
        return node

    def _revive(self, nodes: list[Node]) -> bool:
        """Give host-only nodes new device KV (recomputed); False if the device cannot hold them."""
        for node in nodes:
            if node.device is not None:
                continue
            assert node.host is not None
            value = self._alloc_device(len(node.names), any(p in node.host for p in self.per_node))
            if value is None:
                return False
            node.device = value
            self._compute(node)
        return True

    def _compute(self, node: Node) -> None:
        """The model writes the node's KV on the device (deterministic content; see :mod:`content`)."""
        assert node.device is not None
        node.device_used_ns, node.device_reused = time.monotonic_ns(), False
        seed = self.config.seed
        for name, pool in self.device.pools.items():
            index_pool = pool.spec.sidecar_of or name
            pages = node.device.get(index_pool)
            if pages is None:
                continue
            if pool.spec.per_node:
                pool.page_view(pages[0]).copy_(page_content(pool.spec, node.names[-1], seed, 1))
                continue
            for page, page_name in zip(pages, node.names, strict=True):
                pool.page_view(page).copy_(page_content(pool.spec, page_name, seed, pool.page_size))

    def _move_lock(self, old: Node, new: Node) -> Node:
        self.tree.inc_lock(new)
        self.tree.dec_lock(old)
        return new

    # ------------------------------------------------------------------ write policy and backups
    def _apply_write_policy(self, path: list[Node]) -> None:
        threshold = WRITE_THROUGH_THRESHOLD.get(self.policy)
        if threshold is None:  # write_back: backups happen only inside eviction
            return
        for node in path:
            node.hits += 1
            if node.host is None and node.device is not None and node.hits >= threshold:
                self._backup(node)
        self.controller.start_writing()  # one merged transfer for this request's backups

    def _backup(self, node: Node) -> bool:
        assert node.device is not None
        pages = len(node.names)
        state = any(p in node.device for p in self.per_node)
        if not self.host.can_alloc(pages, state):
            self.evict_host(pages * self.config.page_size, 1 if state else 0)
        host_value = self.controller.write(node.device, node.id)
        if host_value is None:
            return False
        node.host, node.ticket = host_value, [False]
        node.host_used_ns, node.host_reused, node.host_unread = time.monotonic_ns(), False, TransferOperation.BACKUP
        self.tree.inc_lock(node)  # until the write ack
        return True

    def _on_writes(self, node_ids: list[int]) -> None:
        for node_id in node_ids:
            node = self.tree.nodes[node_id]
            assert node.ticket is not None
            node.ticket[0] = True
            self.tree.dec_lock(node)
            self._storage_backup(node)

    def _on_loads(self, node_ids: list[int]) -> None:
        for node_id in node_ids:
            self.tree.dec_lock(self.tree.nodes[node_id])

    # ------------------------------------------------------------------ L3
    def _storage_backup(self, node: Node) -> None:
        """After its L2 write completed, copy the node (and the split parts sharing its write) to L3."""
        if self.store is None:
            return
        nodes = [node]
        while (up := nodes[0].parent) is not None and up.ticket is node.ticket:
            nodes.insert(0, up)
        names: list[str] = []
        value: Value = {}
        for n in nodes:
            assert n.host is not None
            names.extend(n.names)
            for pool in self.host.owning:
                if pool not in self.per_node:
                    value.setdefault(pool, []).extend(n.host[pool])
        job = StorageJob(TransferOperation.STORAGE_BACKUP, node.id, names, value)
        for n in nodes:
            n.host_lock += 1
        self._storage_jobs[id(job)] = (job, node, sum(n.num_tokens for n in nodes))
        self.store.submit(job)

    def _prefetch(
        self, parent: Node, key: list[int], names: list[str], pos: int, pages: int, request_span: Span | None
    ) -> Node | None:
        """Bring ``pages`` stored pages after ``parent`` into host memory; the new host-only node, or None.

        The request waits for it (its ``storage`` KV wait) from here until the job is done or given up."""
        assert self.store is not None
        needed_ns = time.monotonic_ns()
        ps = self.config.page_size
        if not self.host.can_alloc(pages, False):
            self.evict_host(pages * ps)
        value, _ = self.host.alloc(pages, False)
        if value is None:
            self.telemetry.record_failure(
                TransferFailure(
                    operation=TransferOperation.STORAGE_PREFETCH,
                    error_type="host_pool_full",
                    tokens_by_pool={self.host.anchor: pages * ps},
                    time_ns=now_ns(),
                )
            )
            return None
        first = pos // ps
        job = StorageJob(
            TransferOperation.STORAGE_PREFETCH,
            parent.id,
            names[first : first + pages],
            value,
            links=span_links(request_span),
        )
        if not self.store.submit(job):
            self.host.free(value)
            return None
        finished = job.done.wait(self.config.prefetch_timeout_s)
        waited_s = (time.monotonic_ns() - needed_ns) / 1e9
        self.telemetry.record_kv_wait(KvWait(Tier.STORAGE, waited_s, now_ns()), request_span)
        if not finished:
            self._abandoned[id(job)] = (job, value)  # the thread still writes these pages: free them later
            return None
        got = job.pages_done
        self.host.free({pool: ids[got:] for pool, ids in value.items()})
        if got == 0:
            return None
        node = self.tree.add_child(parent, key[pos : pos + got * ps], names[first : first + got])
        node.host = {pool: ids[:got] for pool, ids in value.items()}
        node.host_used_ns, node.host_unread = time.monotonic_ns(), TransferOperation.STORAGE_PREFETCH
        return node

    def _drain_storage(self) -> None:
        if self.store is None:
            return
        completed = self.store.completed
        while completed:
            job = completed.popleft()
            entry = self._storage_jobs.pop(id(job), None)
            if entry is not None:
                n: Node | None = entry[1]
                remaining = entry[2]
                while remaining > 0 and n is not None:
                    n.host_lock -= 1
                    remaining -= n.num_tokens
                    n = n.parent
            abandoned = self._abandoned.pop(id(job), None)
            if abandoned is not None:
                self.host.free(abandoned[1])

    # ------------------------------------------------------------------ load back
    def _load_back(self, nodes: list[Node], request_span: Span | None) -> bool:
        """H->D for the evicted path, all or nothing; False when skipped (threshold) or the device is full.

        The request needs the KV from here on: its ``host`` KV wait runs from this point to the copy's finish."""
        tokens = sum(n.num_tokens for n in nodes)
        if tokens < self.config.load_back_threshold:
            self.stats.load_back_skipped += 1
            return False
        needed = self.controller.mark_needed()
        pages = sum(len(n.names) for n in nodes)
        states = sum(1 for n in nodes if n.host is not None and any(p in n.host for p in self.per_node))
        self._make_device_room(pages, states)
        loaded: list[tuple[Node, Value]] = []
        for node in nodes:
            assert node.host is not None
            value = self.controller.load(node.host, node.id)
            if value is None:  # all or nothing: give back what this path took, nothing was issued yet
                for _, v in loaded:
                    self.device.free(v)
                self.controller.cancel_loads(len(loaded))
                return False
            loaded.append((node, value))
        now = time.monotonic_ns()
        for node, value in loaded:
            node.device = value
            node.device_used_ns, node.device_reused = now, False  # a new device copy, read by this forward
            node.host_used_ns, node.host_reused, node.host_unread = now, True, None  # the host copy served a hit
            self.tree.inc_lock(node)  # until the load ack
        self.controller.start_loading(KvWaiter(needed, request_span))
        self.controller.fence_loads()
        return True

    # ------------------------------------------------------------------ eviction
    def _alloc_device(self, pages: int, state: bool) -> Value | None:
        self._make_device_room(pages, 1 if state else 0)
        value, _ = self.device.alloc(pages, state)
        return value

    def _make_device_room(self, pages: int, states: int) -> None:
        if not self.device.can_alloc(pages, False) or (states and not self._device_states_free(states)):
            anchor = self.device.pools[self.device.anchor]
            need = max(0, pages * self.config.page_size - anchor.free_slots)
            self.evict_device(need, states)

    def _device_states_free(self, states: int) -> bool:
        return all(self.device.pools[p].free_slots >= states for p in self.per_node)

    def evict_device(self, num_tokens: int, states: int = 0) -> int:
        """Free at least ``num_tokens`` device token slots (and ``states`` state slots) from unlocked leaves."""
        start = time.perf_counter()
        heap = [(n.last_access, n.id, n) for n in self._device_leaves()]
        heapq.heapify(heap)
        freed = 0
        entries: list[EvictedEntry] = []
        while heap and (freed < num_tokens or (states and not self._device_states_free(states))):
            _, _, node = heapq.heappop(heap)
            if not self._is_device_leaf(node):
                continue
            parent = node.parent
            entry = EvictedEntry(node.num_tokens, _idle_s(node.device_used_ns), node.device_reused)
            if node.backed:
                self._demote(node)
            elif self.policy is WritePolicy.WRITE_BACK:
                if self._backup(node):  # blocking backup, then demote
                    self._on_writes(self.controller.wait_writes())
                    self._demote(node)
                elif not self._drop(node, DropReason.HOST_PRESSURE):
                    continue
            else:
                reason = (
                    DropReason.WRITE_THROUGH_UNBACKED_EVICTION if self.policy is WritePolicy.WRITE_THROUGH else None
                )
                if not self._drop(node, reason):
                    continue
            freed += node.num_tokens
            entries.append(entry)
            if parent is not None and self._is_device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        self._record_eviction(Tier.DEVICE, freed, start, entries)
        return freed

    def evict_host(self, num_tokens: int, states: int = 0) -> int:
        """Free host slots from evicted (host-only) leaves nobody uses."""
        start = time.perf_counter()
        heap = [(n.last_access, n.id, n) for n in self.tree.nodes.values() if self._is_host_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        entries: list[EvictedEntry] = []
        host_state_free = lambda: all(self.host.pools[p].free_slots >= states for p in self.per_node)  # noqa: E731
        while heap and (freed < num_tokens or (states and not host_state_free())):
            _, _, node = heapq.heappop(heap)
            if not self._is_host_leaf(node):
                continue
            parent = node.parent
            assert node.host is not None
            unread = self.controller.bytes_of(node.host) if node.host_unread is not None else 0
            entries.append(
                EvictedEntry(node.num_tokens, _idle_s(node.host_used_ns), node.host_reused, unread, node.host_unread)
            )
            self.host.free(node.host)
            self.tree.remove(node)
            freed += node.num_tokens
            if parent is not None and self._is_host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        self._record_eviction(Tier.HOST, freed, start, entries)
        return freed

    def _demote(self, node: Node) -> None:
        assert node.device is not None
        self.device.free(node.device)
        node.device = None

    def _drop(self, node: Node, reason: DropReason | None) -> bool:
        """Delete ``node`` (a device leaf with no host copy) and its host-only subtree; False if something is in use."""
        subtree = list(self.tree.subtree(node))
        if any(n.host_lock or (n is not node and n.lock) for n in subtree):
            return False
        assert node.device is not None
        freed = value_slots(self.device, node.device)
        self.device.free(node.device)
        node.device = None
        for n in subtree:
            if n.host is not None:
                self.host.free(n.host)
            self.tree.remove(n)
        if reason is not None:
            tokens = {pool: slots for pool, slots in freed.items() if slots}
            self.telemetry.record_drop(DropRecord(reason=reason, tokens_by_pool=tokens, time_ns=now_ns()))
            for pool, slots in tokens.items():
                self.stats.dropped[(reason.value, pool)] += slots
        return True

    def _record_eviction(self, tier: Tier, freed: int, start: float, entries: list[EvictedEntry]) -> None:
        if freed:
            duration = time.perf_counter() - start
            self.telemetry.record_eviction(
                EvictionRecord(tier=tier, num_tokens=freed, duration_s=duration, time_ns=now_ns(), entries=entries)
            )
            self.stats.evicted[tier.value] += freed
            self.stats.evictions[tier.value] += 1

    def _device_leaves(self) -> Iterator[Node]:
        return (n for n in self.tree.nodes.values() if self._is_device_leaf(n))

    def _is_device_leaf(self, node: Node) -> bool:
        return (
            node is not self.tree.root
            and node.id in self.tree.nodes
            and node.device is not None
            and node.lock == 0
            and not any(c.device is not None for c in node.children.values())
        )

    def _is_host_leaf(self, node: Node) -> bool:
        return (
            node is not self.tree.root
            and node.id in self.tree.nodes
            and node.device is None
            and node.host is not None
            and not node.children
            and node.lock == 0
            and node.host_lock == 0
        )


def _idle_s(used_ns: int) -> float:
    """Seconds since a copy's last use (a monotonic time stamp taken when it was used)."""
    return max(0, time.monotonic_ns() - used_ns) / 1e9


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
