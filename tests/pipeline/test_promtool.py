"""The shipped Prometheus config and rules pass promtool, and the alert rules behave as their unit tests say."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from otel_hicache.capacity import WARM_LOOKUPS
from tests.pipeline.support import CONFIG, DASHBOARD, RULES, needs

pytestmark = pytest.mark.prometheus


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([needs("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=CONFIG)


def test_prometheus_config_is_valid_and_its_rule_files_load() -> None:
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rules found" in result.stdout + result.stderr  # the rule file was followed, not skipped


def test_rules_are_valid() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rule_unit_tests_pass() -> None:
    result = promtool("test", "rules", "rules/hicache.rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_a_broken_expectation_fails_the_rule_unit_tests(tmp_path: Path) -> None:
    """The unit tests can fail: the same file with one threshold expectation changed does."""
    text = (CONFIG / "rules" / "hicache.rules.test.yml").read_text()
    broken = text.replace('summary: "node1: host pool kv is 98% full"', 'summary: "node1: host pool kv is 50% full"')
    assert broken != text
    (tmp_path / "hicache.rules.yml").write_text(RULES.read_text())
    (tmp_path / "broken.test.yml").write_text(broken)
    result = subprocess.run(
        [needs("promtool"), "test", "rules", "broken.test.yml"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode != 0


def unit_tests_of_edited_rules(tmp_path: Path, edits: list[tuple[str, str]]) -> subprocess.CompletedProcess[str]:
    """The shipped rule unit tests, run against the shipped rules with each ``(text, replacement)`` applied."""
    broken = RULES.read_text()
    for old, new in edits:
        assert old in broken, old
        broken = broken.replace(old, new)
    (tmp_path / "hicache.rules.yml").write_text(broken)
    (tmp_path / "hicache.rules.test.yml").write_text((CONFIG / "rules" / "hicache.rules.test.yml").read_text())
    return subprocess.run(
        [needs("promtool"), "test", "rules", "hicache.rules.test.yml"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


#: Ways to get L2 bandwidth wrong, as edits of the shipped rule: (fault, [(text, replacement), ...]).
BANDWIDTH_FAULTS = [
    ("timing sources mixed", [("hicache_operation, hicache_timing_source)", "hicache_operation)")]),
    (
        "all bytes over the timed copy time",
        [("hicache_operation, hicache_timing_source)", "hicache_operation)"), ('{hicache_timing_source!="none"}', "")],
    ),
]


@pytest.mark.parametrize(("fault", "edits"), BANDWIDTH_FAULTS, ids=[f for f, _ in BANDWIDTH_FAULTS])
def test_the_bandwidth_unit_tests_catch_a_rule_that_mixes_timings_or_counts_untimed_bytes(
    tmp_path: Path, fault: str, edits: list[tuple[str, str]]
) -> None:
    """Bandwidth is bytes of timed transfers / their copy time, per timing source; each wrong rule fails."""
    result = unit_tests_of_edited_rules(tmp_path, edits)
    assert result.returncode != 0, fault
    assert "hicache:transfer_bandwidth_bytes_per_second:rate5m" in result.stdout + result.stderr, fault


#: Ways to get load versus recompute wrong, as edits of the shipped rules: (fault, rule the tests catch, edits).
RECOMPUTE_FAULTS = [
    (
        "copy seconds of every TP rank added up",
        "hicache:load_seconds_per_token:rate5m",
        [
            (
                "and on (job, instance, hicache_operation) sum by (job, instance, hicache_operation) "
                '(hicache_transfer_tokens_total{hicache_pool="kv"})',
                "",
            )
        ],
    ),
    (
        "untimed copies taken as free",
        "hicache:load_seconds_per_token:rate5m",
        [
            (
                "* sum by (job, instance, hicache_operation) (rate(hicache_transfer_size_bytes_total"
                '{hicache_operation=~"load_back|storage_prefetch"}[5m]))',
                "",
            ),
            (
                "/ (sum by (job, instance, hicache_operation) (rate(hicache_transfer_size_bytes_total"
                '{hicache_operation=~"load_back|storage_prefetch", hicache_timing_source!="none"}[5m])) > 0)',
                "",
            ),
        ],
    ),
    (
        "state slots counted as tokens",
        "hicache:load_seconds_per_token:rate5m",
        [(', hicache_pool="kv"}', "}")],  # the denominator's tokens
    ),
    (
        "decode passes counted as prefill work",
        "hicache:engine_prefill_seconds_per_token:rate5m",
        [('{category=~"extend|split_prefill"}', "")],
    ),
    (
        "cached prompt tokens counted as recomputed",
        "hicache:engine_prefill_seconds_per_token:rate5m",
        [('{mode="prefill_compute"}', "")],
    ),
    (
        "storage prefetches alerted on",
        "HiCacheLoadSlowerThanRecompute",
        [('rate5m{hicache_operation="load_back"}', "rate5m")],
    ),
]


@pytest.mark.parametrize(("fault", "rule", "edits"), RECOMPUTE_FAULTS, ids=[f for f, _, _ in RECOMPUTE_FAULTS])
def test_the_load_versus_recompute_unit_tests_catch_each_wrong_rule(
    tmp_path: Path, fault: str, rule: str, edits: list[tuple[str, str]]
) -> None:
    """Load seconds per token (one rank per TP group, untimed copies scaled in, kv tokens only) and the engines'
    prefill seconds per computed token: each way of getting them wrong fails the unit tests, on that rule."""
    result = unit_tests_of_edited_rules(tmp_path, edits)
    assert result.returncode != 0, fault
    assert rule in result.stdout + result.stderr, fault


def test_the_dashboards_load_versus_recompute_panel_shows_the_rules_the_unit_tests_check() -> None:
    """Its two lines are the two recording rules themselves (evaluated for SGLang and vLLM by the unit tests; the demo
    has no engine prefill timing for the end-to-end test to read)."""
    dashboard = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in dashboard["panels"] if p["title"].startswith("Load vs recompute")]
    assert [t["expr"] for t in panel["targets"]] == [
        "hicache:load_seconds_per_token:rate5m",
        "hicache:engine_prefill_seconds_per_token:rate5m",
    ]
    tests = yaml.safe_load((CONFIG / "rules" / "hicache.rules.test.yml").read_text())["tests"]
    checked = [
        sample["labels"]
        for test in tests
        for case in test.get("promql_expr_test", [])
        for sample in case["exp_samples"]
        if case["expr"] in {t["expr"] for t in panel["targets"]}
    ]
    for engine in ("sglang", "vllm"):
        assert any(f'hicache_engine="{engine}"' in labels and "engine_prefill" in labels for labels in checked)
        assert any(f'hicache_engine="{engine}"' in labels and "load_seconds" in labels for labels in checked)


def test_the_dashboards_memory_and_prefill_panel_shows_rules_the_unit_tests_check() -> None:
    """ "+N GiB of host memory saves X prefill seconds per second": the panel reads the four recording rules of the
    capacity curve in the operator's units, and the unit tests evaluate each of them for the device and the host."""
    dashboard = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in dashboard["panels"] if p["title"].startswith("Memory a tier's size takes")]
    rules = [t["expr"].split("{")[0] for t in panel["targets"]]
    assert rules == [
        "hicache:capacity_memory_bytes:gain_2x",
        "hicache:capacity_prefill_seconds_per_second:gain_2x",
        "hicache:capacity_memory_bytes:loss_half",
        "hicache:capacity_prefill_seconds_per_second:loss_half",
    ]
    tests = yaml.safe_load((CONFIG / "rules" / "hicache.rules.test.yml").read_text())["tests"]
    checked = {
        (case["expr"].split("{")[0], tier)
        for test in tests
        for case in test.get("promql_expr_test", [])
        for sample in case["exp_samples"]
        for tier in ("device", "host")
        if f'hicache_tier="{tier}"' in sample["labels"] and sample["value"] > 0
    }
    assert {(rule, tier) for rule in rules for tier in ("device", "host")} <= checked


def test_the_capacity_alerts_wait_for_as_many_lookups_as_the_model_calls_warm() -> None:
    """Both capacity alerts read a curve only with ``WARM_LOOKUPS`` behind it (the unit tests: a cold process with an
    undersized and an oversized tier raises neither)."""
    rules = {
        rule["alert"]: rule["expr"]
        for group in yaml.safe_load((CONFIG / "rules" / "hicache.rules.yml").read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    for alert in ("HiCacheTierUndersized", "HiCacheTierOversized"):
        assert f"(hicache_capacity_lookups) >= {WARM_LOOKUPS})" in rules[alert], alert
