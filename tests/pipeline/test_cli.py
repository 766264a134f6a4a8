# ruff: noqa: E501  (the case table reads best one case per line)
"""``otel-hicache demo``: the summary a person reads, clear errors for bad input, and OTLP delivery."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner, Result

from otel_hicache import semconv as sc
from otel_hicache.cli import main
from otel_hicache.testing import free_port
from otel_hicache.testing.otlp_receiver import OtlpReceiver, attributes

#: No OTEL_* from the developer's shell: the embedded default unless a test sets otherwise.
CLEAN_ENV = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": None,
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": None,
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": None,
    "OTEL_TRACES_EXPORTER": None,
    "OTEL_METRICS_EXPORTER": None,
    "OTEL_SDK_DISABLED": None,
}


def run(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env={**CLEAN_ENV, **(env or {})})


@pytest.fixture(scope="module")
def summary_run() -> Result:
    return run("demo", "--requests", "60", "--no-progress")


def test_demo_prints_every_summary_section(summary_run: Result) -> None:
    assert summary_run.exit_code == 0, summary_run.output
    out = summary_run.output
    assert out.startswith("otel-hicache demo: 60 requests in ")
    for heading in (
        "Prefix hits (share of",
        "Transfers by operation",
        "Tokens and bytes by operation and pool",
        "Drops (device KV lost without a host copy)",
        "Evictions: device",
        "KV wait per request",
        "Is each tier the right size",
        "Wasted movement",
        "Load vs recompute",
        "What if each tier were bigger or smaller",
        "Telemetry: ",
    ):
        assert heading in out, heading
    for tier in ("device", "host", "storage", "computed"):
        assert any(line.split()[:1] == [tier] and line.strip().endswith("tokens") for line in out.splitlines()), tier
    for op in sc.TransferOperation:
        assert any(line.split()[:1] == [op.value] for line in out.splitlines()), op
    assert "bandwidth = bytes / sum of copy durations, timed by " in out
    assert "recompute cost: needs the engine's prefill timing; the demo has no model" in out


def test_demo_compares_loads_with_the_recompute_cost_it_is_given() -> None:
    """The ratio itself is summarize()'s (tests/pipeline/test_summary.py); here the flag reaches it and the verdict."""
    result = run("demo", "--requests", "60", "--no-progress", "--prefill-seconds-per-token", "1e-9")
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.output.splitlines() if line.split()[:1] == ["load_back"] and "/token" in line]
    assert "vs recompute 1 ns/token" in line and "loading is slower" in line  # 1 ns: no copy is that fast
    assert "recompute cost: needs" not in result.output


def test_json_summary_matches_the_demos_own_ground_truth() -> None:
    """The summary is computed from the telemetry; the demo counts at the copy sites: they must agree."""
    result = run("demo", "--requests", "60", "--no-progress", "--json")
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    truth = body["result"]
    for op, by_pool in truth["copied_tokens"].items():
        for pool, n in by_pool.items():
            assert body["tokens"].get(f"{op}/{pool}", 0) == n, (op, pool)
    for op, by_pool in truth["copied_bytes"].items():
        assert body["bytes_by_operation"][op] == sum(by_pool.values()), op
    assert body["prefill_tokens"] == truth["prefix_tokens"]
    for reason, by_pool in truth["dropped_tokens_by_pool"].items():
        for pool, n in by_pool.items():
            assert body["drops"].get(f"{reason}/{pool}", 0) == n, (reason, pool)
    assert body["evictions"] == truth["evicted_tokens"]
    for tier, evicted in truth["evicted_tokens"].items():  # the reference cache knows every entry's reuse
        sizing = body["tier_sizing"][tier]
        assert sizing["evicted_tokens"] == sizing["reuse_known_tokens"] == evicted
        assert 0 <= sizing["never_reused_share"] <= 1 and sizing["age"]["count"] > 0
    assert body["kv_waits"]["host"]["count"] > 0 and body["kv_waits"]["storage"]["count"] > 0
    assert 0 < body["wasted_bytes"]["backup"] <= body["bytes_by_operation"]["backup"]
    assert body["wasted_shares"]["storage_backup"] == 0  # the demo's L3 store never evicts
    assert body["load_seconds_per_token"]["load_back"] > 0
    assert body["prefill_seconds_per_token"] is None and body["load_vs_recompute"] == {}
    assert body["spans_recorded"] > 0 and body["pipeline"] == {"rejected": 0, "normalized": 0, "dropped_spans": 0}
    backup = body["durations"]["backup"]
    assert 0 < backup["p50_s"] <= backup["p99_s"]
    assert body["bandwidth_bytes_per_s"]["backup"] > 0


def test_tiers_sized_on_the_command_line_carry_their_capacity_curve_in_the_json() -> None:
    result = run(
        "demo", "--requests", "60", "--no-progress", "--json", "--device-tokens", "768", "--host-tokens", "3072"
    )
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert set(body["capacity"]) == {"device", "host"}
    for tier, tokens in (("device", 768), ("host", 3072)):
        curve = body["capacity"][tier]
        assert curve["tokens"] == tokens and list(curve["hit_ratio"]) == list(sc.CAPACITY_FACTORS)
        ratios = list(curve["hit_ratio"].values())
        assert all(0 <= r <= 1 for r in ratios) and ratios == sorted(ratios), (tier, ratios)  # bigger never serves less
    device, host = body["capacity"]["device"]["hit_ratio"], body["capacity"]["host"]["hit_ratio"]
    assert host["1"] >= device["1"] and host["inf"] == device["inf"]  # the host serves what the device does, and more
    assert set(body["hit_rates"]) == {"device", "host", "storage"}  # hit_rates keeps its meaning
    table = run("demo", "--requests", "60", "--no-progress", "--device-tokens", "768").output
    (device_row,) = [line for line in table.splitlines() if line.split()[:2] == ["device", "768"]]
    assert device_row.endswith(" pt")  # the model's error at 1x, beside the observed share


def test_the_what_if_is_given_in_memory_and_prefill_seconds_from_the_runs_own_numbers() -> None:
    """Each tier's memory at a size is its kv capacity change times the bytes its transfers moved per kv token (every
    pool's), and the prefill it saves the share it gains times the run's prompt tokens per second times the recompute
    cost given: the recording rules' arithmetic on the demo's JSON."""
    result = run("demo", "--requests", "60", "--no-progress", "--json", "--prefill-seconds-per-token", "2e-5")
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    moves = ("backup", "load_back")
    per_token = sum(body["bytes_by_operation"][op] for op in moves) / sum(body["tokens"][f"{op}/kv"] for op in moves)
    assert per_token > 1024  # the demo's kv pool keeps 1 KiB per token; its sidecar and state pools add to it
    rate = sum(body["prefill_tokens"].values()) / body["elapsed_s"]
    decisions = {(d["tier"], d["factor"]): d for d in body["size_decisions"]}
    assert set(decisions) == {(tier, f) for tier in ("device", "host") for f in ("0.5", "2", "4")}
    for (tier, factor), d in decisions.items():
        curve = body["capacity"][tier]
        assert d["memory_bytes"] == pytest.approx((float(factor) - 1) * curve["tokens"] * per_token)
        gained = (curve["hit_ratio"][factor] - curve["hit_ratio"]["1"]) * rate
        assert d["prefill_tokens_per_s"] == pytest.approx(gained, rel=1e-3)
        assert d["prefill_seconds_per_s"] == pytest.approx(gained * 2e-5, rel=1e-3)
    assert decisions["device", "2"]["prefill_seconds_per_s"] > 0 > decisions["device", "0.5"]["prefill_seconds_per_s"]
    table = run("demo", "--requests", "60", "--no-progress").output
    (row,) = [line.split() for line in table.splitlines() if line.split()[:2] == ["host", "2x"]]
    assert row[2].startswith("+") and row[3] in ("KiB", "MiB")  # "+1.9 MiB" of host memory ...
    assert "give --prefill-seconds-per-token" in table  # ... and the prefill, once the cost is given


def test_seed_selects_the_workload() -> None:
    """Same seed, same prompts (the hit split may differ: copies complete asynchronously); another seed, others."""

    def prefill_total(seed: int) -> int:
        result = run("demo", "--requests", "40", "--seed", str(seed), "--json")
        assert result.exit_code == 0, result.output
        return sum(json.loads(result.output)["prefill_tokens"].values())

    assert prefill_total(7) == prefill_total(7) != prefill_total(8)


#: (flags, OTEL_* variables, what the one "Error:" line must say: the flag or variable and the accepted form)
BAD_INPUT: list[tuple[list[str], dict[str, str], str]] = [  # unformatted: one case a line, as the table reads
    (["--requests", "0"], {}, "Invalid value for '--requests': 0 is not in the range x>=1"),
    (["--requests", "-5"], {}, "Invalid value for '--requests'"),
    (["--requests", "many"], {}, "Invalid value for '--requests'"),
    (["--seconds", "-1"], {}, "Invalid value for '--seconds'"),
    (["--seconds", "0"], {}, "Invalid value for '--seconds'"),
    (["--seconds", "nan"], {}, "Invalid value for '--seconds': 'nan' is not a finite number"),
    (["--seconds", "inf"], {}, "Invalid value for '--seconds': 'inf' is not a finite number"),
    (["--requests", "5", "--seconds", "1"], {}, "either --requests or --seconds"),
    (["--seed", "x"], {}, "Invalid value for '--seed'"),
    (["--device", "tpu"], {}, "Invalid value for '--device'"),
    (["--write-policy", "sometimes"], {}, "Invalid value for '--write-policy'"),
    (["--protocol", "thrift"], {}, "Invalid value for '--protocol'"),
    (["--endpoint", "localhost:4317"], {}, "--endpoint='localhost:4317' is not valid; use an http:// or https:// URL"),
    (["--endpoint", "http://[::1"], {}, "--endpoint='http://[::1' is not valid"),
    (["--endpoint", "http://localhost:70000"], {}, "--endpoint='http://localhost:70000' is not valid"),
    (["--service-name", " "], {}, "--service-name=' ': use a non-empty name"),
    (["--prometheus-port", "70000"], {}, "Invalid value for '--prometheus-port'"),
    (["--prometheus-port", "-1"], {}, "Invalid value for '--prometheus-port'"),
    (["--prometheus-host", "local host", "--prometheus-port", "0"], {}, "--prometheus-host='local host' is not valid"),
    (["--linger", "5"], {}, "--linger only applies with --prometheus-port"),
    (["--linger", "-1", "--prometheus-port", "0"], {}, "Invalid value for '--linger'"),
    (["--linger", "nan", "--prometheus-port", "0"], {}, "Invalid value for '--linger': 'nan' is not a finite number"),
    (["--prefill-seconds-per-token", "0"], {}, "Invalid value for '--prefill-seconds-per-token': 0.0 is not in the range x>0"),
    (["--prefill-seconds-per-token", "inf"], {}, "Invalid value for '--prefill-seconds-per-token': 'inf' is not a finite number"),
    (["--prefill-seconds-per-token", "fast"], {}, "Invalid value for '--prefill-seconds-per-token'"),
    (["--storage-dir", "/proc/otel-hicache/l3"], {}, "--storage-dir='/proc/otel-hicache/l3': No such file or directory"),
    (["--storage-dir", "/etc/hostname"], {}, "Invalid value for '--storage-dir'"),
    ([], {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1"}, "OTEL_EXPORTER_OTLP_ENDPOINT='http://[::1' is not valid"),
    ([], {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:99999"}, "OTEL_EXPORTER_OTLP_ENDPOINT="),
    ([], {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317 "}, "OTEL_EXPORTER_OTLP_ENDPOINT='http://collector:4317 ' is not valid"),
    ([], {"OTEL_PYTHON_CONTEXT": "nope"}, "OTEL_PYTHON_CONTEXT='nope' is not valid"),
    ([], {"OTEL_EXPORTER_OTLP_PROTOCOL": "udp"}, "OTEL_EXPORTER_OTLP_PROTOCOL='udp' is not supported"),
    ([], {"OTEL_EXPORTER_OTLP_HEADERS": "api key=1"}, "OTEL_EXPORTER_OTLP_HEADERS: the name of member 1 is not a header name"),
    ([], {"OTEL_EXPORTER_OTLP_TIMEOUT": "-3"}, "OTEL_EXPORTER_OTLP_TIMEOUT='-3' is out of range"),
    ([], {"OTEL_EXPORTER_OTLP_COMPRESSION": "brotli"}, "OTEL_EXPORTER_OTLP_COMPRESSION='brotli'"),
    ([], {"OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent/ca.pem"}, "OTEL_EXPORTER_OTLP_CERTIFICATE="),
    ([], {"OTEL_TRACES_SAMPLER": "bogus"}, "OTEL_TRACES_SAMPLER='bogus' is not supported"),
    ([], {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"}, "OTEL_TRACES_SAMPLER_ARG='1.5'"),
    ([], {"OTEL_METRIC_EXPORT_INTERVAL": "soon"}, "OTEL_METRIC_EXPORT_INTERVAL='soon' is not a number"),
    (["--device-tokens", "8"], {}, "'--device-tokens': 8 is not in the range x>=16"),
    ([], {"OTEL_METRIC_EXPORT_TIMEOUT": "-1"}, "OTEL_METRIC_EXPORT_TIMEOUT='-1' is out of range"),
    ([], {"OTEL_BSP_MAX_QUEUE_SIZE": "0"}, "OTEL_BSP_MAX_QUEUE_SIZE='0' is not valid"),
    ([], {"OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "many"}, "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT='many' is not valid"),
    ([], {"OTEL_METRICS_EXEMPLAR_FILTER": "sometimes"}, "OTEL_METRICS_EXEMPLAR_FILTER='sometimes'"),
    ([], {"OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "x"}, "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"),
    ([], {"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "x"}, "OTEL_EXPORTER_PROMETHEUS_PORT='x'"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "env", "message"),
    BAD_INPUT,
    ids=[" ".join(a) or ",".join(f"{k}={v}" for k, v in e.items()) for a, e, _ in BAD_INPUT],
)
def test_bad_flags_and_variables_exit_2_with_one_line_naming_them(
    args: list[str], env: dict[str, str], message: str
) -> None:
    """The installed command in its own process: exit 2, one "Error:" line on stderr, no traceback, no output."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-m", "otel_hicache.cli", "demo", "--no-progress", *(args or ["--requests", "5"])],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_cuda_requested_where_there_is_none_is_a_clear_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    result = run("demo", "--device", "cuda", "--requests", "5")
    assert result.exit_code == 2
    assert "CUDA is not available" in result.output


def test_a_taken_prometheus_port_is_a_clear_error() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = run("demo", "--requests", "5", "--prometheus-port", str(busy.getsockname()[1]))
    assert result.exit_code == 2
    assert "cannot serve Prometheus metrics on 127.0.0.1:" in result.output


@pytest.mark.parametrize(("protocol", "endpoint"), [("grpc", "grpc_endpoint"), ("http/protobuf", "http_endpoint")])
def test_endpoint_delivers_spans_and_metrics_to_an_otlp_receiver(protocol: str, endpoint: str) -> None:
    with OtlpReceiver() as receiver:
        result = run(
            "demo",
            "--requests",
            "30",
            "--no-progress",
            "--json",
            "--endpoint",
            getattr(receiver, endpoint),
            "--protocol",
            protocol,
            "--service-name",
            "cli-test",
        )
        assert result.exit_code == 0, result.output
        body = json.loads(result.output)
        assert body["mode"] == "otlp"
        # shutdown flushed both signals before the command returned
        spans = receiver.spans()
        names = {s.name for s in spans}
        assert {"hicache.backup", "hicache.load_back"} <= names
        tokens = receiver.latest_metric(sc.METRIC_TRANSFER_TOKENS)
        assert tokens is not None
        received = {
            (attributes(p.attributes)[sc.ATTR_OPERATION], attributes(p.attributes)[sc.ATTR_POOL]): p.as_int
            for p in tokens.sum.data_points
        }
        truth = body["result"]["copied_tokens"]
        assert received[("backup", "kv")] == truth["backup"]["kv"]
        assert received[("load_back", "kv")] == truth["load_back"]["kv"]
        resource = attributes(receiver.trace_requests[0].resource_spans[0].resource.attributes)
        assert resource["service.name"] == "cli-test"
        assert resource[sc.RESOURCE_ENGINE] == "reference"
        # the summary waited for the collector's answer: what it calls delivered is what the receiver holds
        delivery = body["delivery"]
        assert (delivery["exported"], delivery["failed"], delivery["shed"]) == (len(spans), 0, 0)
        assert delivery["complete"] is True


def test_otlp_endpoint_from_the_standard_environment_variable() -> None:
    with OtlpReceiver() as receiver:
        result = run(
            "demo",
            "--requests",
            "20",
            "--no-progress",
            env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
        )
        assert result.exit_code == 0, result.output
        spans = receiver.spans()
        assert spans and receiver.latest_metric(sc.METRIC_PREFILL_TOKENS) is not None
        assert result.output.splitlines()[1] == (
            f"OTLP to the collector at {receiver.http_endpoint}/v1/traces: {len(spans)} spans delivered, 0 dropped "
            "(0 not taken, 0 shed with the queue full); counters below are this process's exact totals."
        )


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_demo_against_a_closed_port_says_nothing_was_delivered_and_names_the_collector(protocol: str) -> None:
    """Nothing listens: the run itself worked (exit 0), and the summary says the collector took nothing, names it
    (without the userinfo the URL carried, for http/protobuf) and never says exported."""
    port = free_port()
    userinfo = "user:pw@" if protocol == "http/protobuf" else ""  # grpc refuses userinfo
    endpoint = f"http://{userinfo}127.0.0.1:{port}"
    result = run("demo", "--requests", "20", "--no-progress", "--endpoint", endpoint, "--protocol", protocol)
    assert result.exit_code == 0, result.output
    shown = f"http://{'***@' if userinfo else ''}127.0.0.1:{port}{'/v1/traces' if userinfo else ''}"
    assert result.output.splitlines()[1] == (
        f"OTLP: nothing delivered yet: the collector at {shown} took no span in the 5 s this summary waited (0 dropped "
        "so far): is it running and reachable? Counters below are this process's own totals, not what the collector "
        "has."
    )
    assert "Exported" not in result.output and "spans delivered" not in result.output and "pw@" not in result.output


def test_a_collector_that_refuses_every_export_is_named_with_every_span_dropped() -> None:
    """An OTLP/HTTP endpoint that answers 400 (not retried): each span is dropped at once, and the summary says so."""
    refused: list[int] = []

    class Refusing(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            refused.append(1)
            self.send_response(400)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return None

    with ThreadingHTTPServer(("127.0.0.1", 0), Refusing) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        result = run("demo", "--requests", "20", "--no-progress", "--endpoint", endpoint, "--protocol", "http/protobuf")
        server.shutdown()
    assert result.exit_code == 0, result.output
    line = result.output.splitlines()[1]
    said = re.fullmatch(
        rf"OTLP: nothing delivered: the collector at {endpoint}/v1/traces took none of (\d+) spans, all dropped: is it "
        r"running and reachable\? Counters below are this process's own totals, not what the collector has\.",
        line,
    )
    assert said is not None, line
    assert int(said.group(1)) > 0 and refused  # the collector was asked, and refused them all


def test_prometheus_port_serves_the_run_while_lingering() -> None:
    """The installed console script, in its own process: the scrape endpoint stays up for --linger seconds."""
    import shutil
    import time

    from otel_hicache.testing import free_port

    port = free_port()
    script = shutil.which("otel-hicache") or f"{sys.executable} -m otel_hicache.cli"
    command = [
        *script.split(),
        "demo",
        "--requests",
        "20",
        "--no-progress",
        "--prometheus-port",
        str(port),
        "--linger",
        "30",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, text = time.monotonic() + 60, ""
        while time.monotonic() < deadline and "hicache_transfer_tokens_total" not in text:
            assert process.poll() is None, process.communicate()
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                time.sleep(0.2)
        # the run is over (summary printed) but the endpoint still answers with its final totals
        assert process.stderr is not None
        deadline = time.monotonic() + 60
        assert process.stderr is not None
        while "Serving Prometheus metrics" not in (line := process.stderr.readline()) and time.monotonic() < deadline:
            assert line, "the CLI ended without lingering"
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        assert 'hicache_transfer_tokens_total{hicache_operation="backup",hicache_pool="kv"' in text
        assert "hicache_transfer_duration_seconds_bucket" in text
    finally:
        process.terminate()
        process.communicate(timeout=30)
    assert process.returncode == 130  # SIGTERM ends the linger cleanly


def test_progress_bar_counts_requests_on_stderr_and_stays_off_when_asked() -> None:
    shown = CliRunner().invoke(main, ["demo", "--requests", "30", "--progress"], env=CLEAN_ENV)
    assert shown.exit_code == 0
    assert "/30 [" in shown.stderr and "req/s" in shown.stderr
    assert "req/s" not in shown.stdout  # the summary on stdout stays clean for pipes
    hidden = CliRunner().invoke(main, ["demo", "--requests", "30", "--no-progress"], env=CLEAN_ENV)
    assert "req/s" not in hidden.stderr
