"""An SGLang HiCache program that knows nothing about OpenTelemetry (run by test_auto_instrumentation.py).

It builds SGLang 0.5.23's real UnifiedRadixCache on a CPU (the shims of otel_hicache.testing.sglang), backs a prefix
up to the host, evicts it from the device and loads it back, and checks the bytes came back unchanged. Any telemetry it
produces comes from ``opentelemetry-instrument`` loading our entry point, which patches SGLang as the app imports it.
"""

from __future__ import annotations

from array import array


def main() -> None:
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from otel_hicache.testing.sglang import build_hicache, install_cpu_shims

    install_cpu_shims()
    cache, allocator, _ = build_hicache("write_through", kv_size=64)
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
