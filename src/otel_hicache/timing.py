"""Copy timing and clocks.

* :func:`make_timing_event_pair` returns ``(start, finish, source)``: two ``torch.cuda.Event`` created with
  ``enable_timing=True`` where CUDA is available (``source`` is ``TimingSource.CUDA_EVENT``), else two
  :class:`HostClockEvent` with the same ``record / query / synchronize / elapsed_time`` interface
  (``TimingSource.HOST_CLOCK``). Record them on the transfer stream right around the
  copy loop; the duration then covers the copy only. Without torch (the core install) the host clock is the clock,
  silently; a torch that cannot time (a broken driver) is reported in one warning.
* :func:`elapsed_seconds` reads a duration only from a pair whose finish event is already complete (``query()``),
  so it never synchronises the device. A pair that cannot time gives ``None``, never a made-up number.
* :class:`WallClockAnchor` ties the monotonic clock to the wall clock once, so span timestamps are epoch
  nanoseconds that never jump with NTP adjustments.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Protocol

from otel_hicache.semconv import TimingSource

_log = logging.getLogger(__name__)


class TimingEvent(Protocol):
    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end_event: Any) -> float: ...


class HostClockEvent:
    """A host-clock stand-in for ``torch.cuda.Event(enable_timing=True)``.

    Correct for copies that are complete when ``record()`` returns (CPU tensors, or a CUDA copy followed by a
    synchronisation the caller already performs). ``elapsed_time`` is in milliseconds, like CUDA's.
    """

    __slots__ = ("_ns",)

    def __init__(self) -> None:
        self._ns: int | None = None

    def record(self, stream: Any = None) -> None:
        self._ns = time.perf_counter_ns()

    def query(self) -> bool:
        return self._ns is not None

    def synchronize(self) -> None:  # a host event is complete once recorded
        return None

    def elapsed_time(self, end_event: HostClockEvent) -> float:
        if self._ns is None or end_event._ns is None:
            raise RuntimeError("both events must be recorded before elapsed_time()")
        return (end_event._ns - self._ns) / 1e6


@functools.cache
def cuda_timing_available() -> bool:
    """Whether ``torch.cuda.Event(enable_timing=True)`` can time copies here (probed once, cached)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        torch.cuda.Event(enable_timing=True)
        return True
    except Exception as exc:  # a broken torch or driver: fall back, say so once
        # without torch at all (the core install) the host clock is the documented clock: nothing to say
        if not (isinstance(exc, ModuleNotFoundError) and exc.name == "torch"):
            _log.warning("otel_hicache: CUDA event timing unavailable (%s); using the host clock", exc)
        return False


def make_timing_event_pair(device: str | None = None) -> tuple[TimingEvent, TimingEvent, TimingSource]:
    """A ``(start, finish, source)`` pair of events for timing one merged copy.

    ``device`` is the transfer's device type (``"cuda"``, ``"cpu"``; ``None`` means CUDA where available).
    """
    if device != "cpu" and cuda_timing_available():
        import torch

        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), TimingSource.CUDA_EVENT
    return HostClockEvent(), HostClockEvent(), TimingSource.HOST_CLOCK


def elapsed_seconds(start: Any, finish: Any, timing_enabled: bool = True) -> float | None:
    """Copy time in seconds, or ``None`` when the pair cannot time or is not complete.

    Only reads events already known complete: ``finish.query()`` is checked first, so no device sync is added.
    """
    if not timing_enabled or start is None or finish is None:
        return None
    try:
        if not finish.query():
            return None
        ms = start.elapsed_time(finish)
    except Exception:  # an untimed CUDA event raises on elapsed_time
        return None
    if ms != ms or ms < 0:  # NaN or clock went backwards
        return None
    return float(ms) / 1e3


class WallClockAnchor:
    """Maps monotonic nanoseconds to epoch nanoseconds through one (wall, monotonic) pair taken together."""

    __slots__ = ("monotonic_ns", "offset_ns", "wall_ns")

    def __init__(self) -> None:
        self.monotonic_ns = time.monotonic_ns()
        self.wall_ns = time.time_ns()
        self.offset_ns = self.wall_ns - self.monotonic_ns  # epoch = monotonic + offset (no call on a hot path)

    def to_epoch_ns(self, monotonic_ns: int) -> int:
        return monotonic_ns + self.offset_ns

    def now_ns(self) -> int:
        """Epoch nanoseconds now, on the monotonic clock (immune to wall-clock steps)."""
        return self.wall_ns + (time.monotonic_ns() - self.monotonic_ns)


#: The process-wide anchor every producer uses, so all records share one time base.
ANCHOR = WallClockAnchor()


def now_ns() -> int:
    """Epoch nanoseconds on the shared anchor."""
    return ANCHOR.now_ns()
