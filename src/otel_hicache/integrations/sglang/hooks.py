"""The wrapt wrappers around SGLang's HiCache methods (:class:`HiCacheHooks`).

Each wrapper calls SGLang's method exactly once, unchanged, and reads only what SGLang already computed (an eviction
result, the prefill adder's counters, a prefetch operation) to build a record for
:class:`~otel_hicache.telemetry.HiCacheTelemetry`. Transfers between device and host are seen on SGLang's ack queues
(:mod:`.ack_queues`): the submission wrappers only adopt a controller's queue, once. What the wrappers read from
SGLang's objects is in :mod:`.reading`, the eviction bookkeeping in :mod:`.eviction`, the self-check against SGLang's
own collector in :mod:`.self_check`. Nothing here synchronises a device.

Failure rule (:mod:`.._base`): our code never raises into SGLang nor changes its exception; a failure is logged once.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from time import monotonic_ns
from typing import Any

from otel_hicache.integrations._base import (
    EngineHooks,
    ProcessSink,
    Ranks,
    WeakPoolSource,
    checks_suppression,
    trim,
    warn_once,
)
from otel_hicache.integrations.sglang.ack_queues import LOAD, QUEUE, WRITE, AckQueue, AckReporter, Links
from otel_hicache.integrations.sglang.capacity import CapacityHooks
from otel_hicache.integrations.sglang.eviction import READ, AccessClock, Evictions, full_tokens, radix_node
from otel_hicache.integrations.sglang.prefix import request_split
from otel_hicache.integrations.sglang.reading import (
    PrefillCounts,
    drop_arguments,
    host_pool_usage,
    prefill_counts,
    request_span,
    size_per_token,
)
from otel_hicache.integrations.sglang.self_check import SelfCheck
from otel_hicache.records import DropRecord, EvictedEntry, EvictionRecord, KvWait, TransferRecord
from otel_hicache.semconv import (
    DEFAULT_POOL,
    RecordKind,
    Tier,
    TimingSource,
    TransferOperation,
)
from otel_hicache.telemetry import DeferredQueue
from otel_hicache.timing import ANCHOR, now_ns

#: Each direction's submission method on ``HiCacheController`` and its in-flight transfers on ``UnifiedRadixCache``.
_SUBMIT = {WRITE: "start_writing", LOAD: "start_loading"}
_ONGOING = {WRITE: "ongoing_write_through", LOAD: "ongoing_load_back"}


class HiCacheHooks(EngineHooks):
    """The wrapper callables (wrapt signature ``(wrapped, instance, args, kwargs)``) reporting through one
    :class:`~.._base.ProcessSink`.

    The sink is built (with ``ranks()``) on the process's first HiCache event (``init_hicache``, a consumed ack, a
    drop, an L3 transfer); evictions and prefill admissions are reported once it exists, so a process that never runs
    HiCache builds nothing. Every wrapper is installed under the failure rule of :mod:`.._base`: if its own code
    fails, SGLang's call goes on untouched and the failure is logged once.
    """

    def __init__(self, sink: ProcessSink, ranks: Callable[[], Ranks] | None = None) -> None:
        super().__init__(sink, ranks)
        self._capacity = CapacityHooks(sink, ranks)  # each prefill batch's admissions feed the capacity estimator
        # Per-controller request links live on the controller itself (one attribute read); the weak dictionary is
        # only the fallback for a controller that takes no new attributes.
        self._attr = f"_otel_hicache_links_{id(self):x}"
        self._links_of: weakref.WeakKeyDictionary[Any, dict[str, Links]] = weakref.WeakKeyDictionary()
        # Every queue reporting to these hooks, by id (a list is unhashable).
        self._queues: weakref.WeakValueDictionary[int, AckQueue] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._prefill_queue: DeferredQueue | None = None  # prefill batches' splits, counted on the host thread
        # request id -> when its prefetch started, until SGLang lets the request go; then -> (seconds its prefetch
        # held it, when it was let go), until the request is admitted
        self._prefetch_starts: dict[str, float] = {}
        self._storage_waits: dict[str, tuple[float, int]] = {}
        self._evictions = Evictions()  # the eviction passes running on this thread, innermost last
        self._clock = AccessClock()  # SGLang's access counter -> time, for the age of evicted nodes
        self._check = SelfCheck(sink.switch)  # against SGLang's own collector

    def _links(self, controller: Any) -> dict[str, Links]:
        """``controller``'s request links, per direction (a load-back's request is never linked to a backup)."""
        links = getattr(controller, self._attr, None)
        if links is not None:
            return links
        with self._lock:
            links = self._links_of.get(controller)
            if links is None:
                links = {WRITE: {}, LOAD: {}}
                try:
                    setattr(controller, self._attr, links)
                except (AttributeError, TypeError):  # __slots__ or a frozen object
                    self._links_of[controller] = links
        return links

    def detach(self) -> None:
        """Stop every adopted ack queue reporting (``uninstrument()``): each stays a plain list for SGLang, and its
        controller calls SGLang's submission methods through the class again; and the self-check."""
        for queue in list(self._queues.values()):
            queue.detach()
        self._queues.clear()
        super().detach()
        self._check.end()
        if self._prefill_queue is not None:
            self._prefill_queue.close()  # dropped by the telemetry once drained

    # ------------------------------------------------------------------ submission: HiCacheController
    @checks_suppression
    def start_writing(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        return self._submit(wrapped, instance, args, kwargs, WRITE)

    @checks_suppression
    def start_loading(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        return self._submit(wrapped, instance, args, kwargs, LOAD)

    def _submit(self, wrapped: Callable[..., Any], cc: Any, args: tuple, kwargs: dict, direction: str) -> Any:
        """Adopt ``cc``'s ack queue of ``direction`` (it notes each submission itself from then on), and let ``cc``'s
        later submissions of that direction skip this wrapper. Adopted under suppression too: the ack appended there
        is then known as not to be reported."""
        if self._queue(cc, direction) is not None:
            self._skips(cc, _SUBMIT.values()).set(_SUBMIT[direction], True)
        return wrapped(*args, **kwargs)

    def _queue(self, cc: Any, direction: str) -> AckQueue | None:
        """``cc``'s ack queue for ``direction``, reporting to these hooks (adopted now if need be); None while there
        is no telemetry, or where the queue is not a list. Runs on the scheduler thread, the only one that touches
        the queue."""
        name = QUEUE[direction]
        queue = getattr(cc, name)
        kind = type(queue)
        if kind is AckQueue and self._queues.get(id(queue)) is queue:
            return queue
        if kind is not list and kind is not AckQueue:
            warn_once(
                f"queue:{name}:{kind.__module__}.{kind.__qualname__}",
                "otel_hicache: this SGLang's HiCacheController.%s is a %s, not a list: left as it is, so its "
                "transfers are not reported.",
                name,
                kind.__qualname__,
            )
            return None
        telemetry = self._sink()
        if telemetry is None:
            return None
        reporter = AckReporter(telemetry, cc, direction, self._links(cc)[direction], self._clock.sample)
        deferred = telemetry.deferred_queue(reporter.record)
        if kind is not AckQueue:  # else adopted by an earlier instrument(): it reports again, here
            queue = AckQueue(queue)
            setattr(cc, name, queue)
        queue.attach(reporter, deferred)
        self._queues[id(queue)] = queue
        return queue

    @checks_suppression
    def reset(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``HiCacheController.reset`` clears the ack queues: their acks are forgotten, they were never consumed
        (also inside suppress_instrumentation(), where a clear would otherwise count as consumption)."""
        reporters = [
            queue.reporter
            for queue in (getattr(instance, name, None) for name in QUEUE.values())
            if type(queue) is AckQueue and queue.reporter is not None
        ]
        for reporter in reporters:
            reporter.forgetting = True
        try:
            return wrapped(*args, **kwargs)
        finally:
            for reporter in reporters:
                reporter.forgetting = False
            for links in self._links(instance).values():
                links.clear()

    # ------------------------------------------------------------------ request links (SGLang request tracing on)
    def load_back(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``UnifiedRadixCache.load_back(node_id, mem_quota, req)``: the load backs it starts serve ``req``, and read
        the host copies of the nodes they load (marked on SGLang's node objects: not wasted when evicted)."""
        req = args[2] if len(args) > 2 else kwargs.get("req")
        ongoing = instance.ongoing_load_back
        before = set(ongoing)
        result = self._link_new_acks(wrapped, instance, args, kwargs, req, LOAD)
        for node_id in ongoing.keys() - before:
            node = radix_node(instance.tree_core, node_id)
            if node is not None:
                setattr(node, READ, True)
        return result

    def checkpoint(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``UnifiedRadixCache.checkpoint_into_tree(req, ...)`` / ``advance_unpublished_req(req)``: the backups its
        insert starts (write-through) carry ``req``'s tokens."""
        req = args[0] if args else kwargs.get("req")
        return self._link_new_acks(wrapped, instance, args, kwargs, req, WRITE)

    def _link_new_acks(
        self, wrapped: Callable[..., Any], cache: Any, args: tuple, kwargs: dict, req: Any, direction: str
    ) -> Any:
        """Remember ``req`` (and its span) for every ack id ``wrapped`` adds to the cache's in-flight transfers of
        ``direction`` (``ongoing_write_through`` / ``ongoing_load_back``); the transfer span of the next ack of that
        direction to complete them links to it, and a load back's completion is the end of the request's KV wait.
        Nothing to do for a backup with tracing off."""
        span = request_span(req)
        if req is None or (span is None and direction is WRITE):
            return wrapped(*args, **kwargs)
        ongoing = getattr(cache, _ONGOING[direction])
        before = set(ongoing)
        result = wrapped(*args, **kwargs)
        new = ongoing.keys() - before
        if new and cache.cache_controller is not None:
            links = self._links(cache.cache_controller)[direction]
            link = (monotonic_ns(), None if span is None else span.get_span_context(), span, id(req))
            for ack_id in new:
                links[ack_id] = (*links.get(ack_id, ()), link)
            trim(links)  # ack ids whose ack was never consumed (a reset we did not see)
        return result

    # ------------------------------------------------------------------ eviction and drops: UnifiedRadixCache
    def evict(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``_evict``: one device eviction pass, with an entry per radix node it evicted (:meth:`device_entry`);
        SGLang reports full-layer tokens only, and nothing when none were freed."""
        with self._evictions.open(0) as entries:
            start = time.perf_counter()
            result = wrapped(*args, **kwargs)
        freed = result.num_tokens_evicted
        telemetry = self.telemetry
        if freed > 0 and telemetry is not None:
            duration = time.perf_counter() - start
            telemetry.record_eviction(EvictionRecord(Tier.DEVICE, freed, duration, now_ns(), self._clock.idle(entries)))
        return result

    def device_entry(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``_evict_device_leaf(node_id, tracker)`` / ``_demote(node_id, tracker)``: one radix node leaves the
        device (deleted, or demoted to its host copy). Reused: it served a hit - SGLang's ``hit_count`` counts the
        insert that made the node and each later insert of its prefix (a request that reused it), so above 1; under
        write-back SGLang counts no hits: unknown."""
        core = instance.tree_core
        node = radix_node(core, args[0] if args else kwargs["node_id"])
        tracker = args[1] if len(args) > 1 else kwargs["tracker"]
        before = full_tokens(tracker)
        result = wrapped(*args, **kwargs)
        tokens = full_tokens(tracker) - before
        if tokens > 0:
            if node is None:  # the Rust TreeCore keeps its nodes to itself: no detail
                self._evictions.add(EvictedEntry(tokens))
            else:
                reused = None if core.is_write_back else node.hit_count > 1
                self._evictions.add(EvictedEntry(tokens, node.last_access_time, reused))
        return result

    def evict_host(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``evict_host(num_tokens, ...)``: one host eviction pass (SGLang 0.5.23 reports none), with an entry per
        host copy it freed (:meth:`host_entry`): reused = it was loaded back; wasted = the bytes of one never read."""
        cc = instance.cache_controller
        per_token = size_per_token(getattr(cc, "mem_pool_host", None)) if cc is not None else 0
        with self._evictions.open(per_token) as entries:
            start = time.perf_counter()
            result = wrapped(*args, **kwargs)
        telemetry = self.telemetry
        component = args[1] if len(args) > 1 else kwargs.get("component_type")
        freed = int(result) if component is None or getattr(component, "name", None) == "FULL" else 0
        if freed > 0 and telemetry is not None:
            duration = time.perf_counter() - start
            telemetry.record_eviction(EvictionRecord(Tier.HOST, freed, duration, now_ns(), self._clock.idle(entries)))
        return result

    def host_entry(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``UnifiedTreeCore._evict_host_leaf(node, tracker, ...)``: one radix node's host copy is freed."""
        node = args[0] if args else kwargs["node"]
        tracker = args[1] if len(args) > 1 else kwargs["tracker"]
        before = full_tokens(tracker)
        result = wrapped(*args, **kwargs)
        tokens = full_tokens(tracker) - before
        if tokens > 0:
            read = getattr(node, READ, False)
            unread = 0 if read else tokens * self._evictions.bytes_per_token()
            self._evictions.add(EvictedEntry(tokens, node.last_access_time, read, unread))
        return result

    def dropped_tokens(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``_record_dropped_tokens(dropped_tokens, reason)``: SGLang's own drop count, per reason."""
        result = wrapped(*args, **kwargs)
        tokens, reason = drop_arguments(*args, **kwargs)
        telemetry = self._sink() if tokens > 0 else None
        if telemetry is not None:
            telemetry.record_drop(DropRecord(reason=reason, tokens_by_pool={DEFAULT_POOL: tokens}, time_ns=now_ns()))
        return result

    # ------------------------------------------------------------------ prefill admission: PrefillAdder
    def prefill_batch(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``PrefillStats.from_adder(adder, ...)``: SGLang's stats of one prefill batch, built metrics on or off, from
        the adder's counters; the one wrapper of a prefill batch. The batch's split is counted once, from the same
        counters (so the sums agree with SGLang's ``prefill_effective_tokens_total``: input minus retracted re-counts,
        hits of non-retracted requests), on the host thread; the requests it admitted are fed to the capacity
        estimator (:mod:`.capacity`), and with SGLang's request tracing on each one's own split goes on its span
        (:func:`.prefix.request_split`); and the KV wait a storage prefetch held each of its requests for ends here."""
        result = wrapped(*args, **kwargs)
        adder = args[0] if args else kwargs["adder"]
        self._clock.sample()
        counts = prefill_counts(adder)
        if any(counts):
            self._count_prefill(counts)
        if self._storage_waits:
            self._end_storage_waits(adder.can_run_list)
        admitted = self._capacity.admissions(adder)
        if admitted:
            self._split_on_spans(admitted)
        return result

    def _split_on_spans(self, admitted: list[Any]) -> None:
        """Each traced request's own split on its span, while it is open (counted with its batch); a retracted one
        coming back keeps its first admission's (SGLang counts no hits for it)."""
        telemetry = self.telemetry
        if telemetry is None:
            return
        for req in admitted:
            span = None if req.retracted_stain else request_span(req)
            if span is not None:
                telemetry.record_prefix_split(request_split(req), request_span=span, counted=True)

    def _end_storage_waits(self, admitted: list[Any]) -> None:
        telemetry = self.telemetry
        for req in admitted:
            waited = self._storage_waits.pop(req.cache_request_handle.rid, None)
            if waited is not None and telemetry is not None and not req.retracted_stain:
                telemetry.record_kv_wait(KvWait(Tier.STORAGE, waited[0], waited[1]), request_span=request_span(req))

    def _count_prefill(self, counts: PrefillCounts) -> None:
        """Count a batch's split, the adder's counters as :func:`.reading.prefill_counts` reads them, on the
        telemetry's host thread (one entry put on a queue of ours), once the process reports."""
        queue = self._prefill_queue
        if queue is None:
            telemetry = self.telemetry
            if telemetry is None:
                return
            queue = self._prefill_queue = telemetry.deferred_queue(
                self._counted_prefills, batched=True, kind=RecordKind.PREFIX_SPLIT
            )
        queue.put((next(queue.seq), counts))

    def _counted_prefills(self, entries: list[tuple[int, PrefillCounts]]) -> None:
        """Host thread: count the splits of every batch waiting (:meth:`_count_prefill`), summed: one count."""
        telemetry = self.telemetry
        if telemetry is not None:
            telemetry.record_prefix_splits(counts for _, counts in entries)

    # ------------------------------------------------------------------ L3 storage
    def storage_backup(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``_page_backup_or_log(operation)`` (storage backup thread): one host -> storage write, host-clock timed."""
        submit_ns, start = now_ns(), time.perf_counter()
        result = wrapped(*args, **kwargs)
        operation = args[0] if args else kwargs["operation"]
        tokens = operation.completed_tokens
        telemetry = self._sink() if tokens > 0 else None
        if telemetry is not None:
            duration = time.perf_counter() - start
            telemetry.record_transfer(
                TransferRecord(
                    operation=TransferOperation.STORAGE_BACKUP,
                    tokens_by_pool={DEFAULT_POOL: tokens},
                    num_bytes=tokens * size_per_token(instance.storage_host_pool),
                    submit_time_ns=submit_ns,
                    complete_time_ns=now_ns(),
                    copy_duration_s=duration,
                    timing_source=TimingSource.HOST_CLOCK,
                    write_policy=instance.write_policy,
                    io_backend=instance.storage_backend_type,
                )
            )
        return result

    def storage_prefetch(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``_handle_prefetch_result(operation)``: a finished storage -> host prefetch, from its issue to its result."""
        operation = args[0] if args else kwargs["operation"]
        self._prefetching(operation)  # its request is let go at the next progress check
        tokens = operation.completed_tokens
        issued_ns = ANCHOR.to_epoch_ns(int(operation.start_time * 1e9))  # PrefetchOperation: time.monotonic()
        result = wrapped(*args, **kwargs)
        telemetry = self._sink() if tokens > 0 else None
        if telemetry is not None:
            cc = instance.cache_controller
            telemetry.record_transfer(
                TransferRecord(
                    operation=TransferOperation.STORAGE_PREFETCH,
                    tokens_by_pool={DEFAULT_POOL: tokens},
                    num_bytes=tokens * size_per_token(cc.storage_host_pool),
                    submit_time_ns=min(issued_ns, now_ns()),
                    complete_time_ns=now_ns(),
                    io_backend=cc.storage_backend_type,
                )
            )
        return result

    def prefetch_progress(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``check_prefetch_progress(request)``: the scheduler asks each step whether a request's storage prefetch
        lets it go; the first yes ends its KV wait (from the prefetch's start), recorded at its admission."""
        request = args[0] if args else kwargs["request"]
        ongoing = instance.ongoing_prefetch.get(request)
        if ongoing is not None:
            self._prefetching(ongoing.operation)
        result = wrapped(*args, **kwargs)
        started = self._prefetch_starts.pop(request.rid, None) if result is True else None
        if started is not None:
            self._storage_waits[request.rid] = (max(0.0, time.monotonic() - started), now_ns())
            trim(self._storage_waits)  # requests released and never admitted (aborted)
        return result

    def _prefetching(self, operation: Any) -> None:
        """Note when a request's prefetch started (``PrefetchOperation.start_time``: ``time.monotonic()``)."""
        self._prefetch_starts[operation.request_id] = operation.start_time
        trim(self._prefetch_starts)

    # ------------------------------------------------------------------ pool occupancy
    def init_hicache(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """After ``UnifiedRadixCache.init_hicache``: report the host KV pool's occupancy at each collection."""
        result = wrapped(*args, **kwargs)
        telemetry = self._sink()
        if telemetry is not None:
            telemetry.add_pool_usage_source(WeakPoolSource(instance, host_pool_usage, telemetry, self.sink.switch))
            self._check.add(telemetry, instance)
        return result
