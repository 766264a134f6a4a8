"""Helpers of the pipeline tests: paths of the shipped configs and a client of a running Prometheus server."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "collector-config"
RULES = CONFIG / "rules" / "hicache.rules.yml"
DASHBOARD = CONFIG / "grafana" / "dashboards" / "otel-hicache.json"


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

    def wait_for_data(self, ready: list[str], app: subprocess.Popen[str], what: str, timeout_s: float) -> None:
        """Until every query in ``ready`` returns data (several scrapes of ``app`` stored, the rules built on rates
        evaluated); fails at once, with the app's output, if ``app`` exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if app.poll() is not None:
                out, err = app.communicate()
                pytest.fail(f"{what} exited early ({app.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
            if all(self.query(expr) for expr in ready):
                return
            time.sleep(0.5)
        pytest.fail(f"Prometheus never stored enough scrapes of {what}")
