"""An in-process OTLP receiver (gRPC and HTTP/protobuf) for tests and benchmarks.

The real OTel exporters deliver to it over real sockets on 127.0.0.1; it decodes the protobuf requests and keeps
them, so a test can compare what arrived with what was recorded. The faults a collector has: ``delay_s`` makes it a
slow receiver; ``stop()`` / ``start()`` on the same ports a collector that is down, then back; ``fail(status)`` one
that answers every export with an error (gRPC ``status``; HTTP 500) and keeps nothing; ``black_hole()`` one that
accepts connections on its ports and never answers.

    >>> from otel_hicache.testing.otlp_receiver import OtlpReceiver
    >>> with OtlpReceiver() as rx:
    ...     rx.grpc_endpoint.startswith("http://127.0.0.1:")
    True
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from otel_hicache import semconv as sc

ExportTraceRequest = trace_service_pb2.ExportTraceServiceRequest
ExportMetricsRequest = metrics_service_pb2.ExportMetricsServiceRequest
_Receiver = TypeVar("_Receiver", bound="OtlpReceiver")  # start() / __enter__ return a subclass as itself


class OtlpReceiver:
    """Receives OTLP traces and metrics over gRPC (``grpc_endpoint``) and HTTP (``http_endpoint``)."""

    def __init__(self, delay_s: float = 0.0, grpc_port: int = 0, http_port: int = 0) -> None:
        self.delay_s = delay_s
        self.trace_requests: list[ExportTraceRequest] = []
        self.metric_requests: list[ExportMetricsRequest] = []
        self.headers: list[dict[str, str]] = []  # request headers / gRPC metadata, lower-case keys
        self._lock = threading.Lock()
        self._grpc_port = grpc_port
        self._http_port = http_port
        self._grpc: grpc.Server | None = None
        self._http: ThreadingHTTPServer | None = None
        self._failing: grpc.StatusCode | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self: _Receiver) -> _Receiver:
        receiver = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                failing = receiver._failing
                if failing is not None:
                    context.abort(failing, "the test's collector refuses every export")
                receiver._keep(request, dict(context.invocation_metadata()))
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                failing = receiver._failing
                if failing is not None:
                    context.abort(failing, "the test's collector refuses every export")
                receiver._keep(request, dict(context.invocation_metadata()))
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self._grpc)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self._grpc)
        self._grpc_port = self._grpc.add_insecure_port(f"127.0.0.1:{self._grpc_port}")
        self._grpc.start()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/v1/traces":
                    request: Any = ExportTraceRequest()
                    response: Any = trace_service_pb2.ExportTraceServiceResponse()
                elif self.path == "/v1/metrics":
                    request = ExportMetricsRequest()
                    response = metrics_service_pb2.ExportMetricsServiceResponse()
                else:
                    self.send_error(404)
                    return
                if receiver._failing is not None:
                    self.send_error(500)
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    import gzip

                    body = gzip.decompress(body)
                request.ParseFromString(body)
                receiver._keep(request, {k.lower(): v for k, v in self.headers.items()})
                payload = response.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                return None

        self._http = ThreadingHTTPServer(("127.0.0.1", self._http_port), Handler)
        self._http.daemon_threads = True
        self._http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, name="otlp-http-receiver", daemon=True).start()
        return self

    def stop(self) -> None:
        """Close both listeners (the ports stay remembered, so ``start()`` reopens the same ones)."""
        if self._grpc is not None:
            self._grpc.stop(grace=None).wait(5)
            self._grpc = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def fail(self, status: grpc.StatusCode | None) -> None:
        """Answer every export with ``status`` from now on (HTTP: 500), keeping nothing; None: answer again."""
        self._failing = status

    @contextlib.contextmanager
    def black_hole(self) -> Iterator[None]:
        """Within the block, the receiver is stopped and its ports held by listeners that accept connections and never
        answer (no error, no progress: the worst collector); then it starts again on the same ports."""
        self.stop()
        listeners, held = [], []
        for port in (self._grpc_port, self._http_port):
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen(64)
            listener.settimeout(0.1)
            listeners.append(listener)
        stop = threading.Event()

        def accept() -> None:
            while not stop.is_set():
                for listener in listeners:
                    with contextlib.suppress(OSError):
                        held.append(listener.accept()[0])

        thread = threading.Thread(target=accept, name="otlp-black-hole", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            for held_socket in (*held, *listeners):
                held_socket.close()
            self.start()

    def __enter__(self: _Receiver) -> _Receiver:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ endpoints and data
    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self._grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self._http_port}"

    def _keep(self, request: Any, headers: dict[str, str]) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)  # a slow collector, on the receiving side only
        with self._lock:
            self.headers.append(headers)
            if isinstance(request, ExportTraceRequest):
                self.trace_requests.append(request)
            else:
                self.metric_requests.append(request)

    def spans(self) -> list[Span]:
        with self._lock:
            requests = list(self.trace_requests)
        return [span for r in requests for rs in r.resource_spans for ss in rs.scope_spans for span in ss.spans]

    def metrics(self) -> Iterator[Metric]:
        with self._lock:
            requests = list(self.metric_requests)
        for r in requests:
            for rm in r.resource_metrics:
                for sm in rm.scope_metrics:
                    yield from sm.metrics

    def latest_metric(self, name: str) -> Metric | None:
        """The last received export of metric ``name`` (cumulative metrics: the current totals)."""
        found = None
        for metric in self.metrics():
            if metric.name == name:
                found = metric
        return found

    def capacity_curve(self) -> dict[tuple[str, str], float]:
        """The last received ``hicache.capacity.hit_ratio``: ``(tier, factor) -> ratio`` (empty before any)."""
        metric = self.latest_metric(sc.METRIC_CAPACITY_HIT_RATIO)
        points = [] if metric is None else metric.gauge.data_points
        return {
            (attributes(p.attributes)[sc.ATTR_TIER], attributes(p.attributes)[sc.ATTR_CAPACITY_FACTOR]): p.as_double
            for p in points
        }

    def wait_for(self, predicate: Any, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.02)
        return bool(predicate())


def attributes(kvs: Any) -> dict[str, Any]:
    """OTLP ``KeyValue`` list as a plain dict."""
    out: dict[str, Any] = {}
    for kv in kvs:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = getattr(value, kind) if kind else None
    return out
