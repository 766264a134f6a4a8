"""``hicache.capacity.hit_ratio`` for SGLang HiCache: each admitted request's prefix lookup fed to the capacity
estimator (:mod:`otel_hicache.capacity`), page by page.

The access stream is what SGLang's prefill batches admit: every request a batch admits, once, read where SGLang builds
the batch's stats (``PrefillStats.from_adder``, wrapped once per batch: no wrapper runs per request) from the batch's
list, ``adder.can_run_list`` (a chunked request's later chunks, also in that list, are not admissions: a request is fed
the first time a batch lists it; a retracted request coming back is left out, as SGLang leaves it out of its own
per-tier counters). On the scheduler thread each admitted request's prompt (``origin_input_ids``) is handed over with
:meth:`~otel_hicache.capacity.CapacityFeed.put_ids`: exporting over OTLP, its ids are copied (SGLang's ``array('q')``:
one copy) into the id ring that only the export process maps, which computes the page keys and runs the estimator;
in-process, a reference is queued for the telemetry's host thread. The page keys are a chain of hashes per SGLang page
(:func:`otel_hicache.capacity.page_keys`, namespaced by the request's ``extra_key`` and ``cache_salt`` as SGLang's
``RadixKey`` is). No token id goes anywhere else (docs/architecture.md, "Token ids"); only the curve is exported.

What the model assumes of SGLang (``docs/sglang.md``):

* the device tier is an LRU over the radix tree's leaves, of the device KV pool's size
  (``token_to_kv_pool_allocator.size``, tokens): a request's pages are touched last page first, so a prefix outlives
  its extensions as a radix node outlives its children;
* the host tier, of the host KV pool's size (its ``hicache.pool.limit``, read at each collection), holds what the device
  holds under ``write_through`` (inclusive) and what the device evicted under ``write_back`` (exclusive,
  ``reclaims_copies``: SGLang frees the host copy of a page the device holds again, ``_update_duplicate_tracking`` in
  its tree core, so device and host are one LRU of their summed size). Under ``write_through_selective`` it holds only
  what the device hit twice (its backup threshold): not modelled, no host points, one info line;
* the storage tier (L3) is not modelled;
* the tree keeps KV only: a hybrid model's tree (sliding-window or mamba state beside the KV, ``is_swa_enabled`` /
  ``is_mamba_enabled``) gets no curve, with one info line;
* one SGLang page is one model page; a prompt's last page counts as a possible hit (SGLang recomputes a prompt's
  last token: off by one page for a prompt repeated exactly).

Like every token-counted instrument, the curve is reported by one rank of each attention-TP group
(:func:`~.instrumentor.reports_tokens`): every rank admits the same requests.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

from otel_hicache.capacity import CapacityFeed, TierCapacity, page_keys
from otel_hicache.integrations._base import CapacityFeeder, inform_once
from otel_hicache.semconv import METRIC_CAPACITY_HIT_RATIO, Tier

_WRITE_BACK = "write_back"
#: Host write policies the model does not follow, and what the host then holds.
_HOST_UNMODELLED = {"write_through_selective": "twice (its backup threshold)"}
#: A hybrid model's tree: (the state it keeps beside the KV, the tree's flag for it).
_HYBRID = (("swa", "is_swa_enabled"), ("mamba", "is_mamba_enabled"))
#: Marks a request some batch has listed (on SGLang's ``Req``, which goes when the request does).
_SEEN = "_otel_hicache_admitted"


class CapacityHooks(CapacityFeeder):
    """What each prefill batch admitted, read from its list once per batch, fed to the process's capacity estimator
    (one per process: one scheduler, one tree)."""

    def admissions(self, adder: Any) -> list[Any]:
        """The requests ``adder``'s batch admitted (scheduler thread, once per batch): its list less those an earlier
        batch listed (a chunked request's next chunk: the same ``Req``, marked when first seen; a new ``Req`` reusing
        a finished one's rid is a new admission); each that is not a retracted one coming back is fed to the
        estimator."""
        admitted = []
        for req in adder.can_run_list:
            if not getattr(req, _SEEN, False):
                setattr(req, _SEEN, True)
                admitted.append(req)
        if admitted:
            feed = self.feed(adder)
            if feed is not None:
                for req in admitted:
                    if not req.retracted_stain:
                        ids = req.origin_input_ids
                        feed.put_ids(ids, len(ids), namespace_seed(req))
        return admitted

    def _feed_for(self, adder: Any) -> CapacityFeed | None:
        """At the first admission: the estimator over this scheduler's tree, its tiers read from SGLang's pools;
        none where the process reports no tokens, the tree has no HiCache or is a hybrid model's."""
        ranks = self._ranks
        telemetry = self._sink()
        cache = adder.tree_cache
        controller = getattr(cache, "cache_controller", None)
        if telemetry is None or controller is None or (ranks is not None and not ranks().token_metrics):
            return None
        hybrid = [kind for kind, flag in _HYBRID if getattr(cache, flag, False)]
        if hybrid:  # its state pools hold and evict by rules of their own, which one LRU of KV pages does not model
            message = "otel_hicache: SGLang's radix tree keeps %s state beside its KV (a hybrid model); %s models a KV "
            message += "tree: no points."
            inform_once("capacity-hybrid", message, " and ".join(hybrid), METRIC_CAPACITY_HIT_RATIO)
            return None
        policy = controller.write_policy
        write_back = policy == _WRITE_BACK
        tiers = [TierCapacity(Tier.DEVICE, int(adder.token_to_kv_pool_allocator.size))]
        if policy in _HOST_UNMODELLED:  # the device tier holds what it holds whatever the host keeps
            message = "otel_hicache: SGLang's host tier under %s holds only what the device hit %s; %s does not model "
            message += "it: no host points."
            inform_once(
                f"capacity-policy:{policy}", message, policy, _HOST_UNMODELLED[policy], METRIC_CAPACITY_HIT_RATIO
            )
        else:
            tiers.append(TierCapacity(Tier.HOST, None, inclusive=not write_back, reclaims_copies=write_back))
        page = int(cache.page_size)
        return telemetry.capacity_feed(page, tiers)


def namespace_seed(req: Any) -> int:
    """The seed of ``req``'s page keys: the namespace SGLang's radix tree keys its prompt in (``extra_key``,
    ``cache_salt``; 0 for none)."""
    namespace = (getattr(req, "extra_key", None), getattr(req, "cache_salt", None))
    return 0 if namespace == (None, None) else hash(namespace)


def request_keys(req: Any, page_tokens: int) -> Iterable[Hashable]:
    """The keys of ``req``'s full prompt pages, lazily (the estimator reads them a piece at a time): a hash chain over
    its token ids per page, seeded by its namespace (:func:`namespace_seed`): what the estimator keys the ids
    :meth:`~otel_hicache.capacity.CapacityFeed.put_ids` hands it by, in either process."""
    return page_keys(req.origin_input_ids, page_tokens, namespace_seed(req))
