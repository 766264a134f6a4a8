"""vLLM 0.32's real KV offloading connector on a CPU, for tests/vllm.

vLLM's own ``OffloadingConnector`` (both roles), ``OffloadingConnectorWorker``, ``CPUOffloadingSpec`` and
``CPUOffloadingManager`` run unchanged. One piece is ours: vLLM's ``CPUOffloadingWorker`` copies with CUDA streams
and events (``get_worker`` refuses a CPU platform), so :class:`HostCopySpec` is vLLM's ``CPUOffloadingSpec`` with a
worker that implements vLLM's ``OffloadingWorker`` interface with real host copies between the registered KV tensor
and a host buffer, timed with the host clock, one ``TransferResult`` per job as vLLM's worker reports them. vLLM loads
it the way it loads any out-of-tree spec (``spec_name`` / ``spec_module_path`` in ``kv_connector_extra_config``).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.utils.math_utils import round_up
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    ReqContext,
    TransferResult,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.outputs import KVConnectorOutput

BLOCK_SIZE = 16  # tokens per GPU block
NUM_GPU_BLOCKS = 64
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
ATTENTION = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float16)


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 128,
    "max_position_embeddings": 256, "torch_dtype": "float16",
}  # fmt: skip


class HostCopyWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` interface over real host copies: one host buffer per registered KV tensor."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int) -> None:
        self._device = [t.tensor for t in kv_caches.tensors]
        self._host = [torch.zeros((num_chunks * blocks_per_chunk, t.shape[1]), dtype=torch.int8) for t in self._device]
        self._blocks_per_chunk = blocks_per_chunk
        self._finished: deque[TransferResult] = deque()

    def _copy(self, job_id: int, src: list[torch.Tensor], src_ids: Any, dst: list[torch.Tensor], dst_ids: Any) -> bool:
        start = time.perf_counter()
        moved = 0
        src_index, dst_index = torch.as_tensor(src_ids, dtype=torch.long), torch.as_tensor(dst_ids, dtype=torch.long)
        for s, d in zip(src, dst, strict=True):
            rows = s.index_select(0, src_index)
            d.index_copy_(0, dst_index, rows)
            moved += rows.numel() * rows.element_size()
        self._finished.append(TransferResult(job_id, True, moved, time.perf_counter() - start))
        return True

    def _host_rows(self, chunk_ids: Any, count: int) -> list[int]:
        return [c * self._blocks_per_chunk + i for c in chunk_ids for i in range(self._blocks_per_chunk)][:count]

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        blocks = src_spec.block_ids
        return self._copy(job_id, self._device, blocks, self._host, self._host_rows(dst_spec.block_ids, len(blocks)))

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        blocks = dst_spec.block_ids
        return self._copy(job_id, self._host, self._host_rows(src_spec.block_ids, len(blocks)), self._device, blocks)

    def get_finished(self) -> list[TransferResult]:
        done = list(self._finished)
        self._finished.clear()
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Copies are synchronous: nothing to wait for."""


class HostCopySpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec (manager, chunk sizing, metrics) with :class:`HostCopyWorker` as its worker."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]


def tiny_model() -> ModelConfig:
    """vLLM's model config of a two-layer Llama described by a local ``config.json`` (no weights, no tokenizer)."""
    directory = tempfile.mkdtemp(prefix="otel-hicache-vllm-model-")
    with open(f"{directory}/config.json", "w") as f:
        json.dump(TINY_LLAMA, f)
    return ModelConfig(model=directory, skip_tokenizer_init=True, dtype="float16")


def vllm_config(
    cpu_chunks: int, blocks_per_chunk: int = 1, rank: int = 0, tp: int = 1
) -> tuple[VllmConfig, KVCacheConfig]:
    """A vLLM config with the OffloadingConnector (CPU tier of ``cpu_chunks`` chunks) and a two-layer KV cache, as
    seen by worker ``rank`` of a ``tp``-way tensor-parallel engine."""
    page = ATTENTION.page_size_bytes
    extra = {
        "spec_name": "HostCopySpec",
        "spec_module_path": __name__,
        # vLLM rounds each chunk up to its alignment: size the tier in aligned chunks
        "cpu_bytes_to_use": cpu_chunks
        * round_up(page * len(LAYERS) * blocks_per_chunk, HostCopySpec.BLOCK_SIZE_ALIGNMENT),
        "block_size": BLOCK_SIZE * blocks_per_chunk,
    }
    config = VllmConfig(
        model_config=tiny_model(),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        ),
    )
    config.cache_config.block_size = BLOCK_SIZE
    config.parallel_config.tensor_parallel_size = config.parallel_config.world_size = tp
    config.parallel_config.rank = rank
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_GPU_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * NUM_GPU_BLOCKS, layers=[name], layer_stride=page * NUM_GPU_BLOCKS, block_stride=page
            )
            for name in LAYERS
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), ATTENTION)],
    )
    return config, kv_cache_config


@dataclass
class Engine:
    """vLLM's two connector roles for one engine with one worker; transfers driven step by step, as vLLM's model
    runner does (``handle_preemptions``, ``start_kv_transfers``, ``prepare_store_kv``, ``get_finished``), with the
    worker's metadata handed to the scheduler role each step (``update_connector_output``)."""

    scheduler: OffloadingConnector
    worker: OffloadingConnector
    kv_caches: dict[str, torch.Tensor]
    next_job: int = 1
    stats: list[Any] = field(default_factory=list)  # OffloadingConnectorStats of each get_kv_connector_stats()

    @property
    def manager(self) -> Any:
        assert self.scheduler.connector_scheduler is not None
        return self.scheduler.connector_scheduler.manager

    def store(self, request: str, gpu_blocks: list[int], flush: bool = False) -> list[Any] | None:
        """Offload ``gpu_blocks`` of ``request`` to the CPU tier (vLLM's manager picks the chunks); ``None`` when
        the manager has no room. Returns the keys stored. ``flush``: the scheduler flushes the store at once (as
        for a preempted request: ``jobs_to_flush``) instead of deferring it to the next step."""
        keys = [make_offload_key(f"{request}:{b}".encode(), 0) for b in gpu_blocks]
        context = ReqContext(req_id=request)
        out = self.manager.prepare_store(keys, context)
        if out is None:
            return None
        gpu = GPULoadStoreSpec(gpu_blocks, group_sizes=[len(gpu_blocks)], block_indices=[0])
        job = self._job()
        if flush:
            self._step(store_jobs={job: TransferJob(request, gpu, out.store_spec)}, flush={job})
        else:
            self._step(store_jobs={job: TransferJob(request, gpu, out.store_spec)})
            self._step()  # stores are submitted at the start of the next step
        self.manager.complete_store(keys, context)
        return keys

    def load(self, request: str, keys: list[Any], gpu_blocks: list[int]) -> None:
        context = ReqContext(req_id=request)
        src = self.manager.prepare_load(keys, context)
        gpu = GPULoadStoreSpec(gpu_blocks, group_sizes=[len(gpu_blocks)], block_indices=[0])
        self._step(load_jobs={self._job(): TransferJob(request, src, gpu)})
        self.manager.complete_load(keys, context)

    def _job(self) -> int:
        self.next_job += 1
        return self.next_job - 1

    def _step(
        self,
        load_jobs: dict[int, TransferJob] | None = None,
        store_jobs: dict[int, TransferJob] | None = None,
        flush: set[int] | None = None,
    ) -> None:
        worker = self.worker.connector_worker
        assert worker is not None
        metadata = OffloadingConnectorMetadata(
            load_jobs=load_jobs or {}, store_jobs=store_jobs or {}, jobs_to_flush=flush
        )
        worker.handle_preemptions(metadata)
        worker.start_kv_transfers(metadata)
        worker.prepare_store_kv(metadata)
        worker.get_finished(set())
        meta = worker.build_connector_worker_meta()
        # vLLM's scheduler role counts the transfer stats of the workers' metadata (completed jobs are matched to
        # the scheduler's own request bookkeeping, which these hand-made jobs bypass)
        if meta is not None:
            sched = self.scheduler.connector_scheduler
            assert sched is not None
            sched.update_connector_output(
                KVConnectorOutput(kv_connector_worker_meta=OffloadingWorkerMetadata(transfer_stats=meta.transfer_stats))
            )

    def vllm_stats(self) -> dict[str, float]:
        """vLLM's own reduction of its offloading stats since the last call (``OffloadingConnectorStats.reduce``)."""
        stats = self.scheduler.get_kv_connector_stats()
        return {} if stats is None else stats.reduce()


def engine(cpu_chunks: int = 8, rank: int = 0, tp: int = 1) -> Engine:
    config, kv_cache_config = vllm_config(cpu_chunks, rank=rank, tp=tp)
    scheduler = OffloadingConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    worker = OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    generator = torch.Generator().manual_seed(0)
    kv_caches = {
        name: torch.randint(-128, 127, (NUM_GPU_BLOCKS, ATTENTION.page_size_bytes), dtype=torch.int8,
                            generator=generator).view(torch.float16)
        for name in LAYERS
    }  # fmt: skip
    worker.register_kv_caches(kv_caches)
    return Engine(scheduler, worker, kv_caches)


def run_workload(engine: Engine, prefix: str = "") -> None:
    """Stores of 1, 3 and 5 blocks (the third evicts the first from an 8-chunk tier), then loads of the last two
    back into other GPU blocks."""
    stored = {}
    for request, blocks in (("a", [0]), ("b", [1, 2, 3]), ("c", [4, 5, 6, 7, 8])):
        keys = engine.store(prefix + request, blocks)
        assert keys is not None, request
        stored[request] = keys
    engine.load(prefix + "b", stored["b"], [20, 21, 22])
    engine.load(prefix + "c", stored["c"], [30, 31, 32, 33, 34])
