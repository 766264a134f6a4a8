"""SGLang's own series keep their ``sglang:*`` names in Prometheus (the shipped ``metric_relabel_configs``).

SGLang's metric classes from the stat-logger route (``otel_hicache.integrations.sglang.stat_loggers``, no SGLang
needed for them) report into a real Prometheus exporter; the real Prometheus of the session scrapes it with the
shipped ``prometheus.yml`` and must store SGLang's names, not the exporter's escaped ``sglang_*`` ones.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from otel_hicache.integrations.sglang.stat_loggers import OTelStatLoggers
from otel_hicache.sdk import TelemetrySetup, configure
from tests.pipeline.support import Prometheus

pytestmark = pytest.mark.prometheus


@pytest.fixture
def sglang_series(prometheus: Prometheus) -> Iterator[TelemetrySetup]:
    setup = configure(env={}, prometheus_port=prometheus.target_port, service_name="sglang")
    classes = OTelStatLoggers(setup.meter_provider).metric_classes
    try:
        registry = CollectorRegistry()  # SGLang's own prometheus_client side, kept apart from the default registry
        labels = ["model_name"]
        tokens = classes["_counter_cls"]("sglang:prompt_tokens_total", "Prefill tokens", labels, registry=registry)
        running = classes["_gauge_cls"]("sglang:num_running_reqs", "Running requests", labels, registry=registry)
        ttft = classes["_histogram_cls"](
            "sglang:time_to_first_token_seconds", "TTFT", labels, buckets=(0.1, 1.0), registry=registry
        )
        tokens.labels(model_name="m").inc(128)
        running.labels(model_name="m").set(3)
        ttft.labels(model_name="m").observe(0.25)
        yield setup
    finally:
        setup.shutdown()


def stored_names(prometheus: Prometheus, pattern: str) -> set[str]:
    return set(prometheus.api("label/__name__/values", **{"match[]": f'{{__name__=~"{pattern}"}}'}))


def test_sglang_series_are_stored_under_sglangs_own_names(
    prometheus: Prometheus, sglang_series: TelemetrySetup
) -> None:
    expected = {
        "sglang:prompt_tokens_total",
        "sglang:num_running_reqs",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:time_to_first_token_seconds_count",
        "sglang:time_to_first_token_seconds_sum",
    }
    deadline = time.monotonic() + 30
    while not expected <= stored_names(prometheus, "sglang.+") and time.monotonic() < deadline:
        time.sleep(0.5)
    names = stored_names(prometheus, "sglang.+")
    assert expected <= names, names
    assert not {n for n in names if n.startswith("sglang_")}, names  # every escaped name was renamed
    (tokens,) = prometheus.query('sglang:prompt_tokens_total{model_name="m"}')
    assert float(tokens["value"][1]) == 128
    assert prometheus.query("hicache_transfer_tokens_total")  # otel_hicache's own names are left alone
