# ruff: noqa: E501  (the case tables read best one case per line)
"""Every bad setting is refused before anything starts, with one message naming it and the accepted form.

The cases are a table: each bad ``OTEL_*`` value and each bad ``configure()`` argument goes to
:func:`otel_hicache.config.validate` and to :func:`otel_hicache.configure` (ConfigError naming it, no thread left
running, the Prometheus port free again), and the environment cases also to the ``otel-hicache`` CLI in
``test_cli.py``.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from typing import Any

import pytest

from otel_hicache import config
from otel_hicache.config import SPAN_LIMITS, ConfigError, validate
from otel_hicache.testing import free_port

MISSING_FILE = "/nonexistent/otel-hicache/ca.pem"
NOT_PEM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__init__.py")  # a readable file, no certificate

#: (variables, the text the message must contain: the variable's name and the accepted form)
BAD_ENV: list[tuple[dict[str, str], str]] = [  # unformatted: one case a line, as the table reads
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1"}, "OTEL_EXPORTER_OTLP_ENDPOINT='http://[::1' is not valid; use an http:// or https:// URL"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://localhost:70000"}, "OTEL_EXPORTER_OTLP_ENDPOINT='http://localhost:70000'"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://localhost:0"}, "OTEL_EXPORTER_OTLP_ENDPOINT='http://localhost:0'"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4317"}, "OTEL_EXPORTER_OTLP_ENDPOINT='localhost:4317'"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "ftp://collector:4317"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://:4318/v1/metrics"}, "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://localhost:4317 "}, "OTEL_EXPORTER_OTLP_ENDPOINT='http://localhost:4317 ' is not valid; use an http:// or https:// URL such as http://localhost:4317 (no spaces"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://local host:4317"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT='http://local host:4317' is not valid"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://coll{ector}:4317"}, "OTEL_EXPORTER_OTLP_ENDPOINT='http://coll{ector}:4317' is not valid"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL='http/json' is not supported; use one of: grpc, http/protobuf"),
    ({"OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "udp"}, "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL='udp'"),
    ({"OTEL_EXPORTER_OTLP_HEADERS": "api key=secret"}, "OTEL_EXPORTER_OTLP_HEADERS: the name of member 1 is not a header name"),
    ({"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer s\u00e9same"}, "OTEL_EXPORTER_OTLP_HEADERS: the value of header 'authorization' (member 1) holds characters the OTLP exporters drop"),
    ({"OTEL_EXPORTER_OTLP_METRICS_HEADERS": 'x-tenant="a"'}, "OTEL_EXPORTER_OTLP_METRICS_HEADERS: the value of header 'x-tenant' (member 1) holds characters"),
    ({"OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=caf%C3%A9"}, "OTEL_EXPORTER_OTLP_HEADERS: the value of header 'x-tenant' (member 1) is not printable ASCII once percent-decoded"),
    ({"OTEL_EXPORTER_OTLP_TRACES_HEADERS": "no-value-here"}, "OTEL_EXPORTER_OTLP_TRACES_HEADERS: member 1 has no '=' (its text is not shown); use comma-separated name=value"),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "-1"}, "OTEL_EXPORTER_OTLP_TIMEOUT='-1' is out of range; use seconds > 0"),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "0"}, "OTEL_EXPORTER_OTLP_TIMEOUT='0' is out of range"),
    ({"OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "soon"}, "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT='soon' is not a number"),
    ({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "nan"}, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT='nan' is out of range"),
    ({"OTEL_EXPORTER_OTLP_COMPRESSION": "brotli"}, "OTEL_EXPORTER_OTLP_COMPRESSION='brotli' is not supported by the grpc exporter; use one of: gzip"),
    ({"OTEL_EXPORTER_OTLP_COMPRESSION": "deflate"}, "OTEL_EXPORTER_OTLP_COMPRESSION='deflate' is not supported by the grpc exporter"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "zstd"}, "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION='zstd' is not supported by the http/protobuf exporter; use one of: gzip, deflate, none"),
    ({"OTEL_EXPORTER_OTLP_CERTIFICATE": MISSING_FILE}, "OTEL_EXPORTER_OTLP_CERTIFICATE='/nonexistent/otel-hicache/ca.pem': no readable file there"),
    ({"OTEL_EXPORTER_OTLP_CLIENT_KEY": MISSING_FILE}, "OTEL_EXPORTER_OTLP_CLIENT_KEY="),
    ({"OTEL_EXPORTER_OTLP_CERTIFICATE": "/tmp"}, "OTEL_EXPORTER_OTLP_CERTIFICATE='/tmp': no readable file there; use the path of a PEM file"),
    ({"OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE": NOT_PEM}, f"OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE={NOT_PEM!r}: no PEM block (-----BEGIN ...) in it"),
    ({"OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE": MISSING_FILE}, "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE="),
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER='sometimes' is not supported; use one of: always_on"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG='2' is out of range; use a probability between 0 and 1"),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG='half' is not a number"),
    ({"OTEL_METRIC_EXPORT_INTERVAL": "soon"}, "OTEL_METRIC_EXPORT_INTERVAL='soon' is not a number; use milliseconds > 0"),
    ({"OTEL_METRIC_EXPORT_INTERVAL": "0"}, "OTEL_METRIC_EXPORT_INTERVAL='0' is out of range"),
    ({"OTEL_METRIC_EXPORT_TIMEOUT": "-5000"}, "OTEL_METRIC_EXPORT_TIMEOUT='-5000' is out of range; use milliseconds > 0"),
    ({"OTEL_METRIC_EXPORT_TIMEOUT": "inf"}, "OTEL_METRIC_EXPORT_TIMEOUT='inf' is out of range"),
    ({"OTEL_METRICS_EXEMPLAR_FILTER": "sometimes"}, "OTEL_METRICS_EXEMPLAR_FILTER='sometimes' is not valid; use one of trace_based, always_on, always_off"),
    ({"OTEL_METRICS_EXEMPLAR_FILTER": "ALWAYS_ON"}, "OTEL_METRICS_EXEMPLAR_FILTER='ALWAYS_ON'"),  # the SDK does not fold case
    ({"OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE": "sideways"}, "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE='sideways' is not supported; use one of: cumulative, delta, lowmemory"),
    ({"OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": "exponential"}, "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION='exponential'"),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "0"}, "OTEL_BSP_MAX_QUEUE_SIZE='0' is not valid; use an integer >= 1"),
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "lots"}, "OTEL_BSP_MAX_QUEUE_SIZE='lots'"),
    ({"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4096"}, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE=4096 is larger than OTEL_BSP_MAX_QUEUE_SIZE=2048"),
    ({"OTEL_BSP_SCHEDULE_DELAY": "0"}, "OTEL_BSP_SCHEDULE_DELAY='0' is not valid; use an integer >= 1"),
    ({"OTEL_BSP_EXPORT_TIMEOUT": "-1"}, "OTEL_BSP_EXPORT_TIMEOUT='-1' is not valid; use an integer >= 0"),
    *[({name: value}, f"{name}={value!r} is not valid; use an integer >= 0, or unset") for name in SPAN_LIMITS for value in ("many", "-1")],
    ({"OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "1.5"}, "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT='1.5'"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment"}, "OTEL_RESOURCE_ATTRIBUTES: member 1 has no '=' (its text is not shown); use comma-separated key=value pairs"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "a=1,=2"}, "OTEL_RESOURCE_ATTRIBUTES: member 2 has an empty key"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin' is not supported; use one of: none, console, otlp, otlp_proto_grpc, otlp_proto_http"),
    ({"OTEL_TRACES_EXPORTER": "otlp,zipkin"}, "OTEL_TRACES_EXPORTER='otlp,zipkin' is not supported; use one of: none, console, otlp, otlp_proto_grpc, otlp_proto_http (or a comma-separated list"),
    ({"OTEL_METRICS_EXPORTER": "none,otlp"}, "OTEL_METRICS_EXPORTER='none,otlp' lists none with other exporters; use none alone"),
    ({"OTEL_METRICS_EXPORTER": "statsd"}, "OTEL_METRICS_EXPORTER='statsd' is not supported; use one of: none, console, otlp, otlp_proto_grpc, otlp_proto_http, prometheus"),
    ({"OTEL_EXPORTER_PROMETHEUS_PORT": "99999"}, "OTEL_EXPORTER_PROMETHEUS_PORT='99999' is not valid; use an integer 0-65535"),
    ({"OTEL_EXPORTER_PROMETHEUS_PORT": "9464.5"}, "OTEL_EXPORTER_PROMETHEUS_PORT='9464.5'"),
    ({"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_HOST": "local host"}, "OTEL_EXPORTER_PROMETHEUS_HOST='local host' is not valid; use a host name or IP address"),
    ({"OTEL_PYTHON_CONTEXT": "threadlocal"}, "OTEL_PYTHON_CONTEXT='threadlocal' is not valid; use one of the installed opentelemetry_context entry points: contextvars_context"),
    ({"OTEL_PYTHON_EXPORTER_OTLP_GRPC_RETRYABLE_ERROR_CODES": "UNAVAILABLE,NOPE"}, "OTEL_PYTHON_EXPORTER_OTLP_GRPC_RETRYABLE_ERROR_CODES='UNAVAILABLE,NOPE' is not valid; use comma-separated gRPC status code names"),
]  # fmt: skip

#: (configure() keyword arguments, the text the message must contain)
BAD_ARGUMENTS: list[tuple[dict[str, Any], str]] = [
    ({"endpoint": "http://[::1"}, "endpoint='http://[::1' is not valid"),
    ({"endpoint": "collector:4317"}, "endpoint='collector:4317' is not valid; use an http:// or https:// URL"),
    ({"endpoint": 4317}, "endpoint: int is not a URL string"),
    ({"protocol": "udp"}, "protocol 'udp' is not supported; use one of: grpc, http/protobuf"),
    ({"prometheus_port": -1}, "prometheus_port=-1: use an integer port 0-65535"),
    ({"prometheus_port": 70000}, "prometheus_port=70000"),
    ({"prometheus_port": "9464"}, "prometheus_port='9464'"),
    ({"prometheus_port": True}, "prometheus_port=True"),
    ({"prometheus_host": ""}, "prometheus_host='' is not valid; use a host name or IP address"),
    ({"service_name": " "}, "service_name=' ': use a non-empty string"),
    ({"ranks": {"ep": 1}}, "ranks: unknown rank 'ep'; use tp, pp or dp"),
    ({"ranks": {"tp": -1}}, "ranks['tp']=-1: use an integer >= 0"),
    ({"resource_attributes": {"k": object}}, "resource_attributes['k']="),
    ({"pools": "kv"}, "pools='kv': use a non-empty sequence of pool names"),
    ({"pools": ()}, "pools=(): use a non-empty sequence"),
    (
        {"extra_pools": [f"pool{i}" for i in range(100)]},
        "extra_pools: 100 names beyond the standard pools; use at most 64",
    ),
    ({"extra_pools": "swa_extra"}, "extra_pools='swa_extra': use a sequence of pool names"),
    ({"endpoint": "http://localhost:4317 "}, "endpoint='http://localhost:4317 ' is not valid"),
    ({"cardinality_limit": 0}, "cardinality_limit=0: use an integer >= 1"),
    ({"cardinality_limit": 1.5}, "cardinality_limit=1.5"),
    ({"set_global": "yes"}, "set_global='yes': use True or False"),
]


def case_id(case: tuple[dict[str, Any], str]) -> str:
    return ",".join(f"{k}={v!r}" for k, v in case[0].items())[:80]


@pytest.mark.parametrize(("env", "message"), BAD_ENV, ids=[case_id(c) for c in BAD_ENV])
def test_validate_refuses_a_bad_variable_naming_it_and_the_accepted_form(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        validate(env)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(("arguments", "message"), BAD_ARGUMENTS, ids=[case_id(c) for c in BAD_ARGUMENTS])
def test_validate_refuses_a_bad_argument_naming_it(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        validate({}, **arguments)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("env", "arguments", "message"),
    [*((env, {}, message) for env, message in BAD_ENV), *(({}, args, message) for args, message in BAD_ARGUMENTS)],
    ids=[case_id(c) for c in BAD_ENV] + [case_id(c) for c in BAD_ARGUMENTS],
)
def test_configure_refuses_it_before_starting_anything(
    env: dict[str, str], arguments: dict[str, Any], message: str
) -> None:
    """No exporter thread and no Prometheus port are left behind: the same port serves the corrected retry."""
    from otel_hicache import configure

    arguments = {"prometheus_port": free_port(), **arguments}
    threads = set(threading.enumerate())
    with pytest.raises(ConfigError) as raised:
        configure(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", **env}, **arguments)
    assert message in str(raised.value)
    assert set(threading.enumerate()) <= threads, "a thread outlived the refused configuration"
    port = arguments["prometheus_port"]
    if isinstance(port, int) and not isinstance(port, bool) and 0 < port <= 65535:
        setup = configure(env={}, prometheus_port=port)
        try:
            assert setup.prometheus_address == ("127.0.0.1", port)
        finally:
            setup.shutdown()


def test_a_taken_prometheus_port_is_refused_and_the_retry_on_it_succeeds_once_it_is_free() -> None:
    """Needs configure() to bind the port before it starts exporter threads (or to undo them on failure)."""
    from otel_hicache import configure

    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        threads = set(threading.enumerate())
        with pytest.raises(ConfigError, match=f"cannot serve Prometheus metrics on 127.0.0.1:{port}"):
            configure(env=env, prometheus_port=port)
        assert set(threading.enumerate()) <= threads, "exporter threads outlived the refused configuration"
    setup = configure(env=env, prometheus_port=port)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "hicache_transfer_tokens_total" in body
    finally:
        setup.shutdown()


@pytest.mark.parametrize("value", ["maybe", "1", "yes", "on"])
def test_a_boolean_other_than_true_or_false_warns_once_and_reads_as_false(
    value: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config, "_warned", set())  # "once" is per process: start from none warned yet
    env = {"OTEL_EXPORTER_OTLP_INSECURE": value, "OTEL_SDK_DISABLED": value}
    with caplog.at_level(logging.WARNING, logger="otel_hicache.config"):
        first, second = validate(env), validate(env)
    assert first.disabled is False and first.traces.insecure is False and second.metrics.insecure is False
    # this module's lines only: an exporter left retrying by an earlier test may log into the same capture
    warnings = [r.getMessage() for r in caplog.records if r.name == "otel_hicache.config"]
    assert warnings == [
        f"OTEL_SDK_DISABLED={value!r} is not a boolean (true or false); reading it as false",
        f"OTEL_EXPORTER_OTLP_INSECURE={value!r} is not a boolean (true or false); reading it as false",
    ]


def test_booleans_are_case_insensitive() -> None:
    assert validate({"OTEL_SDK_DISABLED": "TRUE"}).disabled is True
    assert validate({"OTEL_SDK_DISABLED": "False"}).disabled is False
    assert validate({"OTEL_EXPORTER_OTLP_TRACES_INSECURE": " True "}).traces.insecure is True


def test_settings_resolve_arguments_over_per_signal_over_general_variables() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "https://metrics.example:443/custom",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "5",
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "2.5",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "OTEL_METRIC_EXPORT_INTERVAL": "5000",
        "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "unset",
        "OTEL_SPAN_EVENT_COUNT_LIMIT": "16",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,team=a%20b",
        "OTEL_SERVICE_NAME": "sglang",
    }
    settings = validate(env)
    assert settings.traces.endpoint == "http://collector:4318/" and settings.traces.protocol == "grpc"
    assert settings.metrics.endpoint == "https://metrics.example:443/custom"
    assert settings.metrics.protocol == "http/protobuf" and settings.metrics.compression == "gzip"
    assert (settings.traces.timeout_s, settings.metrics.timeout_s) == (5.0, 2.5)
    assert settings.traces_exporters == settings.metrics_exporters == ("otlp",)
    assert (settings.sampler, settings.sampler_arg) == ("parentbased_traceidratio", 0.25)
    assert settings.metric_export_interval_ms == 5000.0
    assert settings.span_limits["OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT"] is None
    assert settings.span_limits["OTEL_SPAN_EVENT_COUNT_LIMIT"] == 16
    assert settings.resource_attributes == {"deployment.environment": "prod", "team": "a b"}
    assert settings.service_name == "sglang"

    argued = validate(env, endpoint="http://other:4318", protocol="http/protobuf", service_name="x")
    assert argued.traces.endpoint == "http://other:4318/v1/traces"
    assert argued.metrics.endpoint == "http://other:4318/v1/metrics"
    assert argued.service_name == "x"


def test_no_endpoint_means_embedded_and_prometheus_takes_its_host_and_port_from_the_environment() -> None:
    embedded = validate({})
    assert (embedded.traces_exporters, embedded.metrics_exporters, embedded.prometheus_port) == (
        ("embedded",),
        ("embedded",),
        None,
    )
    prom = validate(
        {
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_EXPORTER_PROMETHEUS_HOST": "0.0.0.0",
            "OTEL_EXPORTER_PROMETHEUS_PORT": "0",
        }
    )
    assert (prom.metrics_exporters, prom.prometheus_host, prom.prometheus_port) == (("prometheus",), "0.0.0.0", 0)
    assert validate({"OTEL_METRICS_EXPORTER": "prometheus"}).prometheus_port == 9464


def test_importing_the_package_never_fails_on_the_environment() -> None:
    """The OTel SDK raises while being imported on a bad OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT; otel_hicache does not."""
    env = {**os.environ, **{name: "many" for name in SPAN_LIMITS}, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://[::1"}
    script = (
        "import otel_hicache\n"
        "try:\n"
        "    otel_hicache.configure()\n"
        "except otel_hicache.ConfigError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.strip() == "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT='many' is not valid; use an integer >= 0, or unset"


def test_configure_validate_and_the_command_share_one_arguments_object_and_its_defaults() -> None:
    """configure()'s keyword arguments are the fields of config.Arguments, with its defaults (read from it, so they
    cannot drift); validate() takes the same object; the command's --prometheus-host default is the same value."""
    import dataclasses
    import inspect

    from otel_hicache import configure
    from otel_hicache.cli import demo
    from otel_hicache.config import DEFAULTS, Arguments

    parameters = {n: p.default for n, p in inspect.signature(configure).parameters.items() if n != "env"}
    assert parameters == {f.name: getattr(DEFAULTS, f.name) for f in dataclasses.fields(Arguments)}
    assert validate({}, Arguments(prometheus_host="::1", cardinality_limit=7)) == validate(
        {}, prometheus_host="::1", cardinality_limit=7
    )
    (host,) = [p for p in demo.params if p.name == "prometheus_host"]
    assert host.default == DEFAULTS.prometheus_host
