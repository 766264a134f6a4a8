"""Validation of every setting :func:`otel_hicache.configure` and the CLI depend on, before anything is built.

:func:`validate` checks the ``OTEL_*`` variables that otel_hicache, the OTel SDK (1.45) and the OTLP / Prometheus
exporters read, together with ``configure()``'s arguments, and returns a frozen :class:`Settings`. A bad value
raises :class:`ConfigError` with one line naming the variable (or argument) and the accepted form. It starts no
thread, opens no socket and imports no part of the OTel SDK, so it can run first and a retry after fixing the value
finds nothing left behind.

Booleans follow the OTel specification: ``true`` / ``false`` in any case; anything else warns once and reads as
false. Variables of signals otel_hicache never builds (logs: ``OTEL_BLRP_*``, ``OTEL_LOGS_EXPORTER``) and those read
only by ``opentelemetry-instrument``'s configurator (``OTEL_PYTHON_*_PROVIDER``, ``OTEL_PROPAGATORS``) are not
checked here.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import unquote, urlsplit

from otel_hicache.semconv import DEFAULT_POOL, MAX_EXTRA_POOLS, OTHER_POOL, POOLS

_logger = logging.getLogger(__name__)

PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
#: The entry-point groups ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` name exporters of, as the OTel SDK's
#: configurator reads them (``otlp`` is one of them: ``otlp_proto_grpc`` or ``otlp_proto_http`` by the protocol).
TRACES_GROUP = "opentelemetry_traces_exporter"
METRICS_GROUP = "opentelemetry_metrics_exporter"
#: The exporter name of no exporter, and of the embedded default (no endpoint, no exporter named: in-process stores).
NONE, EMBEDDED = "none", "embedded"
EXEMPLAR_FILTERS = ("trace_based", "always_on", "always_off")
TEMPORALITY_PREFERENCES = ("cumulative", "delta", "lowmemory")
HISTOGRAM_AGGREGATIONS = ("explicit_bucket_histogram", "base2_exponential_bucket_histogram")
#: What each OTLP exporter accepts in ``..._COMPRESSION`` (the gRPC one raises on anything but gzip).
COMPRESSIONS = {"grpc": ("gzip",), "http/protobuf": ("gzip", "deflate", "none")}
DEFAULT_PROMETHEUS_HOST = "127.0.0.1"
DEFAULT_PROMETHEUS_PORT = 9464
DEFAULT_CARDINALITY_LIMIT = 2000
#: Span limits the SDK reads (non-negative integer or ``unset``). The SDK reads OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT
#: already when ``opentelemetry.sdk.trace`` is imported, and raises there on a bad value.
SPAN_LIMITS = (
    "OTEL_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
    "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
    "OTEL_SPAN_EVENT_COUNT_LIMIT",
    "OTEL_SPAN_LINK_COUNT_LIMIT",
    "OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_LINK_ATTRIBUTE_COUNT_LIMIT",
)
SDK_IMPORT_VARIABLES = ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",)
_RANKS = ("tp", "pp", "dp")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP header name (RFC 9110 token)
#: What a header value may hold before percent-decoding: the OTel exporters drop a header with anything else
#: (``opentelemetry.util.re``'s liberal pattern: printable ASCII but ``"``, ``,``, ``;`` and ``\``).
_HEADER_VALUE = re.compile(r"[\x20\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*")
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")
_HOST_NAME = re.compile(r"[A-Za-z0-9._-]+")
#: The most bytes a certificate or key file may have (a CA bundle is a few hundred KiB).
MAX_PEM_BYTES = 16 * 1024 * 1024
_warned: set[tuple[str, str]] = set()


class ConfigError(ValueError):
    """A configuration value (argument or ``OTEL_*`` variable) is invalid; the message names it."""


@dataclass(frozen=True)
class SignalSettings:
    """OTLP settings of one signal after the per-signal variable / general variable / argument precedence.

    ``endpoint`` is the URL to hand the exporter: the argument or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (with
    ``/v1/traces`` or ``/v1/metrics`` appended for http/protobuf), else the per-signal variable as is; None when
    nothing names one.
    ``compression``, ``timeout_s``, ``insecure`` and the certificate paths are None when unset; ``headers`` are the
    percent-decoded ``name -> value`` pairs (names in lower case, as the OTel exporters send them). Exporters are built
    from these values, never from the process environment, so ``configure(env=...)`` means what it says.
    """

    endpoint: str | None
    protocol: str
    compression: str | None
    timeout_s: float | None
    insecure: bool | None
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)  # their values are secrets
    certificate: str | None = None
    client_key: str | None = None
    client_certificate: str | None = None


@dataclass(frozen=True)
class Settings:
    """Everything ``configure()`` needs, parsed and checked; arguments already won over the environment.

    ``traces_exporters`` are the exporters ``OTEL_TRACES_EXPORTER`` lists (``otlp``, ``console``, any installed entry
    point of :data:`TRACES_GROUP`; ``("none",)`` for none), or ``("embedded",)`` when no endpoint and no exporter is
    asked for; ``metrics_exporters`` the same for :data:`METRICS_GROUP` (``prometheus`` among them).
    ``prometheus_port`` is set when a scrape endpoint is wanted (argument, or ``prometheus`` in
    ``OTEL_METRICS_EXPORTER``). Times are milliseconds as in the variables, except the OTLP
    timeouts, which the Python exporters read as seconds. ``span_limits`` holds the limits that are set (None:
    ``unset``, no limit). ``temporality_preference``, ``histogram_aggregation`` and ``retryable_error_codes`` are
    None when unset.
    """

    disabled: bool
    service_name: str | None
    resource_attributes: Mapping[str, Any]
    ranks: Mapping[str, int]
    traces_exporters: tuple[str, ...]
    metrics_exporters: tuple[str, ...]
    traces: SignalSettings
    metrics: SignalSettings
    sampler: str
    sampler_arg: float | None
    metric_export_interval_ms: float
    metric_export_timeout_ms: float
    exemplar_filter: str
    bsp_max_queue_size: int
    bsp_max_export_batch_size: int
    bsp_schedule_delay_ms: int
    bsp_export_timeout_ms: int
    span_limits: Mapping[str, int | None]
    prometheus_host: str
    prometheus_port: int | None
    pools: tuple[str, ...]
    cardinality_limit: int
    internal_metrics: bool | None  # None: OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED unset
    temporality_preference: str | None = None
    histogram_aggregation: str | None = None
    retryable_error_codes: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Arguments:
    """``configure()``'s arguments, as ``configure()``, :func:`validate` and the CLI pass them: each default is spelled
    here, once (``configure()``'s signature reads them from :data:`DEFAULTS`). :meth:`check` refuses a bad one."""

    service_name: str | None = None
    endpoint: str | None = None
    protocol: str | None = None
    prometheus_port: int | None = None
    prometheus_host: str = DEFAULT_PROMETHEUS_HOST
    ranks: Mapping[str, int] | None = None
    resource_attributes: Mapping[str, Any] | None = None
    pools: Sequence[str] = (DEFAULT_POOL,)
    extra_pools: Sequence[str] = ()
    cardinality_limit: int = DEFAULT_CARDINALITY_LIMIT
    token_metrics: bool = True
    set_global: bool = False

    def keywords(self) -> dict[str, Any]:
        """As ``configure()``'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def check(self) -> None:
        """ConfigError naming the first bad argument (values that may hold a secret are not shown)."""
        if self.service_name is not None and (not isinstance(self.service_name, str) or not self.service_name.strip()):
            raise ConfigError(f"service_name={self.service_name!r}: use a non-empty string")
        if self.endpoint is not None:
            if not isinstance(self.endpoint, str):  # its repr is not shown: it may hold a password
                raise ConfigError(
                    f"endpoint: {type(self.endpoint).__name__} is not a URL string; use one such as http://localhost:4317"
                )
            check_url(self.endpoint, "endpoint")
        if self.protocol is not None and self.protocol not in PROTOCOLS:
            raise ConfigError(f"protocol {self.protocol!r} is not supported; use one of: {', '.join(PROTOCOLS)}")
        if self.prometheus_port is not None and not _is_int(self.prometheus_port, 0, 65535):
            raise ConfigError(
                f"prometheus_port={self.prometheus_port!r}: use an integer port 0-65535 (0 picks a free one)"
            )
        if not isinstance(self.prometheus_host, str):
            raise ConfigError(f"prometheus_host={self.prometheus_host!r}: use a host name or IP address")
        check_host(self.prometheus_host, "prometheus_host")
        if self.ranks is not None:
            if not isinstance(self.ranks, Mapping):
                raise ConfigError(f"ranks={self.ranks!r}: use a mapping such as {{'tp': 0, 'pp': 0, 'dp': 0}}")
            for rank, value in self.ranks.items():
                if rank not in _RANKS:
                    raise ConfigError(f"ranks: unknown rank {rank!r}; use tp, pp or dp")
                if not _is_int(value, 0, None):
                    raise ConfigError(f"ranks[{rank!r}]={value!r}: use an integer >= 0")
        if self.resource_attributes is not None:
            if not isinstance(self.resource_attributes, Mapping):
                raise ConfigError(
                    f"resource_attributes={self.resource_attributes!r}: use a mapping of str to str/bool/int/float"
                )
            for key, value in self.resource_attributes.items():
                if not isinstance(key, str) or not key:
                    raise ConfigError(f"resource_attributes: key {key!r} is not a non-empty string")
                if not isinstance(value, (str, bool, int, float)):
                    raise ConfigError(f"resource_attributes[{key!r}]={value!r}: use a str, bool, int or float")
        if isinstance(self.pools, str) or not isinstance(self.pools, Sequence) or not self.pools:
            raise ConfigError(f"pools={self.pools!r}: use a non-empty sequence of pool names such as ('kv',)")
        for pool in self.pools:
            if not isinstance(pool, str) or not pool:
                raise ConfigError(f"pools: {pool!r} is not a non-empty string")
        if isinstance(self.extra_pools, str) or not isinstance(self.extra_pools, Sequence):
            raise ConfigError(f"extra_pools={self.extra_pools!r}: use a sequence of pool names such as ('swa_extra',)")
        for pool in self.extra_pools:
            if not isinstance(pool, str) or not pool:
                raise ConfigError(f"extra_pools: {pool!r} is not a non-empty string")
        extra = {pool for pool in self.extra_pools if pool not in POOLS and pool != OTHER_POOL}
        if len(extra) > MAX_EXTRA_POOLS:
            raise ConfigError(
                f"extra_pools: {len(extra)} names beyond the standard pools; use at most {MAX_EXTRA_POOLS} (each is a "
                "series of every metric)"
            )
        if not _is_int(self.cardinality_limit, 1, None):
            raise ConfigError(f"cardinality_limit={self.cardinality_limit!r}: use an integer >= 1")
        if not isinstance(self.set_global, bool):
            raise ConfigError(f"set_global={self.set_global!r}: use True or False")


#: ``configure()``'s defaults.
DEFAULTS = Arguments()


def validate(env: Mapping[str, str] | None = None, arguments: Arguments | None = None, **given: Any) -> Settings:
    """Check ``env`` (``os.environ`` when None) and ``configure()``'s ``arguments`` (:class:`Arguments`, or ``given``
    by name: ``validate(env, endpoint=...)`` is ``validate(env, Arguments(endpoint=...))``); return the
    :class:`Settings`.

    Contract: pure apart from a once-per-value warning for a non-boolean boolean; starts nothing, binds nothing,
    imports no OTel SDK module; raises :class:`ConfigError` ("``NAME=value``: what is wrong; the accepted form"),
    naming the first bad variable or argument. Arguments win over variables: ``endpoint`` over every
    ``..._ENDPOINT``, ``protocol`` over every ``..._PROTOCOL``, ``prometheus_port`` over
    ``OTEL_EXPORTER_PROMETHEUS_*``.
    """
    env = os.environ if env is None else env
    arguments = replace(arguments or DEFAULTS, **given)
    arguments.check()
    endpoint, protocol, prometheus_host = arguments.endpoint, arguments.protocol, arguments.prometheus_host

    disabled = _boolean(env, "OTEL_SDK_DISABLED") or False
    resource = key_values(env, "OTEL_RESOURCE_ATTRIBUTES")
    env_service = env.get("OTEL_SERVICE_NAME", "").strip() or None

    traces = _signal(env, "TRACES", endpoint, protocol)
    metrics = _signal(env, "METRICS", endpoint, protocol)
    any_endpoint = traces.endpoint is not None or metrics.endpoint is not None
    default_kinds = ("otlp",) if any_endpoint else (EMBEDDED,)
    traces_kinds = _exporters(env, "OTEL_TRACES_EXPORTER", TRACES_GROUP) or default_kinds
    metrics_kinds = _exporters(env, "OTEL_METRICS_EXPORTER", METRICS_GROUP) or default_kinds

    sampler = _choice(env, "OTEL_TRACES_SAMPLER", SAMPLERS) or "parentbased_always_on"
    sampler_arg = None
    if sampler.endswith("traceidratio"):
        sampler_arg = _number(env, "OTEL_TRACES_SAMPLER_ARG", "a probability between 0 and 1", low=0.0, high=1.0)

    interval = _number(env, "OTEL_METRIC_EXPORT_INTERVAL", "milliseconds > 0", low=0.0, low_open=True)
    timeout = _number(env, "OTEL_METRIC_EXPORT_TIMEOUT", "milliseconds > 0", low=0.0, low_open=True)
    exemplar_filter = env.get("OTEL_METRICS_EXEMPLAR_FILTER", "trace_based")
    if exemplar_filter not in EXEMPLAR_FILTERS:  # the SDK compares exactly, no case folding
        raise ConfigError(
            _bad("OTEL_METRICS_EXEMPLAR_FILTER", exemplar_filter, f"one of {', '.join(EXEMPLAR_FILTERS)}")
        )
    temporality = _choice(env, "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", TEMPORALITY_PREFERENCES)
    aggregation = _choice(env, "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION", HISTOGRAM_AGGREGATIONS)

    queue = _integer(env, "OTEL_BSP_MAX_QUEUE_SIZE", low=1)
    batch = _integer(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", low=1)
    queue, batch = (2048 if queue is None else queue), (512 if batch is None else batch)
    if batch > queue:
        raise ConfigError(
            f"OTEL_BSP_MAX_EXPORT_BATCH_SIZE={batch} is larger than OTEL_BSP_MAX_QUEUE_SIZE={queue}; "
            "use a batch size <= the queue size"
        )
    delay = _integer(env, "OTEL_BSP_SCHEDULE_DELAY", low=1)
    bsp_timeout = _integer(env, "OTEL_BSP_EXPORT_TIMEOUT", low=0)
    limits = {name: _span_limit(env, name) for name in SPAN_LIMITS if name in env}
    retryable = _retryable_codes(env)
    _entry_point(env, "OTEL_PYTHON_CONTEXT", "opentelemetry_context")

    prometheus_port_out = arguments.prometheus_port
    if "prometheus" in metrics_kinds and arguments.prometheus_port is None:
        port = _integer(env, "OTEL_EXPORTER_PROMETHEUS_PORT", low=0, high=65535)
        prometheus_port_out = DEFAULT_PROMETHEUS_PORT if port is None else port
        raw_host = _raw(env, "OTEL_EXPORTER_PROMETHEUS_HOST")
        if raw_host is not None:
            prometheus_host = check_host(raw_host, "OTEL_EXPORTER_PROMETHEUS_HOST")
    else:  # still checked: a typo should not wait until someone switches the exporter on
        _integer(env, "OTEL_EXPORTER_PROMETHEUS_PORT", low=0, high=65535)
        raw_host = _raw(env, "OTEL_EXPORTER_PROMETHEUS_HOST")
        if raw_host is not None:
            check_host(raw_host, "OTEL_EXPORTER_PROMETHEUS_HOST")

    return Settings(
        disabled=disabled,
        service_name=arguments.service_name if arguments.service_name is not None else env_service,
        resource_attributes={**resource, **(arguments.resource_attributes or {})},
        ranks=dict(arguments.ranks or {}),
        traces_exporters=traces_kinds,
        metrics_exporters=metrics_kinds,
        traces=traces,
        metrics=metrics,
        sampler=sampler,
        sampler_arg=sampler_arg,
        metric_export_interval_ms=60_000.0 if interval is None else interval,
        metric_export_timeout_ms=30_000.0 if timeout is None else timeout,
        exemplar_filter=exemplar_filter,
        bsp_max_queue_size=queue,
        bsp_max_export_batch_size=batch,
        bsp_schedule_delay_ms=5000 if delay is None else delay,
        bsp_export_timeout_ms=30_000 if bsp_timeout is None else bsp_timeout,
        span_limits=limits,
        prometheus_host=prometheus_host,
        prometheus_port=prometheus_port_out,
        pools=tuple(arguments.pools),
        cardinality_limit=arguments.cardinality_limit,
        internal_metrics=_boolean(env, "OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED"),
        temporality_preference=temporality,
        histogram_aggregation=aggregation,
        retryable_error_codes=retryable,
    )


def check_sdk_import(env: Mapping[str, str] | None = None) -> None:
    """Check the variables the OTel SDK reads while being imported (so ``import`` cannot raise on them)."""
    env = os.environ if env is None else env
    for name in SDK_IMPORT_VARIABLES:
        _span_limit(env, name)


def check_url(value: str, name: str) -> str:
    """``value`` as an OTLP endpoint URL (``http(s)://host[:port][/path]``, no blanks anywhere: the exporters take
    the value as it is), or ConfigError naming ``name``. The message shows the URL without its userinfo."""
    accepted = "an http:// or https:// URL such as http://localhost:4317"
    if any(c.isspace() for c in value):
        raise ConfigError(_bad(name, without_userinfo(value), f"{accepted} (no spaces, also none around it)"))
    try:
        parts = urlsplit(value)
        port = parts.port  # raises on a port that is not a number or is out of range
        host = parts.hostname
    except ValueError:  # not its text: urlsplit quotes the part it could not read, which may be a password
        raise ConfigError(
            _bad(name, without_userinfo(value), f"{accepted} (its host or port cannot be read: a port is 1-65535)")
        ) from None
    if parts.scheme not in ("http", "https") or not host or not _valid_host(host):
        raise ConfigError(_bad(name, without_userinfo(value), accepted))
    if port == 0:
        raise ConfigError(_bad(name, without_userinfo(value), f"{accepted} (port 1-65535)"))
    return value


def without_userinfo(url: str) -> str:
    """``url`` as messages may show it: whatever stands before the last ``@`` of what follows the scheme (the
    userinfo, in a URL however malformed) replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.rpartition('@')[2]}"


def _valid_host(host: str) -> bool:
    """A DNS name or IPv4 address (letters, digits, ``.``, ``-``, ``_``), or an IPv6 address (urlsplit took off its
    brackets)."""
    if ":" not in host:
        return _HOST_NAME.fullmatch(host) is not None
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------- arguments
def _is_int(value: Any, low: int, high: int | None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)


def check_host(value: str, name: str) -> str:
    """``value`` as a host name or IP address to bind (brackets around IPv6 allowed), or ConfigError naming ``name``."""
    host = value.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c.isspace() or c in "/?#@[]" for c in host):
        raise ConfigError(_bad(name, value, "a host name or IP address such as 127.0.0.1, 0.0.0.0 or ::"))
    return host


# --------------------------------------------------------------------------- variables
def _bad(name: str, raw: object, accepted: str) -> str:
    return f"{name}={raw!r} is not valid; use {accepted}"


def _raw(env: Mapping[str, str], name: str) -> str | None:
    """The value, or None when unset or blank (the SDK treats a blank value as unset)."""
    raw = env.get(name)
    return raw if raw is not None and raw.strip() else None


def _choice(env: Mapping[str, str], name: str, allowed: Sequence[str]) -> str | None:
    raw = _raw(env, name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value not in allowed:
        raise ConfigError(f"{name}={raw!r} is not supported; use one of: {', '.join(allowed)}")
    return value


def _exporters(env: Mapping[str, str], name: str, group: str) -> tuple[str, ...] | None:
    """A comma-separated list of exporters, as the specification allows (``otlp,console``), each ``none`` or an
    installed entry point of ``group``; ``none`` stands alone."""
    raw = _raw(env, name)
    if raw is None:
        return None
    values = tuple(dict.fromkeys(v.strip().lower() for v in raw.split(",") if v.strip()))
    from importlib.metadata import entry_points

    allowed = (NONE, *sorted({ep.name for ep in entry_points(group=group)}))
    unknown = [v for v in values if v not in allowed]
    if unknown or not values:
        raise ConfigError(
            f"{name}={raw!r} is not supported; use one of: {', '.join(allowed)} (or a comma-separated list; the "
            f"names are the installed {group} entry points)"
        )
    if NONE in values and len(values) > 1:
        raise ConfigError(f"{name}={raw!r} lists none with other exporters; use none alone, or leave it out")
    return values


def _number(
    env: Mapping[str, str],
    name: str,
    accepted: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> float | None:
    raw = _raw(env, name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number; use {accepted}") from None
    too_low = low is not None and (value <= low if low_open else value < low)
    if not math.isfinite(value) or too_low or (high is not None and value > high):
        raise ConfigError(f"{name}={raw!r} is out of range; use {accepted}")
    return value


def _integer(env: Mapping[str, str], name: str, *, low: int, high: int | None = None) -> int | None:
    raw = _raw(env, name)
    if raw is None:
        return None
    accepted = f"an integer >= {low}" if high is None else f"an integer {low}-{high}"
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(_bad(name, raw, accepted)) from None
    if value < low or (high is not None and value > high):
        raise ConfigError(_bad(name, raw, accepted))
    return value


def _span_limit(env: Mapping[str, str], name: str) -> int | None:
    if name not in env:
        return None
    raw = env[name]
    text = raw.strip().lower()
    if text == "unset":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(_bad(name, raw, "an integer >= 0, or unset"))
    return value


def _boolean(env: Mapping[str, str], name: str) -> bool | None:
    """The spec's boolean: true/false in any case; anything else warns once and is false. None when unset."""
    raw = _raw(env, name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value not in ("true", "false"):
        if (name, raw) not in _warned:
            _warned.add((name, raw))
            _logger.warning("%s=%r is not a boolean (true or false); reading it as false", name, raw)
        return False
    return value == "true"


def key_values(env: Mapping[str, str], name: str) -> dict[str, str]:
    """``key=value,key2=value2`` (values percent-encoded), as OTEL_RESOURCE_ATTRIBUTES and the headers use."""
    accepted = "comma-separated key=value pairs, values percent-encoded"
    return {key: unquote(value).strip() for _, key, value in _members(env, name, accepted)}


def _members(env: Mapping[str, str], name: str, accepted: str) -> Iterator[tuple[int, str, str]]:
    """``(position, key, raw value)`` of each member of a comma-separated ``key=value`` list (positions from 1, blank
    members counted). A bad member is named by its position only: without ``=`` it may be the secret itself."""
    for position, member in enumerate(env.get(name, "").split(","), 1):
        if not member.strip():
            continue
        key, sep, value = member.partition("=")
        key = unquote(key).strip()
        if not sep:
            raise ConfigError(f"{name}: member {position} has no '=' (its text is not shown); use {accepted}")
        if not key:
            raise ConfigError(f"{name}: member {position} has an empty key; use {accepted}")
        yield position, key, value


def _headers(env: Mapping[str, str], name: str) -> dict[str, str]:
    """The headers, percent-decoded, names in lower case; a header the OTLP exporters would drop (or could not send)
    is refused, so that an auth header never silently disappears. Messages name a header by its position, and by
    its name once that is a valid header name; never by its value."""
    accepted = "comma-separated name=value pairs such as api-key=secret,x-tenant=a (values percent-encoded)"
    headers = {}
    for position, key, raw_value in _members(env, name, accepted):
        if not _TOKEN.fullmatch(key):
            raise ConfigError(
                f"{name}: the name of member {position} is not a header name (letters, digits and "
                f"!#$%&'*+-.^_`|~ only; its text is not shown); use {accepted}"
            )
        if not _HEADER_VALUE.fullmatch(raw_value.strip()):
            raise ConfigError(
                f"{name}: the value of header {key!r} (member {position}) holds characters the OTLP exporters drop "
                f"(non-ASCII, '\"', ';', '\\'); percent-encode them ({accepted})"
            )
        value = unquote(raw_value).strip()
        if not _PRINTABLE_ASCII.fullmatch(value):
            raise ConfigError(
                f"{name}: the value of header {key!r} (member {position}) is not printable ASCII once percent-decoded "
                "(gRPC and HTTP cannot send it); use printable ASCII characters"
            )
        headers[key.lower()] = value
    return headers


def _file(env: Mapping[str, str], name: str) -> str | None:
    """A certificate or key variable: the path of a readable regular file holding a PEM block."""
    path = _raw(env, name)
    if path is None:
        return None
    accepted = "use the path of a PEM file"
    if "-----BEGIN" in path or "\n" in path:  # a key pasted in place of its path: not shown, it may be a secret
        raise ConfigError(f"{name}: holds PEM content (not shown), not a path; {accepted}")
    if not os.path.isfile(path):  # a directory passes os.access, and the exporter then raises
        raise ConfigError(f"{name}={path!r}: no readable file there; {accepted}")
    try:
        with open(path, "rb") as handle:
            content = handle.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{name}={path!r}: cannot be read ({exc.strerror or exc}); {accepted}") from None
    if len(content) > MAX_PEM_BYTES or b"-----BEGIN " not in content:
        raise ConfigError(f"{name}={path!r}: no PEM block (-----BEGIN ...) in it; {accepted}")
    return path


def _signal(env: Mapping[str, str], signal: str, endpoint: str | None, protocol: str | None) -> SignalSettings:
    """One signal's OTLP settings: ``OTEL_EXPORTER_OTLP_<SIGNAL>_X`` wins over ``OTEL_EXPORTER_OTLP_X``."""
    general, specific = "OTEL_EXPORTER_OTLP_", f"OTEL_EXPORTER_OTLP_{signal}_"
    headers: dict[str, dict[str, str]] = {}
    files: dict[str, str | None] = {}
    for prefix in (general, specific):  # both checked: the exporters read both
        raw = _raw(env, prefix + "ENDPOINT")
        if raw is not None:
            check_url(raw, prefix + "ENDPOINT")
        _choice(env, prefix + "PROTOCOL", PROTOCOLS)
        _boolean(env, prefix + "INSECURE")
        headers[prefix] = _headers(env, prefix + "HEADERS")
        for suffix in ("CERTIFICATE", "CLIENT_CERTIFICATE", "CLIENT_KEY"):
            files[prefix + suffix] = _file(env, prefix + suffix)
        _number(env, prefix + "TIMEOUT", "seconds > 0 (the Python OTLP exporters read seconds)", low=0.0, low_open=True)

    def first(suffix: str) -> tuple[str, str] | tuple[None, None]:
        for prefix in (specific, general):
            raw = _raw(env, prefix + suffix)
            if raw is not None:
                return prefix + suffix, raw
        return None, None

    chosen_protocol = protocol or _choice(env, first("PROTOCOL")[0] or general + "PROTOCOL", PROTOCOLS) or "grpc"
    compression_name, compression_raw = first("COMPRESSION")
    compression = None
    if compression_name is not None and compression_raw is not None:
        compression = compression_raw.strip().lower()
        accepted = COMPRESSIONS[chosen_protocol]
        if compression not in accepted:
            raise ConfigError(
                f"{compression_name}={compression_raw!r} is not supported by the {chosen_protocol} exporter; "
                f"use one of: {', '.join(accepted)} (or leave it unset)"
            )
    timeout_name, _ = first("TIMEOUT")
    timeout = _number(env, timeout_name, "seconds > 0", low=0.0, low_open=True) if timeout_name else None
    insecure_name, _ = first("INSECURE")
    insecure = _boolean(env, insecure_name) if insecure_name else None
    specific_endpoint = _raw(env, specific + "ENDPOINT")
    base = endpoint if endpoint is not None else (None if specific_endpoint else _raw(env, general + "ENDPOINT"))
    if base is not None:
        resolved: str | None = base
        if chosen_protocol == "http/protobuf":
            resolved = f"{base.rstrip('/')}/v1/{signal.lower()}"
    else:
        resolved = specific_endpoint
    if resolved is not None and chosen_protocol == "grpc" and "@" in urlsplit(resolved).netloc:
        # the gRPC exporter takes the whole netloc for its target (so it can never connect) and logs it
        source = "endpoint" if endpoint is not None else (specific if specific_endpoint else general) + "ENDPOINT"
        raise ConfigError(
            f"{source}={without_userinfo(resolved)!r} holds userinfo (user:password@), which the grpc exporter cannot "
            "send; send credentials as a header (OTEL_EXPORTER_OTLP_HEADERS=authorization=Basic%20...) or use "
            "http/protobuf"
        )
    headers_name = first("HEADERS")[0]

    def path(suffix: str) -> str | None:
        return files[specific + suffix] or files[general + suffix]

    return SignalSettings(
        endpoint=resolved,
        protocol=chosen_protocol,
        compression=compression,
        timeout_s=timeout,
        insecure=insecure,
        headers=headers[specific] if headers_name == specific + "HEADERS" else headers[general],
        certificate=path("CERTIFICATE"),
        client_key=path("CLIENT_KEY"),
        client_certificate=path("CLIENT_CERTIFICATE"),
    )


def _entry_point(env: Mapping[str, str], name: str, group: str) -> None:
    """A variable naming a plugin: one of the installed entry points of ``group``."""
    raw = _raw(env, name)
    if raw is None:
        return
    from importlib.metadata import entry_points

    installed = sorted(ep.name for ep in entry_points(group=group))
    if raw.strip() not in installed:
        raise ConfigError(_bad(name, raw, f"one of the installed {group} entry points: {', '.join(installed)}"))


def _retryable_codes(env: Mapping[str, str]) -> tuple[str, ...] | None:
    name = "OTEL_PYTHON_EXPORTER_OTLP_GRPC_RETRYABLE_ERROR_CODES"
    raw = _raw(env, name)
    if raw is None:
        return None
    from grpc import StatusCode  # only when set: grpc is heavy to import

    names = tuple(code.strip().upper() for code in raw.split(",") if code.strip())
    unknown = [code for code in names if code not in StatusCode.__members__]
    if unknown:
        raise ConfigError(_bad(name, raw, "comma-separated gRPC status code names such as UNAVAILABLE,ABORTED"))
    return names
