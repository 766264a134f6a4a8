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
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from otel_hicache.capacity import WARM_LOOKUPS
from otel_hicache.testing.otlp_receiver import OtlpReceiver
from tests.pipeline.support import DASHBOARD, RULES, Prometheus

pytestmark = pytest.mark.prometheus

#: The labels each rule's result must carry: the spec of what dashboards and alert routing can group by.
RULE_LABELS: dict[str, set[str]] = {
    "hicache:prefill_hit_ratio:rate5m": {"job", "instance"},
    "hicache:prefill_hit_ratio_by_mode:rate5m": {"job", "instance", "hicache_prefill_mode"},
    "hicache:prefill_hit_ratio:avg1h": {"job", "instance"},
    "hicache:transfer_bandwidth_bytes_per_second:rate5m": {
        "job",
        "instance",
        "hicache_operation",
        "hicache_timing_source",
    },
    "hicache:l2_link_bandwidth_bytes_per_second": set(),
    "hicache:drop_ratio:rate5m": {"job", "instance"},
    "hicache:pool_used_ratio": {"job", "instance", "hicache_tier", "hicache_pool"},
    "hicache:telemetry_records_lost:rate5m": {"job", "instance"},
    "otel_sdk:span_drop_ratio:rate5m": {"job", "instance"},
    "hicache:eviction_never_reused_ratio:rate5m": {"job", "instance", "hicache_tier"},
    "hicache:wasted_ratio:rate5m": {"hicache_engine", "hicache_operation"},
    "hicache:load_seconds_per_token:rate5m": {"hicache_engine", "hicache_operation"},
    "hicache:engine_prefill_seconds_per_token:rate5m": {"hicache_engine"},
    "HiCacheDropRateHigh": {"job", "instance"},
    "HiCacheL2BandwidthLow": {"job", "instance", "hicache_operation", "hicache_timing_source"},
    "HiCacheHostPoolSaturated": {"job", "instance", "hicache_tier", "hicache_pool"},
    "HiCachePrefixHitRateCollapse": {"job", "instance"},
    "HiCacheTelemetryRecordsLost": {"job", "instance"},
    "OTelSDKSpansDropped": {"job", "instance"},
    "HiCacheLoadSlowerThanRecompute": {"hicache_engine", "hicache_operation"},
    "hicache:capacity_hit_ratio:gain_2x": {"job", "instance", "hicache_tier"},
    "hicache:capacity_hit_ratio:loss_half": {"job", "instance", "hicache_tier"},
    "hicache:kv_bytes_per_token:rate1h": {"job"},
    "hicache:capacity_memory_bytes:gain_2x": {"job", "instance", "hicache_tier"},
    "hicache:capacity_memory_bytes:loss_half": {"job", "instance", "hicache_tier"},
    "hicache:capacity_prefill_seconds_per_second:gain_2x": {"job", "instance", "hicache_tier", "hicache_engine"},
    "hicache:capacity_prefill_seconds_per_second:loss_half": {"job", "instance", "hicache_tier", "hicache_engine"},
    "HiCacheTierUndersized": {"job", "instance", "hicache_tier"},
    "HiCacheTierOversized": {"job", "instance", "hicache_tier"},
}
#: Rules and the panel built on hicache_timing_source of hicache_transfer_size_bytes_total (bandwidth from timed
#: transfers only, per timing source): checked by test_bandwidth_from_timed_transfers_per_timing_source.
BANDWIDTH_RULES = {"hicache:transfer_bandwidth_bytes_per_second:rate5m", "HiCacheL2BandwidthLow"}
BANDWIDTH_PANEL = 3
#: Built on an engine's own prefill timing (SGLang's or vLLM's series), which the demo - no model - does not have:
#: the promtool tests in rules/hicache.rules.test.yml evaluate them for each engine; here the rule is evaluated
#: (health ok) and the alert is checked on the live load seconds with a stand-in recompute cost.
RECOMPUTE = "hicache:engine_prefill_seconds_per_token:rate5m"
RECOMPUTE_RULES = {
    RECOMPUTE,
    "HiCacheLoadSlowerThanRecompute",
    "hicache:capacity_prefill_seconds_per_second:gain_2x",
    "hicache:capacity_prefill_seconds_per_second:loss_half",
}
#: Alerts that wait for a warm capacity curve (WARM_LOOKUPS lookups behind it), which the short demo run is not:
#: checked with the demo's own warmth standing in (test_the_capacity_alerts_read_the_live_curves_warmth).
WARM = f"(hicache_capacity_lookups) >= {WARM_LOOKUPS})"
WARM_RULES = {"HiCacheTierUndersized", "HiCacheTierOversized"}
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
            [
                sys.executable,
                "-m",
                "otel_hicache.cli",
                "demo",
                "--seconds",
                "60",
                "--no-progress",
                "--prometheus-port",
                str(prometheus.target_port),
                "--endpoint",
                receiver.grpc_endpoint,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            prometheus.wait_for_data(DEMO_READY, process, "the demo", timeout_s=60)
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


#: Several scrapes of the live demo stored, and the rules built on rates evaluated (finite values, not 0/0).
DEMO_READY = [
    'count_over_time(hicache_transfer_tokens_total{hicache_operation="backup",hicache_pool="kv"}[1m]) >= 4',
    "hicache:prefill_hit_ratio:avg1h",
    'rate(hicache_transfer_duration_seconds_sum{hicache_operation="backup"}[1m]) > 0',
    "otel_sdk:span_drop_ratio:rate5m >= 0",
    'hicache:load_seconds_per_token:rate5m{hicache_operation="load_back"} > 0',
    "rate(hicache_eviction_age_seconds_count[1m]) > 0",
]


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


@pytest.mark.parametrize("name", sorted(set(RULE_LABELS) - BANDWIDTH_RULES - RECOMPUTE_RULES - WARM_RULES))
def test_rule_returns_data_with_its_labels(live_demo: Prometheus, name: str) -> None:
    assert_rule_returns_data_with_its_labels(live_demo, name)


def assert_rule_returns_data_with_its_labels(live_demo: Prometheus, name: str, **substitute: str) -> list[Any]:
    """The rule's result (an alert's: every series it watches) carries RULE_LABELS[name]; ``substitute`` replaces
    text in the expression first."""
    rule = next(r for r in rules() if name in (r.get("record"), r.get("alert")))
    expr = rule["expr"] if "record" in rule else signal_of(rule["expr"])
    for old, new in substitute.items():
        assert old in expr, (name, old)
        expr = expr.replace(old, new)
    result = live_demo.query(expr)
    assert result, f"{name}: no data for {expr}"
    for sample in result:
        labels = set(sample["metric"]) - {"__name__"}
        assert RULE_LABELS[name] <= labels, (name, sample["metric"])
        if "alert" in rule:
            templated = set(re.findall(r"\$labels\.(\w+)", json.dumps(rule["annotations"])))
            assert templated <= labels, f"{name}: annotations use labels the expression does not keep"
    return result


def test_rule_values_describe_the_demo(live_demo: Prometheus) -> None:
    """Not just present: hit ratios are fractions, pools are fractions full, nothing is lost."""
    (hit,) = live_demo.query("hicache:prefill_hit_ratio:rate5m")
    assert 0 < float(hit["value"][1]) < 1
    pools = live_demo.query('hicache:pool_used_ratio{hicache_tier="host"}')
    assert {s["metric"]["hicache_pool"] for s in pools} >= {"kv", "mamba"}
    assert all(0 <= float(s["value"][1]) <= 1 for s in pools)
    (lost,) = live_demo.query("hicache:telemetry_records_lost:rate5m")
    assert float(lost["value"][1]) == 0
    (sdk,) = live_demo.query("otel_sdk:span_drop_ratio:rate5m")
    assert float(sdk["value"][1]) == 0


def panel_targets(bandwidth: bool = False) -> list[tuple[str, str, str]]:
    """(title, query, legend) of every panel target (rows hold none); only the bandwidth panel's with
    ``bandwidth``, else all others but those on an engine's own prefill timing (see RECOMPUTE)."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (p["title"], t["expr"], t.get("legendFormat", ""))
        for p in dashboard["panels"]
        for t in p.get("targets", [])
        if (p["id"] == BANDWIDTH_PANEL) == bandwidth and not any(rule in t["expr"] for rule in RECOMPUTE_RULES)
    ]


@pytest.mark.parametrize(("title", "expr", "legend"), panel_targets(), ids=[f"{t[0]}:{t[2]}" for t in panel_targets()])
def test_dashboard_query_returns_data_with_the_labels_its_legend_shows(
    live_demo: Prometheus, title: str, expr: str, legend: str
) -> None:
    assert_panel_query_returns_data(live_demo, title, expr, legend)


def assert_panel_query_returns_data(live_demo: Prometheus, title: str, expr: str, legend: str) -> None:
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


def test_the_new_answers_describe_the_demo(live_demo: Prometheus) -> None:
    """Shares are fractions, every tier the demo evicts from is there, and loads take some time per token."""
    never = live_demo.query("hicache:eviction_never_reused_ratio:rate5m")
    assert {s["metric"]["hicache_tier"] for s in never} == {"device", "host"}
    assert all(0 <= float(s["value"][1]) <= 1 for s in never if s["value"][1] != "NaN")
    wasted = live_demo.query("hicache:wasted_ratio:rate5m")
    assert {s["metric"]["hicache_engine"] for s in wasted} == {"reference"}  # from target_info
    assert {"backup", "storage_backup"} <= {s["metric"]["hicache_operation"] for s in wasted}
    assert all(0 <= float(s["value"][1]) <= 1 for s in wasted if s["value"][1] != "NaN")
    loads = {
        s["metric"]["hicache_operation"]: float(s["value"][1])
        for s in live_demo.query("hicache:load_seconds_per_token:rate5m")
    }
    assert set(loads) <= {"load_back", "storage_prefetch"} and 0 < loads["load_back"] < 1


def test_the_capacity_curve_of_each_tier_is_scraped_and_its_rules_describe_the_demo(live_demo: Prometheus) -> None:
    """Every factor of both tiers the demo sizes, from its engine; the gain and loss rules are the curve's steps."""
    curve = {
        (s["metric"]["hicache_tier"], s["metric"]["hicache_capacity_factor"]): float(s["value"][1])
        for s in live_demo.query(
            "hicache_capacity_hit_ratio * on (job, instance) group_left (hicache_engine) target_info"
        )
        if s["metric"]["hicache_engine"] == "reference"
    }
    assert set(curve) == {(tier, f) for tier in ("device", "host") for f in ("0.25", "0.5", "1", "2", "4", "8", "inf")}
    assert all(0 <= r <= 1 for r in curve.values())
    gains = {
        s["metric"]["hicache_tier"]: float(s["value"][1]) for s in live_demo.query("hicache:capacity_hit_ratio:gain_2x")
    }
    assert gains["device"] == pytest.approx(curve[("device", "2")] - curve[("device", "1")], abs=0.05)  # scrapes apart
    assert all(gain >= 0 for gain in gains.values())  # a bigger tier never serves less


def test_load_slower_than_recompute_matches_the_live_loads_by_engine(live_demo: Prometheus) -> None:
    """The alert on the demo's real load seconds, with a recompute cost for its engine standing in for the engine's
    own prefill timing (the demo has none): it keeps the labels its routing and annotations use, and fires only
    when the recompute cost is below the loads'."""
    name = "HiCacheLoadSlowerThanRecompute"

    def recompute_costs(seconds: str) -> dict[str, str]:
        return {RECOMPUTE: f'label_replace(vector({seconds}), "hicache_engine", "reference", "", "")'}

    fast = assert_rule_returns_data_with_its_labels(live_demo, name, **recompute_costs("1e-12"))
    assert [(s["metric"]["hicache_operation"], s["value"][1]) for s in fast] == [("load_back", "1")]  # firing
    slow = assert_rule_returns_data_with_its_labels(live_demo, name, **recompute_costs("1e3"))
    assert [s["value"][1] for s in slow] == ["0"]  # loading beats a 1,000 s recompute


def test_the_curve_in_memory_and_prefill_seconds_follows_the_live_pools_and_traffic(live_demo: Prometheus) -> None:
    """Doubling a tier takes its capacity today times the bytes the demo's transfers move per kv token (every
    pool's), halving frees half; the prefill seconds are the points gained times the prompt tokens per second times a
    recompute cost for the demo's engine (standing in for the engine's own prefill timing, which the demo lacks)."""
    (per_token,) = live_demo.query("hicache:kv_bytes_per_token:rate1h")
    assert float(per_token["value"][1]) > 1024  # the demo's kv pool keeps 1 KiB per token; sidecar and state add
    capacities = live_demo.query("hicache_capacity_tokens")
    limits = {s["metric"]["hicache_tier"]: float(s["value"][1]) for s in capacities}
    assert limits == {"device": 1536, "host": 1536}  # the demo's tiers
    for rule, factor in (("gain_2x", 1.0), ("loss_half", 0.5)):
        memory = live_demo.query(f"hicache:capacity_memory_bytes:{rule}")
        assert {s["metric"]["hicache_tier"] for s in memory} == {"device", "host"}
        for s in memory:
            expected = factor * limits[s["metric"]["hicache_tier"]] * float(per_token["value"][1])
            assert float(s["value"][1]) == pytest.approx(expected, rel=0.1), rule  # two reads a scrape apart
    cost = {RECOMPUTE: 'label_replace(vector(2e-5), "hicache_engine", "reference", "", "")'}
    for rule in ("gain_2x", "loss_half"):
        saved = assert_rule_returns_data_with_its_labels(
            live_demo, f"hicache:capacity_prefill_seconds_per_second:{rule}", **cost
        )
        assert {s["metric"]["hicache_tier"] for s in saved} == {"device", "host"}
        assert all(float(s["value"][1]) >= 0 for s in saved)  # a gain and a loss in points, both >= 0


def test_the_capacity_alerts_read_the_live_curves_warmth(live_demo: Prometheus) -> None:
    """The demo exports how many lookups each tier's curve rests on; the capacity alerts keep their labels when the
    warmth they wait for is the one the demo has reached."""
    warmth = {s["metric"]["hicache_tier"]: float(s["value"][1]) for s in live_demo.query("hicache_capacity_lookups")}
    assert set(warmth) == {"device", "host"} and 0 < min(warmth.values())
    pages = live_demo.query("hicache_capacity_sampled_pages")
    assert {s["metric"]["hicache_tier"] for s in pages} == {"device", "host"}
    for name in sorted(WARM_RULES):
        reached = f"(hicache_capacity_lookups) >= {min(warmth.values())})"
        assert_rule_returns_data_with_its_labels(live_demo, name, **{WARM: reached})


def test_the_template_variables_list_the_demo(live_demo: Prometheus) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    for variable in dashboard["templating"]["list"]:
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["definition"])
        assert match, variable["definition"]
        selector = match.group(1).replace("$job", ".+")
        values = live_demo.api("series", **{"match[]": selector})
        assert {s[match.group(2)] for s in values}, variable["name"]


def test_bandwidth_from_timed_transfers_per_timing_source(live_demo: Prometheus) -> None:
    """The L2 bandwidth rule, alert and panel on the live demo: bytes of timed transfers per timing source.

    Needs ``hicache.timing.source`` on ``hicache.transfer.size`` (series ``hicache_transfer_size_bytes_total{...,
    hicache_timing_source}``); the promtool tests in rules/hicache.rules.test.yml check the arithmetic on mixed
    timed and untimed input. The demo times its copies with CUDA events on a GPU and with the host clock on a CPU;
    the alert (CUDA-event timings only) is checked with the demo's own timing source in its place.
    """
    sizes = live_demo.query('hicache_transfer_size_bytes_total{hicache_operation="backup"}')
    assert sizes and all("hicache_timing_source" in s["metric"] for s in sizes), (
        f"hicache_transfer_size_bytes_total lacks hicache_timing_source: {sizes}"
    )
    sources = {s["metric"]["hicache_timing_source"] for s in sizes if float(s["value"][1]) > 0}
    timed = sources - {"none"}
    assert len(timed) == 1, sources  # one timing per device: CUDA events or the host clock
    (source,) = timed

    result = assert_rule_returns_data_with_its_labels(live_demo, "hicache:transfer_bandwidth_bytes_per_second:rate5m")
    bandwidth = {
        (s["metric"]["hicache_operation"], s["metric"]["hicache_timing_source"]): float(s["value"][1]) for s in result
    }
    assert bandwidth[("backup", source)] > 0 and bandwidth[("load_back", source)] > 0
    assert all(src != "none" for _, src in bandwidth), bandwidth

    alert = assert_rule_returns_data_with_its_labels(
        live_demo,
        "HiCacheL2BandwidthLow",
        **{'hicache_timing_source="cuda_event"': f'hicache_timing_source="{source}"'},
    )
    assert {s["metric"]["hicache_operation"] for s in alert} == {"backup", "load_back"}

    for title, expr, legend in panel_targets(bandwidth=True):
        assert_panel_query_returns_data(live_demo, title, expr, legend)
