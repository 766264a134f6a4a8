"""vLLM's real scheduler stepped with its offloading connector, no model: for the scheduler- and tracing-level tests.

vLLM's ``Scheduler`` (with the ``OffloadingConnector``'s scheduler role it builds itself, on the host-copy spec of
:mod:`tests.vllm.support`) schedules; the connector's worker role gets each step's metadata as vLLM's model runner
hands it over (``handle_preemptions``, ``start_load_kv``, ``wait_for_save``, ``get_finished``,
``build_connector_worker_meta``), copying real blocks between the KV tensors and the host; the step's output goes back
through ``Scheduler.update_from_output`` with that worker metadata. The one thing not run is the forward pass: each
request that completes its prompt in a step samples token 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.vllm import support

_TAKES_INDEX = "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}

init_none_hash(sha256)


@dataclass
class Stepper:
    """One engine: vLLM's scheduler and one worker's connector."""

    scheduler: Scheduler
    worker: OffloadingConnector
    outputs: list[Any] = field(default_factory=list)  # EngineCoreOutputs of every step

    @property
    def connector(self) -> Any:
        """The scheduler role's ``OffloadingConnectorScheduler``."""
        return self.scheduler.connector.connector_scheduler

    def add(
        self, name: str, prompt: list[int], max_tokens: int = 1, trace_headers: dict[str, str] | None = None
    ) -> Request:
        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, None)
        request = Request(
            request_id=name,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            trace_headers=trace_headers,
            block_hasher=get_request_block_hasher(support.BLOCK_SIZE, sha256),
        )
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:
        """One engine step; returns vLLM's ``SchedulerOutput``."""
        out = self.scheduler.schedule()
        self.execute(out)
        return out

    def execute(self, out: Any) -> None:
        """The worker's part of a scheduled step, then its output back to the scheduler."""
        worker = self.worker
        metadata = out.kv_connector_metadata
        worker.handle_preemptions(metadata)
        worker.bind_connector_metadata(metadata)
        worker.start_load_kv(None)  # the offloading connector reads no forward context
        worker.wait_for_save()
        sending, receiving = worker.get_finished(out.finished_req_ids)
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens + out.num_scheduled_tokens[req_id] >= request.num_tokens
            sampled.append([0] if done else [])
        # vLLM < 0.34 also takes each request's index; 0.34 derives it from ``req_ids``
        index = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if _TAKES_INDEX else {}
        output = ModelRunnerOutput(
            req_ids=req_ids,
            **index,
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending, finished_recving=receiving, kv_connector_worker_meta=worker_meta
            ),
        )
        self.outputs.append(self.scheduler.update_from_output(out, output))

    def run(self, steps: int = 50, pause_s: float = 0.0) -> None:
        """Step until no request and no job of the connector or its manager is left (at most ``steps``), pausing
        ``pause_s`` between steps as a forward pass would (a storage tier's I/O threads work meanwhile)."""
        pending = getattr(self.connector.manager, "has_pending_work", lambda: False)  # vLLM's tiering manager
        for _ in range(steps):
            if not self.scheduler.has_requests() and not self.connector._jobs and not pending():
                return
            self.step()
            time.sleep(pause_s)
        raise AssertionError(f"requests left after {steps} steps: {list(self.scheduler.requests)}")

    def finished_trace_headers(self) -> dict[str, dict[str, str]]:
        """Each finished request's ``trace_headers`` as the engine core sent them to the frontend."""
        headers = {}
        for outputs in self.outputs:
            for engine_outputs in outputs.values():
                for output in engine_outputs.outputs:
                    if output.finish_reason is not None:
                        headers[output.request_id] = dict(output.trace_headers or {})
        return headers


def stepper(
    cpu_chunks: int = 16,
    tracing: bool = False,
    deferred_loads: bool = False,
    groups: tuple[Any, ...] = (support.ATTENTION,),
    **extra: Any,
) -> Stepper:
    """An engine whose CPU tier holds ``cpu_chunks`` blocks; ``extra``: more ``kv_connector_extra_config`` (e.g.
    ``sync_load_budget_bytes``); ``tracing``: vLLM's request tracing on (an endpoint nothing listens on: the tracing
    level reads what the engine core sends back, not an export); ``deferred_loads``: vLLM >= 0.33 defers an async
    load admitted while a step is in flight until that step's output is in (see :meth:`Stepper.execute`); ``groups``:
    the KV cache groups (:func:`.support.vllm_config`: two for a hybrid model)."""
    config, kv_cache_config = support.vllm_config(cpu_chunks, groups=groups)
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector_extra_config.update(extra)
    config.cache_config.enable_prefix_caching = True
    config.cache_config.num_gpu_blocks = support.NUM_GPU_BLOCKS
    # steps in flight while the next is scheduled: vLLM defers freeing blocks (and, below, loads)
    config.scheduler_config.async_scheduling = deferred_loads
    if tracing:
        config.observability_config.otlp_traces_endpoint = "http://127.0.0.1:9"
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=support.BLOCK_SIZE,
        log_stats=True,
    )
    if deferred_loads:
        # vLLM >= 0.33 sets it for a HiSparse layout with a step in flight (async scheduling), which needs its CUDA
        # HiSparse kernels; set here, vLLM's own deferral runs (Scheduler.deferred_loads, _drain_deferred_loads)
        assert scheduler.defer_block_free and hasattr(scheduler, "defer_async_loads")
        scheduler.defer_async_loads = True
    worker = OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    generator = torch.Generator().manual_seed(0)
    worker.register_kv_caches(
        {
            name: torch.randint(
                -128,
                127,
                (support.NUM_GPU_BLOCKS, support.ATTENTION.page_size_bytes),
                dtype=torch.int8,
                generator=generator,
            ).view(torch.float16)
            for name in support.LAYERS
        }
    )
    return Stepper(scheduler, worker)


def prompt(seed: int, blocks: int) -> list[int]:
    """A prompt of ``blocks`` full blocks, distinct per ``seed``."""
    return [(seed * 1000 + i) % 127 + 1 for i in range(blocks * support.BLOCK_SIZE)]
