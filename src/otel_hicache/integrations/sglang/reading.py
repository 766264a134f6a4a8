"""What the wrappers read from SGLang's own objects: a request's span, the prefill adder's counters, the host pool's
occupancy and bytes per token, a drop's arguments. Reads only; nothing here changes SGLang's state."""

from __future__ import annotations

import re
from typing import Any, cast

from opentelemetry.trace import Span

from otel_hicache.records import PoolUsage
from otel_hicache.semconv import DEFAULT_POOL, DropReason, Tier

#: The prefill adder's counters we know, by prefill mode (SGLang counts each admission's tokens into them).
_KNOWN_HITS = frozenset({"log_device_hit_tokens", "log_host_hit_tokens", "log_storage_hit_tokens"})
_HIT_COUNTER = re.compile(r"log_\w+_hit_tokens")


def request_span(req: Any) -> Span | None:
    """The span SGLang's request tracing keeps for ``req`` in this (scheduler) process, or None with tracing off."""
    try:
        trace_ctx = req.time_stats.trace_ctx
        if getattr(trace_ctx, "tracing_enable", False) is not True:  # TraceNullContext answers every attribute
            return None
        thread_context = trace_ctx.thread_context
        span = None if thread_context is None else thread_context.thread_span
        return span if span is not None and span.is_recording() else None
    except Exception:  # not a traced SGLang request: no link
        return None


def drop_arguments(dropped_tokens: int, reason: str) -> tuple[int, DropReason]:
    """``_record_dropped_tokens(dropped_tokens, reason)``'s arguments, as given by name or position."""
    # a reason this release added is counted by the core as "other" (and noted), every time
    return int(dropped_tokens), cast(DropReason, str(reason))


#: (adder class, how many attributes the adder has) -> the hit counters among them we do not know. SGLang adds an
#: adder's attributes and never takes one away: a counter it adds (or a renamed one) changes the count and is found
#: then, and the names are not searched at every admission.
_UNKNOWN_HITS: dict[tuple[type, int], tuple[str, ...]] = {}


#: (input, device, host, storage, other hit tokens)
PrefillCounts = tuple[int, int, int, int, int]


def prefill_counts(adder: Any) -> PrefillCounts:
    """(input, device, host, storage, other hit tokens) the adder has counted. A hit counter SGLang added (or
    renamed: the known one then reads 0) is summed into ``other``."""
    counters = adder.__dict__
    shape = (type(adder), len(counters))
    unknown = _UNKNOWN_HITS.get(shape)
    if unknown is None:
        unknown = _UNKNOWN_HITS[shape] = tuple(
            name
            for name, value in counters.items()
            if name not in _KNOWN_HITS and type(value) is int and _HIT_COUNTER.fullmatch(name)
        )
    return (
        adder.log_input_tokens - getattr(adder, "reprocessed_log_input_tokens", 0),
        getattr(adder, "log_device_hit_tokens", 0),
        getattr(adder, "log_host_hit_tokens", 0),
        getattr(adder, "log_storage_hit_tokens", 0),
        sum(getattr(adder, name, 0) for name in unknown) if unknown else 0,
    )


def host_pool_usage(cache: Any) -> list[PoolUsage]:
    """Host KV pool occupancy as SGLang's scheduler computes it (logical size minus available)."""
    pool = getattr(cache, "token_to_kv_pool_host", None) or getattr(cache, "full_kv_pool_host", None)
    if pool is None:
        return []
    total = pool.logical_size
    return [PoolUsage(tier=Tier.HOST, pool=DEFAULT_POOL, used=total - pool.available_size(), limit=total)]


def size_per_token(pool: Any) -> int:
    """Bytes per token of a host pool; 0 where the pool does not say (a pool group)."""
    size = getattr(pool, "size_per_token", 0)
    return size if isinstance(size, int) and size > 0 else 0
