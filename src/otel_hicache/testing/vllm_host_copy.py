"""vLLM's ``CPUOffloadingSpec`` with a worker that copies on the host, so vLLM's real KV offloading connector runs on a
CPU (needs vLLM): for tests/vllm, the vLLM benchmark and trying the adapter without a GPU.

vLLM's ``CPUOffloadingWorker`` copies with CUDA streams and events (``get_worker`` refuses a CPU platform), so
:class:`HostCopySpec` is vLLM's ``CPUOffloadingSpec`` with a worker that implements vLLM's ``OffloadingWorker``
interface with real host copies between the registered KV tensors and a host buffer, timed with the host clock, one
``TransferResult`` per job as vLLM's worker reports them. vLLM loads it the way it loads any out-of-tree spec
(``spec_name`` / ``spec_module_path`` in ``kv_connector_extra_config``: see
:func:`otel_hicache.testing.vllm.kv_transfer_config`).

:class:`HostCopyTieringSpec` is vLLM's ``TieringOffloadingSpec`` (the CPU primary tier and the secondary tiers behind
it, e.g. its filesystem tier) the same way: its worker copies into the worker's views of vLLM's shared offload region,
the memory the secondary tiers read and write from the scheduler, as vLLM's ``CPUOffloadingWorker`` does.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class HostCopyWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` interface over real host copies: one host buffer per registered KV tensor, each KV
    cache group's blocks copied between its own tensors (``group_data_refs``) and their CPU chunks. ``region``: the host
    buffers are this worker's views of vLLM's shared offload region (one chunk per block) instead of its own."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_chunks: int,
        region: SharedOffloadRegion | None = None,
    ) -> None:
        self._device = [t.tensor for t in kv_caches.tensors]
        if region is None:
            self._host = [
                torch.zeros((num_chunks * blocks_per_chunk, t.shape[1]), dtype=torch.int8) for t in self._device
            ]
        else:  # rows of the region: a chunk's row holds every worker's pages of it, one view per tensor
            assert blocks_per_chunk == 1, "the shared region's views are chunk rows: one block per chunk"
            self._host = [region.create_next_worker_view(t.shape[1]) for t in self._device]
        self._groups = [sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs]
        #: each group's first data ref's tensor, whose row addresses vLLM 0.34's ``DevicePointers`` start with
        self._first_tensor = [kv_caches.tensors[refs[0].tensor_idx].tensor for refs in kv_caches.group_data_refs]
        self._blocks_per_chunk = blocks_per_chunk
        self._finished: deque[TransferResult] = deque()
        #: What ``get_finished`` passes its results through before vLLM reads them (tests/vllm/test_faults.py).
        self.alter: Callable[[list[TransferResult]], list[TransferResult]] | None = None

    def _gpu_blocks(self, gpu_spec: Any) -> tuple[Any, Any, list[int]]:
        """Each group's block count and first logical block, and the GPU block ids, of what the worker is handed:
        a ``GPULoadStoreSpec`` (vLLM < 0.34), or the ``DevicePointers`` vLLM 0.34 resolves from one (each group's
        rows, data ref by data ref: the first data ref's row addresses give the block ids back)."""
        if hasattr(gpu_spec, "group_sizes"):
            return gpu_spec.group_sizes, gpu_spec.block_indices, list(gpu_spec.block_ids)
        block_ids: list[int] = []
        offset = 0
        for tensors, size, refs in zip(
            self._first_tensor, gpu_spec.group_block_counts, gpu_spec.group_data_ref_counts, strict=True
        ):
            base, stride = tensors.data_ptr(), tensors.stride(0)
            block_ids += [(int(p) - base) // stride for p in gpu_spec.ptrs[offset : offset + size]]
            offset += size * refs
        return gpu_spec.group_block_counts, gpu_spec.block_indices, block_ids

    def _copy(self, job_id: int, gpu_spec: Any, chunk_ids: Any, to_host: bool) -> bool:
        """Copy each group's GPU blocks to or from the CPU chunks that follow on from the previous group's."""
        start = time.perf_counter()
        moved, block, chunks, bpc = 0, 0, list(chunk_ids), self._blocks_per_chunk
        group_sizes, block_indices, block_ids = self._gpu_blocks(gpu_spec)
        for tensors, size, first in zip(self._groups, group_sizes, block_indices, strict=True):
            skip = first % bpc  # a first GPU block in the middle of its CPU chunk
            group_chunks, chunks = chunks[: cdiv(size + skip, bpc)], chunks[cdiv(size + skip, bpc) :]
            rows = [c * bpc + i for c in group_chunks for i in range(bpc)][skip : skip + size]
            gpu_index = torch.as_tensor(block_ids[block : block + size], dtype=torch.long)
            host_index = torch.as_tensor(rows, dtype=torch.long)
            block += size
            for t in tensors:
                src, src_index, dst, dst_index = (
                    (self._device[t], gpu_index, self._host[t], host_index)
                    if to_host
                    else (self._host[t], host_index, self._device[t], gpu_index)
                )
                copied = src.index_select(0, src_index)
                dst.index_copy_(0, dst_index, copied)
                moved += copied.numel() * copied.element_size()
        self._finished.append(TransferResult(job_id, True, moved, time.perf_counter() - start))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """``src_spec``: the GPU blocks (a ``DevicePointers`` from vLLM 0.34: see :meth:`_gpu_blocks`)."""
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)  # vLLM's CPU spec: chunk ids
        return self._copy(job_id, src_spec, dst_spec.block_ids, to_host=True)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        """``expedited`` (vLLM >= 0.33): a sync load, waited for within the step; copies are synchronous anyway."""
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        return self._copy(job_id, dst_spec, src_spec.block_ids, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done = list(self._finished)
        self._finished.clear()
        return done if self.alter is None else self.alter(done)

    def wait(self, job_ids: set[int]) -> None:
        """Copies are synchronous: nothing to wait for."""


class HostCopySpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec (manager, chunk sizing, metrics) with :class:`HostCopyWorker` as its worker."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._host_worker: HostCopyWorker | None = None  # in place of vLLM's ``_worker`` (a CPUOffloadingWorker)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._host_worker is None:
            self._host_worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._host_worker


class HostCopyTieringSpec(TieringOffloadingSpec):
    """vLLM's tiering spec (its manager, CPU primary tier in the shared offload region, secondary tiers, metrics) with
    :class:`HostCopyWorker` over this worker's views of that region as its worker (one block per chunk)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._host_worker: HostCopyWorker | None = None
        self._worker_region: SharedOffloadRegion | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._host_worker is None:
            # the worker's side of the region, as vLLM's create_worker opens it
            self._worker_region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._host_worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, self._worker_region)
        return self._host_worker

    def release(self) -> None:
        """The worker lets go of its side of the region (the scheduler's ``manager.shutdown()`` lets go of the other,
        and of the region's file under /dev/shm)."""
        if self._host_worker is not None:
            self._host_worker._host.clear()  # its views of the region
            self._host_worker = None
        if self._worker_region is not None:
            self._worker_region.cleanup()
            self._worker_region = None
