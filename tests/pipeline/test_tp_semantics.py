"""TP semantics in PromQL: every recording rule and dashboard query over token series gives the same values whether
the workload ran on 1 rank or on 2 tensor-parallel ranks.

On a TP group only attention-TP rank 0 reports the instruments counted in tokens (``token_metrics=False`` elsewhere,
set by the SGLang integration); every rank reports its own bytes and copy durations. The shipped rules and the
dashboard are read at test time (not copied), so the test follows their edits. Each query under test becomes a
recording rule; promtool evaluates it over one input in which the 1-rank run (minutes 0-60) and the 2-rank run of the
same workload (minutes 120-180, ranks ``rank0`` and ``rank1``) follow each other, and compares the query at 170m
with itself ``offset 120m``: the same series with the same values, and not none. The rules of a tier's memory in bytes
are the group's (bytes add up across ranks, each rank keeping its shard of every token): over 2 ranks that each move
the 1-rank run's bytes they read twice the 1-rank run's value, and that is checked instead.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.pipeline.support import DASHBOARD, RULES, needs

pytestmark = pytest.mark.prometheus

#: Series counted in tokens (Prometheus names): reported by one rank per TP group.
TOKEN_SERIES = re.compile(r"hicache_(prefill|transfer|dropped|eviction)_tokens_total|hicache_pool_|hicache_capacity_")
#: Rules (and dashboard queries over them) of a TP group's memory: bytes of every rank per logical token.
GROUP_BYTES = ("hicache:kv_bytes_per_token:rate1h", "hicache:capacity_memory_bytes:")
#: Shipped rules over token series (directly or through another rule) that must be under test.
TOKEN_RULES = (
    "hicache:prefill_hit_ratio:rate5m",
    "hicache:drop_ratio:rate5m",
    "hicache:pool_used_ratio",
    "hicache:eviction_never_reused_ratio:rate5m",
    "hicache:load_seconds_per_token:rate5m",  # copy seconds of the token-reporting rank only
)
#: Grafana's variables, as a dashboard user with every job and instance selected would have them.
GRAFANA = {"$job": ".*", "$instance": ".*", "$__rate_interval": "5m", "$__interval": "1m"}

#: One rank's workload, per minute (counters) or constant (gauges): (series, per-minute increase or gauge value).
TOKENS_PER_MINUTE: list[tuple[str, float]] = [
    ('hicache_prefill_tokens_total{hicache_prefill_mode="input"}', 600),
    ('hicache_prefill_tokens_total{hicache_prefill_mode="device_hit"}', 300),
    ('hicache_prefill_tokens_total{hicache_prefill_mode="host_hit"}', 200),
    ('hicache_prefill_tokens_total{hicache_prefill_mode="storage_hit"}', 100),
    ('hicache_transfer_tokens_total{hicache_operation="backup",hicache_pool="kv"}', 400),
    ('hicache_transfer_tokens_total{hicache_operation="load_back",hicache_pool="kv"}', 200),
    ('hicache_dropped_tokens_total{hicache_drop_reason="host_pressure",hicache_pool="kv"}', 20),
    ('hicache_eviction_tokens_total{hicache_tier="device"}', 300),
    ('hicache_eviction_tokens_total{hicache_tier="device",hicache_eviction_reused="true"}', 100),
    ('hicache_eviction_tokens_total{hicache_tier="device",hicache_eviction_reused="false"}', 200),
    ('hicache_eviction_tokens_total{hicache_tier="host",hicache_eviction_reused="false"}', 150),
]
GAUGES: list[tuple[str, float]] = [
    ('hicache_pool_usage{hicache_tier="host",hicache_pool="kv",hicache_slot_state="used"}', 500),
    ('hicache_pool_limit{hicache_tier="host",hicache_pool="kv"}', 1000),
    ('target_info{hicache_engine="sglang"}', 1),  # every process: the per-engine rules join it
    ('hicache_capacity_tokens{hicache_tier="device"}', 500),
    ('hicache_capacity_tokens{hicache_tier="host"}', 1000),
    ('hicache_capacity_hit_ratio{hicache_tier="host",hicache_capacity_factor="0.5"}', 0.4),
    ('hicache_capacity_hit_ratio{hicache_tier="host",hicache_capacity_factor="1"}', 0.5),
    ('hicache_capacity_hit_ratio{hicache_tier="host",hicache_capacity_factor="2"}', 0.6),
    ('hicache_capacity_hit_ratio{hicache_tier="device",hicache_capacity_factor="0.5"}', 0.2),
    ('hicache_capacity_hit_ratio{hicache_tier="device",hicache_capacity_factor="1"}', 0.3),
    ('hicache_capacity_hit_ratio{hicache_tier="device",hicache_capacity_factor="2"}', 0.45),
]
PER_RANK_PER_MINUTE: list[tuple[str, float]] = [
    ('hicache_transfer_size_bytes_total{hicache_operation="backup"}', 4e6),
    ('hicache_transfer_size_bytes_total{hicache_operation="load_back"}', 2e6),
    ('hicache_transfer_duration_seconds_sum{hicache_operation="backup"}', 0.5),
    ('hicache_transfer_duration_seconds_count{hicache_operation="backup"}', 10),
    ('hicache_transfer_duration_seconds_sum{hicache_operation="load_back"}', 0.2),  # each rank copies its shard
    ('hicache_wasted_size_bytes_total{hicache_operation="backup"}', 1e6),
    ('otel_sdk_processor_span_processed_total{error_type=""}', 20),
    # SGLang's own prefill timing, from every scheduler rank (the recompute cost's rule sums them)
    ('sglang:forward_execution_seconds_total{category="extend"}', 3),
    ('sglang:realtime_tokens_total{mode="prefill_compute"}', 600),
]


def _labels(series: str, instance: str) -> str:
    return series.replace("{", f'{{job="sglang",instance="{instance}",', 1)


def _input_series(tokens_on_every_rank: bool) -> list[dict[str, str]]:
    """1-rank run at minutes 0-60 (instance rank0), nothing until 120, then the 2-rank run at 120-180."""
    out = []

    def both_runs(series: str, step: float, gauge: bool) -> str:
        run = f"{step:g}x60" if gauge else f"0+{step:g}x60"
        return f"{run} _x59 {run}"

    def second_run_only(series: str, step: float, gauge: bool) -> str:
        return f"_x120 {step:g}x60" if gauge else f"_x120 0+{step:g}x60"

    for series, step, gauge in [
        *((s, v, False) for s, v in TOKENS_PER_MINUTE),
        *((s, v, True) for s, v in GAUGES),
        *((s, v, False) for s, v in PER_RANK_PER_MINUTE),
    ]:
        out.append({"series": _labels(series, "rank0"), "values": both_runs(series, step, gauge)})
        if tokens_on_every_rank or not TOKEN_SERIES.search(series):
            out.append({"series": _labels(series, "rank1"), "values": second_run_only(series, step, gauge)})
    return out


def _token_queries() -> dict[str, str]:
    """Recording rule name -> expression: every shipped recording rule over token series (directly or through
    another such rule) and every dashboard query over token series (as ``dashboard:q<N>``)."""
    queries: dict[str, str] = {}
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            expr = rule.get("expr", "")
            if "record" in rule and (TOKEN_SERIES.search(expr) or any(name in expr for name in queries)):
                queries[rule["record"]] = expr
    panels: list[Any] = list(json.loads(DASHBOARD.read_text())["panels"])
    while panels:
        panel = panels.pop(0)
        panels += panel.get("panels", [])
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            if TOKEN_SERIES.search(expr) or any(name in expr for name in queries):
                for variable, value in GRAFANA.items():
                    expr = expr.replace(variable, value)
                queries[f"dashboard:q{len(queries)}"] = expr
    return queries


def _promtool_test(tmp_path: Path, tokens_on_every_rank: bool) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    queries = _token_queries()
    rules = [{"record": name, "expr": expr} for name, expr in queries.items() if name.startswith("dashboard:")]
    (tmp_path / "shipped.rules.yml").write_text(RULES.read_text())
    (tmp_path / "dashboard.rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checks = []
    for name in queries:
        if any(rule in queries[name] or name.startswith(rule) for rule in GROUP_BYTES):
            ratio = f"{name} / ({name} offset 120m)"
            checks += [
                {
                    "expr": f"count({ratio} != 2) or vector(0)",
                    "eval_time": "170m",
                    "exp_samples": [{"labels": "{}", "value": 0}],
                },
                {
                    "expr": f"count({ratio} == 2) > bool 0",
                    "eval_time": "170m",
                    "exp_samples": [{"labels": "{}", "value": 1}],
                },
            ]
            continue
        checks += [
            {"expr": f"{name} != {name} offset 120m", "eval_time": "170m", "exp_samples": []},
            {"expr": f"{name} offset 120m != {name}", "eval_time": "170m", "exp_samples": []},
            {
                "expr": f"(count({name}) or vector(0)) - (count({name} offset 120m) or vector(0))",
                "eval_time": "170m",
                "exp_samples": [{"labels": "{}", "value": 0}],
            },
            {
                "expr": f"count({name} offset 120m) > bool 0",  # not nothing
                "eval_time": "170m",
                "exp_samples": [{"labels": "{}", "value": 1}],
            },
        ]
    test = {
        "rule_files": ["shipped.rules.yml", "dashboard.rules.yml"],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": _input_series(tokens_on_every_rank), "promql_expr_test": checks}],
    }
    (tmp_path / "tp.test.yml").write_text(yaml.safe_dump(test, sort_keys=False))
    result = subprocess.run(
        [needs("promtool"), "test", "rules", "tp.test.yml"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    return result, list(queries)


def test_every_token_rule_and_dashboard_query_reads_the_same_over_two_tp_ranks_as_over_one(tmp_path: Path) -> None:
    result, names = _promtool_test(tmp_path, tokens_on_every_rank=False)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "SUCCESS" in result.stdout
    # What is under test: the token rules of the shipped file and the dashboard's token panels.
    assert set(TOKEN_RULES) <= set(names)
    assert sum(name.startswith("dashboard:") for name in names) >= 5


def test_token_series_from_every_rank_would_double_the_token_panels(tmp_path: Path) -> None:
    """The check can fail: with every rank reporting tokens (no TP semantics), the sums differ from the 1-rank run."""
    result, _ = _promtool_test(tmp_path, tokens_on_every_rank=True)
    assert result.returncode != 0
    assert "dashboard:q" in result.stdout + result.stderr
