"""SGLang's real HiCache classes on a CPU, for the SGLang tests and benchmarks (needs the sglang package).

Built from SGLang's own classes only (the pools, allocator, ``CacheInitParams`` and ``UnifiedRadixCache`` a scheduler
builds), never from SGLang's test kits, so the suite runs against any supported release (0.5.22 has no radix-cache
kit).

CPU shims, test-only, for the three GPU-only pieces the HiCache path touches (nothing else is replaced):

* ``pool_host.mha.transfer_kv_direct`` is a CUDA kernel op (sgl_kernel): replaced by the same index copy in torch;
* ``pool_host.common.ALLOC_MEMORY_FUNCS["cpu"]`` pins host memory with cudaHostRegister: replaced by a plain alloc;
* a host pool's ``pin_memory`` flag is cleared after ``init_hicache`` (in :func:`build_hicache`): the L3 read path
  allocates pinned scratch pages (``get_dummy_flat_data_page``), which needs a driver.

The transfers use ``hicache_io_backend="direct"`` with ``hicache_mem_layout="layer_first"``; the tree is SGLang's
Python TreeCore.
"""

from __future__ import annotations

import atexit
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _transfer_kv_direct(
    src_layers: list[Any], dst_layers: list[Any], src_indices: Any, dst_indices: Any, page_size: int = 1
) -> None:
    """What sgl_kernel's transfer_kv_direct does, in torch: copy the indexed token rows of every layer."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst.index_copy_(0, dst_indices.to(dst.device), src.index_select(0, src_indices.to(src.device)))


def _alloc_plain(
    dims: tuple[int, ...], dtype: Any, device: str, pin_memory: bool, allocator: Any, *_: Any, **__: Any
) -> Any:
    return allocator.allocate(dims, dtype=dtype, device=device)


def install_cpu_shims() -> Callable[[], None]:
    """Install the CPU shims; returns the function that puts SGLang's originals back."""
    import sglang.srt.mem_cache.pool_host.common as common
    import sglang.srt.mem_cache.pool_host.mha as mha

    saved = (getattr(mha, "transfer_kv_direct", None), common.ALLOC_MEMORY_FUNCS.get("cpu"))
    mha.transfer_kv_direct = _transfer_kv_direct
    common.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_plain

    def restore() -> None:
        mha.transfer_kv_direct, cpu_alloc = saved
        if cpu_alloc is None:
            common.ALLOC_MEMORY_FUNCS.pop("cpu", None)
        else:
            common.ALLOC_MEMORY_FUNCS["cpu"] = cpu_alloc

    return restore


#: The device KV pools of every cache built here (SGLang's defaults for a small test model).
HEAD_NUM, HEAD_DIM, MAX_REQUESTS, MAX_CONTEXT = 2, 64, 10, 512
SLIDING_WINDOW = 4  # the window of an SWA hybrid cache's sliding-window layers


def _build_tree(
    kv_size: int, page_size: int, num_layers: int, hybrid_swa: bool, max_context: int = MAX_CONTEXT
) -> tuple[Any, Any, Any]:
    """(UnifiedRadixCache, device allocator, req_to_token_pool) as a scheduler builds them, on the CPU."""
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    device, dtype = "cpu", torch.bfloat16
    req_to_token_pool = ReqToTokenPool(
        size=MAX_REQUESTS, max_context_len=max_context, device=device, enable_memory_saver=False
    )
    components: tuple[Any, ...] = (ComponentType.FULL,)
    if hybrid_swa:  # every other layer full attention, the rest sliding window
        full = list(range(1, num_layers, 2))
        kv_pool: Any = SWAKVPool(
            size=kv_size,
            size_swa=kv_size,
            page_size=page_size,
            dtype=dtype,
            head_num=HEAD_NUM,
            head_dim=HEAD_DIM,
            swa_attention_layer_ids=[i for i in range(num_layers) if i not in full],
            full_attention_layer_ids=full,
            device=device,
        )
        allocator: Any = SWATokenToKVPoolAllocator(
            size=kv_size,
            size_swa=kv_size,
            page_size=page_size,
            dtype=dtype,
            device=device,
            kvcache=kv_pool,
            need_sort=False,
        )
        components = (ComponentType.FULL, ComponentType.SWA)
    else:
        kv_pool = MHATokenToKVPool(
            size=kv_size,
            page_size=page_size,
            dtype=dtype,
            head_num=HEAD_NUM,
            head_dim=HEAD_DIM,
            layer_num=num_layers,
            device=device,
            enable_memory_saver=False,
        )
        allocator = TokenToKVPoolAllocator(size=kv_size, dtype=dtype, device=device, kvcache=kv_pool, need_sort=False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        sliding_window_size=SLIDING_WINDOW if hybrid_swa else None,
        tree_components=components,
        tree_core_backend="python",
    )
    cache = UnifiedRadixCache(params=params)
    cache.cache_init_params = params  # what init_hicache is given, as the scheduler gives it
    return cache, allocator, req_to_token_pool


def build_hicache(
    write_policy: str,
    *,
    metrics: Any = None,
    kv_size: int = 64,
    page_size: int = 1,
    num_layers: int = 2,
    storage_metrics: Any = None,
    hybrid_swa: bool = False,
    tp_group: Any = None,
    hicache_ratio: float = 2.0,
    max_context: int = MAX_CONTEXT,
) -> tuple[Any, Any, Any]:
    """A real UnifiedRadixCache with HiCache on a CPU (shims installed): (cache, device allocator, req_to_token_pool).

    ``metrics``: SGLang's own radix-cache collector, as ``--enable-metrics`` sets it. ``storage_metrics`` given: the
    cache also has SGLang's file L3 backend (``HiCacheFile``; call inside :func:`file_storage`) and reports to that
    StorageMetricsCollector. ``hybrid_swa``: a FULL + SWA hybrid cache (``HybridCacheController``, host pools ``kv``
    and ``swa``). ``tp_group``: a CPU (gloo) process group of the tensor-parallel ranks, as the scheduler passes its
    ``tp_cpu_group``: the cache agrees on completed acks across the ranks (see :func:`init_cpu_parallel`).
    ``hicache_ratio``: the host KV pool's size over the device pool's (``--hicache-ratio``); ``max_context``: the
    longest request in tokens."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    tp_size = 1
    if tp_group is not None:
        import torch.distributed as dist

        tp_size = dist.get_world_size(tp_group)
    storage = storage_metrics is not None
    server_args = ServerArgs(
        model_path="dummy",
        tp_size=tp_size,
        page_size=page_size,
        hicache_io_backend="direct",
        hicache_mem_layout="layer_first",
        hicache_write_policy=write_policy,
        hicache_ratio=hicache_ratio,
        hicache_storage_backend="file" if storage else None,
        hicache_storage_backend_extra_config=json.dumps({"prefetch_threshold": 1}) if storage else None,
    )
    set_global_server_args_for_scheduler(server_args)
    cache, allocator, req_to_token_pool = _build_tree(kv_size, page_size, num_layers, hybrid_swa, max_context)
    if tp_group is not None:
        cache.tp_group = cache.cache_init_params.tp_cache_group = tp_group
        cache.attn_tp_group = cache.cache_init_params.attn_tp_cache_group = tp_group
        cache.tp_world_size = tp_size
    cache.metrics_collector = metrics
    cache.init_hicache(server_args, cache.cache_init_params)
    atexit.unregister(cache.shutdown)  # init_hicache registers it; it would keep every test's cache until exit
    cc = cache.cache_controller
    for pool in (cc.mem_pool_host, getattr(cc, "storage_host_pool", None)):
        if pool is not None and hasattr(pool, "pin_memory"):
            pool.pin_memory = False
    if storage:
        # Host and device pools are sized equally here, which zeroes the prefetch capacity.
        cc.prefetch_capacity_limit = max(cc.prefetch_capacity_limit, cc.mem_pool_host.size)
        cache.enable_storage_metrics = True  # what --enable-metrics sets, with our collector (one per process)
        cache.storage_metrics_collector = storage_metrics
    return cache, allocator, req_to_token_pool


class FileStorage:
    """SGLang's file L3 backend rooted in one directory (see :func:`file_storage`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.caches: list[Any] = []

    def build(self, write_policy: str, storage_metrics: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
        built = build_hicache(write_policy, storage_metrics=storage_metrics, **kwargs)
        self.caches.append(built[0])
        return built

    def stored_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.directory.rglob("*") if f.is_file())


@contextmanager
def file_storage(directory: Path) -> Iterator[FileStorage]:
    """The file L3 backend in ``directory`` with a single-rank topology; the storage threads of every cache built
    through it are stopped on exit."""
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_parallel

    storage = FileStorage(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with (
        get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1),
        envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(str(directory)),
    ):
        try:
            yield storage
        finally:
            for cache in storage.caches:
                cache.cache_controller._stop_storage_threads()


def make_request(tokens: list[int], rid: str, retracted: bool = False) -> Any:
    """An SGLang ``Req`` for ``tokens`` (greedy, 4 new tokens), as the scheduler receives it."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=array("q", tokens),
        sampling_params=SamplingParams(temperature=0, max_new_tokens=4),
    )
    req.retracted_stain = retracted
    return req


def init_cpu_parallel(rank: int, world_size: int, init_method: str, **server_args: Any) -> Any:
    """Make this process tensor-parallel rank ``rank`` of ``world_size`` as an SGLang scheduler process is: publish
    the ranks (``run_scheduler_process``), join the WORLD over gloo and build SGLang's parallel groups. Returns the TP
    group's CPU process group. CPU shim: the groups get no NCCL / custom all-reduce communicators (they need CUDA)."""
    import sglang.srt.distributed.parallel_state as parallel_state
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    publish(
        ServerArgs(model_path="dummy", tp_size=world_size, **server_args),
        role="scheduler",
        ranks=SpawnRanks(world_rank=rank, dp_rank=None),
    )
    build = parallel_state.init_model_parallel_group
    cpu_only = {
        "use_pynccl": False,
        "use_custom_allreduce": False,
        "use_mscclpp": False,
        "use_torch_symm_mem_allreduce": False,
    }
    parallel_state.init_model_parallel_group = lambda *a, **k: build(*a, **{**k, **cpu_only})
    try:
        parallel_state.init_distributed_environment(
            backend="gloo", world_size=world_size, rank=rank, distributed_init_method=init_method, local_rank=rank
        )
        parallel_state.initialize_model_parallel(backend="gloo")
    finally:
        parallel_state.init_model_parallel_group = build
    return get_parallel().tp_group.cpu_group


def pump(cache: Any, done: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Run the scheduler's per-step HiCache event round until ``done()`` (the L3 threads work in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        cache.check_hicache_events()
        if done():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not finish within {timeout} s")
        time.sleep(0.005)
