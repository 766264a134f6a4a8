"""SGLang's names: its pool names beyond the core's and how its ``sglang:*`` HiCache series map onto ours.

The core vocabulary (:mod:`otel_hicache.semconv`) is engine-neutral; what only SGLang spells lives here.
"""

from __future__ import annotations

from typing import Final

#: The name of both entry points (``opentelemetry_instrumentor`` and ``sglang.srt.plugins``): listing it in
#: ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` turns both routes off.
ENTRY_POINT: Final = "sglang_hicache"

#: SGLang 0.5.23's ``PoolName`` values that are not core pool kinds (:data:`otel_hicache.semconv.POOLS`): the
#: instrumentor passes them to ``HiCacheTelemetry(extra_pools=...)`` so they are counted under their own name.
SGLANG_POOLS: Final[tuple[str, ...]] = (
    "auxiliary_swa",
    "deepseek_v4_c1",
    "deepseek_v4_c1_indexer",
    "deepseek_v4_c1_indexer_scale",
    "deepseek_v4_c2",
    "deepseek_v4_c2_indexer",
    "deepseek_v4_c2_indexer_scale",
    "deepseek_v4_c4",
    "deepseek_v4_c4_indexer",
    "deepseek_v4_c4_indexer_scale",
    "deepseek_v4_c128",
    "deepseek_v4_c4_rope",
    "deepseek_v4_c128_rope",
    "deepseek_v4_c4_state",
    "deepseek_v4_c4_indexer_state",
    "deepseek_v4_c128_state",
    "draft_indexer",
    "draft_swa",
)
#: Every ``sglang:*`` HiCache series and the otel_hicache series that carries the same quantity. Prometheus names
#: are what the Collector's ``prometheus`` exporter produces from our OTel names.
SGLANG_SERIES: Final[tuple[tuple[str, str], ...]] = (
    (
        "sglang:hicache_backup_tokens_total{pool}",
        'hicache_transfer_tokens_total{hicache_operation="backup",hicache_pool}',
    ),
    ("sglang:hicache_backup_bytes_total", 'hicache_transfer_size_bytes_total{hicache_operation="backup"}'),
    ("sglang:hicache_backup_duration_seconds", 'hicache_transfer_duration_seconds{hicache_operation="backup"}'),
    (
        "sglang:load_back_tokens_total{pool}",
        'hicache_transfer_tokens_total{hicache_operation="load_back",hicache_pool}',
    ),
    ("sglang:load_back_bytes_total", 'hicache_transfer_size_bytes_total{hicache_operation="load_back"}'),
    ("sglang:load_back_duration_seconds", 'hicache_transfer_duration_seconds{hicache_operation="load_back"}'),
    (
        "sglang:hicache_dropped_tokens_total{reason,pool}",
        "hicache_dropped_tokens_total{hicache_drop_reason,hicache_pool}",
    ),
    ("sglang:evicted_tokens_total", 'hicache_eviction_tokens_total{hicache_tier="device"}'),
    ("sglang:eviction_duration_seconds", 'hicache_eviction_duration_seconds{hicache_tier="device"}'),
    ("sglang:prefill_effective_tokens_total{mode}", "hicache_prefill_tokens_total{hicache_prefill_mode}"),
    ("sglang:hicache_host_used_tokens", 'hicache_pool_usage{hicache_tier="host",hicache_slot_state="used"}'),
    ("sglang:hicache_host_total_tokens", 'hicache_pool_limit{hicache_tier="host"}'),
    ("sglang:prefetched_tokens_total", 'hicache_transfer_tokens_total{hicache_operation="storage_prefetch"}'),
    ("sglang:backuped_tokens_total", 'hicache_transfer_tokens_total{hicache_operation="storage_backup"}'),
)
