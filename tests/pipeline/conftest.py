"""Fixtures for the pipeline tests: paths of the shipped configs, and one real Prometheus server per session."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "collector-config"
RULES = CONFIG / "rules" / "hicache.rules.yml"
DASHBOARD = CONFIG / "grafana" / "dashboards" / "otel-hicache.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def needs(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed (apt-get install prometheus)")
    return path


@dataclass
class Prometheus:
    """A running Prometheus server with the shipped config, scraping ``127.0.0.1:target_port`` every second."""

    url: str
    target_port: int
    process: subprocess.Popen[bytes]

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the result vector (each item: ``metric`` labels and ``value``)."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return list(data["result"])


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """The shipped ``prometheus.yml`` and rules, re-pointed at a local exporter, 1 s scrape and evaluation.

    Prometheus takes its first scrape ~5 s after start, so one server serves the whole session.
    """
    binary = needs("prometheus")
    config = yaml.safe_load((CONFIG / "prometheus.yml").read_text())
    target_port = free_port()
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "otel-collector")
    job["static_configs"] = [{"targets": [f"127.0.0.1:{target_port}"]}]
    config["scrape_configs"] = [job]  # the collector's self-metrics job has no counterpart here
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(CONFIG / path) for path in config["rule_files"]]
    workdir = tmp_path_factory.mktemp("prometheus")
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--enable-feature=exemplar-storage",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(workdir / "prometheus.log").open("wb"),
    )
    server = Prometheus(f"http://127.0.0.1:{port}", target_port, process)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("prometheus did not start:\n" + (workdir / "prometheus.log").read_text()[-3000:])
            time.sleep(0.1)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
