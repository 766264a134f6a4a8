"""An SGLang HiCache program that knows nothing about OpenTelemetry (run by test_auto_instrumentation.py).

It builds SGLang 0.5.23's real UnifiedRadixCache on a CPU (conftest's shims), backs a prefix up to the host, evicts
it from the device and loads it back, and checks the bytes came back unchanged. Any telemetry it produces comes from
``opentelemetry-instrument`` loading our entry point.
"""

from __future__ import annotations

import sys
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import conftest as shims


def main() -> None:
    import sglang.srt.mem_cache.pool_host.common as common
    import sglang.srt.mem_cache.pool_host.mha as mha
    import sglang.test.kits.unified_radix_cache.fixtures as kit
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    mha.transfer_kv_direct, common.ALLOC_MEMORY_FUNCS["cpu"] = shims._transfer_kv_direct, shims._alloc_plain
    kit.get_device = lambda *_a, **_k: "cpu"

    cache, allocator, _ = shims.build_hicache("write_through", kv_size=64)
    kv = allocator.get_kvcache()
    tokens = list(range(1, 21))
    key = RadixKey(array("q", tokens))
    indices = allocator.alloc(len(tokens))
    marker = torch.arange(len(tokens), dtype=torch.float32).view(-1, 1, 1).expand(-1, kv.head_num, kv.head_dim)
    kv.get_key_buffer(0)[indices] = marker.to(kv.dtype)
    cache.insert(InsertParams(key=key, value=indices))
    cache.flush_pending_backups()
    cache.writing_check()  # device -> host backup done

    assert cache.evict(EvictParams(num_tokens=len(tokens))).num_tokens_evicted == len(tokens)
    match = cache.match_prefix(MatchPrefixParams(key=key))
    assert match.host_hit_length == len(tokens) and cache.load_back(match.best_match_node)
    cache.ready_to_load_host_cache()
    cache.loading_check()  # host -> device load back done

    match = cache.match_prefix(MatchPrefixParams(key=key))
    rows = cache.tree_core.collect_full_device_indices(match.last_device_node, cache.root_node_handle())
    assert torch.equal(kv.get_key_buffer(0)[rows], marker.to(kv.dtype)), "load back changed the bytes"
    print("round trip ok", flush=True)


if __name__ == "__main__":
    main()
