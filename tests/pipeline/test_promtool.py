"""The shipped Prometheus config and rules pass promtool, and the alert rules behave as their unit tests say."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.pipeline.support import CONFIG, RULES, needs

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


def test_a_broken_expectation_fails_the_rule_unit_tests(tmp_path) -> None:  # type: ignore[no-untyped-def]
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
    broken = RULES.read_text()
    for old, new in edits:
        assert old in broken, fault
        broken = broken.replace(old, new)
    (tmp_path / "hicache.rules.yml").write_text(broken)
    (tmp_path / "hicache.rules.test.yml").write_text((CONFIG / "rules" / "hicache.rules.test.yml").read_text())
    result = subprocess.run(
        [needs("promtool"), "test", "rules", "hicache.rules.test.yml"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode != 0, fault
    assert "hicache:transfer_bandwidth_bytes_per_second:rate5m" in result.stdout + result.stderr, fault
