"""Bounded shutdown: providers, readers and servers stopped on daemon threads within a time budget, so a step that
hangs (an exporter retrying a dead collector) never holds up the caller. Used by :mod:`.providers` (a build that fails
half-way) and by ``configure()``'s flush and shutdown (:mod:`otel_hicache.sdk`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

_log = logging.getLogger(__name__)


def shutdown_provider(provider: Any, timeout_s: float) -> None:
    try:
        provider.shutdown(timeout_millis=int(timeout_s * 1000))
    except TypeError:  # TracerProvider.shutdown() takes no timeout: bounded() cuts it off
        provider.shutdown()


def bounded(jobs: Sequence[Any], timeout_s: float) -> bool:
    """Run ``jobs`` concurrently on daemon threads and wait at most ``timeout_s`` for all of them. A job that
    outlives the budget (an exporter retrying a dead collector) is abandoned; the caller goes on. A job no thread can
    be started for (the process is at its thread limit) is skipped, with one log line: never run here unbounded."""
    threads = []
    for job in jobs:
        thread = threading.Thread(target=_quietly, args=(job,), daemon=True, name="otel-hicache-close")
        try:
            thread.start()
        except RuntimeError as exc:  # can't start new thread
            _log.warning("otel_hicache: a shutdown step was skipped: %s", exc)
            continue
        threads.append(thread)
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return len(threads) == len(jobs) and not any(thread.is_alive() for thread in threads)


def _quietly(job: Any) -> None:
    try:
        job()
    except Exception:
        _log.debug("otel_hicache: a shutdown step failed", exc_info=True)
