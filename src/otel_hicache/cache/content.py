"""Identity and content of KV pages: the prefix hash chain, and the deterministic KV the stand-in model writes.

A page is named by a hash chain over the token ids of every page up to it (SGLang's prefix hash), so equal names
mean equal prefixes. The name is what L3 file names are made of: token ids never appear in clear anywhere.

The stand-in model writes KV that is a pure function of (seed, page name, pool, layer, slot, column), with small
integers that every float dtype holds exactly, so a test can say what any page must contain after any path.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence

import torch

from otel_hicache.cache.pools import PoolSpec

_DIGEST = 16  # bytes: 128-bit names, collision-free for any realistic cache


def page_hashes(tokens: Sequence[int], page_size: int, parent: str = "") -> list[str]:
    """Hex names of each full page of ``tokens``, chained from ``parent`` (the name of the page before)."""
    out: list[str] = []
    prev = bytes.fromhex(parent)
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hashlib.blake2b(prev, digest_size=_DIGEST)
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens[start : start + page_size]))
        prev = h.digest()
        out.append(prev.hex())
    return out


def page_content(spec: PoolSpec, name: str, seed: int, slots: int) -> torch.Tensor:
    """The ``layers x slots x width`` KV the model writes for the page (or per-node state) called ``name``."""
    base = (int(name[:8], 16) ^ (seed * 0x9E3779B1) ^ zlib.crc32(spec.name.encode())) % 251
    layer = torch.arange(spec.layers).view(-1, 1, 1) * 31
    slot = torch.arange(slots).view(1, -1, 1) * 7
    col = torch.arange(spec.width).view(1, 1, -1)
    return ((base + layer + slot + col) % 251).to(spec.dtype)  # < 256: exact in fp16, bf16 and fp32
