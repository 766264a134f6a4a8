"""Device and host KV pools: one layer-first buffer per pool kind and tier, allocated in pages.

A *pool kind* (``kv``, ``swa``, ``mamba``, ``draft`` ...) has its own bytes per slot and layer count. Per-token pools
hold one slot per token; a ``per_node`` pool (mamba) holds one state slot per tree node. A *sidecar* pool
(``sidecar_of="kv"``, e.g. the draft model's KV piggybacking on the target's) has its own buffer but reuses the
indices of the pool it rides, so it owns no allocator: exactly SGLang's ``indices_from_pool``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from otel_hicache.records import PoolUsage
from otel_hicache.semconv import POOLS, Tier

#: A node's value on one tier: page ids per owning pool (a per-node pool may be absent).
Value = dict[str, list[int]]


@dataclass(frozen=True)
class PoolSpec:
    """Shape of one pool kind: ``layers x slots x width`` elements of ``dtype`` on each tier."""

    name: str
    layers: int
    heads: int
    head_dim: int
    kv: bool = True  # K and V halves; False for a single state buffer (mamba)
    dtype: torch.dtype = torch.float16
    sidecar_of: str | None = None  # reuses that pool's indices (draft piggyback); counted in bytes only
    per_node: bool = False  # one state slot per tree node instead of one slot per token

    def __post_init__(self) -> None:
        if self.name not in POOLS:
            raise ValueError(f"pool name {self.name!r} is not one of semconv.POOLS")
        if min(self.layers, self.heads, self.head_dim) < 1:
            raise ValueError(f"pool {self.name!r}: layers, heads and head_dim must be >= 1")
        if self.sidecar_of is not None and self.per_node:
            raise ValueError(f"pool {self.name!r}: a sidecar cannot be per-node")

    @property
    def width(self) -> int:
        return (2 if self.kv else 1) * self.heads * self.head_dim

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one token (one state for a per-node pool) over all layers, like SGLang's size_per_token."""
        return self.layers * self.width * torch.empty((), dtype=self.dtype).element_size()


class PagePool:
    """One pool kind on one tier: the buffer, and (unless a sidecar) a free list of pages."""

    def __init__(self, spec: PoolSpec, tier: Tier, num_pages: int, page_size: int, device: torch.device) -> None:
        if num_pages < 1:
            raise ValueError(f"{tier.value} pool {spec.name!r} needs at least one page")
        self.spec, self.tier, self.page_size, self.num_pages = spec, tier, page_size, num_pages
        pin = tier is Tier.HOST and torch.cuda.is_available()  # pinned host memory makes D<->H copies async
        self.buffer = torch.zeros(
            (spec.layers, num_pages * page_size, spec.width), dtype=spec.dtype, device=device, pin_memory=pin
        )
        # Pop from the end: lowest page ids first, so fresh allocations tend to be contiguous runs.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_slots(self) -> int:
        return len(self._free) * self.page_size

    def alloc(self, num_pages: int) -> list[int] | None:
        """``num_pages`` page ids, or None (nothing taken) when the pool cannot hold them."""
        free = self._free
        if num_pages > len(free):
            return None
        if num_pages == 0:
            return []
        pages = free[-num_pages:]
        del free[-num_pages:]
        pages.reverse()
        return pages

    def free(self, pages: Iterable[int]) -> None:
        self._free.extend(pages)

    def page_view(self, page: int) -> torch.Tensor:
        """``layers x page_size x width`` view of one page."""
        start = page * self.page_size
        return self.buffer[:, start : start + self.page_size]


class PoolGroup:
    """All pool kinds of one tier. Per-token pools share ``page_size``; per-node pools use pages of one slot."""

    def __init__(
        self,
        tier: Tier,
        specs: Sequence[PoolSpec],
        *,
        token_slots: int,
        node_slots: int,
        page_size: int,
        device: str | torch.device,
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate pool names: {names}")
        if not specs or specs[0].per_node or specs[0].sidecar_of is not None:
            raise ValueError("the first pool spec must be the per-token anchor pool (kv)")
        if token_slots % page_size:
            raise ValueError(f"token_slots ({token_slots}) must be a multiple of page_size ({page_size})")
        by_name = {s.name: s for s in specs}
        for s in specs:
            source = by_name.get(s.sidecar_of) if s.sidecar_of else None
            if s.sidecar_of is not None and (source is None or source.per_node or source.sidecar_of):
                raise ValueError(f"sidecar {s.name!r} must ride an owning per-token pool, not {s.sidecar_of!r}")
        self.tier, self.page_size, self.device = tier, page_size, torch.device(device)
        self.anchor = specs[0].name
        self.pools: dict[str, PagePool] = {}
        for s in specs:
            if s.per_node:
                self.pools[s.name] = PagePool(s, tier, node_slots, 1, self.device)
            else:
                self.pools[s.name] = PagePool(s, tier, token_slots // page_size, page_size, self.device)
        self.owning = [s.name for s in specs if s.sidecar_of is None]
        self.sidecars = [(s.name, s.sidecar_of) for s in specs if s.sidecar_of is not None]
        self.per_token = [s.name for s in specs if not s.per_node]

    def alloc(self, num_pages: int, with_state: bool) -> tuple[Value | None, str | None]:
        """Pages for a node of ``num_pages`` token pages in every owning pool, all or nothing.

        Returns ``(value, None)`` or ``(None, name of the pool that was full)``.
        """
        value: Value = {}
        for name in self.owning:
            pool = self.pools[name]
            if pool.spec.per_node and not with_state:
                continue
            pages = pool.alloc(1 if pool.spec.per_node else num_pages)
            if pages is None:
                self.free(value)
                return None, name
            value[name] = pages
        return value, None

    def free(self, value: Mapping[str, list[int]]) -> None:
        for name, pages in value.items():
            self.pools[name].free(pages)

    def can_alloc(self, num_pages: int, with_state: bool) -> bool:
        for name in self.owning:
            pool = self.pools[name]
            if pool.spec.per_node:
                if with_state and pool.free_slots < 1:
                    return False
            elif pool.free_slots < num_pages * self.page_size:
                return False
        return True

    def usage(self) -> Iterator[PoolUsage]:
        for name in self.owning:
            pool = self.pools[name]
            yield PoolUsage(tier=self.tier, pool=name, used=pool.slots - pool.free_slots, limit=pool.slots)


def value_slots(group: PoolGroup, value: Mapping[str, list[int]]) -> dict[str, int]:
    """Slots (tokens, or states for a per-node pool) a value holds per owning pool."""
    return {name: len(pages) * group.pools[name].page_size for name, pages in value.items()}
