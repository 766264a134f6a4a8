"""The id ring (:mod:`otel_hicache._internal.shared.ids`): records in order across the arena's end, a full ring that
refuses instead of overwriting or waiting, what it read zeroed, and the feed's description."""

from __future__ import annotations

from array import array

import pytest

from otel_hicache._internal.shared.ids import IDS_HEADER, IdRing, TierRow, region_bytes

ARENA = 1024  # bytes: 128 int64 slots, a record's header taking four


def ring() -> IdRing:
    return IdRing(memoryview(bytearray(region_bytes(ARENA))))


def test_records_come_out_in_order_across_the_end_of_the_arena_and_what_was_read_is_zeroed() -> None:
    r = ring()
    got = []
    for n in range(1, 60):  # ~25 passes over the arena, wrapping at every size of tail
        ids = array("q", range(n, 2 * n))
        assert r.put(ids if n % 2 else list(ids), n + 100, -n)
        (lookup,) = r.take()
        got.append(lookup)
        assert bytes(r._arena) == bytes(ARENA)  # the ring holds no id it has handed over
    assert [(list(x.ids), x.prompt_tokens, x.seed) for x in got] == [
        (list(range(n, 2 * n)), n + 100, -n) for n in range(1, 60)
    ]


def test_an_engines_page_keys_come_out_as_the_first_word_of_each_digest() -> None:
    r = ring()
    digests = [bytes(range(i, i + 32)) for i in range(5)]  # 32-byte digests (vLLM's sha256): four words a key
    assert r.put(b"".join(digests), 80, 0, 4)
    (lookup,) = r.take()
    assert lookup.prompt_tokens == 80 and lookup.stride == 4
    assert list(lookup.keys() or []) == [int.from_bytes(d[:8], "little", signed=True) for d in digests]
    assert r.put(array("q", [1, 2]), 2, 0)
    (ids,) = r.take()
    assert ids.keys() is None and list(ids.ids) == [1, 2]  # token ids: keyed by the export process
    with pytest.raises(ValueError):
        r.put(bytes(24), 16, 0, 2)  # not whole 16-byte keys
    assert list(r.take()) == []


def test_a_full_ring_refuses_a_record_and_keeps_the_unread_ones_intact() -> None:
    r = ring()
    written = 0
    while r.put(array("q", [written] * 10), 10, 0):
        written += 1
    assert written == ARENA // (8 * 14)  # whole records only; the one that does not fit is refused
    assert not r.put(array("q", [0] * 10), 10, 0)  # still full: nothing was overwritten
    assert [x.ids[0] for x in r.take()] == list(range(written))
    assert r.put(array("q", [7] * 10), 10, 0)  # room again once read
    assert not r.put(array("q", range(ARENA // 8)), ARENA // 8, 0)  # never fits


def test_ids_that_are_not_64_bit_integers_are_refused_with_nothing_written() -> None:
    r = ring()
    for bad in ([1, 2**64], [1.5], ["7"]):
        with pytest.raises((OverflowError, TypeError)):
            r.put(bad, 1, 0)
    assert list(r.take()) == []


def test_the_description_of_the_feed_moves_on_a_generation_with_each_change() -> None:
    r = ring()
    assert r.tiers() == (0, 0, [])
    rows = [TierRow(0, 4096, True, False, 0), TierRow(1, -1, False, True, 2)]
    r.describe(16, rows)
    assert r.tiers() == (1, 16, rows)
    r.describe(1, rows[:1])
    assert r.tiers() == (2, 1, rows[:1])
    assert IDS_HEADER * 8 + ARENA == region_bytes(ARENA)
