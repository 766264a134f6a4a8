"""The wrapt wrappers around SGLang's HiCache methods, and the ack queues that report consumed transfers.

Each wrapper calls SGLang's method exactly once, unchanged, and reads only what SGLang already computed (the
``HiCacheAck`` of a merged transfer, an eviction result, the prefill adder's counters) to build a record for
:class:`~otel_hicache.telemetry.HiCacheTelemetry`. Nothing here synchronises a device: a copy duration is read
from an ack's events only after SGLang consumed the ack (its finish event is complete), through
:func:`otel_hicache.timing.elapsed_seconds`, which checks ``query()`` first.

Consumed acks are seen where they leave, not around the methods that consume them: the first submission the
``start_writing`` / ``start_loading`` wrapper sees replaces the controller's ``ack_write_queue`` / ``ack_load_queue``
by an :class:`AckQueue` (a ``list``, with the same acks) whose ``pop`` and ``clear`` report each ack that leaves it.
Every consumer of SGLang 0.5.23 is covered that way - ``writing_check`` (``pop(0)``; ``clear()`` under write-back),
``loading_check`` (``pop(0)``), PD decode's ``DecodeKVCacheOffloadManager._check_offload_progress`` (``pop(0)``) - and
the checks themselves run unwrapped: a check that consumes nothing costs nothing, and a consumed ack costs its
scheduler thread one entry put on a :class:`~otel_hicache.telemetry.DeferredQueue` (two C calls); the record is built
and counted on the telemetry's host thread.

An ack leaves a queue only through ``pop`` in SGLang 0.5.23 (and ``clear``); every other way a list can lose items
(``del q[:n]``, ``q[:] = ...``, ``remove``, ``q *= 0``) reports the acks it removed the same way, as consumed: SGLang
removes only acks it consumed, except in ``HiCacheController.reset`` (wrapped: those are forgotten). A queue that is not
a ``list`` (say, a ``collections.deque``) is left as it is, with one warning: its acks are not reported, and the
self-check counts the missing transfers. A queue object SGLang replaces takes its unconsumed acks with it, unseen.

Failure rule (:mod:`.._base`): our code never raises into SGLang nor changes its exception; a failure is logged once.
"""

from __future__ import annotations

import bisect
import contextlib
import re
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from time import monotonic_ns
from typing import Any, SupportsIndex, cast

from opentelemetry.instrumentation.utils import is_instrumentation_enabled
from opentelemetry.trace import Span, SpanContext

from otel_hicache.integrations._base import (
    EngineHooks,
    ProcessSink,
    Ranks,
    WeakPoolSource,
    checks_suppression,
    hook_failed,
    trim,
)
from otel_hicache.integrations._base import warn_once as _warn_once
from otel_hicache.records import (
    DropRecord,
    EvictedEntry,
    EvictionRecord,
    KvWait,
    PoolUsage,
    PrefixSplit,
    TransferRecord,
)
from otel_hicache.semconv import (
    ATTR_PREFIX_TOKENS,
    DEFAULT_POOL,
    MAX_EVICTION_ENTRIES,
    METRIC_DROPPED_TOKENS,
    METRIC_EVICTION_TOKENS,
    METRIC_TRANSFER_SIZE,
    METRIC_TRANSFER_TOKENS,
    DropReason,
    PrefillMode,
    Tier,
    TimingSource,
    TransferOperation,
)
from otel_hicache.telemetry import DeferredQueue, HiCacheTelemetry
from otel_hicache.timing import ANCHOR, elapsed_seconds, now_ns

_ENGINE = "SGLang HiCache"
_WRITE = "write"
_LOAD = "load"
_QUEUE = {_WRITE: "ack_write_queue", _LOAD: "ack_load_queue"}
_ONGOING = {_WRITE: "ongoing_write_through", _LOAD: "ongoing_load_back"}
_Submitted = tuple["int | None", int]  # (submit time in monotonic ns, or None when unknown; merged ops)
_UNSEEN: _Submitted = (None, 1)  # an ack queued before its queue was adopted
#: What a transfer is known to serve: (when, in monotonic ns; the request span's context, None untraced; the request
#: span; the request's identity). Load backs: every request that started one (its KV wait); backups: traced ones only.
_Link = tuple[int, "SpanContext | None", "Span | None", int]
#: ack id -> the links of the requests its next transfer serves
_Links = dict[int, tuple[_Link, ...]]


class AckQueue(list[Any]):  # SGLang's List[HiCacheAck]
    """A controller's ack queue as SGLang uses it (a ``list``; appending and reading are untouched) that hands each
    ack leaving it to the telemetry's host thread: one entry put on a :class:`~otel_hicache.telemetry.DeferredQueue`,
    two C calls. Detached (uninstrumented): a plain list."""

    __slots__ = ("__weakref__", "_closer", "_deferred", "reporter")

    def __init__(self, acks: Iterable[Any]) -> None:
        super().__init__(acks)
        self.reporter: AckReporter | None = None
        self._deferred: DeferredQueue | None = None
        self._closer: weakref.finalize[Any, Any] | None = None

    def attach(self, reporter: AckReporter, deferred: DeferredQueue) -> None:
        self.detach()
        self.reporter, self._deferred = reporter, deferred
        # a controller that goes away: its queue is dropped once drained
        self._closer = weakref.finalize(self, deferred.close)

    def detach(self) -> None:
        closer, self._closer, self._deferred, self.reporter = self._closer, None, None, None
        if closer is not None:
            closer()  # closes the deferred queue, and lets go of it (and of its reporter) once drained

    def pop(self, index: SupportsIndex = -1) -> Any:
        ack = list.pop(self, index)
        deferred = self._deferred
        if deferred is not None:
            try:
                deferred.put((next(deferred.seq), ack, monotonic_ns()))
            except Exception:
                hook_failed(_ENGINE, "ack queue")
        return ack

    def clear(self) -> None:
        acks = list(self) if self._deferred is not None else ()
        list.clear(self)
        self._left(acks)

    def remove(self, value: Any) -> None:
        try:
            index = list.index(self, value)
        except Exception:
            return list.remove(self, value)  # raises what a list raises
        ack = list.__getitem__(self, index)
        list.__delitem__(self, index)
        self._left((ack,))
        return None

    def __delitem__(self, index: SupportsIndex | slice) -> None:
        try:
            removed = list.__getitem__(self, index)
        except Exception:
            return list.__delitem__(self, index)  # raises what a list raises
        list.__delitem__(self, index)
        self._left(removed if isinstance(index, slice) else (removed,))
        return None

    def __setitem__(self, index: Any, value: Any) -> None:
        try:
            before = list.__getitem__(self, index)
        except Exception:
            return list.__setitem__(self, index, value)  # raises what a list raises
        list.__setitem__(self, index, value)
        if isinstance(index, slice):
            kept = {id(ack) for ack in self}
            self._left([ack for ack in before if id(ack) not in kept])
        elif before is not list.__getitem__(self, index):
            self._left((before,))
        return None

    def __imul__(self, times: SupportsIndex) -> AckQueue:
        before = list(self)
        list.__imul__(self, times)
        if not self:
            self._left(before)
        return self

    def _left(self, acks: Iterable[Any]) -> None:
        """``acks`` left the queue other than by ``pop``: consumed, or forgotten by ``HiCacheController.reset``."""
        deferred, reporter = self._deferred, self.reporter
        if deferred is None or reporter is None:
            return
        try:
            if reporter.forgetting:  # HiCacheController.reset: these acks were never consumed
                for ack in acks:
                    reporter.submitted.pop(id(ack), None)
                return
            done_ns = monotonic_ns()  # write-back's writing_check clears after synchronising every ack
            for ack in acks:
                deferred.put((next(deferred.seq), ack, done_ns))
        except Exception:
            hook_failed(_ENGINE, "ack queue")


class AckReporter:
    """Reports one queue's consumed acks as transfers of one operation (``backup`` for the write queue, ``load_back``
    for the load queue), on the telemetry's host thread."""

    __slots__ = ("forgetting", "links", "report", "site", "submitted", "waits")

    def __init__(self, telemetry: HiCacheTelemetry, cc: Any, direction: str, links: _Links) -> None:
        write = direction is _WRITE
        self.site = telemetry.transfer_site(
            TransferOperation.BACKUP if write else TransferOperation.LOAD_BACK,
            timing_source=TimingSource.CUDA_EVENT,  # SGLang times its copies with device events, when it times them
            write_policy=cc.write_policy if write else None,
            io_backend=cc.io_backend or None,
        )
        self.report = telemetry.record_transfer_at
        self.waits = None if write else telemetry.record_kv_wait  # a load back: its requests waited for it
        self.links = links  # the requests this direction's transfers serve
        self.submitted: dict[int, _Submitted | None] = {}  # id(ack) -> submission; None: under suppression
        self.forgetting = False  # HiCacheController.reset is clearing the queue: its acks were never consumed

    def submit(self, ack: Any, submitted: _Submitted | None) -> None:
        """On the scheduler thread, after the ack was appended (the host thread reads it once it is consumed)."""
        table = self.submitted
        table[id(ack)] = submitted
        trim(table)

    def record(self, entry: tuple[int, Any, int]) -> None:
        """Report one consumed ack, ``(seq, ack, when it left)`` (host thread), unless it was submitted under
        suppression. No record object: the transfer's values go to the telemetry as they are."""
        _, ack, done_ns = entry
        submitted = self.submitted.pop(id(ack), _UNSEEN)  # the ack is alive in the payload: its id is its own
        if submitted is None:
            return  # submitted inside suppress_instrumentation(): not reported
        submit_ns, merged = submitted
        nodes, epoch = ack.node_ids, ANCHOR.offset_ns  # monotonic -> epoch ns
        served = _served(self.links, nodes, done_ns) if self.links else ()
        self.report(
            self.site,
            ack.num_tokens_by_pool or {},
            ack.num_bytes,  # one total across pools: SGLang does not split bytes by pool
            (done_ns if submit_ns is None else submit_ns) + epoch,
            done_ns + epoch,
            # the ack was consumed, so its finish event is complete: no sync here
            elapsed_seconds(ack.start_event, ack.finish_event) if ack.timing_enabled else None,
            merged,
            len(nodes),
            tuple(context for _, context, _, _ in served if context is not None),
        )
        waits, waited = self.waits, set()
        if waits is not None:
            for linked_ns, _, span, request in served:  # each request once: its nodes may be several of the ack's
                if request not in waited:
                    waited.add(request)
                    waits(KvWait(Tier.HOST, (done_ns - linked_ns) / 1e9, done_ns + epoch), span)


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
        # Per-controller request links live on the controller itself (one attribute read); the weak dictionary is
        # only the fallback for a controller that takes no new attributes.
        self._attr = f"_otel_hicache_links_{id(self):x}"
        self._links_of: weakref.WeakKeyDictionary[Any, dict[str, _Links]] = weakref.WeakKeyDictionary()
        # Every queue reporting to these hooks, by id (a list is unhashable).
        self._queues: weakref.WeakValueDictionary[int, AckQueue] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._admitted_input: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # per PrefillAdder
        # request id -> when its prefetch started, until SGLang lets the request go; then -> (seconds its prefetch
        # held it, when it was let go), until the request is admitted
        self._prefetch_starts: dict[str, float] = {}
        self._storage_waits: dict[str, tuple[float, int]] = {}
        self._evictions = _Evictions()  # the eviction passes running on this thread, innermost last
        self._clock = _AccessClock()  # SGLang's access counter -> time, for the age of evicted nodes
        self._check: CountersCheck | None = None  # the self-check against SGLang's own collector
        self._incomparable = False  # a cache counts into no collector, or into another: no self-check

    def _links(self, controller: Any) -> dict[str, _Links]:
        """``controller``'s request links, per direction (a load-back's request is never linked to a backup)."""
        links = getattr(controller, self._attr, None)
        if links is not None:
            return links
        with self._lock:
            links = self._links_of.get(controller)
            if links is None:
                links = {_WRITE: {}, _LOAD: {}}
                try:
                    setattr(controller, self._attr, links)
                except (AttributeError, TypeError):  # __slots__ or a frozen object
                    self._links_of[controller] = links
        return links

    def detach(self) -> None:
        """Stop every adopted ack queue reporting (``uninstrument()``): each stays a plain list for SGLang; and the
        self-check."""
        for queue in list(self._queues.values()):
            queue.detach()
        self._queues.clear()
        self.end_self_check()

    # ------------------------------------------------------------------ submission: HiCacheController
    @checks_suppression
    def start_writing(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        return self._submit(wrapped, instance, args, kwargs, _WRITE)

    @checks_suppression
    def start_loading(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        return self._submit(wrapped, instance, args, kwargs, _LOAD)

    def _submit(self, wrapped: Callable[..., Any], cc: Any, args: tuple, kwargs: dict, direction: str) -> Any:
        """Note the submission time and merged-op count of the ack ``wrapped`` appends (adopting the queue first)."""
        self._clock.sample()
        merged = len(cc.write_queue if direction is _WRITE else cc.load_queue)
        queue = self._queue(cc, direction) if merged else None  # no pending op: no ack, nothing to note
        if queue is None:
            return wrapped(*args, **kwargs)
        n_acks, submit_ns = len(queue), monotonic_ns()
        result = wrapped(*args, **kwargs)
        reporter = queue.reporter
        if len(queue) > n_acks and reporter is not None:  # one merged op became one ack, appended last
            reporter.submit(queue[-1], (submit_ns, merged) if is_instrumentation_enabled() else None)
        return result

    def _queue(self, cc: Any, direction: str) -> AckQueue | None:
        """``cc``'s ack queue for ``direction``, reporting to these hooks (adopted now if need be); None while there
        is no telemetry, or where the queue is not a list. Runs on the scheduler thread, the only one that touches
        the queue."""
        name = _QUEUE[direction]
        queue = getattr(cc, name)
        kind = type(queue)
        if kind is AckQueue and self._queues.get(id(queue)) is queue:
            return queue
        if kind is not list and kind is not AckQueue:
            _warn_once(
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
        reporter = AckReporter(telemetry, cc, direction, self._links(cc)[direction])
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
            for queue in (getattr(instance, name, None) for name in _QUEUE.values())
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
        result = self._link_new_acks(wrapped, instance, args, kwargs, req, _LOAD)
        for node_id in ongoing.keys() - before:
            node = _node(instance.tree_core, node_id)
            if node is not None:
                setattr(node, _READ, True)
        return result

    def checkpoint(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``UnifiedRadixCache.checkpoint_into_tree(req, ...)`` / ``advance_unpublished_req(req)``: the backups its
        insert starts (write-through) carry ``req``'s tokens."""
        req = args[0] if args else kwargs.get("req")
        return self._link_new_acks(wrapped, instance, args, kwargs, req, _WRITE)

    def _link_new_acks(
        self, wrapped: Callable[..., Any], cache: Any, args: tuple, kwargs: dict, req: Any, direction: str
    ) -> Any:
        """Remember ``req`` (and its span) for every ack id ``wrapped`` adds to the cache's in-flight transfers of
        ``direction`` (``ongoing_write_through`` / ``ongoing_load_back``); the transfer span of the next ack of that
        direction to complete them links to it, and a load back's completion is the end of the request's KV wait.
        Nothing to do for a backup with tracing off."""
        span = _request_span(req)
        if req is None or (span is None and direction is _WRITE):
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
        node = _node(core, args[0] if args else kwargs["node_id"])
        tracker = args[1] if len(args) > 1 else kwargs["tracker"]
        before = _full_tokens(tracker)
        result = wrapped(*args, **kwargs)
        tokens = _full_tokens(tracker) - before
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
        per_token = _size_per_token(getattr(cc, "mem_pool_host", None)) if cc is not None else 0
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
        before = _full_tokens(tracker)
        result = wrapped(*args, **kwargs)
        tokens = _full_tokens(tracker) - before
        if tokens > 0:
            read = getattr(node, _READ, False)
            unread = 0 if read else tokens * self._evictions.bytes_per_token()
            self._evictions.add(EvictedEntry(tokens, node.last_access_time, read, unread))
        return result

    def dropped_tokens(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``_record_dropped_tokens(dropped_tokens, reason)``: SGLang's own drop count, per reason."""
        result = wrapped(*args, **kwargs)
        tokens, reason = _drop_arguments(*args, **kwargs)
        telemetry = self._sink() if tokens > 0 else None
        if telemetry is not None:
            telemetry.record_drop(DropRecord(reason=reason, tokens_by_pool={DEFAULT_POOL: tokens}, time_ns=now_ns()))
        return result

    # ------------------------------------------------------------------ prefill admission: PrefillAdder
    def prefill_budget(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``_update_prefill_budget``: the adder's input-token counter delta (retracted re-counts excluded)."""
        self._clock.sample()
        (split, other), result = _prefill_delta(wrapped, instance, args, kwargs)
        self._admitted_input[instance] = split.input_tokens
        telemetry = self.telemetry
        if (any(split) or other) and telemetry is not None:
            telemetry.record_prefix_split(split, other_hit=other)
        return result

    def prefill_admission(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``_account_prefill_cache_admission(req, ...)``: the adder's per-tier hit counter deltas.

        SGLang's ``prefill_effective_tokens_total`` is built from the same counters (input minus retracted
        re-counts, and the per-tier split of non-retracted requests), so the sums agree. With SGLang's request
        tracing on, it also puts the split on ``req``'s span: its hits, and the input tokens of the budget update
        SGLang makes for the same admission just before.
        """
        (split, other), result = _prefill_delta(wrapped, instance, args, kwargs)
        req = args[0] if args else kwargs["req"]
        span = _request_span(req)
        telemetry = self.telemetry
        waited = self._storage_waits.pop(req.cache_request_handle.rid, None) if self._storage_waits else None
        if waited is not None and telemetry is not None and not req.retracted_stain:
            telemetry.record_kv_wait(KvWait(Tier.STORAGE, waited[0], waited[1]), request_span=span)
        if (any(split) or other or span is not None) and telemetry is not None:
            telemetry.record_prefix_split(split, request_span=span, other_hit=other)
            if span is not None:
                span.set_attribute(
                    f"{ATTR_PREFIX_TOKENS}.{PrefillMode.INPUT.value}", self._admitted_input.pop(instance, 0)
                )
        return result

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
                    num_bytes=tokens * _size_per_token(instance.storage_host_pool),
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
                    num_bytes=tokens * _size_per_token(cc.storage_host_pool),
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
            telemetry.add_pool_usage_source(WeakPoolSource(instance, _host_pool_usage, telemetry))
            self._self_check(telemetry, instance)
        return result

    def _self_check(self, telemetry: HiCacheTelemetry, cache: Any) -> None:
        """Compare ours with the radix-cache collector SGLang keeps in this process (``--enable-metrics``), while
        every cache reporting here counts into that one collector; a cache without it (or with another) ends the
        comparison."""
        collector = getattr(cache, "metrics_collector", None)
        check = self._check
        if check is None and collector is not None and not self._incomparable:
            self._check = check = CountersCheck(telemetry, collector)
            telemetry.add_engine_check(check)
        if check is not None and check.collector is collector:
            check.caches.add(cache)
            return
        self._incomparable = True
        self.end_self_check()

    def end_self_check(self) -> None:
        check, self._check = self._check, None
        if check is not None:
            check.telemetry.remove_engine_check(check)


#: How long a difference between SGLang's count and ours must last to be real: our record of an ack is counted on
#: the telemetry's host thread within a tick (50 ms) of the ack leaving its queue, and SGLang counts right after it
#: left; a difference that outlasts both is an ack one of us never counted.
CHECK_LAG_S = 1.0
#: What the self-check compares: our instrument, the part of it (by its first attribute value), and the attribute of
#: SGLang's ``RadixCacheMetricsCollector`` counting the same (summed over its pools / reasons).
_COMPARED: tuple[tuple[str, str | None, str], ...] = (
    (METRIC_TRANSFER_TOKENS, TransferOperation.BACKUP.value, "backup_num_tokens"),
    (METRIC_TRANSFER_TOKENS, TransferOperation.LOAD_BACK.value, "load_back_num_tokens"),
    (METRIC_TRANSFER_SIZE, TransferOperation.BACKUP.value, "backup_num_bytes"),
    (METRIC_TRANSFER_SIZE, TransferOperation.LOAD_BACK.value, "load_back_num_bytes"),
    (METRIC_EVICTION_TOKENS, Tier.DEVICE.value, "eviction_num_tokens"),
    (METRIC_DROPPED_TOKENS, None, "hicache_dropped_tokens"),
)
_Sample = tuple[float, tuple[float, ...], tuple[float, ...]]  # (monotonic time, ours, SGLang's)


class CountersCheck:
    """The engine self-check (:meth:`~otel_hicache.telemetry.HiCacheTelemetry.add_engine_check`): our backup and
    load-back tokens and bytes, evicted and dropped tokens against SGLang's radix-cache collector in this process,
    counted from when the check began. A difference is real when ours is below what SGLang had counted
    :data:`CHECK_LAG_S` earlier, or was above what SGLang holds now that long after: each such finding is reported
    once (the comparison then starts again from there). Quantities SGLang's collector does not have are skipped."""

    def __init__(self, telemetry: HiCacheTelemetry, collector: Any) -> None:
        self.telemetry = telemetry
        self.collector = collector
        self.caches: weakref.WeakSet[Any] = weakref.WeakSet()  # while one lives, its counts go to the collector
        self._samples: deque[_Sample] = deque(maxlen=64)
        self._base = self._read()

    def __call__(self) -> list[str]:
        if not self.caches:  # every cache went away
            self.telemetry.remove_engine_check(self)
            return []
        now = time.monotonic()
        ours, theirs = self._read()
        ours = tuple(n - b for n, b in zip(ours, self._base[0], strict=True))
        theirs = tuple(n - b for n, b in zip(theirs, self._base[1], strict=True))
        samples = self._samples
        samples.append((now, ours, theirs))
        while len(samples) > 1 and now - samples[1][0] >= CHECK_LAG_S:
            samples.popleft()
        then, ours_then, theirs_then = samples[0]
        if now - then < CHECK_LAG_S:
            return []
        mismatched = {
            name
            for (name, _, _), *counts in zip(_COMPARED, ours, theirs, ours_then, theirs_then, strict=True)
            if counts[0] < counts[3] or counts[2] > counts[1]
        }
        if mismatched:  # reported once: compare from here on
            self._base = self._read()
            samples.clear()
        return sorted(mismatched)

    def _read(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        snapshot = self.telemetry.snapshot()
        ours, theirs = [], []
        for name, part, attribute in _COMPARED:
            ours.append(sum(n for key, n in snapshot.get(name, {}).items() if part is None or key[0] == part))
            theirs.append(_sglang_total(self.collector, attribute))
        return tuple(ours), tuple(theirs)


def _sglang_total(collector: Any, attribute: str) -> float:
    """The total of one of SGLang's counters (its samples of this collector's labels); 0 where it has none."""
    metric = getattr(collector, attribute, None)
    metric = getattr(metric, "_prom", metric)  # our OTel-backed stat-logger classes keep SGLang's metric there
    if metric is None:
        return 0.0
    labels = getattr(collector, "labels", {})
    return sum(
        sample.value
        for family in metric.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and all(sample.labels.get(k) == v for k, v in labels.items())
    )


#: The mark SGLang's radix node gets when a load back reads its host copy.
_READ = "_otel_hicache_read"
#: SGLang's module holding the access counter its radix nodes' ``last_access_time`` is read from.
_COUNTER_MODULE = "sglang.srt.mem_cache.unified_cache.components.base"
_COUNTER = "_LAST_ACCESS_TIME_COUNTER_FLOAT"
#: Samples of that counter kept (one per scheduler event that found it moved): the age of a node used before the
#: oldest sample is counted from that sample (a lower bound).
CLOCK_SAMPLES = 4096


def _node(core: Any, node_id: Any) -> Any:
    """SGLang's radix node object, or None where the TreeCore has none to give (the Rust one)."""
    try:
        return core.node_by_id(node_id)
    except NotImplementedError:
        return None


def _full_tokens(tracker: Any) -> int:
    """The full-attention tokens an eviction tracker (``{ComponentType: tokens}``) has counted."""
    return sum(int(n) for kind, n in tracker.items() if getattr(kind, "name", None) == "FULL")


class _Evictions:
    """The eviction passes open on each thread (a device pass may run a host pass inside), collecting the entries
    of the nodes each evicts: :class:`~otel_hicache.records.EvictedEntry` with SGLang's ``last_access_time``
    counter in place of ``idle_s`` until :meth:`_AccessClock.idle` turns it into seconds."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _stack(self) -> list[tuple[list[EvictedEntry], int]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    @contextlib.contextmanager
    def open(self, bytes_per_token: int) -> Iterator[list[EvictedEntry]]:
        """A pass: what its nodes' entries are added to (``bytes_per_token``: of the tier's copies, for waste)."""
        stack = self._stack()
        entries: list[EvictedEntry] = []
        stack.append((entries, bytes_per_token))
        try:
            yield entries
        finally:
            stack.pop()

    def add(self, entry: EvictedEntry) -> None:
        stack = self._stack()
        if stack and len(stack[-1][0]) < MAX_EVICTION_ENTRIES:  # the first ones; the pass's total stays exact
            stack[-1][0].append(entry)

    def bytes_per_token(self) -> int:
        stack = self._stack()
        return stack[-1][1] if stack else 0


class _AccessClock:
    """When SGLang's access counter had which value: radix nodes record their last use as that counter (a logical
    clock), so the age of an evicted node is the time since the first sample after its last use (a lower bound; the
    samples are taken at submissions, admissions and eviction passes, one scheduler step apart at most)."""

    def __init__(self) -> None:
        self._counters: deque[float] = deque(maxlen=CLOCK_SAMPLES)
        self._times: deque[int] = deque(maxlen=CLOCK_SAMPLES)

    def sample(self) -> None:
        module = sys.modules.get(_COUNTER_MODULE)
        counter = getattr(module, _COUNTER, None)
        if counter is None or (self._counters and self._counters[-1] == counter):
            return
        self._counters.append(counter)
        self._times.append(monotonic_ns())

    def idle(self, entries: list[EvictedEntry]) -> list[EvictedEntry]:
        """``entries`` with each node's age in seconds (``idle_s``) in place of its access counter."""
        if not entries:
            return entries
        self.sample()
        counters, times, now = list(self._counters), list(self._times), monotonic_ns()
        aged = []
        for entry in entries:
            used = entry.idle_s
            if used is None or not times:
                aged.append(entry._replace(idle_s=None))
                continue
            after = bisect.bisect_right(counters, used)  # the first sample taken after the node's last use
            idle_ns = now - times[after] if after < len(times) else 0
            aged.append(entry._replace(idle_s=idle_ns / 1e9))
        return aged


def _host_pool_usage(cache: Any) -> list[PoolUsage]:
    """Host KV pool occupancy as SGLang's scheduler computes it (logical size minus available)."""
    pool = getattr(cache, "token_to_kv_pool_host", None) or getattr(cache, "full_kv_pool_host", None)
    if pool is None:
        return []
    total = pool.logical_size
    return [PoolUsage(tier=Tier.HOST, pool=DEFAULT_POOL, used=total - pool.available_size(), limit=total)]


def _served(links: _Links, ack_ids: list[int], done_ns: int) -> list[_Link]:
    """The requests linked to ``ack_ids`` before their ack was consumed (``done_ns``), taken from ``links``.
    The record is built after consumption, so a link made since belongs to a later transfer of the same node and
    stays for it."""
    served: list[_Link] = []
    for ack_id in ack_ids:
        entry = links.get(ack_id)
        if not entry:
            continue
        mine = [link for link in entry if link[0] <= done_ns]
        if len(mine) == len(entry):
            links.pop(ack_id, None)
        elif mine:
            links[ack_id] = tuple(link for link in entry if link[0] > done_ns)
        served += mine
    return served


def _request_span(req: Any) -> Span | None:
    """The span SGLang's request tracing keeps for ``req`` in this (scheduler) process, or None with tracing off."""
    try:
        trace_ctx = req.time_stats.trace_ctx
        if getattr(trace_ctx, "tracing_enable", False) is not True:  # TraceNullContext answers every attribute
            return None
        thread_context = trace_ctx.thread_context
        span = None if thread_context is None else thread_context.thread_span
        return span if span is not None and span.is_recording() else None
    except Exception:  # not a traced SGLang request: no link
        return None


def _drop_arguments(dropped_tokens: int, reason: str) -> tuple[int, DropReason]:
    # a reason this release added is counted by the core as "other" (and noted), every time
    return int(dropped_tokens), cast(DropReason, str(reason))


#: The prefill adder's counters we know, by prefill mode (SGLang counts each admission's tokens into them).
_KNOWN_HITS = frozenset({"log_device_hit_tokens", "log_host_hit_tokens", "log_storage_hit_tokens"})
_HIT_COUNTER = re.compile(r"log_\w+_hit_tokens")


def _prefill_delta(
    wrapped: Callable[..., Any], adder: Any, args: tuple, kwargs: dict
) -> tuple[tuple[PrefixSplit, int], Any]:
    """Run ``wrapped``; return ((how much it moved the adder's prefill counters, the hits of counters we do not know:
    mode ``other``), its result)."""
    before = _prefill_counts(adder)
    result = wrapped(*args, **kwargs)
    after = _prefill_counts(adder)
    moved = [now - then for now, then in zip(after, before, strict=True)]
    return (PrefixSplit(*moved[:4]), moved[4]), result


def _prefill_counts(adder: Any) -> tuple[int, int, int, int, int]:
    """(input, device, host, storage, other hit tokens) the adder has counted. A hit counter SGLang added (or
    renamed: the known one then reads 0) is summed into ``other``."""
    counters = vars(adder)
    other = sum(
        value
        for name, value in counters.items()
        if name not in _KNOWN_HITS and type(value) is int and _HIT_COUNTER.fullmatch(name)
    )
    return (
        counters["log_input_tokens"] - counters.get("reprocessed_log_input_tokens", 0),
        counters.get("log_device_hit_tokens", 0),
        counters.get("log_host_hit_tokens", 0),
        counters.get("log_storage_hit_tokens", 0),
        other,
    )


def _size_per_token(pool: Any) -> int:
    """Bytes per token of a host pool; 0 where the pool does not say (a pool group)."""
    size = getattr(pool, "size_per_token", 0)
    return size if isinstance(size, int) and size > 0 else 0
