"""An OTLP receiver in a child process: the benchmarks' stand-in for a Collector on the same host.

Running it out of process keeps its protobuf decoding out of the measured process's CPU time and its memory out of
the measured RSS, as with a real Collector. It counts spans and keeps only the latest value of each metric stream,
so it runs for minutes in flat memory.

Protocol (line-based JSON on stdin/stdout): on start it prints ``{"grpc": URL, "http": URL}``; each ``stats`` line
is answered with the counts; ``quit`` exits. :class:`CollectorProcess` wraps this for the parent.

A measuring device of an OTLP receiver out of the measured process, used by hotpath, loop, soak and sglang.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from typing import Any

from otel_hicache.testing.otlp_receiver import ExportTraceRequest, OtlpReceiver, attributes


class CountingReceiver(OtlpReceiver):
    """Keeps span counts by name and the latest data points of every metric, not the requests themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.span_counts: Counter[str] = Counter()
        self.latest: dict[str, list[Any]] = {}
        self.trace_batches = 0
        self.metric_batches = 0

    def _keep(self, request: Any, *_context: Any) -> None:  # the base class's hook for every decoded request
        with self._lock:
            if isinstance(request, ExportTraceRequest):
                self.trace_batches += 1
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            self.span_counts[span.name] += 1
                return
            self.metric_batches += 1
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        self.latest[f"{sm.scope.name}/{metric.name}"] = _points(metric)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "spans": sum(self.span_counts.values()),
                "spans_by_name": dict(self.span_counts),
                "trace_batches": self.trace_batches,
                "metric_batches": self.metric_batches,
                "metrics": dict(self.latest),
            }


def _points(metric: Any) -> list[Any]:
    kind = metric.WhichOneof("data")
    if kind in ("sum", "gauge"):
        out = []
        for p in getattr(metric, kind).data_points:
            value = p.as_int if p.WhichOneof("value") == "as_int" else p.as_double
            out.append([attributes(p.attributes), value])
        return out
    if kind == "histogram":
        return [[attributes(p.attributes), p.count, p.sum] for p in metric.histogram.data_points]
    return []


def main() -> None:
    receiver = CountingReceiver().start()
    print(json.dumps({"grpc": receiver.grpc_endpoint, "http": receiver.http_endpoint}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "stats":
            print(json.dumps(receiver.stats()), flush=True)
        elif command == "quit":
            break
    receiver.stop()


class CollectorProcess:
    """Starts ``python -m benchmarks._collector`` and talks to it."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks._collector"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._lock = threading.Lock()
        assert self._proc.stdout is not None
        first = self._proc.stdout.readline()
        if not first:
            raise RuntimeError("the OTLP receiver child process did not start")
        endpoints = json.loads(first)
        self.grpc_endpoint: str = endpoints["grpc"]
        self.http_endpoint: str = endpoints["http"]
        self.pid = self._proc.pid

    def stats(self) -> dict[str, Any]:
        with self._lock:
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write("stats\n")
            self._proc.stdin.flush()
            return json.loads(self._proc.stdout.readline())

    def close(self) -> None:
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.write("quit\n")
                self._proc.stdin.flush()
            self._proc.wait(10)
        except Exception:
            self._proc.kill()
            self._proc.wait(5)

    def __enter__(self) -> CollectorProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


if __name__ == "__main__":
    main()
