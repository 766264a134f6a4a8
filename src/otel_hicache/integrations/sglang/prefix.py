"""The cached-prefix split by tier as SGLang 0.5.23 computes it, for producers that hold SGLang-style match lengths.

SGLang's own admission counters already carry a batch's split (the instrumentor counts those); the instrumentor puts a
traced request's own split on its span with these helpers, which also serve an engine built on SGLang's radix-cache
shapes that wants the same ``device / host / storage`` attribution.

    >>> split_cached_prefix_by_tier(100, host_hit_len=40, storage_hit_len=10)
    (60, 30, 10)
    >>> prefix_split(120, prefix_len=100, host_hit_len=40, storage_hit_len=10)
    PrefixSplit(input_tokens=20, device_hit=60, host_hit=30, storage_hit=10)
"""

from __future__ import annotations

from typing import Any

from otel_hicache.records import PrefixSplit


def split_cached_prefix_by_tier(
    prefix_len: int,
    host_hit_len: int,
    storage_hit_len: int,
    storage_hit_start: int | None = None,
    host_hit_is_storage: bool = False,
) -> tuple[int, int, int]:
    """Split a request's cached prefix into ``(device, host, storage)`` hit tokens, as SGLang 0.5.23 does.

    ``host_hit_len`` is the materialized host hit (the tail of the prefix that came from host memory). Without
    ``storage_hit_start`` the storage hit is the part of the host hit that came from L3; with it, the storage hit is
    the span ``[storage_hit_start, storage_hit_start + storage_hit_len)`` clipped to the prefix. When
    ``host_hit_is_storage`` (host memory used only as L3 staging), all of the host hit is a storage hit.
    The three parts always add up to ``prefix_len``.
    """
    host_hit_len = min(prefix_len, host_hit_len)
    host_start = prefix_len - host_hit_len
    if storage_hit_start is None:
        if host_hit_is_storage:
            storage, host = host_hit_len, 0
        else:
            storage = min(host_hit_len, storage_hit_len)
            host = host_hit_len - storage
    else:
        storage_end = storage_hit_start + storage_hit_len
        storage = max(0, min(prefix_len, storage_end) - max(0, storage_hit_start))
        storage_in_host = max(0, min(prefix_len, storage_end) - max(host_start, storage_hit_start))
        host = 0 if host_hit_is_storage else host_hit_len - storage_in_host
    device = prefix_len - host - storage
    return device, host, storage


def prefix_split(
    input_len: int,
    prefix_len: int,
    host_hit_len: int,
    storage_hit_len: int = 0,
    storage_hit_start: int | None = None,
    host_hit_is_storage: bool = False,
) -> PrefixSplit:
    """A :class:`PrefixSplit` for a request of ``input_len`` tokens whose first ``prefix_len`` were cached."""
    device, host, storage = split_cached_prefix_by_tier(
        prefix_len, host_hit_len, storage_hit_len, storage_hit_start, host_hit_is_storage
    )
    return PrefixSplit(input_tokens=input_len - prefix_len, device_hit=device, host_hit=host, storage_hit=storage)


def request_split(req: Any) -> PrefixSplit:
    """A request's own split at its admission, as SGLang's adder counts it (``_update_prefill_budget`` and
    ``_account_prefill_cache_admission``): the input it runs (``extend_end - prefix_len``: a chunked request's first
    chunk) and its cached prefix by tier (:func:`prefix_split`, SGLang's ``split_cached_prefix_by_tier``)."""
    if req.prefix_len <= 0:
        return PrefixSplit(req.extend_end - req.prefix_len, 0, 0, 0)
    return prefix_split(
        req.extend_end,
        req.prefix_len,
        host_hit_len=req.materialized_host_hit_len(),
        storage_hit_len=req.storage_hit_length,
        storage_hit_start=req.storage_hit_start,
        host_hit_is_storage=req.host_hit_is_storage,
    )
