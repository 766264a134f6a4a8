"""Shared pieces: result tables, order statistics, the machine description, memory sampling.

A measuring device of result tables, order statistics, the machine line and memory sampling, used by every benchmark.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Table:
    """One benchmark's result: a markdown table plus the command that reproduces it and the checks it made.

    ``checks`` are correctness facts (ground-truth equality, accounting identities); a False check makes the CLI
    exit non-zero. Timings are never checks: benchmarks are not timed tests.
    """

    key: str
    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    command: str = ""
    checks: dict[str, bool] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)  # raw numbers for --json and the smoke test

    def markdown(self) -> str:
        out = [f"### {self.title}", ""]
        if self.command:
            out += [f"Command: `{self.command}`", ""]
        out.append("| " + " | ".join(self.columns) + " |")
        out.append("|" + "|".join("---" for _ in self.columns) + "|")
        for row in self.rows:
            out.append("| " + " | ".join(_cell(v) for v in row) + " |")
        if self.checks:
            out += ["", "Checks: " + ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in self.checks.items())]
        if self.notes:
            out += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(out) + "\n"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if value != 0 and abs(value) < 0.01:
            return f"{value:.2e}"
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def flush_cpu_ns(flush: Callable[[], object], empty: int = 3) -> int:
    """Process CPU (all threads) of ``flush()``, less the least of ``empty`` flushes right after it, which have nothing
    left to export: what remains is the work the flush pushed out (span export), not its fixed cost (a forced
    metric collection and export, which a running process pays once per export interval, not once per block). The
    least of several: one follow-up flush that meets a busy machine would make the work look negative."""

    def cost() -> int:
        c0 = time.process_time_ns()
        flush()
        return time.process_time_ns() - c0

    first = cost()
    return first - min(cost() for _ in range(empty))


def slope_per_minute(samples: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of ``(seconds, value)`` samples, per minute (NaN for fewer than 3 samples)."""
    n = len(samples)
    if n < 3:
        return float("nan")
    mx = sum(t for t, _ in samples) / n
    my = sum(v for _, v in samples) / n
    sxx = sum((t - mx) ** 2 for t, _ in samples)
    if sxx == 0:
        return float("nan")
    sxy = sum((t - mx) * (v - my) for t, v in samples)
    return sxy / sxx * 60.0


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; falls back to the peak from getrusage elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_thread_id() -> int | None:
    """The native id of this process's otel_hicache host thread; None without one."""
    from otel_hicache._internal.host.worker import HOST_THREAD_NAME

    for thread in threading.enumerate():
        if thread.name == HOST_THREAD_NAME and thread.native_id is not None:
            return thread.native_id
    return None


def thread_cpu_ns(pid: int, tid: int) -> int:
    """CPU time of thread ``tid`` of process ``pid`` so far, in ns (``/proc/PID/task/TID/schedstat``); 0 once it
    ended."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


class RssSampler:
    """Samples RSS every ``interval_s`` on a daemon thread; ``samples`` is ``[(seconds since start, bytes)]``."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss-sampler", daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> RssSampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join(5)
        return self.samples

    def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic() - self._t0, float(rss_bytes())))
            if self._stop.wait(self.interval_s):
                return


def machine() -> dict[str, str]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    try:
        from importlib.metadata import version

        info["opentelemetry-sdk"] = version("opentelemetry-sdk")
        info["prometheus-client"] = version("prometheus-client")
    except Exception:
        pass
    return info


def machine_line() -> str:
    return ", ".join(f"{k} {v}" for k, v in machine().items())


def dump_json(tables: Sequence[Table], path: str) -> None:
    with open(path, "w") as f:
        json.dump({"machine": machine(), "tables": [t.to_json() for t in tables]}, f, indent=2, default=str)
