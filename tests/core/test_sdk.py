"""configure(): the standard OTEL_* environment, Views, the embedded default, clear errors for bad input."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_hicache import semconv as sc
from otel_hicache.records import TransferRecord
from otel_hicache.sdk import ConfigError, build_resource, configure, views
from otel_hicache.semconv import TimingSource, TransferOperation
from otel_hicache.testing.otlp_receiver import OtlpReceiver, attributes
from tests.core.support import resources, tokens_by


def record(tokens: int = 8) -> TransferRecord:
    return TransferRecord(TransferOperation.BACKUP, {"kv": tokens}, tokens * 64, 10, 20, 0.001, TimingSource.HOST_CLOCK)


def test_no_endpoint_means_the_embedded_default_keeps_data_in_process() -> None:
    setup = configure(env={})
    try:
        assert setup.mode == "embedded"
        setup.telemetry.record_transfer(record())
        setup.force_flush()
        assert setup.recent_spans is not None and [s.name for s in setup.recent_spans.spans()] == ["hicache.backup"]
        assert isinstance(setup.metric_reader, InMemoryMetricReader)
        data = setup.metric_reader.get_metrics_data()
        assert data is not None
        names = {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
        assert {sc.METRIC_TRANSFER_TOKENS, sc.METRIC_TRANSFER_DURATION} <= names
    finally:
        setup.shutdown()


def test_embedded_span_store_is_bounded_but_counts_everything() -> None:
    setup = configure(env={})
    for _ in range(3000):
        setup.telemetry.record_transfer(record())
    setup.force_flush()
    assert setup.recent_spans is not None
    assert len(setup.recent_spans.spans()) == 2048
    assert setup.recent_spans.total == 3000
    setup.shutdown()


def test_resource_takes_env_service_name_attributes_ranks_and_host() -> None:
    resource = build_resource(ranks={"tp": 1, "pp": 0, "dp": 2})
    assert resource.attributes["service.name"] == "otel-hicache"
    assert resource.attributes[sc.RESOURCE_TP_RANK] == 1
    assert resource.attributes[sc.RESOURCE_DP_RANK] == 2
    assert resource.attributes["host.name"]


def test_otel_service_name_and_resource_attributes_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "sglang-node-7")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod,hicache.rank.tp=3")
    resource = build_resource(ranks={"tp": 0})
    assert resource.attributes["service.name"] == "sglang-node-7"
    assert resource.attributes["deployment.environment"] == "prod"
    assert resource.attributes[sc.RESOURCE_TP_RANK] == "3"


def test_unknown_rank_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown rank 'ep'"):
        build_resource(ranks={"ep": 1})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not supported"),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "carrier-pigeon"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER='sometimes'"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG='2' is out"),
        ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"}, "is not a number"),
        ({"OTEL_METRIC_EXPORT_INTERVAL": "soon"}, "OTEL_METRIC_EXPORT_INTERVAL='soon' is not a number"),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin' is not supported"),
        ({"OTEL_METRICS_EXPORTER": "statsd"}, "OTEL_METRICS_EXPORTER"),
        ({"OTEL_EXPORTER_PROMETHEUS_PORT": "99999"}, "OTEL_EXPORTER_PROMETHEUS_PORT"),
    ],
)
def test_bad_environment_values_fail_clearly_naming_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
        configure(env=env)


def test_bad_arguments_fail_clearly() -> None:
    with pytest.raises(ConfigError, match="protocol 'udp'"):
        configure(env={}, protocol="udp")
    with pytest.raises(ConfigError, match="cardinality_limit"):
        configure(env={}, cardinality_limit=0)


def test_sdk_disabled_gives_no_op_providers_that_still_accept_records() -> None:
    setup = configure(env={"OTEL_SDK_DISABLED": "true"})
    assert setup.mode == "disabled"
    setup.telemetry.record_transfer(record())
    assert setup.telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 8
    setup.shutdown()


def test_views_fix_attribute_keys_and_a_series_cap_of_what_the_sdk_aggregates() -> None:
    by_name = {v._instrument_name: v for v in views(cardinality_limit=7)}
    aggregated = [spec for spec in sc.INSTRUMENTS if spec.kind != "histogram"]  # histograms: the host's table
    assert set(by_name) == {spec.name for spec in aggregated}
    for spec in aggregated:
        view = by_name[spec.name]
        assert view._attribute_keys == set(spec.attributes)
        assert view._aggregation_cardinality_limit == 7


def test_console_exporters_are_selectable(capsys: pytest.CaptureFixture[str]) -> None:
    setup = configure(env={"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "none"})
    setup.telemetry.record_transfer(record())
    setup.shutdown()
    assert '"name": "hicache.backup"' in capsys.readouterr().out


def test_prometheus_port_serves_the_vocabulary_under_prometheus_names() -> None:
    import re
    import urllib.request

    setup = configure(env={}, prometheus_port=0)
    try:
        setup.telemetry.record_transfer(record(5))
        setup.force_flush()
        assert setup.prometheus_address is not None
        host, port = setup.prometheus_address
        body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
        tokens = re.search(
            r'^hicache_transfer_tokens_total\{hicache_operation="backup",hicache_pool="kv",.*\} (\S+)$', body, re.M
        )
        assert tokens is not None and float(tokens.group(1)) == 5.0
        assert "hicache_transfer_size_bytes_total" in body
        assert "hicache_transfer_duration_seconds_bucket" in body
        assert "hicache_prefill_tokens_total" in body
        again = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
        series = re.compile(r'^hicache_transfer_tokens_total\{hicache_operation="backup",hicache_pool="kv"', re.M)
        for scrape in (body, again):  # force_flush must not make a scrape serve a metric twice
            assert len(series.findall(scrape)) == 1
    finally:
        setup.shutdown()


def test_prometheus_port_in_use_is_a_config_error() -> None:
    first = configure(env={}, prometheus_port=0)
    assert first.prometheus_address is not None
    try:
        with pytest.raises(ConfigError, match="cannot serve Prometheus metrics"):
            configure(env={}, prometheus_port=first.prometheus_address[1])
    finally:
        first.shutdown()


# ---------------------------------------------------------------------- env=, identity, exporter lists
def test_configure_env_drives_the_resource_and_the_apps_providers() -> None:
    """Was: service.name stayed otel-hicache and the app's spans went to localhost:4317 (os.environ's defaults)."""
    with OtlpReceiver() as rx:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": rx.grpc_endpoint,
            "OTEL_SERVICE_NAME": "svc-from-env",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=env-test",
        }
        setup = configure(env=env)
        try:
            setup.telemetry.record_transfer(record())
            with setup.tracer_provider.get_tracer("app").start_as_current_span("app-span"):
                pass
            setup.force_flush(30)
            assert rx.wait_for(lambda: any(r.get("service.name") == "svc-from-env" for r in resources(rx)), 30)
            assert all(r["deployment.environment"] == "env-test" for r in resources(rx))
            assert rx.wait_for(lambda: "app-span" in {s.name for s in rx.spans()}, 30)
            app = [
                rs.resource
                for r in rx.trace_requests
                for rs in r.resource_spans
                if any(s.name == "app-span" for ss in rs.scope_spans for s in ss.spans)
            ]
            assert attributes(app[0].attributes)["service.name"] == "svc-from-env"
        finally:
            setup.shutdown()


def test_two_telemetries_in_one_process_report_under_two_identities() -> None:
    """Was: one identity for both, so a receiver saw 10 and 30 for one series where the truth was 40."""
    with OtlpReceiver() as rx:
        first, second = (configure(env={}, endpoint=rx.grpc_endpoint) for _ in range(2))
        first.telemetry.record_transfer(record(10))
        second.telemetry.record_transfer(record(30))
        for setup in (first, second):
            setup.force_flush(30)
        by_instance = lambda: tokens_by(rx, "service.instance.id")  # noqa: E731
        assert rx.wait_for(lambda: sorted(by_instance().values()) == [10, 30], 30), by_instance()
        assert None not in by_instance()
        for setup in (first, second):
            setup.shutdown()


def test_a_pinned_instance_id_that_an_open_telemetry_uses_is_refused_until_it_is_shut_down() -> None:
    env = {"OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=pod-7"}
    first = configure(env=env)
    with pytest.raises(ConfigError, match=r"service.instance.id='pod-7' is already the identity of an open telemetry"):
        configure(env=env)
    first.shutdown()
    again = configure(env=env)
    assert again.tracer_provider.resource.attributes["service.instance.id"] == "pod-7"  # type: ignore[attr-defined]
    again.shutdown()


def test_a_list_of_trace_exporters_sends_the_spans_to_each(capsys: pytest.CaptureFixture[str]) -> None:
    """The specification allows a list (was: OTEL_TRACES_EXPORTER='otlp,console' refused)."""
    with OtlpReceiver() as rx:
        env = {
            "OTEL_TRACES_EXPORTER": "otlp,console",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_ENDPOINT": rx.grpc_endpoint,
        }
        setup = configure(env=env)
        setup.telemetry.record_transfer(record())
        setup.shutdown()
        assert rx.wait_for(lambda: [s.name for s in rx.spans()] == ["hicache.backup"], 30)
    assert '"name": "hicache.backup"' in capsys.readouterr().out


def test_both_exporters_none_counts_and_exports_nothing() -> None:
    """Was: mode "prometheus" (with no Prometheus anywhere)."""
    setup = configure(env={"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"})
    assert setup.mode == "none"
    setup.telemetry.record_transfer(record())
    assert setup.telemetry.snapshot()[sc.METRIC_TRANSFER_TOKENS][("backup", "kv")] == 8
    assert setup.telemetry.export_pid is None
    setup.shutdown()
