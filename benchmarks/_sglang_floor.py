"""The floor of what SGLang's scheduler thread pays for our hooks: each hook writes its raw record straight into shared
memory, and nothing of ours runs on another thread of the host (no host thread, so no wake beside the scheduler).

Not the product: a measuring device for ``benchmarks sglang``. The records are what the product's hooks hand its host
thread today, packed as fixed-size slots into an anonymous shared mapping that another process could read, and never
read here: validating, counting and building spans would happen in that other process. Per merged transfer, the ack's
submission time (noted as SGLang appends it) and consumption time, tokens per pool, bytes and node count; per prefill
batch, SGLang's split of its tokens; per admitted request, the hashes of its prompt's pages that the capacity
estimator samples (:func:`otel_hicache.capacity.page_keys`, each page sampled: the rate before the sample fills). Left
out, because the CPU path has none of them: an ack's copy time (``timing_enabled`` is off on CPU), request links.
``benchmarks sglang`` also runs these records with the page hashes left out (:meth:`RawRecords.split` alone) beside
the product's own hand-over of the capacity lookups (token ids to the export process).

A measuring device of the least SGLang's scheduler thread could pay for our hooks, used by sglang.
"""

from __future__ import annotations

import itertools
import mmap
import struct
import time
from typing import Any

from otel_hicache.capacity import page_keys

#: slot kinds
_ACK, _PREFILL, _PAGES = 1, 2, 3
_SLOT = 64
_SLOTS = 1 << 14
#: kind, sequence, submitted, consumed (monotonic ns), bytes, nodes, then up to three (pool, tokens) pairs
_ACK_SLOT = struct.Struct("<Bxxxxxxxqqqqi" + "Bi" * 3)
#: kind, sequence, input, device hit, host hit, storage hit tokens
_PREFILL_SLOT = struct.Struct("<Bxxxxxxxqqqqq")
#: kind, hashes in this slot, sequence, up to six sampled page hashes
_PAGES_SLOT = struct.Struct("<BBxxxxxxq" + "q" * 6)
_PAGES_PER_SLOT = 6
assert max(slot.size for slot in (_ACK_SLOT, _PREFILL_SLOT, _PAGES_SLOT)) <= _SLOT


class RawRecords:
    """The shared ring the floor's hooks write into (a producer thread of its own per ring, as the product's queues)."""

    def __init__(self, page_tokens: int) -> None:
        self.ring = mmap.mmap(-1, _SLOT * _SLOTS)
        self.written = 0  # slots written
        self.acks = 0  # of them, acks
        self.seq = itertools.count()
        self.page_tokens = page_tokens
        self.pools: dict[str, int] = {}

    def slot(self) -> int:
        offset = (self.written % _SLOTS) * _SLOT
        self.written += 1
        return offset

    def adopt(self, cache: Any) -> None:
        """Replace the cache's controller's backup ack queue by one that writes each consumed ack."""
        controller = cache.cache_controller
        controller.ack_write_queue = FloorAckQueue(self, controller.ack_write_queue)

    def admitted(self, stats: Any, adder: Any) -> None:
        """A prefill batch: its split, and each admitted request's sampled page hashes."""
        self.split(stats)
        self.pages(adder)

    def split(self, stats: Any) -> None:
        """A prefill batch's split of its tokens by tier."""
        _PREFILL_SLOT.pack_into(
            self.ring,
            self.slot(),
            _PREFILL,
            next(self.seq),
            stats.log_input_tokens - stats.reprocessed_log_input_tokens,
            stats.log_device_hit_tokens,
            stats.log_host_hit_tokens,
            stats.log_storage_hit_tokens,
        )

    def pages(self, adder: Any) -> None:
        """Each request the batch admitted: its prompt's page hashes, every page sampled."""
        for req in adder.can_run_list:
            pages = list(page_keys(req.origin_input_ids, self.page_tokens))
            for start in range(0, len(pages), _PAGES_PER_SLOT):
                chunk = pages[start : start + _PAGES_PER_SLOT]
                padded = chunk + [0] * (_PAGES_PER_SLOT - len(chunk))
                _PAGES_SLOT.pack_into(self.ring, self.slot(), _PAGES, len(chunk), next(self.seq), *padded)

    def ack(self, ack: Any, submitted: int, consumed: int) -> None:
        self.acks += 1
        pools = self.pools
        pairs: list[int] = []
        for pool, tokens in list((ack.num_tokens_by_pool or {}).items())[:3]:
            pairs += (pools.setdefault(pool, len(pools)), tokens)
        pairs += [0, 0] * (3 - len(pairs) // 2)
        _ACK_SLOT.pack_into(
            self.ring,
            self.slot(),
            _ACK,
            next(self.seq),
            submitted,
            consumed,
            ack.num_bytes,
            len(ack.node_ids),
            *pairs,
        )


class FloorAckQueue(list[Any]):
    """SGLang's ack queue, noting each ack's submission as it is appended and writing it as it is consumed."""

    __slots__ = ("records", "submitted")

    def __init__(self, records: RawRecords, acks: list[Any]) -> None:
        super().__init__(acks)
        self.records = records
        self.submitted: dict[int, int] = {}

    def append(self, ack: Any) -> None:
        self.submitted[id(ack)] = time.monotonic_ns()
        list.append(self, ack)

    def pop(self, index: Any = -1) -> Any:
        ack = list.pop(self, index)
        self.records.ack(ack, self.submitted.pop(id(ack), -1), time.monotonic_ns())
        return ack
