"""A long build keeps to the host thread's schedule: once its round has held the GIL for the bound it pauses as the
round would, then goes on in a new slice; off the host thread, pacing does nothing."""

from __future__ import annotations

import threading
import types

import pytest

from otel_hicache._internal.host import pacing


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """The pacer's clock, moved by hand, and the pauses it took (seconds; 0: only let go of the GIL)."""
    fake = types.SimpleNamespace(now=1_000, paused=[])
    fake.perf_counter_ns = lambda: fake.now
    fake.sleep = fake.paused.append
    monkeypatch.setattr(pacing, "time", fake)
    monkeypatch.setattr(pacing, "let_go", lambda: fake.paused.append(0))
    return fake


def a_round(start_ns: int, pause_s: float) -> pacing.Schedule:
    schedule = pacing.Schedule()
    schedule.end_ns, schedule.pause_s = start_ns + schedule.slice_ns, pause_s
    return schedule


def test_a_long_build_pauses_once_its_round_held_the_gil_for_the_bound_then_goes_on_in_a_new_slice(
    clock: types.SimpleNamespace,
) -> None:
    schedule = a_round(clock.now, 0.001)
    pacing.keeping(schedule)
    try:
        clock.now += pacing.MAX_HOLD_NS - 1
        pacing.pace()
        assert clock.paused == []  # within a build, it goes on up to the bound (past the 50 us slice)
        clock.now += 1
        pacing.pace()
        assert clock.paused == [0.001]  # held the GIL that long: the round's pause
        assert schedule.end_ns == clock.now + pacing.SLICE_NS  # then a new slice
        clock.now += pacing.MAX_HOLD_NS - 1
        pacing.pace()
        assert len(clock.paused) == 1
        clock.now += 1
        pacing.pace()
        assert len(clock.paused) == 2
    finally:
        pacing.keeping(None)


def test_while_a_flush_waits_a_long_build_only_lets_go_of_the_gil(clock: types.SimpleNamespace) -> None:
    pacing.keeping(a_round(clock.now, 0.0))
    try:
        clock.now += pacing.MAX_HOLD_NS
        pacing.pace()
        assert clock.paused == [0]
    finally:
        pacing.keeping(None)


def test_off_the_host_thread_pacing_does_nothing(clock: types.SimpleNamespace) -> None:
    pacing.keeping(a_round(clock.now - pacing.MAX_HOLD_NS, 0.001))  # this thread's round: held the GIL long enough
    try:
        other = threading.Thread(target=pacing.pace, name="not-the-host-thread")
        other.start()
        other.join()
        assert clock.paused == []  # another thread has no schedule
        pacing.pace()
        assert clock.paused == [0.001]
    finally:
        pacing.keeping(None)
    clock.now += pacing.MAX_HOLD_NS
    pacing.pace()
    assert len(clock.paused) == 1  # no schedule any more
