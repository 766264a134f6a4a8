"""Helpers for testing and benchmarking otel_hicache against real OTel parts: in a clone only, never in the wheel.

* :mod:`.sdk`: :func:`~.sdk.make_sdk`, an SDK reading into memory with the production Views;
* :mod:`.otlp_receiver`: an in-process OTLP receiver (gRPC and HTTP) the real exporters deliver to;
* :mod:`.sglang`: SGLang 0.5.23's real HiCache classes on a CPU (shims for its four GPU-only pieces);
* :mod:`.vocabulary`: writes the registry's metric groups and docs/vocabulary.md's instrument table from the rows of
  ``semconv.INSTRUMENTS``;
* :mod:`.reruns`: the demo's capacity curve beside re-runs of the demo at each size (ground truth);
* :func:`free_port`: a free TCP port on 127.0.0.1.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a server the test starts next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
