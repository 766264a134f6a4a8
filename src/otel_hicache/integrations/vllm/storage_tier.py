"""The storage tiers behind vLLM's CPU tier (tier ``storage``): vLLM's tiering (``TieringOffloadingSpec``: a CPU
primary tier and secondary tiers behind it - its filesystem tier ``fs``, ``obj``, ``p2p``, out-of-tree ones), in the
scheduler (engine-core) process.

Every copy between the CPU tier and a secondary tier is a job of vLLM's tiering manager, and each finished job goes
through ``TieringMetricsTracker.on_job_finished(job_metadata, result)``, where vLLM counts its tiering metrics. There
each job becomes one transfer: a cascade (CPU tier -> secondary tier) ``storage_backup``, a promotion (secondary tier
-> CPU tier) ``storage_prefetch``, with its chunks' tokens, the bytes vLLM counts (chunks x the primary tier's chunk
size: ``vllm:kv_offload_tiering_write_bytes`` / ``read_bytes``), and the seconds the tier measured
(``..._write_time`` / ``..._read_time``, ``host_clock``; no duration where the tier reports none). A failed job is a
failure (``storage_write_failed`` / ``storage_read_failed``, with its chunks' tokens: vLLM's ``..._job_failures``
counts it once); a promotion that failed part way also reports the chunks it did load as a transfer, as vLLM counts
them. Records are built and counted on the telemetry's host thread (``record_transfer_deferred``), off the step.

The tiering spec's CPU primary tier is reported as the CPU tier (:mod:`.cpu_tier`: occupancy, capacity, evictions). A
request's tokens served from a secondary tier are its ``storage_hit`` (:mod:`.per_request`, from vLLM's own hit
sources). vLLM states no size for any of its secondary tiers (``fs`` grows with the disk; ``obj``, ``p2p``
neither): tier ``storage`` has no ``hicache.pool.*`` and no capacity curve.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from otel_hicache.integrations._base import EngineHooks, ProcessSink, Ranks
from otel_hicache.records import TransferFailure, TransferRecord
from otel_hicache.semconv import DEFAULT_POOL, TimingSource, TransferOperation
from otel_hicache.timing import ANCHOR, now_ns


class StorageTierHooks(EngineHooks):
    """The wrappers of vLLM's tiering spec and its metrics tracker. ``adopt_cpu_tier(spec, manager)``: the CPU tier's
    hooks taking the tiering spec's CPU primary tier (:meth:`.cpu_tier.CpuTierHooks.adopt`)."""

    def __init__(
        self, sink: ProcessSink, ranks: Callable[[Any], Ranks], adopt_cpu_tier: Callable[[Any, Any], None]
    ) -> None:
        super().__init__(sink, ranks)
        self._adopt_cpu_tier = adopt_cpu_tier
        # each tiering manager's metrics tracker -> tokens per chunk
        self._trackers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get_manager(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``TieringOffloadingSpec.get_manager``: its primary tier is the CPU tier; its jobs are storage transfers."""
        manager = wrapped(*args, **kwargs)
        primary = getattr(manager, "primary_tier", None)
        if primary is not None:
            self._adopt_cpu_tier(instance, primary)
        tracker = getattr(manager, "_metrics", None)
        if tracker is not None and self._sink(instance) is not None:
            with self._lock:
                config = instance.config  # a chunk: blocks of the first group, as the CPU tier counts them
                self._trackers[tracker] = int(config.groups[0].tokens_per_block * config.cache.blocks_per_chunk)
        return manager

    def job_finished(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """``TieringMetricsTracker.on_job_finished(job_metadata, result)``: one storage transfer, or failure."""
        counted = wrapped(*args, **kwargs)
        tokens_per_chunk = self._trackers.get(instance)
        telemetry = self.telemetry
        if tokens_per_chunk is None or telemetry is None:
            return counted
        job = (args[0] if args else kwargs["job_metadata"]).transfer_job
        result = args[1] if len(args) > 1 else kwargs["result"]
        promotion = bool(job.is_promotion)
        operation = TransferOperation.STORAGE_PREFETCH if promotion else TransferOperation.STORAGE_BACKUP
        chunks = len(job.keys)
        moved = chunks if result.success else len(result.successful_keys or ()) if promotion else 0
        done_ns = now_ns()
        if moved:
            chunk_bytes = int(instance._primary_chunk_size)  # what vLLM multiplies its chunks by
            payload = (operation, moved * tokens_per_chunk, moved * chunk_bytes, job.submit_time, done_ns, result)
            telemetry.record_transfer_deferred(_built, payload)
        if moved < chunks:
            error = "storage_read_failed" if promotion else "storage_write_failed"
            tokens = {DEFAULT_POOL: (chunks - moved) * tokens_per_chunk}
            telemetry.record_failure(TransferFailure(operation, error, tokens, done_ns))
        return counted


def _built(payload: tuple[TransferOperation, int, int, float, int, Any]) -> TransferRecord:
    """A finished job's transfer record, on the host thread: ``submitted`` is the job's ``time.monotonic()``."""
    operation, tokens, num_bytes, submitted, done_ns, result = payload
    seconds = result.transfer_time
    return TransferRecord(
        operation=operation,
        tokens_by_pool={DEFAULT_POOL: tokens},
        num_bytes=num_bytes,
        submit_time_ns=min(ANCHOR.to_epoch_ns(int(submitted * 1e9)), done_ns),
        complete_time_ns=done_ns,
        copy_duration_s=seconds,
        timing_source=TimingSource.NONE if seconds is None else TimingSource.HOST_CLOCK,
    )
