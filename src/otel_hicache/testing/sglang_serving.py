"""Serve prompts through SGLang's real HiCache classes on a CPU, one request at a time, the way its scheduler admits,
prefills and releases them: what the capacity tests re-run at other tier sizes, and what the benchmarks time.

Each prompt goes through SGLang's own path (nothing is replaced beyond the CPU shims of :mod:`.sglang`): the prefix
match (``Req.init_next_round_input``), the admission (``PrefillAdder.add_one_req``, which starts the load back of a
host hit), the KV allocation of the rest with eviction (``alloc_token_slots``), and the release that inserts the
prompt into the tree (``release_kv_cache``, write-through backups included); then the per-step HiCache event round.
No model runs: the request ends at its prefill (no output tokens), so the tree holds exactly the prompts served.

The tier split of every admission is SGLang's own (the adder's ``log_*_hit_tokens``, what
``sglang:prefill_effective_tokens_total`` counts).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from otel_hicache.records import PrefixSplit
from otel_hicache.testing.sglang import build_hicache, make_request, pump


class Served:
    """A real UnifiedRadixCache with HiCache (built by :func:`~.sglang.build_hicache`) serving prompts one by one;
    :attr:`split` sums SGLang's own tier split of every admission."""

    def __init__(
        self,
        write_policy: str,
        device_tokens: int,
        host_tokens: int,
        page_size: int = 1,
        max_context: int = 4096,
        hybrid_swa: bool = False,
    ) -> None:
        """``host_tokens``: the host pool's size as SGLang sizes it from ``--hicache-ratio`` (rounded to pages, plus
        its padding page); ``max_context``: the longest prompt; ``hybrid_swa``: a hybrid model's tree, sliding-window
        layers beside full attention (an SWA pool beside the KV pool)."""
        self.cache, self.allocator, self.req_to_token_pool = build_hicache(
            write_policy,
            kv_size=device_tokens,
            page_size=page_size,
            hicache_ratio=host_tokens / device_tokens,
            max_context=max_context,
            hybrid_swa=hybrid_swa,
            num_layers=4 if hybrid_swa else 2,
        )
        self.split = PrefixSplit(0, 0, 0, 0)
        self._served = 0

    def serve(self, prompts: Iterable[Sequence[int]]) -> PrefixSplit:
        """Serve each prompt (token ids) in turn; returns the tier split of these admissions."""
        before = self.split
        for tokens in prompts:
            self._one(tokens)
        return PrefixSplit(*(now - then for now, then in zip(self.split, before, strict=True)))

    def _one(self, tokens: Sequence[int]) -> None:
        import torch
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
        from sglang.srt.managers.scheduler_components.metrics_reporter import PrefillStats
        from sglang.srt.mem_cache.allocation import alloc_token_slots
        from sglang.srt.mem_cache.common import release_kv_cache

        cache, pool = self.cache, self.req_to_token_pool
        req = make_request(list(tokens), f"served-{self._served}")
        self._served += 1
        req.init_next_round_input(cache)
        adder: Any = PrefillAdder(cache.page_size, cache, self.allocator, None, 1.0, 1 << 20, None)
        added = adder.add_one_req(req, False, None)
        if added is not AddReqResult.CONTINUE:
            raise RuntimeError(f"SGLang did not admit a prompt of {len(tokens)} tokens: {added}")
        PrefillStats.from_adder(adder, running_reqs=[])  # the batch's stats, as the scheduler builds them
        self.split = PrefixSplit(
            self.split.input_tokens + adder.log_input_tokens,
            self.split.device_hit + adder.log_device_hit_tokens,
            self.split.host_hit + adder.log_host_hit_tokens,
            self.split.storage_hit + adder.log_storage_hit_tokens,
        )
        cache.ready_to_load_host_cache()  # the batch's load backs, as the forward pass would start them
        pump(cache, lambda: not cache.cache_controller.ack_load_queue, "load back")
        pool.alloc([req])
        row = pool.req_to_token[req.kv.req_pool_idx]
        if req.prefix_len:
            row[: req.prefix_len] = cache.prefix_device_indices(req)
        row[req.prefix_len : len(tokens)] = alloc_token_slots(cache, len(tokens) - req.prefix_len).to(torch.int32)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = len(tokens)
        req.finished_reason = FINISH_LENGTH(length=0)
        release_kv_cache(req, cache, checkpoint=True)
        cache.check_hicache_events()

    def close(self) -> None:
        """Let every backup finish and stop the controller's threads."""
        cache = self.cache
        cache.flush_pending_backups()
        pump(cache, lambda: not cache.ongoing_write_through, "backups")
        cache.cache_controller._stop_storage_threads()
