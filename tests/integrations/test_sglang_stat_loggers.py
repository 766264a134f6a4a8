"""SGLang's stat-logger metric classes keep their meter with them: two set-ups never share one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from otel_hicache.integrations.sglang.stat_loggers import OTelStatLoggers
from otel_hicache.testing.sdk import Sdk, make_sdk


@pytest.fixture
def two_sdks() -> Iterator[tuple[Sdk, Sdk]]:
    first, second = make_sdk(), make_sdk()
    yield first, second
    first.shutdown()
    second.shutdown()


def otel_points(sdk: Sdk) -> dict[str, list[tuple[dict[str, str], float]]]:
    return {
        name: [(dict(p.attributes), p.value) for p in metric.data.data_points]
        for name, metric in sdk.metrics().items()
        if name.startswith("sglang.")
    }


def test_counters_of_two_stat_logger_sets_report_to_their_own_meter_provider(two_sdks: tuple[Sdk, Sdk]) -> None:
    first, second = two_sdks
    counters = []
    try:
        for sdk, name in ((first, "sglang:first_test_tokens_total"), (second, "sglang:second_test_tokens_total")):
            counter_cls = OTelStatLoggers(sdk.meter_provider).metric_classes["_counter_cls"]
            counter = counter_cls(name, "tokens", ["role"])
            counters.append(counter)
            counter.labels(role="scheduler").inc(7)
        assert REGISTRY.get_sample_value("sglang:first_test_tokens_total", {"role": "scheduler"}) == 7
        assert otel_points(first) == {"sglang.first_test_tokens": [({"role": "scheduler"}, 7)]}
        assert otel_points(second) == {"sglang.second_test_tokens": [({"role": "scheduler"}, 7)]}
    finally:
        for counter in counters:
            REGISTRY.unregister(counter._prom)
