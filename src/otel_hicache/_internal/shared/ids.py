"""The id ring: the one place a prompt's token ids travel, from a hook in the host to its export process (and the way
an engine's own page keys travel there too: vLLM's block hashes).

A region at the end of the channel's memfd (:mod:`~otel_hicache._internal.shared.channel`, shared only: anonymous,
mode ``0600``, inherited by the export process alone), laid out as::

    header (IDS_HEADER int64: cursors, the feed's page size and tiers)  |  arena (variable-length records)

A record is ``(words, prompt tokens, seed, stride)`` then its words, int64 each: one admitted request's lookup, copied
on the engine's thread. Stride 0: the words are the prompt's token ids (an ``array('q')`` in one copy, anything else
through one ``array('q')``), keyed by the export process; stride ``k``: they are the engine's own page keys, ``k``
words a key (vLLM's digests joined, one ``bytes`` copy), of which the first word is the key. The host is the only
producer (under its lock), the export process the only consumer: it reads a record, turns its ids into page keys at
once and zeroes the record's bytes before it moves ``READ`` on, so the arena holds the ids of unread records only. A
record that does not fit is dropped (the producer counts it), never waited for; one that does not fit before the end
of the arena leaves a wrap mark and starts again at its beginning. Nothing else ever holds ids: no pipe, socket, file,
log line, span, metric or error message.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

#: The header's slots: byte cursors (monotonic), then the feed's description, written by the host.
WRITE, READ, PAGE_TOKENS, TIERS, TIER_ROWS = 0, 1, 2, 3, 4
#: A tier row: tier index (``semconv.Tier`` order), tokens (-1: from the pool reading), inclusive, reclaims copies,
#: pool index (the channel's pools).
TIER_WIDTH = 5
MAX_TIERS = 3
IDS_HEADER = TIER_ROWS + MAX_TIERS * TIER_WIDTH + 1
#: The arena's size in a shared channel: 128 Ki ids (32 prompts of 4,096 tokens), read every 0.1 s by the exporter.
ARENA_BYTES = 1 << 20
_RECORD = struct.Struct("<qqqq")  # words (-1: wrap to the arena's start), prompt tokens, seed, stride
_WRAP = -1


class Lookup(NamedTuple):
    """One record as the exporter reads it (the words a private copy, the ring's bytes already zeroed)."""

    ids: array[int]  # token ids (stride 0), or page keys of ``stride`` words each
    prompt_tokens: int
    seed: int
    stride: int

    def keys(self) -> array[int] | None:
        """The engine's page keys (a key's first word each), or None for token ids."""
        return self.ids[:: self.stride] if self.stride else None


class TierRow(NamedTuple):
    tier: int
    tokens: int  # -1: today's capacity from the pool reading
    inclusive: bool
    reclaims_copies: bool
    pool: int


def region_bytes(arena: int) -> int:
    """The bytes an id ring of ``arena`` bytes takes in the channel (0: none)."""
    return IDS_HEADER * 8 + arena if arena else 0


class IdRing:
    """The ring over ``view`` (the channel's region: header then arena; see the module docstring)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self.ints = view[: IDS_HEADER * 8].cast("q")
        self._arena = view[IDS_HEADER * 8 :]
        self.size = len(self._arena)

    def release(self) -> None:
        self.ints.release()
        self._arena.release()
        self._view.release()

    # ------------------------------------------------------------------ producer (host)
    def describe(self, page_tokens: int, tiers: Sequence[TierRow]) -> None:
        """The feed the records are for: its page size and tiers (fastest first); the exporter takes them up at its
        next read."""
        ints = self.ints
        for i, row in enumerate(tiers[:MAX_TIERS]):
            base = TIER_ROWS + i * TIER_WIDTH
            ints[base : base + TIER_WIDTH] = array(
                "q", [row.tier, row.tokens, row.inclusive, row.reclaims_copies, row.pool]
            )
        ints[PAGE_TOKENS] = page_tokens
        ints[TIERS] = len(tiers[:MAX_TIERS]) | (((ints[TIERS] >> 8) + 1) << 8)  # count, and a generation above it

    def put(self, ids: Any, prompt_tokens: int, seed: int, stride: int = 0) -> bool:
        """Copy one lookup in: a prompt's token ids (``stride`` 0), or ``bytes`` of page keys ``stride`` words each;
        False (nothing written) when the arena cannot take it now. Raises OverflowError or TypeError for ids that are
        not int64, ValueError for bytes that are not whole keys (the caller counts it)."""
        if stride:
            data = memoryview(ids)
            if len(data) % (8 * stride):
                raise ValueError("not whole keys")
        else:
            if not (type(ids) is array and ids.typecode == "q"):
                ids = array("q", ids)
            data = memoryview(ids).cast("B")
        need = _RECORD.size + len(data)
        ints, size = self.ints, self.size
        write, read = ints[WRITE], ints[READ]
        at = write % size
        tail = size - at
        if tail < need:  # no room before the end: a wrap mark (when one fits) and the record at the start
            wrap = tail
            at = 0
        else:
            wrap = 0
        if write + wrap + need - read > size:
            return False
        if wrap >= _RECORD.size:
            _RECORD.pack_into(self._arena, write % size, _WRAP, 0, 0, 0)
        _RECORD.pack_into(self._arena, at, len(data) // 8, prompt_tokens, seed, stride)
        self._arena[at + _RECORD.size : at + need] = data
        ints[WRITE] = write + wrap + need  # published after the bytes
        return True

    # ------------------------------------------------------------------ consumer (export process)
    def tiers(self) -> tuple[int, int, list[TierRow]]:
        """``(generation, page tokens, rows)`` as the host last described them (generation 0: never)."""
        ints = self.ints
        count, generation = ints[TIERS] & 0xFF, ints[TIERS] >> 8
        rows = []
        for i in range(count):
            base = TIER_ROWS + i * TIER_WIDTH
            tier, tokens, inclusive, reclaims, pool = ints[base : base + TIER_WIDTH]
            rows.append(TierRow(tier, tokens, bool(inclusive), bool(reclaims), pool))
        return generation, ints[PAGE_TOKENS], rows

    def take(self) -> Iterator[Lookup]:
        """Each unread record, oldest first: copied out, its bytes zeroed, then ``READ`` moved past it."""
        ints, arena, size = self.ints, self._arena, self.size
        while ints[READ] < ints[WRITE]:
            read = ints[READ]
            at = read % size
            tail = size - at
            n = _RECORD.unpack_from(arena, at)[0] if tail >= _RECORD.size else _WRAP
            if n == _WRAP:
                arena[at:] = bytes(tail)
                ints[READ] = read + tail
                continue
            n, prompt_tokens, seed, stride = _RECORD.unpack_from(arena, at)
            end = at + _RECORD.size + 8 * n
            ids = array("q")
            ids.frombytes(arena[at + _RECORD.size : end])
            arena[at:end] = bytes(end - at)
            ints[READ] = read + end - at
            yield Lookup(ids, prompt_tokens, seed, stride)
