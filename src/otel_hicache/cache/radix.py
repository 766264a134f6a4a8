"""Radix tree over page-aligned token ids: structure, matching, splitting, lock references.

Each node holds a run of whole pages and, per tier, the page ids of its KV (``device`` / ``host`` values) and what
an eviction reports about that copy: when it was last used, whether it served a hit, and (host) which transfer wrote
it if nothing has read it back yet. That bookkeeping lives on the node, so it is bounded by the tree and goes with the
node. The tree keeps two invariants the cache relies on: device residency is prefix-closed (a node on the device has its
parent on the device), and every node is on the device or the host (nothing else is kept in the tree). Policies,
transfers and eviction live in :mod:`otel_hicache.cache.hicache`; this module only knows the shape.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from otel_hicache.cache.pools import Value
from otel_hicache.semconv import TransferOperation


class Node:
    __slots__ = (
        "children",
        "device",
        "device_reused",
        "device_used_ns",
        "hits",
        "host",
        "host_lock",
        "host_reused",
        "host_unread",
        "host_used_ns",
        "id",
        "key",
        "last_access",
        "lock",
        "names",
        "parent",
        "ticket",
    )

    def __init__(self, node_id: int, parent: Node | None, key: tuple[int, ...], names: list[str]) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.key = key  # token ids of this node's pages (never logged or exported)
        self.names = names  # prefix-hash name of each page
        self.device: Value | None = None
        self.host: Value | None = None
        self.ticket: list[bool] | None = None  # [done] of the D->H write that made the host copy; shared by splits
        self.lock = 0  # requests or in-flight transfers using the device copy (self and descendants)
        self.host_lock = 0  # in-flight storage backups reading the host copy
        self.hits = 0
        self.last_access = 0
        # Per tier, for eviction: last use (monotonic ns: written, hit or loaded back) and whether a hit was served
        # from that copy since it was made. host_unread: the transfer that wrote the host copy while nothing has
        # loaded it back (backup or storage_prefetch); None once read back.
        self.device_used_ns = 0
        self.device_reused = False
        self.host_used_ns = 0
        self.host_reused = False
        self.host_unread: TransferOperation | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.key)

    @property
    def backed(self) -> bool:
        """The host copy exists and its write has completed."""
        return self.host is not None and (self.ticket is None or self.ticket[0])


class Match(NamedTuple):
    """The matched path, root excluded: ``device_nodes`` then ``host_nodes`` (evicted, host copy only)."""

    device_nodes: list[Node]
    host_nodes: list[Node]
    device_len: int
    host_len: int

    @property
    def last(self) -> Node | None:
        nodes = self.host_nodes or self.device_nodes
        return nodes[-1] if nodes else None


class RadixTree:
    def __init__(self, page_size: int, per_node_pools: frozenset[str] = frozenset()) -> None:
        self.page_size = page_size
        self.per_node_pools = per_node_pools
        self._ids = itertools.count(1)
        self.root = Node(0, None, (), [])
        self.root.lock = 1  # never evicted
        self.nodes: dict[int, Node] = {0: self.root}
        self._clock = itertools.count()

    def tick(self) -> int:
        return next(self._clock)

    def match(self, key: Sequence[int], names: Sequence[str]) -> Match:
        """Longest cached page-aligned prefix of ``key``, splitting a node where the match ends inside it."""
        ps, now = self.page_size, self.tick()
        node, pos = self.root, 0
        device_nodes: list[Node] = []
        host_nodes: list[Node] = []
        while pos < len(key):
            child = node.children.get(tuple(key[pos : pos + ps]))
            if child is None:
                break
            n = _common_pages(child.key, key, pos, ps)
            if n < child.num_tokens:
                child = self.split(child, n)
            child.last_access = now
            (device_nodes if child.device is not None else host_nodes).append(child)
            pos += n
            node = child
        device_len = sum(n.num_tokens for n in device_nodes)
        return Match(device_nodes, host_nodes, device_len, pos - device_len)

    def add_child(self, parent: Node, key: Sequence[int], names: list[str]) -> Node:
        node = Node(next(self._ids), parent, tuple(key), names)
        node.last_access = self.tick()
        parent.children[node.key[: self.page_size]] = node
        self.nodes[node.id] = node
        return node

    def split(self, node: Node, tokens: int) -> Node:
        """Cut ``node`` after ``tokens`` (a page multiple); returns the new upper node. Per-node state stays below."""
        ps = self.page_size
        pages = tokens // ps
        upper = Node(next(self._ids), node.parent, node.key[:tokens], node.names[:pages])
        per_node = self.per_node_pools
        upper.device = _split_value(node.device, pages, per_node, upper_side=True)
        upper.host = _split_value(node.host, pages, per_node, upper_side=True)
        node.device = _split_value(node.device, pages, per_node, upper_side=False)
        node.host = _split_value(node.host, pages, per_node, upper_side=False)
        upper.ticket, upper.lock, upper.host_lock = node.ticket, node.lock, node.host_lock
        upper.hits, upper.last_access = node.hits, node.last_access
        upper.device_used_ns, upper.device_reused = node.device_used_ns, node.device_reused
        upper.host_used_ns, upper.host_reused, upper.host_unread = node.host_used_ns, node.host_reused, node.host_unread
        assert node.parent is not None
        node.parent.children[upper.key[:ps]] = upper
        node.key, node.names = node.key[tokens:], node.names[pages:]
        node.parent = upper
        upper.children[node.key[:ps]] = node
        self.nodes[upper.id] = upper
        return upper

    def remove(self, node: Node) -> None:
        """Detach a childless node."""
        assert not node.children and node.parent is not None
        del node.parent.children[node.key[: self.page_size]]
        del self.nodes[node.id]

    def pinned_device_prefix(self, key: Sequence[int]) -> int:
        """Tokens of ``key``'s cached prefix that sit on the device locked (by requests in flight): read only, no
        split and no access time changes, unlike :meth:`match`."""
        ps, node, pos, pinned = self.page_size, self.root, 0, 0
        while (child := node.children.get(tuple(key[pos : pos + ps]))) is not None:
            n = _common_pages(child.key, key, pos, ps)
            if child.device is not None and child.lock:
                pinned += n
            pos += n
            if n < child.num_tokens:
                break
            node = child
        return pinned

    def inc_lock(self, node: Node) -> None:
        n: Node | None = node
        while n is not None and n is not self.root:
            n.lock += 1
            n = n.parent

    def dec_lock(self, node: Node) -> None:
        n: Node | None = node
        while n is not None and n is not self.root:
            n.lock -= 1
            assert n.lock >= 0, "lock reference went negative"
            n = n.parent

    def subtree(self, node: Node) -> Iterator[Node]:
        """``node`` and its descendants, children before parents."""
        for child in list(node.children.values()):
            yield from self.subtree(child)
        yield node

    def path(self, node: Node) -> list[Node]:
        out = []
        n: Node | None = node
        while n is not None and n is not self.root:
            out.append(n)
            n = n.parent
        out.reverse()
        return out


def _common_pages(node_key: tuple[int, ...], key: Sequence[int], pos: int, ps: int) -> int:
    n = 0
    limit = min(len(node_key), len(key) - pos)
    while n + ps <= limit and tuple(key[pos + n : pos + n + ps]) == node_key[n : n + ps]:
        n += ps
    return n


def _split_value(value: Value | None, pages: int, per_node: frozenset[str], *, upper_side: bool) -> Value | None:
    """Per-token pools split at ``pages``; a per-node state belongs to the lower node (it is the state at its end)."""
    if value is None:
        return None
    out: Value = {}
    for name, ids in value.items():
        if name in per_node:
            if not upper_side:
                out[name] = ids
        else:
            out[name] = ids[:pages] if upper_side else ids[pages:]
    return out
