# ruff: noqa: E501  (the case tables read best one case per line)
"""No secret in any message: a token in a header value, in a URL's userinfo or in a key pasted for its path never
reaches a ConfigError, a log record or a line of standard error, whichever way the value comes in (``validate()``,
``configure()``, the ``otel-hicache`` command) and however it is malformed. The message still names the variable
and what is wrong: the member's position, the header's name where that name is valid."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import traceback
from typing import Any

import pytest
from click.testing import CliRunner

from otel_hicache.cli import main
from otel_hicache.config import ConfigError, validate
from otel_hicache.testing import free_port

TOKEN = "s3cr3tT0k3n"

#: Header lists in every malformed shape, each with the token somewhere: (shape, value, what the message must say).
HEADER_SHAPES: list[tuple[str, str, str]] = [
    ("a member without '=' after the token's", f"authorization=Bearer%20{TOKEN},x-tenant", "member 2 has no '='"),
    ("an empty name", f"=Bearer%20{TOKEN}", "member 1 has an empty key"),
    ("the token alone", TOKEN, "member 1 has no '='"),
    ("a colon for '='", f"x-tenant=a,authorization: Bearer {TOKEN}", "member 2 has no '='"),
    ("the token in the name", f"Bearer {TOKEN}=x", "the name of member 1 is not a header name"),
    ("a quote in the value", f'authorization=Bearer "{TOKEN}"', "the value of header 'authorization' (member 1) holds characters"),
    ("a semicolon in the value", f"authorization=Bearer {TOKEN};x", "the value of header 'authorization' (member 1) holds characters"),
    ("a backslash in the value", f"x-tenant=a,authorization={TOKEN}\\", "the value of header 'authorization' (member 2) holds characters"),
    ("non-ASCII in the value", f"authorization=Bearer {TOKEN}\u00e9", "the value of header 'authorization' (member 1) holds characters"),
    ("a control character once decoded", f"authorization=Bearer%07{TOKEN}", "the value of header 'authorization' (member 1) is not printable ASCII"),
]  # fmt: skip
HEADER_VARIABLES = (
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
)

#: Endpoints with the token as the password of their userinfo, in every malformed shape (and one well-formed, which
#: the grpc exporter cannot send): (shape, value).
ENDPOINT_SHAPES: list[tuple[str, str]] = [
    ("a port out of range", f"http://user:{TOKEN}@127.0.0.1:99999"),
    ("port 0", f"http://user:{TOKEN}@127.0.0.1:0"),
    ("a port that is not a number", f"http://user:{TOKEN}@127.0.0.1:port"),
    ("a slash in the password", f"http://user:{TOKEN}/x@127.0.0.1:4317"),
    ("an unclosed IPv6 host", f"http://user:{TOKEN}@[::1"),
    ("no host", f"http://user:{TOKEN}@"),
    ("a bad host", f"http://user:{TOKEN}@coll$ector:4317"),
    ("another scheme", f"ftp://user:{TOKEN}@127.0.0.1:4317"),
    ("no scheme", f"user:{TOKEN}@127.0.0.1:4317"),
    ("a space", f"http://user:{TOKEN}@127.0.0.1:4317 "),
    ("only a user", f"http://{TOKEN}@127.0.0.1:99999"),
    ("well-formed, for grpc", f"http://user:{TOKEN}@127.0.0.1:4317"),
]  # fmt: skip
ENDPOINT_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)

#: A private key pasted where its path belongs.
PEM = f"-----BEGIN PRIVATE KEY-----\n{TOKEN}\n-----END PRIVATE KEY-----\n"
PEM_VARIABLES = tuple(
    f"OTEL_EXPORTER_OTLP_{signal}{kind}"
    for signal in ("", "TRACES_", "METRICS_")
    for kind in ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE")
)

#: (variables, the text the message must hold) for every case above.
CASES: list[tuple[dict[str, str], str]] = [
    *(({name: value}, f"{name}: {says}") for name in HEADER_VARIABLES for _, value, says in HEADER_SHAPES),
    *(({name: value}, name) for name in ENDPOINT_VARIABLES for _, value in ENDPOINT_SHAPES),
    *(({name: PEM}, f"{name}: holds PEM content (not shown), not a path") for name in PEM_VARIABLES),
]
IDS = [
    *(f"{name}-{shape}" for name in HEADER_VARIABLES for shape, _, _ in HEADER_SHAPES),
    *(f"{name}-{shape}" for name in ENDPOINT_VARIABLES for shape, _ in ENDPOINT_SHAPES),
    *PEM_VARIABLES,
]


def assert_secret_free(*texts: str) -> None:
    for text in texts:
        assert TOKEN not in text and TOKEN.lower() not in text, text


@pytest.mark.parametrize(("env", "says"), CASES, ids=IDS)
def test_a_malformed_variable_is_refused_by_name_without_its_secret(
    env: dict[str, str], says: str, caplog: pytest.LogCaptureFixture
) -> None:
    """validate() and configure(): the same ConfigError, naming the variable and what is wrong, and no log record
    with the token (the OTel SDK's own warnings included: nothing reaches it)."""
    from otel_hicache import configure

    with caplog.at_level(logging.DEBUG):
        with pytest.raises(ConfigError) as checked:
            validate(env)
        with pytest.raises(ConfigError) as configured:
            configure(env=env, prometheus_port=free_port())
    assert says in str(checked.value) and str(configured.value) == str(checked.value)
    crash_report = "".join(traceback.format_exception(checked.value))  # what an uncaught one prints
    assert_secret_free(crash_report, repr(checked.value), *(r.getMessage() for r in caplog.records))


@pytest.mark.parametrize("value", [value for _, value in ENDPOINT_SHAPES], ids=[shape for shape, _ in ENDPOINT_SHAPES])
def test_a_malformed_endpoint_argument_is_refused_without_its_userinfo(value: str) -> None:
    with pytest.raises(ConfigError) as raised:
        validate({}, endpoint=value)
    assert str(raised.value).startswith("endpoint=") and "***@" in str(raised.value)
    assert_secret_free(str(raised.value))
    with pytest.raises(ConfigError) as raised:
        validate({}, endpoint=value.encode())  # not even a str: its repr is not shown either
    assert_secret_free(str(raised.value))


def test_valid_headers_are_kept_out_of_the_settings_repr() -> None:
    """What a debug log of the checked settings would print holds no header value."""
    settings = validate({"OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{TOKEN}"})
    assert settings.traces.headers == {"authorization": f"Bearer {TOKEN}"}
    assert_secret_free(repr(settings), str(settings))


def test_the_message_shows_the_url_without_its_userinfo() -> None:
    with pytest.raises(ConfigError) as raised:
        validate({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://user:{TOKEN}@127.0.0.1:99999"})
    assert str(raised.value).startswith("OTEL_EXPORTER_OTLP_ENDPOINT='http://***@127.0.0.1:99999' is not valid; use")


@pytest.mark.parametrize(
    ("args", "env"),
    [
        *(([], case) for case, _ in CASES),
        *((["--endpoint", value], {}) for _, value in ENDPOINT_SHAPES),
    ],
    ids=[*IDS, *(f"--endpoint-{shape}" for shape, _ in ENDPOINT_SHAPES)],
)
def test_the_command_refuses_it_with_exit_2_and_no_secret(args: list[str], env: dict[str, str]) -> None:
    """In process through click (one process per case would take minutes); the installed command's own stderr is
    the next test's."""
    clean: dict[str, str | None] = {name: None for name in os.environ if name.startswith("OTEL_")}
    result = CliRunner().invoke(main, ["demo", "--requests", "5", "--no-progress", *args], env={**clean, **env})
    assert result.exit_code == 2, result.output
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1, result.output
    assert_secret_free(result.output)


@pytest.mark.parametrize(
    ("args", "env"),
    [
        ([], {"OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{TOKEN},x-tenant"}),
        ([], {"OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"=Bearer%20{TOKEN}"}),
        ([], {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://user:{TOKEN}@127.0.0.1:99999"}),
        (["--endpoint", f"http://user:{TOKEN}@127.0.0.1:99999"], {}),
    ],
    ids=["headers", "traces-headers-empty-key", "endpoint-variable", "endpoint-flag"],
)
def test_the_installed_command_prints_no_secret_on_stderr(args: list[str], env: dict[str, str]) -> None:
    """The three cases of the issue, and the flag, through the command's own process: the exit-2 line names the
    variable and holds no token."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-m", "otel_hicache.cli", "demo", "--no-progress", "--requests", "5", *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: ") and ("--endpoint" in args or next(iter(env)) in line), line
    assert_secret_free(result.stderr, result.stdout)


EXPORT = textwrap.dedent(
    """
    import logging, sys
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s: %(message)s")
    from otel_hicache import configure, TransferOperation, TransferRecord

    setup = configure(env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": sys.argv[1],
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_HEADERS": sys.argv[2],
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
        "OTEL_METRIC_EXPORT_INTERVAL": "100",
    })
    setup.telemetry.record_transfer(TransferRecord(TransferOperation.BACKUP, {"kv": 4}, 256, 10, 20))
    setup.force_flush(15.0)  # long enough for the failed export's line on a loaded machine; returns once sent
    setup.shutdown(10.0)
    """
)


def test_a_well_formed_secret_is_never_logged_by_a_failing_export(tmp_path: Any) -> None:
    """A URL with userinfo (http/protobuf sends it as basic auth) and an auth header, exported to a closed port:
    every log line of this process and of its export process (relayed into this one's logging) is token-free, and
    the failure itself is logged."""
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-c", EXPORT, f"http://user:{TOKEN}@127.0.0.1:{port}", f"authorization=Bearer%20{TOKEN}"],
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "otel_hicache export process" in result.stderr  # the export process's lines reached this one's logging
    # tried and failed: the SDK's retry line, or its final one when the retries ran out before the host exited
    assert "encountered while exporting" in result.stderr or "Failed to export" in result.stderr
    assert_secret_free(result.stderr, result.stdout)
