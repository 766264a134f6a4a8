"""vLLM's names: which modules the adapter patches and how vLLM's ``vllm:kv_offload_*`` series map onto ours.

The core vocabulary (:mod:`otel_hicache.semconv`) is engine-neutral; what only vLLM spells lives here. vLLM's
transfer types map onto operations (``GPU_to_CPU`` = ``backup``, ``CPU_to_GPU`` = ``load_back``), its CPU tier onto
tier ``host``, and its blocks onto tokens (GPU blocks x tokens per block) of the pool of their KV cache group's kind
(:data:`GROUP_POOLS`).
"""

from __future__ import annotations

from typing import Final

#: The entry-point name of the instrumentor and of the ``vllm.general_plugins`` plugin; naming it in
#: ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` turns both off.
ENTRY_POINT: Final = "vllm_kv_offload"

#: The pool of a KV cache group, by vLLM's kind of its spec (``vllm.v1.kv_cache_interface.get_kv_cache_spec_kind``).
#: A kind not listed here is reported under its own name, which the core counts as pool ``other`` (with a one-time
#: warning and ``otel_hicache.records.normalized``).
GROUP_POOLS: Final[dict[str, str]] = {
    "full_attention": "kv",
    "mla_attention": "kv",
    "sink_full_attention": "kv",
    "sliding_window": "swa",
    "sliding_window_mla": "swa",
    "chunked_local_attention": "swa",
    "mamba": "mamba",
}
#: An EAGLE / MTP draft group's pool, whatever its kind; a HiSparse indexer group's (role ``hisparse_indexer``).
DRAFT_POOL: Final = "draft"
INDEXER_POOL: Final = "indexer"
INDEXER_ROLE: Final = "hisparse_indexer"


def group_pool(kind: str, is_eagle_group: bool, role: str) -> str:
    """The pool a KV cache group's tokens are counted in."""
    if is_eagle_group:
        return DRAFT_POOL
    if role == INDEXER_ROLE:
        return INDEXER_POOL
    return GROUP_POOLS.get(kind, kind)


#: The attribute of vLLM's connector metadata that carries, per job, the context of the request span it serves
#: (trace id, span id, flags) from the scheduler to the workers (see :mod:`.per_request`).
LINKS: Final = "_otel_hicache_links"
#: The attribute of vLLM's worker metadata (``OffloadingWorkerMetadata``) that carries, per request, how long the
#: workers' ``start_kv_transfers`` waited for its sync load (seconds; the slowest worker's), back to the scheduler.
SYNC_WAITS: Final = "_otel_hicache_sync_waits"

#: vLLM's own allocation-failure counter (``OffloadingConnectorStats`` key): each increment is one store that found
#: no room in the CPU tier.
ALLOCATION_FAILURE: Final = "vllm:kv_offload_allocation_failure"

#: Every vLLM series the adapter reproduces (its ``vllm:kv_offload_*`` transfers and failures, its prompt tokens by
#: source) and the otel_hicache series that carries the same quantity (Prometheus names, as the Collector's
#: ``prometheus`` exporter writes ours). vLLM sums bytes and time over the workers of an engine; ours are per worker
#: (Resource ``hicache.rank.*``): sum them to compare.
VLLM_SERIES: Final[tuple[tuple[str, str], ...]] = (
    ("vllm:kv_offload_store_bytes", 'hicache_transfer_size_bytes_total{hicache_operation="backup"}'),
    ("vllm:kv_offload_store_time", 'hicache_transfer_duration_seconds_sum{hicache_operation="backup"}'),
    ("vllm:kv_offload_store_size", 'hicache_transfer_duration_seconds_count{hicache_operation="backup"}'),
    ("vllm:kv_offload_load_bytes", 'hicache_transfer_size_bytes_total{hicache_operation="load_back"}'),
    ("vllm:kv_offload_load_time", 'hicache_transfer_duration_seconds_sum{hicache_operation="load_back"}'),
    ("vllm:kv_offload_load_size", 'hicache_transfer_duration_seconds_count{hicache_operation="load_back"}'),
    (
        'vllm:kv_offload_total_bytes{transfer_type="GPU_to_CPU"}',
        'hicache_transfer_size_bytes_total{hicache_operation="backup"}',
    ),
    (
        'vllm:kv_offload_total_bytes{transfer_type="CPU_to_GPU"}',
        'hicache_transfer_size_bytes_total{hicache_operation="load_back"}',
    ),
    (
        'vllm:kv_offload_total_time{transfer_type="GPU_to_CPU"}',
        'hicache_transfer_duration_seconds_sum{hicache_operation="backup"}',
    ),
    (
        'vllm:kv_offload_total_time{transfer_type="CPU_to_GPU"}',
        'hicache_transfer_duration_seconds_sum{hicache_operation="load_back"}',
    ),
    (ALLOCATION_FAILURE, 'hicache_transfer_failures_total{hicache_operation="backup",error_type="host_pool_full"}'),
    (
        'vllm:prompt_tokens_by_source{source="local_compute"}',
        'hicache_prefill_tokens_total{hicache_prefill_mode="input"}',
    ),
    (
        'vllm:prompt_tokens_by_source{source="local_cache_hit"}',
        'hicache_prefill_tokens_total{hicache_prefill_mode="device_hit"}',
    ),
    (
        'vllm:prompt_tokens_cached_by_source{source="host"}',
        'hicache_prefill_tokens_total{hicache_prefill_mode="host_hit"}',
    ),
    (
        'vllm:prompt_tokens_cached_by_source{source="disk"}',
        'hicache_prefill_tokens_total{hicache_prefill_mode="storage_hit"}',
    ),
)
