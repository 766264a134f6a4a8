"""The wrapt wrappers around vLLM's KV offloading connector: transfers and failures (the CPU tier's wrappers are in
:mod:`.cpu_tier`, the requests' in :mod:`.per_request`; what they share is :class:`~.._base.EngineHooks`).

Worker side (one process per GPU worker): a transfer is noted at the first of its step's calls on vLLM's
``OffloadingConnectorWorker`` (job id, direction, GPU blocks, the request span it serves), stamped when vLLM submits
it, and reported when its ``get_finished`` consumes the worker's ``TransferResult``: the wrapper sees each result
exactly where vLLM counts it, as the ``DirectionalTransferStats.record(bytes, time)`` call (vLLM's own
``vllm:kv_offload_*`` bytes and time) followed by ``OffloadingWorkerMetadata.mark_completed(job_id)``; its record is
built and counted on the telemetry's host thread (``record_transfer_deferred``), off the worker's step. A step's later
calls with nothing to note skip our wrappers (:class:`~.._base.Skips`). Scheduler side (the engine-core process):
``OffloadingConnectorStats.increase_counter`` of the allocation-failure counter.

Sync loads (vLLM >= 0.33, a load job with ``sync`` set): ``start_kv_transfers`` submits them and waits for them
before the step's forward pass; how long that call took is the wait of each request it loaded for, put on the worker
metadata that vLLM hands to the scheduler at the step's end (:data:`~otel_hicache.integrations.vllm.semconv.SYNC_WAITS`;
the slowest worker's when vLLM merges its workers' metadata with ``OffloadingWorkerMetadata.aggregate``), where it
becomes the request's KV wait (:mod:`.per_request`).

Tokens of a transfer are the logical token positions it covers, per pool by the kind of each KV cache group
(:data:`~otel_hicache.integrations.vllm.semconv.GROUP_POOLS`: full attention ``kv``, sliding window ``swa``, ...): a
group's tokens are its GPU blocks in the transfer x its tokens per block, and a pool's tokens are the largest of its
groups' (vLLM splits the layers of one kind into several groups of equal size, which cover the same positions), never
their sum. Bytes, time and the block count (``hicache.transfer.nodes``) cover every group.

Self-check: vLLM's worker role keeps its own transfer counters in the same process: each timed result is one
``DirectionalTransferStats.record(bytes, time)`` on its ``OffloadingWorkerMetadata``'s ``store`` or ``load``, which
vLLM hands to the scheduler. Every such call is seen (the wrapper of ``record`` runs whether the step skips ours of
``get_finished`` or not) and set beside what we recorded (bytes, timed transfers and their seconds, per direction),
on the worker's own thread once the call that counted it returned, so the pair is consistent; the telemetry's engine
check reports an instrument whose totals drifted apart since the last report (``otel_hicache.engine.mismatch``, one
warning): an adapter that undercounts after a vLLM change says so.

Failure rule (:mod:`.._base`): our code never raises into vLLM nor changes its exception; a failure is logged once.
What vLLM had counted before it raised part-way through ``get_finished`` is still reported. Nothing here synchronises
a device: the duration is the one vLLM's worker measured.
"""

from __future__ import annotations

import importlib
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from opentelemetry.trace import SpanContext, TraceFlags

from otel_hicache.integrations._base import EngineHooks, ProcessSink, Ranks, Skips, trim
from otel_hicache.integrations.vllm.cpu_tier import await_export_process
from otel_hicache.integrations.vllm.semconv import ALLOCATION_FAILURE, LINKS, SYNC_WAITS, group_pool
from otel_hicache.records import TransferFailure, TransferRecord
from otel_hicache.semconv import (
    DEFAULT_POOL,
    METRIC_TRANSFER_DURATION,
    METRIC_TRANSFER_SIZE,
    TimingSource,
    TransferOperation,
)
from otel_hicache.telemetry import HiCacheTelemetry
from otel_hicache.timing import now_ns

#: vLLM's ``OffloadingWorker`` that times each transfer with device events (``torch.Event`` on the transfer stream).
_DEVICE_TIMED_WORKERS = frozenset({"vllm.v1.kv_offload.cpu.gpu_worker.CPUOffloadingWorker"})


class _Pending(NamedTuple):
    operation: TransferOperation
    tokens_by_pool: dict[str, int]  # per pool: the largest of its groups' GPU blocks x tokens per block
    blocks: int  # GPU blocks over all KV groups
    submit_ns: int
    links: tuple[SpanContext, ...]  # the request span the transfer serves


class _Group(NamedTuple):
    """One KV cache group the connector offloads, in the order of a GPU spec's ``group_sizes``."""

    pool: str
    tokens_per_block: int


class _Measured(NamedTuple):
    """The arguments of one ``DirectionalTransferStats.record`` call vLLM completed (read at report time), and the
    stats it counted into (which direction's)."""

    args: tuple
    kwargs: dict
    stats: Any


class _Completed(NamedTuple):
    """The arguments of one ``OffloadingWorkerMetadata.mark_completed`` call vLLM completed."""

    args: tuple
    kwargs: dict


#: The worker's connector calls a step may skip our wrappers of (see OffloadHooks.handle_preemptions).
_SKIPPABLE = ("start_kv_transfers", "get_finished")
#: Per direction (backup, load back): bytes, timed transfers, their seconds.
_Totals = tuple[tuple[float, ...], ...]
_DIRECTIONS = (TransferOperation.BACKUP, TransferOperation.LOAD_BACK)


class _Connector:
    """One ``OffloadingConnectorWorker``'s KV groups and submitted transfers (by vLLM job id), and the totals the
    self-check compares."""

    __slots__ = (
        "__weakref__",
        "compared",
        "groups",
        "ours",
        "pending",
        "sink",
        "skipping",
        "skips",
        "theirs",
        "worker",
        "worker_timing",
    )

    def __init__(self, worker: Any, sink: HiCacheTelemetry | None, groups: tuple[_Group, ...], skips: Skips) -> None:
        self.worker = weakref.ref(worker)
        self.sink = sink
        self.groups = groups
        self.pending: dict[int, _Pending] = {}
        self.skips = skips  # the step's calls the worker skips our wrappers of (decided by handle_preemptions)
        self.skipping = (False, False)  # ... whether start_kv_transfers and get_finished are skipped now
        self.worker_timing: TimingSource | None = None
        # [bytes, timed count, seconds] per direction: what we recorded, what vLLM counted
        self.ours = {op: [0.0, 0.0, 0.0] for op in _DIRECTIONS}
        self.theirs = {op: [0.0, 0.0, 0.0] for op in _DIRECTIONS}
        self.compared: tuple[_Totals, _Totals] | None = None  # (ours, theirs) after the last call that changed them

    def tally(self, operation: TransferOperation, measured: tuple[Any, Any] | None) -> None:
        """Add a reported transfer to ours: what vLLM counted for it (bytes, seconds), as vLLM got them."""
        totals = self.ours.get(operation)
        if totals is not None and measured is not None and measured[1] is not None:
            num_bytes, seconds = measured
            totals[0] += num_bytes if type(num_bytes) is int else 0
            totals[1] += 1
            totals[2] += seconds if isinstance(seconds, float) else 0.0

    def counted(self, event: _Measured) -> bool:
        """vLLM counted one timed result (``event``) into this worker's metadata: add it to theirs, in the direction
        of the stats it went to. A count into stats that are not the worker's current metadata's is not this
        worker's."""
        worker = self.worker()
        meta = None if worker is None else getattr(worker, "_connector_worker_meta", None)
        stats = getattr(meta, "transfer_stats", None)
        if stats is None:
            return False
        if event.stats is stats.store:
            operation = TransferOperation.BACKUP
        elif event.stats is stats.load:
            operation = TransferOperation.LOAD_BACK
        else:
            return False
        num_bytes, seconds = _stats_arguments(*event.args, **event.kwargs)
        theirs = self.theirs[operation]
        theirs[0] += num_bytes  # as vLLM added them (it did, without raising): a value we refuse shows as a difference
        theirs[1] += 1
        theirs[2] += seconds
        return True

    def compare(self) -> None:
        """Ours beside theirs now, for the engine check (a consistent pair: no call of vLLM's is counting)."""
        self.compared = (
            tuple(tuple(self.ours[op]) for op in _DIRECTIONS),
            tuple(tuple(self.theirs[op]) for op in _DIRECTIONS),
        )


class _TransferCheck:
    """The engine check of one connector: the instruments whose totals differ from vLLM's, each time the difference
    changed (a persistent difference is one mismatch, not one a second)."""

    __slots__ = ("_connector", "_reported", "_sink")

    def __init__(self, connector: _Connector, sink: HiCacheTelemetry) -> None:
        self._connector = weakref.ref(connector)
        self._sink = sink
        self._reported: dict[str, tuple[float, ...]] = {}

    def __call__(self) -> list[str]:
        connector = self._connector()
        if connector is None:  # the connector is gone
            self._sink.remove_engine_check(self)
            return []
        compared = connector.compared
        if compared is None:
            return []
        ours, theirs = compared
        differences = {
            METRIC_TRANSFER_SIZE: tuple(t[0] - o[0] for o, t in zip(ours, theirs, strict=True)),
            METRIC_TRANSFER_DURATION: tuple(
                d for o, t in zip(ours, theirs, strict=True) for d in (t[1] - o[1], _time_difference(o[2], t[2]))
            ),
        }
        names = []
        for name, difference in differences.items():
            if not all(math.isfinite(d) for d in difference):
                continue  # vLLM counted something that is not a number: nothing to compare
            if any(difference) and difference != self._reported.get(name):
                names.append(name)
            self._reported[name] = difference
        return names


def _time_difference(ours: float, theirs: float) -> float:
    """vLLM's seconds minus ours, 0 within rounding (the same values, summed in another order)."""
    difference = theirs - ours
    return 0.0 if abs(difference) <= 1e-9 * max(1.0, abs(ours)) else difference


class OffloadHooks(EngineHooks):
    """The wrappers of vLLM's offloading connector: transfers in the workers, allocation failures in the scheduler.
    The rank rule is ``ranks(spec)`` (an ``OffloadingSpec``; ``None`` on the scheduler side)."""

    def __init__(self, sink: ProcessSink, ranks: Callable[[Any], Ranks]) -> None:
        super().__init__(sink, ranks)
        self._attr = f"_otel_hicache_jobs_{id(self):x}"
        self._finishing = threading.local()  # the events of the get_finished call running on this thread
        self._connectors: weakref.WeakSet[_Connector] = weakref.WeakSet()  # those that report: a count is theirs

    def _connector(self, worker: Any) -> _Connector:
        state = getattr(worker, self._attr, None)
        if state is None:
            spec = worker.spec
            sink = self._sink(spec)
            state = _Connector(worker, sink, _groups(spec, worker.kv_cache_config), self._skips(worker, _SKIPPABLE))
            setattr(worker, self._attr, state)
            if sink is not None:
                self._connectors.add(state)
                sink.add_engine_check(_TransferCheck(state, sink), self.sink.switch.mismatched)
        return state

    # ------------------------------------------------------------------ start: OffloadingConnectorWorker
    def register_kv_caches(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """The engine registers the worker's KV caches while it starts: the process's telemetry and its export process
        are built and up now, before the engine serves, not on the serving path at the first transfer."""
        result = wrapped(*args, **kwargs)
        self._connector(instance)
        await_export_process(self.sink)
        return result

    # ------------------------------------------------------------------ submission: OffloadingConnectorWorker
    # A step's calls on the worker's connector run right after vLLM's own work has left their code cold: each wrapped
    # call costs the step ~10 us, whatever it does. So the step's first call notes the step's transfers and says which
    # of the calls after it have nothing to do (skipped: vLLM's method called directly); prepare_store_kv, which only
    # queues the stores the first call noted, is not wrapped at all.
    def handle_preemptions(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """The first of a step's calls (vLLM makes it every step): submits the stores queued last step and those a
        preemption flushes, so their submission time is now. It notes the step's jobs from its metadata: the stores
        the step queues at its end (``prepare_store_kv``), submitted by the next step's call, and the loads that
        ``start_kv_transfers`` submits (which stamps them). ``start_kv_transfers`` is skipped in a step with no load,
        ``get_finished`` while none of our transfers is pending."""
        metadata = args[0] if args else kwargs["kv_connector_metadata"]
        state = self._connector(instance)
        if instance._unsubmitted_store_jobs:
            _stamp(state, (job_id for job_id, *_ in instance._unsubmitted_store_jobs), now_ns())
        stores, loads = metadata.store_jobs, metadata.load_jobs
        if stores and instance._is_store_writer:
            self._note(state, TransferOperation.BACKUP, stores, 0, metadata)
            if metadata.jobs_to_flush:  # submitted by this call
                _stamp(state, metadata.jobs_to_flush, now_ns())
        if loads:
            self._note(state, TransferOperation.LOAD_BACK, loads, 0, metadata)
        result = wrapped(*args, **kwargs)
        skipping = (not loads, not state.pending)
        if skipping != state.skipping:
            state.skipping = skipping
            state.skips.set("start_kv_transfers", skipping[0])
            state.skips.set("get_finished", skipping[1])
        return result

    def start_kv_transfers(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """Submits the step's loads: their submission time is now; and waits for its sync loads (vLLM >= 0.33): the
        time it takes then is what each of their requests waited, put on the worker metadata vLLM hands to the
        scheduler at the step's end (a sync load completes in its step, so that metadata is handed over)."""
        metadata = args[0] if args else kwargs["metadata"]
        state = self._connector(instance)
        jobs = metadata.load_jobs
        _stamp(state, jobs, now_ns())
        synced = [job.req_id for job in jobs.values() if getattr(job, "sync", False)]
        if not synced:
            return wrapped(*args, **kwargs)
        start = time.perf_counter()
        result = wrapped(*args, **kwargs)
        waited = time.perf_counter() - start
        meta = instance._connector_worker_meta
        waits = getattr(meta, SYNC_WAITS, None) or {}
        for req_id in synced:
            waits[req_id] = waited
        setattr(meta, SYNC_WAITS, waits)
        return result

    def _note(self, state: _Connector, operation: TransferOperation, jobs: Any, submit_ns: int, metadata: Any) -> None:
        if state.sink is None or not jobs:
            return
        pending, groups = state.pending, state.groups
        links = getattr(metadata, LINKS, None) or {}
        for job_id, job in jobs.items():
            gpu = job.src_spec if operation is TransferOperation.BACKUP else job.dst_spec
            blocks = len(gpu.block_ids)
            sizes = gpu.group_sizes if len(groups) > 1 else (blocks,)
            tokens: dict[str, int] = {}
            for group, size in zip(groups, sizes, strict=True):
                tokens[group.pool] = max(tokens.get(group.pool, 0), int(size) * group.tokens_per_block)
            served = links.get(job_id)
            link = () if served is None else (_span_context(*served),)
            pending[job_id] = _Pending(operation, tokens, blocks, submit_ns, link)
        trim(pending)

    # ------------------------------------------------------------------ completion
    def get_finished(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """Collect the ``record`` / ``mark_completed`` calls vLLM makes for each finished ``TransferResult`` and
        report them, also when vLLM raises part-way (what it counted before is reported; its exception goes on)."""
        events: list[_Measured | _Completed] = []
        outer = getattr(self._finishing, "events", None)
        self._finishing.events = events
        try:
            return wrapped(*args, **kwargs)
        finally:
            self._finishing.events = outer
            if events:
                self._report(instance, events)

    def transfer_stats_record(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``DirectionalTransferStats.record(num_bytes, time)``: vLLM counting one timed result (noted once vLLM's
        call returned, so what vLLM refused is not reported either) for the ``get_finished`` of ours running on this
        thread. Outside one (the step skipped ours: none of our transfers was pending) it is a transfer we never
        noted: it goes to the self-check of the worker whose metadata it counted into, at once."""
        result = wrapped(*args, **kwargs)
        event = _Measured(args, kwargs, instance)
        events = getattr(self._finishing, "events", None)
        if events is not None:
            events.append(event)
            return result
        for state in list(self._connectors):
            if state.counted(event):
                state.compare()
                break
        return result

    def mark_completed(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``OffloadingWorkerMetadata.mark_completed(job_id)`` (vLLM >= 0.34: ``(job_id, success=True)``): the
        result's job is done, or failed (noted for the ``get_finished`` of ours running on this thread)."""
        result = wrapped(*args, **kwargs)
        events = getattr(self._finishing, "events", None)
        if events is not None:
            events.append(_Completed(args, kwargs))
        return result

    def _report(self, instance: Any, events: list[_Measured | _Completed]) -> None:
        state = self._connector(instance)
        sink = state.sink
        if sink is None:
            return
        if state.worker_timing is None:
            worker = type(instance.worker)
            name = f"{worker.__module__}.{worker.__qualname__}"
            state.worker_timing = TimingSource.CUDA_EVENT if name in _DEVICE_TIMED_WORKERS else TimingSource.HOST_CLOCK
        done_ns = now_ns()
        measured: _Measured | None = None
        for event in events:
            if isinstance(event, _Measured):
                measured = event
                state.counted(event)
                continue
            entry = state.pending.pop(_job_id(*event.args, **event.kwargs), None)
            if entry is not None and not _succeeded(*event.args, **event.kwargs):
                # vLLM >= 0.34 completes a failed job as failed (the copy did not happen): a failure, no transfer
                sink.record_failure(TransferFailure(entry.operation, "copy_failed", entry.tokens_by_pool, done_ns))
            elif entry is not None:
                sizes = None if measured is None else _stats_arguments(*measured.args, **measured.kwargs)
                # built and counted on the telemetry's host thread: off the step, whose next forward waits for it
                sink.record_transfer_deferred(_built, (entry, sizes, done_ns, state.worker_timing))
                state.tally(entry.operation, sizes)
            measured = None
        state.compare()

    def aggregate_worker_meta(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``OffloadingWorkerMetadata.aggregate(other)``: vLLM merges its workers' metadata into a new one; the sync
        waits go with it, the slowest worker's per request (the step waited for it)."""
        merged = wrapped(*args, **kwargs)
        other = args[0] if args else kwargs["other"]
        mine, theirs = getattr(instance, SYNC_WAITS, None), getattr(other, SYNC_WAITS, None)
        if (mine or theirs) and merged is not None:
            waits = dict(mine or {})
            for req_id, wait_s in (theirs or {}).items():
                waits[req_id] = max(wait_s, waits.get(req_id, 0.0))
            setattr(merged, SYNC_WAITS, waits)
        return merged

    # ------------------------------------------------------------------ scheduler side
    def increase_counter(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``OffloadingConnectorStats.increase_counter``: each allocation failure is one failed backup."""
        result = wrapped(*args, **kwargs)
        name, count = _counter_arguments(*args, **kwargs)
        sink = self._sink(None) if name == ALLOCATION_FAILURE and count > 0 else None
        if sink is not None:
            failure = TransferFailure(TransferOperation.BACKUP, "host_pool_full", {DEFAULT_POOL: 0}, now_ns())
            for _ in range(int(count)):
                sink.record_failure(failure)
        return result


def _stamp(state: _Connector, job_ids: Iterable[int], now: int) -> None:
    """The jobs vLLM is about to submit: each noted one not yet stamped gets ``now`` as its submission time."""
    pending = state.pending
    for job_id in job_ids:
        entry = pending.get(job_id)
        if entry is not None and entry.submit_ns == 0:
            pending[job_id] = entry._replace(submit_ns=now)


def _built(payload: tuple[_Pending, tuple[Any, Any] | None, int, TimingSource]) -> TransferRecord:
    """A deferred transfer's record, on the host thread (``record_transfer_deferred``'s build)."""
    return _record(*payload)


def _record(entry: _Pending, measured: tuple[Any, Any] | None, done_ns: int, timing: TimingSource) -> TransferRecord:
    """The transfer record of one finished job. ``measured`` is what vLLM counted for it (bytes, seconds), as vLLM
    got them (the telemetry refuses values that are not counts or durations); ``None`` for a result without size and
    time, which vLLM does not count: then the transfer is reported with its tokens and blocks, no bytes (its span has
    no byte count: unknown, not 0) and no duration (timing source ``none``), so bytes, time and count stay equal to
    vLLM's."""
    submit_ns = entry.submit_ns or done_ns  # a store finished before we saw it submitted
    num_bytes, duration = measured if measured is not None else (0, None)
    return TransferRecord(
        operation=entry.operation,
        tokens_by_pool=entry.tokens_by_pool,
        num_bytes=num_bytes,
        submit_time_ns=min(submit_ns, done_ns),
        complete_time_ns=done_ns,
        copy_duration_s=duration,
        timing_source=TimingSource.NONE if duration is None else timing,
        node_count=entry.blocks,
        links=entry.links,
    )


def _span_context(trace_id: int, span_id: int, flags: int) -> SpanContext:
    return SpanContext(int(trace_id), int(span_id), is_remote=True, trace_flags=TraceFlags(int(flags)))


def _groups(spec: Any, kv_cache_config: Any) -> tuple[_Group, ...]:
    """The KV cache groups a connector offloads (``spec.config.groups``), each with its pool and tokens per block."""
    spec_kind = importlib.import_module("vllm.v1.kv_cache_interface").get_kv_cache_spec_kind
    groups = []
    for group in spec.config.groups:
        cache_group = kv_cache_config.kv_cache_groups[group.group_id]
        kind = spec_kind(cache_group.kv_cache_spec)
        pool = group_pool(str(getattr(kind, "value", kind)), cache_group.is_eagle_group, str(cache_group.role.value))
        groups.append(_Group(pool, int(group.tokens_per_block)))
    return tuple(groups)


def _stats_arguments(num_bytes: Any, time: Any) -> tuple[Any, Any]:
    return num_bytes, time


def _job_id(job_id: Any, success: Any = True) -> int:
    return int(job_id)


def _succeeded(job_id: Any, success: Any = True) -> bool:
    """Whether ``mark_completed`` completed its job as done (vLLM < 0.34 has no ``success``: always)."""
    return success is not False


def _counter_arguments(
    counter_name: str, counter_increase_value: float = 1, labelvalues: tuple[str, ...] = ()
) -> tuple[str, float]:
    return counter_name, counter_increase_value
