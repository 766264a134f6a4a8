"""``hicache.capacity.hit_ratio`` for vLLM: each admitted request's prefix lookup fed to the capacity estimator
(:mod:`otel_hicache.capacity`), block by block, in the scheduler (engine-core) process.

The access stream is what vLLM's scheduler admits after a prefix-cache lookup: ``KVCacheManager.
record_prefix_cache_stats(request, num_hits)``, which vLLM calls once per admission that looked the cache up (a
request preempted and resumed is left out, as vLLM's own prefill statistics leave it out). The keys are vLLM's own
block hashes (``Request.block_hashes``, a digest of each full block's prefix): on the scheduler thread the wrapper
hands them over with the prompt's length (:meth:`~otel_hicache.capacity.CapacityFeed.put_hashes`). Exporting over
OTLP they are joined into the id ring (one ``bytes`` copy) and the export process runs the estimator; otherwise the
telemetry's host thread reads them from a reference to vLLM's list. No hash leaves our processes; only the curve
does.

What the model assumes of vLLM (``docs/vllm.md``):

* the device tier is vLLM's GPU prefix cache, an LRU over its free blocks (a finished request's blocks are freed last
  block first, so a prefix outlives its extensions), of ``num_gpu_blocks - 1`` blocks (the null block excluded), for
  a KV cache of one group (full attention; a hybrid model's groups are not modelled: no curve, one info line);
* the host tier is the CPU offloading tier, of its size in chunks (its ``hicache.pool.limit``, read at each
  collection), inclusive: vLLM offers every full block of every request to it, and its LRU (the CPU spec's default
  ``eviction_policy``) touches a request's chunks last chunk first when the request finishes. A CPU tier of another
  policy (``arc``, an out-of-tree one) is not modelled: the curve has no host points, with one info line (the device
  tier is still predicted: it holds what it holds whatever the CPU tier keeps);
* a prompt's last full block counts as a possible hit (vLLM recomputes a prompt's last token: off by one block for a
  prompt repeated exactly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from otel_hicache.capacity import CapacityFeed, TierCapacity
from otel_hicache.integrations._base import AdmissionHooks, ProcessSink, Ranks, Target, inform_once
from otel_hicache.semconv import METRIC_CAPACITY_HIT_RATIO, Tier

#: The CPU tier's eviction policy the model follows (vLLM's default).
MODELLED_POLICY = "lru"

#: The admission the estimator is fed from (wrapped by :meth:`CapacityHooks.admitted`).
CAPACITY_TARGET = Target(
    "vllm.v1.core.kv_cache_manager", "KVCacheManager", "record_prefix_cache_stats", ("request", "num_hits")
)


class CapacityHooks(AdmissionHooks):
    """The wrapper of vLLM's prefix-cache admission (``KVCacheManager.record_prefix_cache_stats(request,
    num_hits)``) feeding the engine core's capacity estimator: the request's block hashes are handed over.
    ``cpu_tier_policies()``: the eviction policies of the CPU tiers built (:meth:`.cpu_tier.CpuTierHooks.policies`)."""

    def __init__(
        self, sink: ProcessSink, ranks: Callable[[Any], Ranks], cpu_tier_policies: Callable[[], set[str]]
    ) -> None:
        super().__init__(sink, ranks)
        self._cpu_tier_policies = cpu_tier_policies

    def _payload(self, args: tuple, kwargs: dict) -> tuple[list[bytes], int] | None:
        request = args[0] if args else kwargs["request"]
        return None if request.num_preemptions else (request.block_hashes, request.num_prompt_tokens)

    def _feed_for(self, manager: Any) -> CapacityFeed | None:
        """At the first admission: the estimator over this scheduler's KV cache; none where the cache does not keep
        prefixes or has several KV cache groups."""
        groups = manager.kv_cache_config.kv_cache_groups
        telemetry = self._sink(None)
        if telemetry is None or not manager.enable_caching:
            return None
        if len(groups) != 1:  # a hybrid model: each group keeps and evicts its own blocks, which one LRU does not model
            message = "otel_hicache: vLLM's KV cache has %d KV cache groups (a hybrid model); %s models one: no points."
            inform_once("capacity-groups", message, len(groups), METRIC_CAPACITY_HIT_RATIO)
            return None
        block_tokens = int(groups[0].kv_cache_spec.block_size)
        tiers = [TierCapacity(Tier.DEVICE, (int(manager.block_pool.num_gpu_blocks) - 1) * block_tokens)]
        unmodelled = sorted(self._cpu_tier_policies() - {MODELLED_POLICY})
        if unmodelled:
            message = "otel_hicache: vLLM's CPU tier evicts by %s; %s models %r only: no points for the host tier."
            args = (", ".join(repr(p) for p in unmodelled), METRIC_CAPACITY_HIT_RATIO, MODELLED_POLICY)
            inform_once(f"capacity-policy:{unmodelled}", message, *args)
        else:
            tiers.append(TierCapacity(Tier.HOST, None))  # the CPU tier's reading, where there is one
        return telemetry.capacity_feed(block_tokens, tiers)
