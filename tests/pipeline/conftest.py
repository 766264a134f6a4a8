"""Fixtures for the pipeline tests: one real Prometheus server per session, with the shipped config and rules."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Iterator

import pytest
import yaml

from otel_hicache.testing import free_port
from tests.pipeline.support import CONFIG, Prometheus, needs


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
