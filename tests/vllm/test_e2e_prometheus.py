"""End to end with vLLM: a vLLM process offloading through its real connector, instrumented by the plugin alone,
serves the Prometheus endpoint a real Prometheus scrapes; the shipped dashboard panels and recording rules return
data for it with the labels they rely on, as for SGLang and the demo (tests/pipeline/test_e2e_prometheus.py).

The process drives vLLM's connector without vLLM's scheduler and model (tests.vllm.offload_app), so it reports
transfers, failures, the CPU tier's occupancy and evictions, but no prefill, no request's KV wait and no capacity curve
(all three come from the scheduler's admissions: tests/vllm/test_capacity.py has the curve from a real engine), serves
none of vLLM's own series (its prefill timing), and vLLM reports no drops: the panels and rules built only on those
are listed here and return no data for it.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from otel_hicache.testing.otlp_receiver import OtlpReceiver
from tests.pipeline.support import Prometheus
from tests.pipeline.test_e2e_prometheus import (
    BANDWIDTH_RULES,
    GRAFANA_VARIABLES,
    RULE_LABELS,
    assert_panel_query_returns_data,
    assert_rule_returns_data_with_its_labels,
    panel_targets,
)

pytestmark = [pytest.mark.vllm, pytest.mark.prometheus, pytest.mark.timeout(600)]  # the fixture waits up to 400 s

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: What this process cannot feed: per-tier prefill hits, KV waits and the capacity curve (no scheduler admits requests),
#: vLLM's own prefill timing (no engine), and drops (vLLM has none).
NOT_FROM_VLLM_PANELS = {
    "Prefix hit rate by tier",
    "Prefill tokens: computed vs hit per tier",
    "Dropped tokens by reason and pool",
    "Drop ratio",
    "Request KV wait p50 / p99, by tier",
    "Predicted share of prompt tokens served at each size, by engine and tier",
    "Gain from doubling and loss from halving each tier (points)",
    "Memory a tier's size takes, and the prefill it saves",
}
NOT_FROM_VLLM_RULES = {
    "hicache:prefill_hit_ratio:rate5m",
    "hicache:prefill_hit_ratio_by_mode:rate5m",
    "hicache:prefill_hit_ratio:avg1h",
    "hicache:drop_ratio:rate5m",
    "HiCacheDropRateHigh",
    "HiCachePrefixHitRateCollapse",
    "hicache:engine_prefill_seconds_per_token:rate5m",
    "HiCacheLoadSlowerThanRecompute",
    "hicache:capacity_hit_ratio:gain_2x",
    "hicache:capacity_hit_ratio:loss_half",
    "hicache:capacity_memory_bytes:gain_2x",
    "hicache:capacity_memory_bytes:loss_half",
    "hicache:capacity_prefill_seconds_per_second:gain_2x",
    "hicache:capacity_prefill_seconds_per_second:loss_half",
    "HiCacheTierUndersized",
    "HiCacheTierOversized",
}


@pytest.fixture(scope="module")
def live_vllm(prometheus: Prometheus) -> Iterator[Prometheus]:
    """tests.vllm.offload_app offloading for up to 420 s, its metrics on the port Prometheus scrapes (vLLM 0.33's
    CUDA wheel alone takes ~40 s to import on a busy 2-core machine)."""
    with OtlpReceiver() as receiver:
        env = {
            **os.environ,
            "PYTHONPATH": ROOT,
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_EXPORTER_PROMETHEUS_PORT": str(prometheus.target_port),
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_SERVICE_NAME": "vllm-e2e",
            # the SDK's own span-processor metrics for the otel_sdk rule: in-process, the operator turns them on
            "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED": "true",
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm.offload_app", "--seconds", "420"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            prometheus.wait_for_data(VLLM_READY, process, "the vLLM app", timeout_s=400)
            yield prometheus
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()


#: Several scrapes of the live vLLM app stored, and the rules built on rates evaluated.
VLLM_READY = [
    'count_over_time(hicache_transfer_tokens_total{hicache_operation="backup",hicache_pool="kv"}[1m]) >= 4',
    'rate(hicache_transfer_duration_seconds_sum{hicache_operation="load_back"}[1m]) > 0',
    'rate(hicache_eviction_tokens_total{hicache_tier="host"}[1m]) > 0',
    "otel_sdk:span_drop_ratio:rate5m >= 0",
    "hicache:load_seconds_per_token:rate5m > 0",
]


def test_per_engine_views_join_the_engine_from_target_info(live_vllm: Prometheus) -> None:
    """The README's per-engine query: bytes moved per engine."""
    (sample,) = live_vllm.query(
        "sum by (hicache_engine) (rate(hicache_transfer_size_bytes_total[5m]) * on (job, instance) "
        "group_left (hicache_engine) target_info)"
    )
    assert sample["metric"] == {"hicache_engine": "vllm"} and float(sample["value"][1]) > 0


@pytest.mark.parametrize("name", sorted(set(RULE_LABELS) - NOT_FROM_VLLM_RULES))
def test_rule_returns_data_for_vllm(live_vllm: Prometheus, name: str) -> None:
    if name in BANDWIDTH_RULES:  # the alert watches CUDA-event timings; this CPU run times on the host
        substitute = {'hicache_timing_source="cuda_event"': 'hicache_timing_source="host_clock"'}
        assert_rule_returns_data_with_its_labels(live_vllm, name, **(substitute if name.startswith("HiCache") else {}))
    else:
        assert_rule_returns_data_with_its_labels(live_vllm, name)


@pytest.mark.parametrize(
    ("title", "expr", "legend"),
    [t for t in panel_targets() + panel_targets(bandwidth=True) if t[0] not in NOT_FROM_VLLM_PANELS],
    ids=lambda v: v if isinstance(v, str) and len(v) < 60 else None,
)
def test_dashboard_panel_returns_data_for_vllm(live_vllm: Prometheus, title: str, expr: str, legend: str) -> None:
    assert_panel_query_returns_data(live_vllm, title, expr, legend)


def test_the_panels_vllm_cannot_feed_are_the_prefill_and_drop_ones(live_vllm: Prometheus) -> None:
    """They exist in the dashboard, and for vLLM they show nothing but the core's zero-seeded series (0 or 0/0)."""
    titles = {t[0] for t in panel_targets() + panel_targets(bandwidth=True)}
    assert titles >= NOT_FROM_VLLM_PANELS and set(RULE_LABELS) >= NOT_FROM_VLLM_RULES
    for title, expr, _ in panel_targets():
        if title in NOT_FROM_VLLM_PANELS:
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            values = [float(s["value"][1]) for s in live_vllm.query(expr)]
            assert all(math.isnan(v) or v == 0 for v in values), (title, values)
