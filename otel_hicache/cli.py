"""``otel-hicache``: run the seeded demo workload through the reference tiered cache and show its telemetry.

    otel-hicache demo --requests 200                 # embedded: prints a summary when done
    otel-hicache demo --seconds 60 --endpoint http://localhost:4317          # OTLP gRPC to a Collector
    OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4318 OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf otel-hicache demo
    otel-hicache demo --seconds 30 --prometheus-port 9464 --linger 30      # also a Prometheus scrape endpoint
    otel-hicache demo --prefill-seconds-per-token 2e-5   # compare loads with your engine's recompute cost

The demo has no model, so it cannot time a prefill: loading versus recomputing is compared with the prefill seconds
per token the operator gives (``--prefill-seconds-per-token``, e.g. from ``hicache:engine_prefill_seconds_per_token:
rate5m`` on a real engine); without it the summary shows the load seconds per token and says what is missing.

Exit status: 0 done, 1 the run failed, 2 bad arguments or configuration (flags or ``OTEL_*`` variables) or the
``demo`` extra not installed, 130 interrupted. Computing the summary lives in :mod:`otel_hicache.summary`; this
module only prints it. The command is ``otel-hicache`` (:mod:`otel_hicache.__main__`), which needs the ``demo``
extra.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from otel_hicache import __version__
from otel_hicache import semconv as sc
from otel_hicache.config import PROTOCOLS, ConfigError, check_host, check_url, validate
from otel_hicache.package import DEMO_MODULES, demo_missing

if TYPE_CHECKING:  # the OTel SDK is imported only after the OTEL_* variables are checked (it reads some on import)
    from otel_hicache.cache.demo import DemoResult
    from otel_hicache.sdk import TelemetrySetup
    from otel_hicache.summary import Summary

WRITE_POLICIES = [p.value for p in sc.WritePolicy]


class ConfigProblem(click.ClickException):
    """A bad flag value or ``OTEL_*`` variable: a clear message and exit status 2 (like a usage error)."""

    exit_code = 2


def _checked(check: Callable[[str, str], str]) -> Callable[[click.Context, click.Parameter, str | None], str | None]:
    """A click callback running one of otel_hicache.config's checks under the flag's name."""

    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return check(value, param.opts[0])
        except ConfigError as exc:
            raise ConfigProblem(str(exc)) from None

    return callback


def _non_empty(value: str, name: str) -> str:
    if not value.strip():
        raise ConfigError(f"{name}={value!r}: use a non-empty name")
    return value


class FiniteFloat(click.FloatRange):
    """A FloatRange that also refuses nan and inf (which compare false against any bound and slip through)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="otel-hicache")
def main() -> None:
    """OpenTelemetry traces and metrics for the tiered KV cache of LLM servers."""


@main.command()
@click.option("--requests", "requests", type=click.IntRange(min=1), help="Run this many requests (default 200).")
@click.option("--seconds", type=FiniteFloat(min=0, min_open=True), help="Run for this long instead.")
@click.option("--seed", type=int, default=0, show_default=True, help="Workload seed (same seed, same workload).")
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="Where the L1 (device) pools live; auto picks CUDA when present.",
)
@click.option("--write-policy", type=click.Choice(WRITE_POLICIES), default="write_back", show_default=True)
@click.option(
    "--storage-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for the L3 file store (enables storage backup / prefetch).",
)
@click.option(
    "--endpoint",
    callback=_checked(check_url),
    help="OTLP endpoint, e.g. http://localhost:4317 (default: OTEL_EXPORTER_OTLP_ENDPOINT).",
)
@click.option("--protocol", type=click.Choice(PROTOCOLS), help="OTLP protocol (default: OTEL_EXPORTER_OTLP_PROTOCOL).")
@click.option(
    "--service-name",
    callback=_checked(_non_empty),
    help="service.name of the Resource (default: OTEL_SERVICE_NAME or otel-hicache).",
)
@click.option("--prometheus-port", type=click.IntRange(0, 65535), help="Also serve a Prometheus scrape endpoint.")
@click.option(
    "--prometheus-host",
    default="127.0.0.1",
    show_default=True,
    callback=_checked(check_host),
    help="Address the scrape endpoint binds.",
)
@click.option(
    "--linger",
    type=FiniteFloat(min=0),
    default=0.0,
    show_default=True,
    help="Keep serving the Prometheus endpoint this many seconds after the run, so a scraper can read it.",
)
@click.option(
    "--prefill-seconds-per-token",
    type=FiniteFloat(min=0, min_open=True),
    help="Your engine's prefill (recompute) seconds per token, to compare loads with (the demo has no model to time).",
)
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of tables.")
def demo(
    requests: int | None,
    seconds: float | None,
    seed: int,
    device: str,
    write_policy: str,
    storage_dir: Path | None,
    endpoint: str | None,
    protocol: str | None,
    service_name: str | None,
    prometheus_port: int | None,
    prometheus_host: str,
    linger: float,
    prefill_seconds_per_token: float | None,
    progress: bool | None,
    as_json: bool,
) -> None:
    """Run the seeded demo workload through the reference tiered cache (real torch copies)."""
    if requests is not None and seconds is not None:
        raise click.UsageError("give either --requests or --seconds, not both")
    if requests is None and seconds is None:
        requests = 200
    if linger and prometheus_port is None:
        raise click.UsageError("--linger only applies with --prometheus-port")
    arguments: dict[str, Any] = dict(
        service_name=service_name,
        endpoint=endpoint,
        protocol=protocol,
        prometheus_port=prometheus_port,
        prometheus_host=prometheus_host,
        resource_attributes={sc.RESOURCE_ENGINE: sc.Engine.REFERENCE.value},
    )
    try:
        # before anything imports the OTel API or SDK: they read some variables on import and log tracebacks
        validate(os.environ, **arguments)
        if storage_dir is not None:
            _check_storage_dir(storage_dir)
    except ConfigError as exc:
        raise ConfigProblem(str(exc)) from None
    try:
        from otel_hicache.cache.demo import DEMO_POOLS, run_demo
    except ImportError as exc:
        if exc.name in DEMO_MODULES:  # the demo extra is not installed
            raise ConfigProblem(demo_missing(exc.name)) from None
        raise click.ClickException(f"the reference cache is not available: {exc}") from exc  # a broken install
    torch_device = _pick_device(device)
    # This process is the application: it turns the SDK's own pipeline metrics on (configure() never changes the
    # environment; the export process turns them on in its own)
    os.environ.setdefault("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    try:
        from otel_hicache.sdk import configure
        from otel_hicache.summary import summarize

        # pools pre-seeded at 0 so every series exists from the first scrape
        setup = configure(**arguments, pools=tuple(p.name for p in DEMO_POOLS))
    except ConfigError as exc:
        raise ConfigProblem(str(exc)) from None

    with _sigterm_as_interrupt():
        try:
            with _progress_bar(requests, seconds, progress) as on_progress:
                result = run_demo(
                    setup.telemetry,
                    requests=requests,
                    seconds=seconds,
                    seed=seed,
                    device=torch_device,
                    write_policy=write_policy,
                    storage_dir=storage_dir,
                    progress=on_progress,
                )
            summary = summarize(setup, prefill_seconds_per_token)
            if as_json:
                click.echo(json.dumps(_jsonable(summary, result, setup), indent=2, sort_keys=True))
            else:
                click.echo(render(summary, result, setup))
            if setup.prometheus_address is not None and linger > 0:
                host, port = setup.prometheus_address
                click.echo(f"Serving Prometheus metrics on http://{host}:{port}/metrics for {linger:g} s ...", err=True)
                threading.Event().wait(linger)  # waiting for a scraper, not standing in for work
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        finally:
            setup.shutdown()


def _check_storage_dir(path: Path) -> None:
    """Create the L3 directory now and write a file in it, so a bad path fails here and not in the store's thread.

    Trying is the only check that holds for root, read-only mounts and /proc alike.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigProblem(f"--storage-dir={str(path)!r}: {exc.strerror or exc}; use a writable directory") from None


def _pick_device(choice: str) -> str | None:
    if choice == "auto":
        return None
    if choice == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigProblem("--device cuda: CUDA is not available here (use --device cpu or auto)")
    return choice


@contextmanager
def _progress_bar(requests: int | None, seconds: float | None, enabled: bool | None) -> Iterator[Callable[[int], None]]:
    """A tqdm bar fed with the number of requests done so far."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    disable = None if enabled is None else not enabled  # None: only on a terminal
    desc = "demo" if seconds is None else f"demo ({seconds:g} s)"
    with tqdm(total=requests, unit="req", desc=desc, disable=disable, file=sys.stderr, leave=False) as bar:

        def update(done: int) -> None:
            if done > bar.n:
                bar.update(done - bar.n)

        yield update


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """``docker stop`` sends SIGTERM: treat it like Ctrl-C so telemetry is flushed on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------------------- printing
def render(summary: Summary, result: DemoResult, setup: TelemetrySetup) -> str:
    """The summary as plain-text tables a person can read at a glance."""
    out = [
        f"otel-hicache demo: {_n(result.requests)} requests in {result.wall_time_s:.1f} s on {result.device}, "
        f"{result.write_policy}"
    ]
    if setup.mode == "otlp":
        out.append("Exported over OTLP; counters below are this process's exact totals.")

    total = summary.prefill_total
    out += ["", f"Prefix hits (share of {_n(total)} prefill tokens)"]
    rates = summary.hit_rates
    for tier, mode in (("device", "device_hit"), ("host", "host_hit"), ("storage", "storage_hit")):
        out.append(f"  {tier:<9}{_pct(rates[tier]):>8}  {_n(summary.prefill_tokens.get(mode, 0)):>14} tokens")
    computed = summary.prefill_tokens.get("input", 0)
    out.append(f"  {'computed':<9}{_pct(computed / total if total else None):>8}  {_n(computed):>14} tokens")

    out += ["", "Transfers by operation"]
    rows: list[tuple[str, ...]] = [("operation", "tokens", "bytes", "timed", "copy time", "bandwidth", "p50", "p99")]
    for operation in sc.TransferOperation:
        tokens = sum(v for (o, _), v in summary.tokens.items() if o == operation.value)
        nbytes = summary.bytes_by_operation.get(operation.value, 0)
        d = summary.durations.get(operation.value)
        bw = summary.bandwidth_bytes_per_s.get(operation.value)
        rows.append(
            (
                operation.value,
                _n(tokens),
                _bytes(nbytes),
                _n(d.count) if d else "-",
                _secs(d.total_s) if d else "-",
                f"{_bytes(bw)}/s" if bw is not None else "-",
                _secs(d.p50_s) if d else "-",
                _secs(d.p99_s) if d else "-",
            )
        )
    out += _table(rows)
    sources = sorted({d.source for d in summary.durations.values()})
    if sources:
        timing = sorted({t for d in summary.durations.values() for t in d.timing_sources})
        out.append(
            f"  (bandwidth = bytes / sum of copy durations, timed by {', '.join(timing)}; "
            f"percentiles from {' and '.join(sources)})"
        )

    keys = sorted({k for k, v in summary.tokens.items() if v} | set(summary.bytes_by_pool))
    if keys:
        out += ["", "Tokens and bytes by operation and pool (sidecar pools move bytes on another pool's tokens)"]
        rows = [("operation", "pool", "tokens", "bytes")]
        for op, pool in keys:
            split = summary.bytes_by_pool.get((op, pool))
            tokens = summary.tokens.get((op, pool), 0)
            rows.append((op, pool, _n(tokens), _bytes(split) if split is not None else "(total only)"))
        out += _table(rows)

    out += ["", f"Drops (device KV lost without a host copy): {_n(summary.dropped_total)} tokens"]
    for (reason, pool), n in sorted(summary.drops.items()):
        if n:
            out.append(f"  {reason:<34}{pool:<10}{_n(n):>12} tokens")
    failures = {k: v for k, v in summary.failures.items() if v}
    if failures:
        out.append("Failed transfers")
        for (op, error), n in sorted(failures.items()):
            out.append(f"  {op:<18}{error:<24}{_n(n):>8}")
    evictions = ", ".join(f"{tier} {_n(n)} tokens" for tier, n in sorted(summary.evictions.items()))
    out.append(f"Evictions: {evictions or 'none'}")
    out += _answers(summary)

    if summary.pools:
        out += ["", "Pool usage at the end"]
        rows = [("tier", "pool", "used", "limit", "used %")]
        for p in summary.pools:
            rows.append((p.tier, p.pool, _n(p.used), _n(p.limit), _pct(p.fraction_used)))
        out += _table(rows)

    pipe = summary.pipeline
    out += [
        "",
        f"Telemetry: {_n(summary.spans_recorded)} spans recorded, {_n(pipe['rejected'])} records rejected, "
        f"{_n(pipe['normalized'])} normalized, {_n(pipe['dropped_spans'])} spans dropped (queue full)",
    ]
    if setup.prometheus_address is not None:
        host, port = setup.prometheus_address
        out.append(f"Prometheus scrape endpoint: http://{host}:{port}/metrics")
    out += [f"Note: {note}" for note in summary.notes]
    return "\n".join(out)


def _answers(summary: Summary) -> list[str]:
    """Which tier served requests and how long they waited, whether each tier is the right size, what movement was
    wasted, and whether loading beats recomputing."""
    out = ["", "KV wait per request (prefills that waited for KV from a tier; p50 / p99 from histogram buckets)"]
    rows: list[tuple[str, ...]] = [("tier", "requests", "p50", "p99")]
    for tier in (sc.Tier.HOST.value, sc.Tier.STORAGE.value):
        w = summary.kv_waits.get(tier)
        rows.append((tier, _n(w.count), _secs(w.p50_s), _secs(w.p99_s)) if w else (tier, "0", "-", "-"))
    out += _table(rows)

    out += ["", "Is each tier the right size (evicted tokens never reused there; idle time of evicted entries)"]
    rows = [("tier", "evicted", "never reused", "idle p50", "idle p99")]
    for tier, t in summary.tier_sizing.items():
        rows.append(
            (
                tier,
                f"{_n(t.evicted_tokens)} tokens",
                _pct(t.never_reused_share),
                _secs(t.age.p50_s) if t.age else "-",
                _secs(t.age.p99_s) if t.age else "-",
            )
        )
    out += _table(rows) if len(rows) > 1 else ["  nothing evicted"]

    out += ["", "Wasted movement (bytes written to a tier, then evicted without being read back)"]
    rows = [("operation", "wasted", "written", "share")]
    for op, wasted in sorted(summary.wasted_bytes.items()):
        written = summary.bytes_by_operation.get(op, 0)
        rows.append((op, _bytes(wasted), _bytes(written), _pct(summary.wasted_shares.get(op))))
    out += _table(rows)
    out.append("  (the demo's L3 file store never evicts: nothing stored there is counted as wasted)")

    recompute = summary.prefill_seconds_per_token
    out += ["", "Load vs recompute (copy seconds per token; a storage hit pays storage_prefetch, then load_back)"]
    for op, seconds in sorted(summary.load_seconds_per_token.items()):
        line = f"  {op:<18}{_secs(seconds):>10}/token"
        ratio = summary.load_vs_recompute.get(op)
        if recompute is not None and ratio is not None:
            verdict = "faster" if ratio < 1 else "slower"
            line += f"  vs recompute {_secs(recompute)}/token: {ratio:.2g}x the time, loading is {verdict}"
        out.append(line)
    if not summary.load_seconds_per_token:
        out.append("  no timed loads")
    if recompute is None:
        out.append(
            "  recompute cost: needs the engine's prefill timing; the demo has no model "
            "(give --prefill-seconds-per-token)"
        )
    return out


def _jsonable(summary: Summary, result: DemoResult, setup: TelemetrySetup) -> dict[str, Any]:
    def keyed(mapping: dict[Any, Any]) -> dict[str, Any]:
        return {"/".join(map(str, k)) if isinstance(k, tuple) else str(k): v for k, v in mapping.items()}

    def plain(v: Any) -> Any:
        return dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v

    body: dict[str, Any] = {}
    for f in dataclasses.fields(summary):
        value = getattr(summary, f.name)
        if isinstance(value, dict):
            value = keyed({k: plain(v) for k, v in value.items()})
        elif isinstance(value, list):
            value = [plain(v) for v in value]
        body[f.name] = value
    body["hit_rates"] = summary.hit_rates
    body["elapsed_s"] = result.wall_time_s
    body["mode"] = setup.mode
    body["result"] = dataclasses.asdict(result)
    return body


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def _n(value: float) -> str:
    return f"{int(value):,}"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    if value >= 1e-6:
        return f"{value * 1e6:.0f} us"
    return f"{value * 1e9:.0f} ns"


if __name__ == "__main__":  # python -m otel_hicache.cli
    main()
