"""Consumers of a telemetry's ring: where its transfers become spans (and its table is read for metrics).

Two kinds, one :class:`Consumer` interface the host thread (:mod:`otel_hicache._internal.host.worker`) serves:

* :class:`InProcessConsumer`: threads of this process, the host thread in slices and ``flush`` on the caller's (the
  embedded default, and providers handed to :class:`~otel_hicache.telemetry.HiCacheTelemetry`);
* :class:`~otel_hicache._internal.export.handle.ExportProcess`: the handle on an export process that maps the ring
  and drains it itself (``configure()`` over OTLP).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from opentelemetry import metrics, trace

from otel_hicache._internal.emit.emitter import Emitter
from otel_hicache._internal.shared.channel import Channel
from otel_hicache.records import TransferRecord

_log = logging.getLogger("otel_hicache.telemetry")


class Consumer(Protocol):
    """Where the ring's records become spans: a thread of this process, or the export process."""

    def tend(self, channel: Channel, now: bool = False) -> None: ...  # look after it (start it, replace it if dead)
    def drain(self, budget_ns: int) -> bool: ...  # host thread's share of the work; True if more is waiting
    def flush(self, timeout_s: float) -> bool: ...
    def close(self, channel: Channel, timeout_s: float) -> bool: ...
    def before_fork(self) -> bool: ...  # hold what a forked child must not inherit mid-use; True if held
    def after_fork_in_parent(self, held: bool) -> None: ...
    def after_fork_in_child(self, channel: Channel) -> Consumer: ...


class InProcessConsumer:
    """Consumes the ring on threads of this process: the host thread in slices, ``flush`` on the caller's."""

    def __init__(
        self,
        channel: Channel,
        tracer_provider: trace.TracerProvider | None,
        meter_provider: metrics.MeterProvider | None,
        *,
        spans: bool,
        token_metrics: bool,
        before_collect: Callable[[], None],
    ) -> None:
        self._channel = channel
        self._emitter = Emitter(
            channel.counters,
            tracer_provider,
            meter_provider,
            spans=spans,
            token_metrics=token_metrics,
            before_collect=before_collect,
        )
        self._emit_lock = threading.Lock()  # one consumer at a time: the ring has a single consumer side

    def tend(self, channel: Channel, now: bool = False) -> None:
        return None  # this process is alive by definition

    def drain(self, budget_ns: int) -> bool:
        if not self._channel.pending() or not self._emit_lock.acquire(blocking=False):
            return False
        try:
            end = time.perf_counter_ns() + budget_ns
            while time.perf_counter_ns() < end:
                records = self._channel.take(4)
                if not records:
                    return False
                self._emit(records)
            return self._channel.pending() > 0
        finally:
            self._emit_lock.release()

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        if not self._emit_lock.acquire(timeout=timeout_s):
            return False
        try:
            while time.monotonic() < deadline:
                records = self._channel.take(64)
                if not records:
                    return True
                self._emit(records)
        finally:
            self._emit_lock.release()
        return not self._channel.pending()

    def close(self, channel: Channel, timeout_s: float) -> bool:
        return self.flush(timeout_s)

    def before_fork(self) -> bool:
        return self._emit_lock.acquire(timeout=1.0)

    def after_fork_in_parent(self, held: bool) -> None:
        if held:
            self._emit_lock.release()

    def after_fork_in_child(self, channel: Channel) -> Consumer:
        self._emit_lock = threading.Lock()  # the channel was reset in place: the emitter reads the child's counts
        return self

    def _emit(self, records: list[TransferRecord]) -> None:
        for record in records:
            try:
                self._emitter.emit(record)
            except Exception:
                _log.debug("otel_hicache: emitting a record failed", exc_info=True)
        self._channel.settle()
