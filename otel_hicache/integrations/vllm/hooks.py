"""The wrapt wrappers around vLLM's KV offloading classes.

Worker side (one process per GPU worker): a transfer is noted when vLLM's ``OffloadingConnectorWorker`` submits it
(job id, direction, GPU blocks) and reported when its ``get_finished`` consumes the worker's ``TransferResult``: the
wrapper sees each result exactly where vLLM counts it, as the ``DirectionalTransferStats.record(bytes, time)`` call
(vLLM's own ``vllm:kv_offload_*`` bytes and time) followed by ``OffloadingWorkerMetadata.mark_completed(job_id)``.
Scheduler side (the engine-core process): ``OffloadingConnectorStats.increase_counter`` of the allocation-failure
counter, and the CPU tier's occupancy and evictions, from the ``CPUOffloadingManager`` that
``CPUOffloadingSpec.get_manager`` built.

Failure rule: if a wrapper's own code fails it logs once per hook and vLLM's call goes on untouched; an exception
raised by vLLM's method propagates exactly as without instrumentation. Nothing here synchronises a device: the
duration is the one vLLM's worker measured.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from otel_hicache.integrations.vllm.semconv import ALLOCATION_FAILURE
from otel_hicache.records import EvictionRecord, PoolUsage, TransferFailure, TransferRecord
from otel_hicache.semconv import DEFAULT_POOL, Tier, TimingSource, TransferOperation
from otel_hicache.telemetry import HiCacheTelemetry
from otel_hicache.timing import now_ns

_log = logging.getLogger(__name__)

#: Submitted transfers remembered per connector; beyond this the oldest are forgotten (a job vLLM never reports
#: finished must not grow memory without bound).
MAX_PENDING = 4096
#: vLLM's ``OffloadingWorker`` that times each transfer with device events (``torch.Event`` on the transfer stream).
_DEVICE_TIMED_WORKERS = frozenset({"vllm.v1.kv_offload.cpu.gpu_worker.CPUOffloadingWorker"})


class Sinks(Protocol):
    """Where a process's records go: ``for_spec(spec)`` is the sink for what is built from ``spec`` (an
    ``OffloadingSpec``; ``None`` where the caller has none: the process's sink so far), or ``None`` when this process
    reports nothing."""

    def for_spec(self, spec: Any) -> HiCacheTelemetry | None: ...


class FixedSink:
    """Every record to one :class:`HiCacheTelemetry` (``instrument(telemetry=... / providers)``)."""

    def __init__(self, telemetry: HiCacheTelemetry) -> None:
        self.telemetry = telemetry

    def for_spec(self, spec: Any) -> HiCacheTelemetry | None:
        return self.telemetry


class _Pending(NamedTuple):
    operation: TransferOperation
    tokens: int  # first KV group's GPU blocks x its tokens per block
    blocks: int  # GPU blocks over all KV groups
    submit_ns: int


class _Connector:
    """One ``OffloadingConnectorWorker``'s submitted transfers, by vLLM job id."""

    __slots__ = ("pending", "sink", "tokens_per_block", "worker_timing")

    def __init__(self, sink: HiCacheTelemetry | None, tokens_per_block: int) -> None:
        self.sink = sink
        self.tokens_per_block = tokens_per_block
        self.pending: dict[int, _Pending] = {}
        self.worker_timing: TimingSource | None = None


class OffloadHooks:
    """The wrapper callables (wrapt signature ``(wrapped, instance, args, kwargs)``) bound to a :class:`Sinks`."""

    def __init__(self, sinks: Sinks) -> None:
        self.sinks = sinks
        self._attr = f"_otel_hicache_jobs_{id(self):x}"
        self._failed: set[str] = set()
        self._finishing = threading.local()  # the events of the get_finished call running on this thread
        # CPU-tier managers built by CPUOffloadingSpec.get_manager: their sink and tokens per chunk
        self._managers: weakref.WeakKeyDictionary[Any, tuple[HiCacheTelemetry, int]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def _fail(self, hook: str) -> None:
        if hook not in self._failed:
            self._failed.add(hook)
            _log.warning(
                "otel_hicache: the vLLM %s hook failed; vLLM runs unchanged, this hook's telemetry may be incomplete. "
                "Further failures of this hook are not logged.",
                hook,
                exc_info=True,
            )

    def _connector(self, worker: Any) -> _Connector:
        state = getattr(worker, self._attr, None)
        if state is None:
            spec = worker.spec
            state = _Connector(self.sinks.for_spec(spec), int(spec.config.groups[0].tokens_per_block))
            setattr(worker, self._attr, state)
        return state

    # ------------------------------------------------------------------ submission: OffloadingConnectorWorker
    def prepare_store_kv(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """Stores are queued here and submitted at the start of the next step; note their blocks now."""
        result = wrapped(*args, **kwargs)
        try:
            if instance._is_store_writer:
                metadata = args[0] if args else kwargs["metadata"]
                self._note(instance, TransferOperation.BACKUP, metadata.store_jobs, 0)
        except Exception:
            self._fail("prepare_store_kv")
        return result

    def handle_preemptions(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """Submits queued stores and the ones a preemption flushes: their submission time is now."""
        try:
            metadata = args[0] if args else kwargs["kv_connector_metadata"]
            if instance._is_store_writer and metadata.jobs_to_flush:
                flushed = {j: metadata.store_jobs[j] for j in metadata.jobs_to_flush if j in metadata.store_jobs}
                self._note(instance, TransferOperation.BACKUP, flushed, now_ns())
            self._submitted(instance)
        except Exception:
            self._fail("handle_preemptions")
        return wrapped(*args, **kwargs)

    def start_kv_transfers(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """Submits queued stores and this step's loads."""
        try:
            metadata = args[0] if args else kwargs["metadata"]
            self._submitted(instance)
            self._note(instance, TransferOperation.LOAD_BACK, metadata.load_jobs, now_ns())
        except Exception:
            self._fail("start_kv_transfers")
        return wrapped(*args, **kwargs)

    def _note(self, instance: Any, operation: TransferOperation, jobs: Any, submit_ns: int) -> None:
        state = self._connector(instance)
        if state.sink is None or not jobs:
            return
        pending = state.pending
        for job_id, job in jobs.items():
            gpu = job.src_spec if operation is TransferOperation.BACKUP else job.dst_spec
            sizes = gpu.group_sizes
            first = int(sizes[0]) if len(sizes) else len(gpu.block_ids)
            pending[job_id] = _Pending(operation, first * state.tokens_per_block, len(gpu.block_ids), submit_ns)
        while len(pending) > MAX_PENDING:
            del pending[next(iter(pending))]

    def _submitted(self, instance: Any) -> None:
        """Stamp the stores vLLM is about to submit (``_unsubmitted_store_jobs``) with the submission time."""
        queued = instance._unsubmitted_store_jobs
        if queued:
            pending, now = self._connector(instance).pending, now_ns()
            for job_id, *_ in queued:
                entry = pending.get(job_id)
                if entry is not None and entry.submit_ns == 0:
                    pending[job_id] = entry._replace(submit_ns=now)

    # ------------------------------------------------------------------ completion
    def get_finished(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """Collect the ``record`` / ``mark_completed`` calls vLLM makes for each finished ``TransferResult``."""
        events: list[Any] = []
        outer = getattr(self._finishing, "events", None)
        self._finishing.events = events
        try:
            result = wrapped(*args, **kwargs)
        finally:
            self._finishing.events = outer
        if events:
            try:
                self._report(instance, events)
            except Exception:
                self._fail("get_finished")
        return result

    def transfer_stats_record(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``DirectionalTransferStats.record(num_bytes, time)``: vLLM counting one timed result."""
        events = getattr(self._finishing, "events", None)
        if events is not None:
            events.append(_stats_arguments(*args, **kwargs))
        return wrapped(*args, **kwargs)

    def mark_completed(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``OffloadingWorkerMetadata.mark_completed(job_id)``: the result's job is done."""
        events = getattr(self._finishing, "events", None)
        if events is not None:
            events.append(int(args[0] if args else kwargs["job_id"]))
        return wrapped(*args, **kwargs)

    def _report(self, instance: Any, events: list[Any]) -> None:
        state = self._connector(instance)
        sink = state.sink
        if sink is None:
            return
        if state.worker_timing is None:
            worker = type(instance.worker)
            name = f"{worker.__module__}.{worker.__qualname__}"
            state.worker_timing = TimingSource.CUDA_EVENT if name in _DEVICE_TIMED_WORKERS else TimingSource.HOST_CLOCK
        done_ns = now_ns()
        measured: tuple[int, float] | None = None
        for event in events:
            if isinstance(event, tuple):
                measured = event
                continue
            entry = state.pending.pop(event, None)
            if entry is not None:
                sink.record_transfer(_record(entry, measured, done_ns, state.worker_timing))
            measured = None

    # ------------------------------------------------------------------ scheduler side
    def increase_counter(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``OffloadingConnectorStats.increase_counter``: each allocation failure is one failed backup."""
        result = wrapped(*args, **kwargs)
        try:
            name, count = _counter_arguments(*args, **kwargs)
            if name == ALLOCATION_FAILURE and count > 0:
                sink = self.sinks.for_spec(None)
                if sink is not None:
                    failure = TransferFailure(TransferOperation.BACKUP, "host_pool_full", {DEFAULT_POOL: 0}, now_ns())
                    for _ in range(int(count)):
                        sink.record_failure(failure)
        except Exception:
            self._fail("increase_counter")
        return result

    def get_manager(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``CPUOffloadingSpec.get_manager``: report the CPU tier's occupancy of the manager it built."""
        manager = wrapped(*args, **kwargs)
        try:
            with self._lock:
                new = manager not in self._managers
            sink = self.sinks.for_spec(instance) if new else None
            if sink is not None:
                config = instance.config
                tokens_per_chunk = config.groups[0].tokens_per_block * config.cache.blocks_per_chunk
                with self._lock:
                    self._managers[manager] = (sink, tokens_per_chunk)
                sink.add_pool_usage_source(_CpuTierSource(manager, tokens_per_chunk, sink))
        except Exception:
            self._fail("get_manager")
        return manager

    def prepare_store(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``CPUOffloadingManager.prepare_store``: chunks it evicted to make room are an eviction pass on the CPU
        tier, timed on the host around the call."""
        start = time.perf_counter()
        result = wrapped(*args, **kwargs)
        try:
            evicted = len(result.evicted_keys) if result is not None else 0
            known = self._managers.get(instance) if evicted else None
            if known is not None:
                sink, tokens_per_chunk = known
                sink.record_eviction(
                    EvictionRecord(Tier.HOST, evicted * tokens_per_chunk, time.perf_counter() - start, now_ns())
                )
        except Exception:
            self._fail("prepare_store")
        return result


def _record(entry: _Pending, measured: tuple[int, float] | None, done_ns: int, timing: TimingSource) -> TransferRecord:
    submit_ns = entry.submit_ns or done_ns  # a store finished before we saw it submitted
    num_bytes, duration = measured if measured is not None else (0, None)
    return TransferRecord(
        operation=entry.operation,
        tokens_by_pool={DEFAULT_POOL: entry.tokens},
        num_bytes=int(num_bytes),
        submit_time_ns=min(submit_ns, done_ns),
        complete_time_ns=done_ns,
        copy_duration_s=None if duration is None else float(duration),
        timing_source=TimingSource.NONE if duration is None else timing,
        node_count=entry.blocks,
    )


class _CpuTierSource:
    """The CPU tier's chunks holding KV (cached or in flight) and its capacity, in tokens, read at collection."""

    __slots__ = ("__weakref__", "_manager", "_telemetry", "_tokens_per_chunk")

    def __init__(self, manager: Any, tokens_per_chunk: int, telemetry: HiCacheTelemetry) -> None:
        self._manager = weakref.ref(manager)
        self._tokens_per_chunk = tokens_per_chunk
        self._telemetry = telemetry

    def __call__(self) -> list[PoolUsage]:
        manager = self._manager()
        if manager is None:  # the manager is gone: stop reporting it
            self._telemetry.remove_pool_usage_source(self)
            return []
        held = manager._num_allocated_chunks - len(manager._free_list)
        per = self._tokens_per_chunk
        return [PoolUsage(tier=Tier.HOST, pool=DEFAULT_POOL, used=held * per, limit=manager._num_chunks * per)]


def _stats_arguments(num_bytes: int, time: float) -> tuple[int, float]:
    return int(num_bytes), float(time)


def _counter_arguments(
    counter_name: str, counter_increase_value: float = 1, labelvalues: tuple[str, ...] = ()
) -> tuple[str, float]:
    return counter_name, counter_increase_value
