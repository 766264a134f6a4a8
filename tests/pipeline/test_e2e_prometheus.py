"""End to end: the real demo exports through the Prometheus exporter, a real Prometheus scrapes it, and every
recording rule, alert expression and dashboard panel query of the shipped configs returns data with the labels
the rules and panels rely on.

The demo also exports OTLP into an in-process receiver, as a deployment exports spans to a Collector, so the
OTel SDK's own pipeline metrics (``otel_sdk_processor_span_processed_total``) exist for the pipeline rules.
The queries run while the demo is still serving load: pool occupancy is only reported while the cache is alive.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from otel_hicache.testing.otlp_receiver import OtlpReceiver
from tests.pipeline.support import DASHBOARD, RULES, Prometheus

pytestmark = pytest.mark.prometheus

#: The labels each rule's result must carry: the spec of what dashboards and alert routing can group by.
RULE_LABELS: dict[str, set[str]] = {
    "hicache:prefill_hit_ratio:rate5m": {"job", "instance"},
    "hicache:prefill_hit_ratio_by_mode:rate5m": {"job", "instance", "hicache_prefill_mode"},
    "hicache:prefill_hit_ratio:avg1h": {"job", "instance"},
    "hicache:transfer_bandwidth_bytes_per_second:rate5m": {"job", "instance", "hicache_operation"},
    "hicache:l2_link_bandwidth_bytes_per_second": set(),
    "hicache:drop_ratio:rate5m": {"job", "instance"},
    "hicache:pool_used_ratio": {"job", "instance", "hicache_tier", "hicache_pool"},
    "hicache:telemetry_records_lost:rate5m": {"job", "instance"},
    "otel_sdk:span_drop_ratio:rate5m": {"job", "instance"},
    "HiCacheDropRateHigh": {"job", "instance"},
    "HiCacheL2BandwidthLow": {"job", "instance", "hicache_operation"},
    "HiCacheHostPoolSaturated": {"job", "instance", "hicache_tier", "hicache_pool"},
    "HiCachePrefixHitRateCollapse": {"job", "instance"},
    "HiCacheTelemetryRecordsLost": {"job", "instance"},
    "OTelSDKSpansDropped": {"job", "instance"},
}
#: Grafana's variables, as the dashboard would expand them with "All" selected.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$job": ".+", "$instance": ".+"}


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def signal_of(alert_expr: str) -> str:
    """The alert expression with its comparison made a ``bool`` one: every series it watches, firing or not."""
    depth, brace, quote, found = 0, 0, "", []
    i = 0
    while i < len(alert_expr):
        c = alert_expr[i]
        if quote:
            quote = "" if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == "{":
            brace += 1
        elif c == "}":
            brace -= 1
        elif depth == 0 and brace == 0 and c in "<>=!":
            op = alert_expr[i : i + 2] if alert_expr[i : i + 2] in ("<=", ">=", "==", "!=") else c
            found.append((i, op))
            i += len(op)
            continue
        i += 1
    assert len(found) == 1, f"expected one top-level comparison in {alert_expr!r}"
    ((at, op),) = found
    return f"{alert_expr[: at + len(op)]} bool{alert_expr[at + len(op) :]}"


@pytest.fixture(scope="module")
def live_demo(prometheus: Prometheus) -> Iterator[Prometheus]:
    """The CLI demo serving the Prometheus endpoint Prometheus scrapes, until the test module is done."""
    with OtlpReceiver() as receiver:
        # spans leave the SDK's batch processor every 200 ms, so its processed counter moves between scrapes
        env = dict(
            os.environ, OTEL_METRIC_EXPORT_INTERVAL="1000", OTEL_BSP_SCHEDULE_DELAY="200", OTEL_SERVICE_NAME="e2e"
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "otel_hicache.cli", "demo", "--seconds", "60", "--no-progress",
             "--prometheus-port", str(prometheus.target_port), "--endpoint", receiver.grpc_endpoint],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            _wait_for_data(prometheus, process)
            yield prometheus
        finally:
            process.send_signal(signal.SIGTERM)  # the CLI turns it into a clean, flushed shutdown
            try:
                _, err = process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                raise
            assert process.returncode == 130 and "interrupted" in err, err[-2000:]


def _wait_for_data(prometheus: Prometheus, process: subprocess.Popen[str], timeout_s: float = 60) -> None:
    """Until several scrapes of the live demo are stored and the rules built on rates have been evaluated."""
    deadline = time.monotonic() + timeout_s
    ready = [
        'count_over_time(hicache_transfer_tokens_total{hicache_operation="backup",hicache_pool="kv"}[1m]) >= 4',
        "hicache:prefill_hit_ratio:avg1h",
        # rates over two or more changing samples: finite values, not 0/0
        'hicache:transfer_bandwidth_bytes_per_second:rate5m{hicache_operation="backup"} > 0',
        "otel_sdk:span_drop_ratio:rate5m >= 0",
    ]
    while time.monotonic() < deadline:
        if process.poll() is not None:
            out, err = process.communicate()
            pytest.fail(f"the demo exited early ({process.returncode}):\n{out[-2000:]}\n{err[-2000:]}")
        if all(prometheus.query(expr) for expr in ready):
            return
        time.sleep(0.5)
    pytest.fail("Prometheus never stored enough scrapes of the demo")


def test_the_demo_is_scraped_as_a_healthy_target(live_demo: Prometheus) -> None:
    (target,) = live_demo.api("targets")["activeTargets"]
    assert target["health"] == "up", target.get("lastError")
    assert target["scrapeUrl"].endswith(f":{live_demo.target_port}/metrics")


def test_every_rule_is_known_to_this_test_and_evaluates_without_error(live_demo: Prometheus) -> None:
    names = {rule.get("record") or rule.get("alert") for rule in rules()}
    assert names == set(RULE_LABELS), "update RULE_LABELS with the labels a new rule's result carries"
    for group in live_demo.api("rules")["groups"]:
        for rule in group["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))


@pytest.mark.parametrize("name", sorted(RULE_LABELS))
def test_rule_returns_data_with_its_labels(live_demo: Prometheus, name: str) -> None:
    rule = next(r for r in rules() if name in (r.get("record"), r.get("alert")))
    expr = rule["expr"] if "record" in rule else signal_of(rule["expr"])
    result = live_demo.query(expr)
    assert result, f"{name}: no data for {expr}"
    for sample in result:
        labels = set(sample["metric"]) - {"__name__"}
        assert RULE_LABELS[name] <= labels, (name, sample["metric"])
        if "alert" in rule:
            templated = set(re.findall(r"\$labels\.(\w+)", json.dumps(rule["annotations"])))
            assert templated <= labels, f"{name}: annotations use labels the expression does not keep"


def test_rule_values_describe_the_demo(live_demo: Prometheus) -> None:
    """Not just present: hit ratios are fractions, the demo's copies have a positive bandwidth, nothing is lost."""
    (hit,) = live_demo.query("hicache:prefill_hit_ratio:rate5m")
    assert 0 < float(hit["value"][1]) < 1
    bandwidth = {s["metric"]["hicache_operation"]: float(s["value"][1])
                 for s in live_demo.query("hicache:transfer_bandwidth_bytes_per_second:rate5m")}  # fmt: skip
    assert bandwidth["backup"] > 0 and bandwidth["load_back"] > 0
    pools = live_demo.query('hicache:pool_used_ratio{hicache_tier="host"}')
    assert {s["metric"]["hicache_pool"] for s in pools} >= {"kv", "mamba"}
    assert all(0 <= float(s["value"][1]) <= 1 for s in pools)
    (lost,) = live_demo.query("hicache:telemetry_records_lost:rate5m")
    assert float(lost["value"][1]) == 0
    (sdk,) = live_demo.query("otel_sdk:span_drop_ratio:rate5m")
    assert float(sdk["value"][1]) == 0


def panel_targets() -> list[tuple[str, str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"], t.get("legendFormat", "")) for p in dashboard["panels"] for t in p["targets"]]


@pytest.mark.parametrize(("title", "expr", "legend"), panel_targets(), ids=[f"{t[0]}:{t[2]}" for t in panel_targets()])
def test_dashboard_query_returns_data_with_the_labels_its_legend_shows(
    live_demo: Prometheus, title: str, expr: str, legend: str
) -> None:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"{title}: an unexpanded Grafana variable in {expr}"
    result = live_demo.query(expr)
    assert result, f"{title}: no data for {expr}"
    legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
    for sample in result:
        assert legend_labels <= set(sample["metric"]), (title, legend, sample["metric"])
    if "histogram_quantile" in expr or "bandwidth" in title.lower():
        assert any(math.isfinite(float(s["value"][1])) and float(s["value"][1]) > 0 for s in result), title


def test_the_template_variables_list_the_demo(live_demo: Prometheus) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    for variable in dashboard["templating"]["list"]:
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["definition"])
        assert match, variable["definition"]
        selector = match.group(1).replace("$job", ".+")
        values = live_demo.api("series", **{"match[]": selector})
        assert {s[match.group(2)] for s in values}, variable["name"]
