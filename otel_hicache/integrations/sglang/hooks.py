"""The wrapt wrappers around SGLang's HiCache methods.

Each wrapper calls SGLang's method exactly once, unchanged, and reads only what SGLang already computed (the
``HiCacheAck`` of a merged transfer, an eviction result, the prefill adder's counters) to build a record for
:class:`~otel_hicache.telemetry.HiCacheTelemetry`. Nothing here synchronises a device: a copy duration is read
from an ack's events only after SGLang consumed the ack (its finish event is complete), through
:func:`otel_hicache.timing.elapsed_seconds`, which checks ``query()`` first.

Failure rule: if a wrapper's own code fails it logs once per hook and the host's call goes on untouched; an
exception raised by SGLang's method propagates exactly as without instrumentation.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from opentelemetry.trace import Span, SpanContext

from otel_hicache.records import DropRecord, EvictionRecord, PoolUsage, PrefixSplit, TransferRecord
from otel_hicache.semconv import (
    ATTR_PREFIX_TOKENS,
    DEFAULT_POOL,
    DropReason,
    PrefillMode,
    Tier,
    TimingSource,
    TransferOperation,
)
from otel_hicache.telemetry import HiCacheTelemetry
from otel_hicache.timing import ANCHOR, elapsed_seconds, now_ns

_log = logging.getLogger(__name__)

#: Submitted acks remembered per controller and direction; beyond this the oldest are forgotten (a controller whose
#: acks are never consumed, e.g. a queue cleared by code we do not wrap, must not grow memory without bound).
MAX_PENDING = 4096

_WRITE = "write"
_LOAD = "load"
_SUBMIT_HOOK = {_WRITE: "start_writing", _LOAD: "start_loading"}
_CHECK_HOOK = {_WRITE: "writing_check", _LOAD: "loading_check"}
_Pending = tuple[Any, "int | None", int]  # (ack, submit_time_ns or None when unknown, merged_ops)


class _ControllerState:
    """One controller's ack queues as we saw them submitted: ``write`` / ``load`` list, in order, the acks of
    ``ack_write_queue`` / ``ack_load_queue``. SGLang appends acks at the end and consumes them from the front
    (FIFO, or all at once), so while the mirror holds, the acks a check consumed are simply its first
    ``len(mirror) - len(queue)`` entries: no copy of the queue and no identity set per check."""

    __slots__ = ("links", "load", "write")

    def __init__(self) -> None:
        self.write: list[_Pending] = []
        self.load: list[_Pending] = []
        self.links: dict[int, tuple[SpanContext, ...]] = {}  # ack id -> request spans it serves (tracing on)


class HiCacheHooks:
    """The wrapper callables (wrapt signature ``(wrapped, instance, args, kwargs)``) bound to one telemetry sink.

    ``telemetry`` None: the sink is built by ``create()`` on the process's first HiCache event (``init_hicache``, a
    consumed ack, a drop, an L3 transfer); evictions and prefill admissions are reported once it exists, so a process
    that never runs HiCache builds nothing. A ``create()`` that fails is logged once and not retried.
    """

    def __init__(
        self, telemetry: HiCacheTelemetry | None, create: Callable[[], HiCacheTelemetry] | None = None
    ) -> None:
        self.telemetry = telemetry
        self._create = create
        # Per-controller state lives on the controller itself (one attribute read per hook call); the weak
        # dictionary is only the fallback for a controller that takes no new attributes.
        self._attr = f"_otel_hicache_acks_{id(self):x}"
        self._states: weakref.WeakKeyDictionary[Any, _ControllerState] = weakref.WeakKeyDictionary()
        self._failed: set[str] = set()
        self._lock = threading.Lock()
        self._admitted_input: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # per PrefillAdder

    # ------------------------------------------------------------------ failure rule
    def _fail(self, hook: str) -> None:
        if hook in self._failed:
            return
        self._failed.add(hook)
        _log.warning(
            "otel_hicache: the %s hook failed; SGLang runs unchanged, this hook's telemetry may be incomplete. "
            "Further failures of this hook are not logged.",
            hook,
            exc_info=True,
        )

    def _sink(self) -> HiCacheTelemetry | None:
        """The telemetry, built now if this is the process's first HiCache event."""
        telemetry = self.telemetry
        if telemetry is not None or self._create is None:
            return telemetry
        with self._lock:
            if self.telemetry is None and self._create is not None:
                create, self._create = self._create, None
                try:
                    self.telemetry = create()
                except Exception as exc:
                    _log.warning("otel_hicache: SGLang HiCache is not reported in this process: %s", exc)
        return self.telemetry

    def _state(self, controller: Any) -> _ControllerState:
        state = getattr(controller, self._attr, None)
        if state is not None:
            return state
        with self._lock:
            state = self._states.get(controller)
            if state is None:
                state = _ControllerState()
                try:
                    setattr(controller, self._attr, state)
                except (AttributeError, TypeError):  # __slots__ or a frozen object
                    self._states[controller] = state
        return state

    # ------------------------------------------------------------------ submission: HiCacheController
    def start_writing(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        return self._submit(wrapped, instance, args, kwargs, _WRITE)

    def start_loading(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        return self._submit(wrapped, instance, args, kwargs, _LOAD)

    def _submit(self, wrapped: Callable[..., Any], cc: Any, args: tuple, kwargs: dict, direction: str) -> Any:
        try:
            if direction is _WRITE:
                acks, merged = cc.ack_write_queue, len(cc.write_queue)
            else:
                acks, merged = cc.ack_load_queue, len(cc.load_queue)
            n_acks = len(acks)
            submit_ns = now_ns() if merged else 0
        except Exception:
            self._fail(_SUBMIT_HOOK[direction])
            return wrapped(*args, **kwargs)
        result = wrapped(*args, **kwargs)
        if merged:
            try:
                if len(acks) > n_acks:  # one merged op became one ack, appended last
                    state = self._state(cc)
                    mirror = state.write if direction is _WRITE else state.load
                    mirror.append((acks[-1], submit_ns, merged))
                    if len(mirror) > MAX_PENDING:
                        del mirror[0]  # the mirror no longer matches; the next check resynchronises
            except Exception:
                self._fail(_SUBMIT_HOOK[direction])
        return result

    def reset(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``HiCacheController.reset`` clears the ack queues: forget their acks, they were never consumed."""
        result = wrapped(*args, **kwargs)
        try:
            state = self._state(instance)
            state.write.clear()
            state.load.clear()
            state.links.clear()
        except Exception:
            self._fail("reset")
        return result

    # ------------------------------------------------------------------ request links (SGLang request tracing on)
    def load_back(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``UnifiedRadixCache.load_back(node_id, mem_quota, req)``: the load backs it starts serve ``req``."""
        req = args[2] if len(args) > 2 else kwargs.get("req")
        return self._link_new_acks(wrapped, instance, args, kwargs, req, "ongoing_load_back", "load_back")

    def checkpoint(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``UnifiedRadixCache.checkpoint_into_tree(req, ...)`` / ``advance_unpublished_req(req)``: the backups its
        insert starts (write-through) carry ``req``'s tokens."""
        req = args[0] if args else kwargs.get("req")
        return self._link_new_acks(wrapped, instance, args, kwargs, req, "ongoing_write_through", "checkpoint")

    def _link_new_acks(
        self, wrapped: Callable[..., Any], cache: Any, args: tuple, kwargs: dict, req: Any, table: str, hook: str
    ) -> Any:
        """Remember ``req``'s span for every ack id ``wrapped`` adds to ``cache.<table>`` (its in-flight transfers by
        ack id); the transfer span of the ack that completes them links to it. Nothing to do with tracing off."""
        span = _request_span(req)
        if span is None:
            return wrapped(*args, **kwargs)
        try:
            ongoing = getattr(cache, table)
            before = set(ongoing)
        except Exception:
            self._fail(hook)
            return wrapped(*args, **kwargs)
        result = wrapped(*args, **kwargs)
        try:
            new = ongoing.keys() - before
            if new and cache.cache_controller is not None:
                links = self._state(cache.cache_controller).links
                context = span.get_span_context()
                for ack_id in new:
                    links[ack_id] = (*links.get(ack_id, ()), context)
                while len(links) > MAX_PENDING:  # ack ids whose ack was never consumed (a reset we did not see)
                    del links[next(iter(links))]
        except Exception:
            self._fail(hook)
        return result

    # ------------------------------------------------------------------ completion: UnifiedRadixCache
    def writing_check(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        return self._check(wrapped, instance, args, kwargs, _WRITE)

    def loading_check(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        return self._check(wrapped, instance, args, kwargs, _LOAD)

    def decode_offload_check(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``DecodeKVCacheOffloadManager._check_offload_progress(finish_count)``: PD decode's own consumer of its
        controller's write acks (device -> host offloads), reported as backups like ``writing_check``'s."""
        if (args[0] if args else kwargs.get("finish_count", 1)) == 0:
            return wrapped(*args, **kwargs)  # the step with no completed offload consumes nothing: no bookkeeping
        return self._check(wrapped, instance, args, kwargs, _WRITE)

    def _check(self, wrapped: Callable[..., Any], cache: Any, args: tuple, kwargs: dict, direction: str) -> Any:
        if not args and kwargs.get("finish_count", 1) == 0 and not kwargs.get("write_back"):
            return wrapped(**kwargs)  # the scheduler's step with no completed ack consumes nothing: no bookkeeping
        try:
            cc = cache.cache_controller
            if cc is None:
                return wrapped(*args, **kwargs)
            state = self._state(cc)
            if direction is _WRITE:
                acks, mirror = cc.ack_write_queue, state.write
            else:
                acks, mirror = cc.ack_load_queue, state.load
            n = len(acks)
            before = None  # the mirror matches the queue: nothing to copy
            if len(mirror) != n or (n and (mirror[0][0] is not acks[0] or mirror[-1][0] is not acks[-1])):
                before = (acks[:], len(mirror))  # acks we did not see submitted: the careful path
        except Exception:
            self._fail(_CHECK_HOOK[direction])
            return wrapped(*args, **kwargs)
        result = wrapped(*args, **kwargs)
        try:
            if before is None:
                consumed = len(mirror) - len(acks)  # acks submitted during the check (write-back) are in both
                if consumed > 0:
                    if acks and mirror[consumed][0] is not acks[0]:  # not FIFO after all: go by identity
                        self._resync(cc, acks, mirror, [entry[0] for entry in mirror], len(mirror), direction)
                    else:
                        done = mirror[:consumed]
                        del mirror[:consumed]
                        self._emit_all(cc, done, direction)
            else:
                self._resync(cc, acks, mirror, *before, direction)
        except Exception:
            self._fail(_CHECK_HOOK[direction])
        return result

    def _resync(self, cc: Any, acks: list, mirror: list, before: list, mirrored: int, direction: str) -> None:
        """Report the acks of ``before`` (and those submitted during the check) that left the queue, by identity,
        then rebuild the mirror from the queue. Acks queued before instrumentation have no submission time."""
        live = {id(a) for a in acks}
        known = {id(entry[0]): entry for entry in mirror}
        done: list[_Pending] = []
        for ack in before:
            if id(ack) not in live:
                done.append(known.pop(id(ack), None) or (ack, None, 1))
        for entry in mirror[mirrored:]:  # submitted during the check: not in ``before``
            if id(entry[0]) not in live and id(entry[0]) in known:
                done.append(known.pop(id(entry[0])))
        mirror[:] = [known.get(id(a)) or (a, None, 1) for a in acks]
        self._emit_all(cc, done, direction)

    def _emit_all(self, cc: Any, done: list[_Pending], direction: str) -> None:
        """Queue each consumed ack for the telemetry worker: on this (scheduler) thread only an append per ack."""
        done_ns = now_ns()
        if direction is _WRITE:
            operation, policy = TransferOperation.BACKUP, cc.write_policy
        else:
            operation, policy = TransferOperation.LOAD_BACK, None
        io_backend = cc.io_backend or None
        telemetry = self._sink()
        if telemetry is None:
            return
        defer = telemetry.record_transfer_deferred
        links = self._state(cc).links
        for ack, submit_ns, merged in done:
            served: tuple[SpanContext, ...] = ()
            if links:  # request tracing on: the request spans this ack's transfers served
                served = tuple(context for ack_id in ack.node_ids for context in links.pop(ack_id, ()))
            defer(_ack_record, (ack, submit_ns, done_ns, merged, operation, policy, io_backend, served))

    # ------------------------------------------------------------------ eviction and drops: UnifiedRadixCache
    def evict(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``_evict``: one eviction pass; SGLang reports full-layer tokens only, and nothing when none were freed."""
        start = time.perf_counter()
        result = wrapped(*args, **kwargs)
        try:
            freed = result.num_tokens_evicted
            if freed > 0 and self.telemetry is not None:
                duration = time.perf_counter() - start
                self.telemetry.record_eviction(
                    EvictionRecord(tier=Tier.DEVICE, num_tokens=freed, duration_s=duration, time_ns=now_ns())
                )
        except Exception:
            self._fail("evict")
        return result

    def record_dropped_tokens(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            tokens, reason = _drop_arguments(*args, **kwargs)
            telemetry = self._sink() if tokens > 0 else None
            if telemetry is not None:
                telemetry.record_drop(
                    DropRecord(reason=reason, tokens_by_pool={DEFAULT_POOL: tokens}, time_ns=now_ns())
                )
        except Exception:
            self._fail("record_dropped_tokens")
        return result

    # ------------------------------------------------------------------ prefill admission: PrefillAdder
    def prefill_admission(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``_update_prefill_budget`` / ``_account_prefill_cache_admission``: the adder's counter deltas.

        SGLang's ``prefill_effective_tokens_total`` is built from the same counters (input minus retracted
        re-counts, and the per-tier split of non-retracted requests), so the sums agree. With SGLang's request
        tracing on, ``_account_prefill_cache_admission(req, ...)`` also puts the split on ``req``'s span: its hits,
        and the input tokens of the budget update SGLang makes for the same admission just before.
        """
        try:
            before = _prefill_counts(instance)
        except Exception:
            self._fail("prefill_admission")
            return wrapped(*args, **kwargs)
        result = wrapped(*args, **kwargs)
        try:
            after = _prefill_counts(instance)
            split = PrefixSplit(
                input_tokens=after[0] - before[0],
                device_hit=after[1] - before[1],
                host_hit=after[2] - before[2],
                storage_hit=after[3] - before[3],
            )
            span = None
            if wrapped.__name__ == "_account_prefill_cache_admission":
                span = _request_span(args[0] if args else kwargs.get("req"))
            else:
                self._admitted_input[instance] = split.input_tokens
            if (any(split) or span is not None) and self.telemetry is not None:
                self.telemetry.record_prefix_split(split, request_span=span)
                if span is not None:
                    span.set_attribute(f"{ATTR_PREFIX_TOKENS}.{PrefillMode.INPUT.value}",
                                       self._admitted_input.pop(instance, 0))  # fmt: skip
        except Exception:
            self._fail("prefill_admission")
        return result

    # ------------------------------------------------------------------ L3 storage
    def storage_backup(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``_page_backup_or_log`` (storage backup thread): one host -> storage write, host-clock timed."""
        submit_ns, start = now_ns(), time.perf_counter()
        result = wrapped(*args, **kwargs)
        try:
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
        except Exception:
            self._fail("storage_backup")
        return result

    def storage_prefetch(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``_handle_prefetch_result``: a finished storage -> host prefetch, from its issue to its result."""
        try:
            operation = args[0] if args else kwargs["operation"]
            tokens = operation.completed_tokens
            issued_ns = ANCHOR.to_epoch_ns(int(operation.start_time * 1e9))  # PrefetchOperation: time.monotonic()
        except Exception:
            self._fail("storage_prefetch")
            return wrapped(*args, **kwargs)
        result = wrapped(*args, **kwargs)
        try:
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
        except Exception:
            self._fail("storage_prefetch")
        return result

    # ------------------------------------------------------------------ pool occupancy
    def init_hicache(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """After ``UnifiedRadixCache.init_hicache``: report the host KV pool's occupancy at each collection."""
        result = wrapped(*args, **kwargs)
        try:
            telemetry = self._sink()
            if telemetry is not None:
                telemetry.add_pool_usage_source(_HostPoolSource(instance, telemetry))
        except Exception:
            self._fail("init_hicache")
        return result


class _HostPoolSource:
    """Host KV pool occupancy as SGLang's scheduler computes it (logical size minus available), read lazily."""

    __slots__ = ("__weakref__", "_cache", "_telemetry")

    def __init__(self, cache: Any, telemetry: HiCacheTelemetry) -> None:
        self._cache = weakref.ref(cache)
        self._telemetry = telemetry

    def __call__(self) -> list[PoolUsage]:
        cache = self._cache()
        if cache is None:  # the cache is gone: stop reporting it
            self._telemetry.remove_pool_usage_source(self)
            return []
        pool = getattr(cache, "token_to_kv_pool_host", None) or getattr(cache, "full_kv_pool_host", None)
        if pool is None:
            return []
        total = pool.logical_size
        return [PoolUsage(tier=Tier.HOST, pool=DEFAULT_POOL, used=total - pool.available_size(), limit=total)]


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
    return int(dropped_tokens), DropReason(str(reason))


def _prefill_counts(adder: Any) -> tuple[int, int, int, int]:
    return (
        adder.log_input_tokens - adder.reprocessed_log_input_tokens,
        adder.log_device_hit_tokens,
        adder.log_host_hit_tokens,
        adder.log_storage_hit_tokens,
    )


def _size_per_token(pool: Any) -> int:
    """Bytes per token of a host pool; 0 where the pool does not say (a pool group)."""
    size = getattr(pool, "size_per_token", 0)
    return size if isinstance(size, int) and size > 0 else 0


def _ack_record(payload: tuple[Any, ...]) -> TransferRecord:
    """One consumed ``HiCacheAck`` as a transfer record (runs on the telemetry worker, off the scheduler thread)."""
    ack, submit_ns, done_ns, merged, operation, policy, io_backend, links = payload
    duration = None
    if ack.timing_enabled:  # the ack was consumed, so its finish event is complete: no sync here
        duration = elapsed_seconds(ack.start_event, ack.finish_event, True)
    return TransferRecord(
        operation=operation,
        tokens_by_pool=ack.num_tokens_by_pool or {},
        num_bytes=ack.num_bytes,  # one total across pools: SGLang does not split bytes by pool
        submit_time_ns=done_ns if submit_ns is None else submit_ns,
        complete_time_ns=done_ns,
        copy_duration_s=duration,
        timing_source=TimingSource.NONE if duration is None else TimingSource.CUDA_EVENT,
        merged_ops=merged,
        node_count=len(ack.node_ids),
        write_policy=policy,
        io_backend=io_backend,
        links=links,
    )
