"""vLLM 0.32's real KV offloading connector on a CPU, for tests/vllm.

vLLM's own ``OffloadingConnector`` (both roles), ``OffloadingConnectorWorker``, ``CPUOffloadingSpec`` and
``CPUOffloadingManager`` run unchanged. One piece is ours: vLLM's ``CPUOffloadingWorker`` copies with CUDA streams
and events (``get_worker`` refuses a CPU platform), so the spec is :class:`HostCopySpec`
(:mod:`otel_hicache.testing.vllm_host_copy`, which the real engines of tests/vllm and the vLLM benchmark load too):
vLLM's ``CPUOffloadingSpec`` with a worker doing real host copies, loaded the way vLLM loads any out-of-tree spec
(``spec_name`` / ``spec_module_path`` in ``kv_connector_extra_config``).
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import vllm.triton_utils
from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.platforms.cpu import CpuPlatform
from vllm.utils.math_utils import round_up
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext, make_offload_key
from vllm.v1.outputs import KVConnectorOutput

from otel_hicache.testing.vllm import SPEC_MODULE
from otel_hicache.testing.vllm_host_copy import HostCopySpec, HostCopyWorker  # noqa: F401  (test_faults alters it)

# vLLM 0.34's CPU platform refuses an x86 machine without triton-cpu as it checks a config ("vLLM on x86 CPUs requires
# Triton"); the CUDA wheel's Triton has no CPU backend, so vllm.triton_utils.HAS_TRITON is false there. The connector,
# scheduler and host-copy paths of these tests (and of their engine processes, which import this module) launch no
# Triton kernel: the check is told Triton is there. A platform with no such check (0.32's CPU build, 0.33) is left be.
if "requires Triton" in inspect.getsource(CpuPlatform.check_and_update_config):
    vllm.triton_utils.HAS_TRITON = True

BLOCK_SIZE = 16  # tokens per GPU block
NUM_GPU_BLOCKS = 64
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
ATTENTION = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float16)
#: A sliding-window layer of the same page size, for hybrid (full + sliding-window) KV layouts.
SLIDING = SlidingWindowSpec(
    block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype=torch.float16, sliding_window=2 * BLOCK_SIZE
)


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "torch_dtype": "float16",
}


@functools.cache
def _tiny_model_directory() -> tempfile.TemporaryDirectory[str]:
    """The tiny Llama's ``config.json`` in a directory of its own, one per test process: the cache holds it until
    the process exits, when its finalizer removes it."""
    directory = tempfile.TemporaryDirectory(prefix="otel-hicache-vllm-model-")
    with open(f"{directory.name}/config.json", "w") as f:
        json.dump(TINY_LLAMA, f)
    return directory


def tiny_model() -> ModelConfig:
    """vLLM's model config of a two-layer Llama described by a local ``config.json`` (no weights, no tokenizer)."""
    return ModelConfig(model=_tiny_model_directory().name, skip_tokenizer_init=True, dtype="float16")


def vllm_config(
    cpu_chunks: int,
    blocks_per_chunk: int = 1,
    rank: int = 0,
    tp: int = 1,
    groups: tuple[AttentionSpec, ...] = (ATTENTION,),
) -> tuple[VllmConfig, KVCacheConfig]:
    """A vLLM config with the OffloadingConnector (CPU tier of ``cpu_chunks`` chunks) and a two-layer KV cache, as
    seen by worker ``rank`` of a ``tp``-way tensor-parallel engine. ``groups``: the KV cache groups in vLLM's order,
    one spec each (one group: both layers; two: one layer each, e.g. ``(SLIDING, ATTENTION)`` for a hybrid model whose
    first layer is sliding-window)."""
    page = ATTENTION.page_size_bytes
    extra = {
        "spec_name": "HostCopySpec",
        "spec_module_path": SPEC_MODULE,
        # vLLM rounds each chunk up to its alignment: size the tier in aligned chunks
        "cpu_bytes_to_use": cpu_chunks
        * round_up(page * len(LAYERS) * blocks_per_chunk, HostCopySpec.BLOCK_SIZE_ALIGNMENT),
        "block_size": BLOCK_SIZE * blocks_per_chunk,
    }
    total = page * NUM_GPU_BLOCKS * len(LAYERS)
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
        # vLLM 0.32: every KVCacheTensor describes placement within one backing allocation, so its size is the
        # total (what vLLM's offloading config reads as the worker's KV bytes per block x blocks)
        kv_cache_tensors=[
            KVCacheTensor(size=total, layers=[name], layer_stride=page * NUM_GPU_BLOCKS, block_stride=page)
            for name in LAYERS
        ],
        kv_cache_groups=(
            [KVCacheGroupSpec(list(LAYERS), groups[0])]
            if len(groups) == 1
            else [KVCacheGroupSpec([layer], spec) for layer, spec in zip(LAYERS, groups, strict=True)]
        ),
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
    last_worker_meta: Any = None  # what the worker role handed over at the last step (OffloadingWorkerMetadata)

    @property
    def manager(self) -> Any:
        assert self.scheduler.connector_scheduler is not None
        return self.scheduler.connector_scheduler.manager

    def store(
        self, request: str, gpu_blocks: list[int], *more_groups: list[int], flush: bool = False
    ) -> list[Any] | None:
        """Offload ``gpu_blocks`` of ``request`` to the CPU tier (vLLM's manager picks the chunks); ``None`` when
        the manager has no room. Returns the keys stored. ``flush``: the scheduler flushes the store at once (as
        for a preempted request: ``jobs_to_flush``) instead of deferring it to the next step. ``more_groups``: the
        blocks of the second, third ... KV cache group (``gpu_blocks`` are the first group's)."""
        per_group = [gpu_blocks, *more_groups]
        keys = [make_offload_key(f"{request}:{b}".encode(), g) for g, blocks in enumerate(per_group) for b in blocks]
        context = ReqContext(req_id=request)
        out = self.manager.prepare_store(keys, context)
        if out is None:
            return None
        gpu = gpu_spec(per_group)
        job = self._job()
        if flush:
            self._step(store_jobs={job: TransferJob(request, gpu, out.store_spec)}, flush={job})
        else:
            self._step(store_jobs={job: TransferJob(request, gpu, out.store_spec)})
            self._step()  # stores are submitted at the start of the next step
        self.manager.complete_store(keys, context)
        return keys

    def store_together(self, stores: dict[str, list[int]]) -> None:
        """Offload several requests' blocks as jobs of one step, so they finish in one ``get_finished``."""
        jobs = {}
        for request, blocks in stores.items():
            keys = [make_offload_key(f"{request}:{b}".encode(), 0) for b in blocks]
            out = self.manager.prepare_store(keys, ReqContext(req_id=request))
            assert out is not None, request
            jobs[self._job()] = TransferJob(request, gpu_spec([blocks]), out.store_spec)
        self._step(store_jobs=jobs)
        self._step()

    @property
    def transfer_stats(self) -> Any:
        """What vLLM's worker role counted so far and has not yet handed to the scheduler (``TransferStats``)."""
        worker = self.worker.connector_worker
        assert worker is not None
        return worker._connector_worker_meta.transfer_stats

    def load(
        self, request: str, keys: list[Any], gpu_blocks: list[int], *more_groups: list[int], sync: bool = False
    ) -> None:
        """Load ``keys`` back into ``gpu_blocks``; ``sync`` (vLLM >= 0.33): as a sync load, waited for in the step."""
        context = ReqContext(req_id=request)
        src = self.manager.prepare_load(keys, context)
        job = TransferJob(request, src, gpu_spec([gpu_blocks, *more_groups]), **({"sync": True} if sync else {}))
        self._step(load_jobs={self._job(): job})
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
        meta = self.last_worker_meta = worker.build_connector_worker_meta()
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


def gpu_spec(per_group: list[list[int]]) -> GPULoadStoreSpec:
    """vLLM's GPU side of a transfer: each group's blocks in group order, each group starting at its block 0."""
    return GPULoadStoreSpec(
        [b for blocks in per_group for b in blocks],
        group_sizes=[len(blocks) for blocks in per_group],
        block_indices=[0] * len(per_group),
    )


def engine(cpu_chunks: int = 8, rank: int = 0, tp: int = 1, groups: tuple[AttentionSpec, ...] = (ATTENTION,)) -> Engine:
    config, kv_cache_config = vllm_config(cpu_chunks, rank=rank, tp=tp, groups=groups)
    scheduler = OffloadingConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    worker = OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    generator = torch.Generator().manual_seed(0)
    kv_caches = {
        name: torch.randint(
            -128, 127, (NUM_GPU_BLOCKS, ATTENTION.page_size_bytes), dtype=torch.int8, generator=generator
        ).view(torch.float16)
        for name in LAYERS
    }
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


class _Calls:
    """Calls counted by a profile function (it sees a call wherever it comes from, and changes nothing of the calls):
    those :meth:`_name` names, by that name."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __enter__(self) -> _Calls:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        name = self._name(frame) if event == "call" else None
        if name is not None:
            self.calls[name] = self.calls.get(name, 0) + 1

    def _name(self, frame: Any) -> str | None:
        raise NotImplementedError

    def take(self) -> dict[str, int]:
        calls, self.calls = self.calls, {}
        return calls


class Entered(_Calls):
    """How many times each of our hooks ``names`` of ``group`` was entered."""

    def __init__(self, group: type, *names: str) -> None:
        super().__init__()
        self._codes = {getattr(group, name).__code__: name for name in names}

    def _name(self, frame: Any) -> str | None:
        return self._codes.get(frame.f_code)


class WrappedCalls(_Calls):
    """Every call that went through one of our wrappers, by its target's name (``Class.method``): the failure-rule
    guard that every wrapper of ours runs in is what is counted, so each wrapped call is, whichever hook it serves."""

    def __init__(self) -> None:
        from otel_hicache.integrations._patching import AdapterSwitch, guarded

        super().__init__()
        self._code = guarded(lambda *args: None, "", "", AdapterSwitch("")).__code__  # every guard shares its code

    def _name(self, frame: Any) -> str | None:
        return str(frame.f_locals["hook"]) if frame.f_code is self._code else None


@contextmanager
def restored(owner: type, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` set back to ``value`` on the way out (before a fixture uninstruments: a monkeypatch, undone
    after it, would leave our wrapper on the class)."""
    try:
        yield
    finally:
        setattr(owner, name, value)
