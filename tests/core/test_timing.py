"""Timing: device events where CUDA can time, a host-clock stand-in elsewhere, never a made-up duration."""

from __future__ import annotations

import time

import pytest

from otel_hicache import timing
from otel_hicache.semconv import TimingSource
from otel_hicache.timing import HostClockEvent, WallClockAnchor, elapsed_seconds, make_timing_event_pair


def test_cpu_pair_is_a_host_clock_pair_that_times_the_work_between_records() -> None:
    start, finish, source = make_timing_event_pair("cpu")
    assert source is TimingSource.HOST_CLOCK
    assert isinstance(start, HostClockEvent) and isinstance(finish, HostClockEvent)
    start.record()
    busy_until = time.perf_counter() + 0.02
    while time.perf_counter() < busy_until:  # real work between the records, not a sleep
        pass
    finish.record()
    seconds = elapsed_seconds(start, finish)
    assert seconds is not None and 0.02 <= seconds < 1.0
    assert start.elapsed_time(finish) == pytest.approx(seconds * 1e3)


def test_unrecorded_or_disabled_timing_gives_no_duration() -> None:
    start, finish, _ = make_timing_event_pair("cpu")
    assert not finish.query()
    assert elapsed_seconds(start, finish) is None  # finish not complete: nothing is read
    start.record()
    finish.record()
    assert elapsed_seconds(start, finish, timing_enabled=False) is None
    assert elapsed_seconds(None, finish) is None


def test_elapsed_time_of_an_unrecorded_host_event_raises_like_cuda() -> None:
    with pytest.raises(RuntimeError):
        HostClockEvent().elapsed_time(HostClockEvent())


def test_a_pair_that_cannot_time_or_ran_backwards_gives_none() -> None:
    class UntimedEvent:  # what torch.cuda.Event() without enable_timing does
        def query(self) -> bool:
            return True

        def elapsed_time(self, other: object) -> float:
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")

    assert elapsed_seconds(UntimedEvent(), UntimedEvent()) is None
    start, finish, _ = make_timing_event_pair("cpu")
    finish.record()
    start.record()
    assert elapsed_seconds(start, finish) is None or elapsed_seconds(start, finish) == 0.0


def test_capability_probe_runs_once() -> None:
    timing.cuda_timing_available.cache_clear()
    first = timing.cuda_timing_available()
    assert timing.cuda_timing_available() == first
    assert timing.cuda_timing_available.cache_info().hits >= 1


def test_default_device_falls_back_to_the_host_clock_without_cuda() -> None:
    import torch

    _, _, source = make_timing_event_pair()
    expected = TimingSource.CUDA_EVENT if torch.cuda.is_available() else TimingSource.HOST_CLOCK
    assert source is expected


def test_anchor_maps_monotonic_time_onto_the_wall_clock() -> None:
    anchor = WallClockAnchor()
    assert abs(anchor.now_ns() - time.time_ns()) < 50_000_000
    later = time.monotonic_ns()
    assert anchor.to_epoch_ns(later) - anchor.wall_ns == later - anchor.monotonic_ns
    a, b = timing.now_ns(), timing.now_ns()
    assert b >= a  # monotonic: never steps back with NTP


@pytest.mark.gpu
def test_cuda_events_time_a_device_copy_without_synchronising() -> None:
    import torch

    start, finish, source = make_timing_event_pair("cuda")
    assert source is TimingSource.CUDA_EVENT
    src = torch.randn(64 * 1024 * 1024 // 4, device="cuda")
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        finish.record(stream)
    while not finish.query():  # poll, as a scheduler would; elapsed_seconds never blocks
        assert elapsed_seconds(start, finish) is None or finish.query()
    seconds = elapsed_seconds(start, finish)
    assert seconds is not None and 0 < seconds < 1.0
    assert torch.equal(dst, src.cpu())
