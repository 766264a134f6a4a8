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
``demo`` extra not installed, 130 interrupted. Computing the summary lives in :mod:`otel_hicache.summary`, the
tables and JSON in :mod:`otel_hicache.rendering`; this module runs the command. The command is ``otel-hicache``
(:mod:`otel_hicache.__main__`), which needs the ``demo`` extra.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from otel_hicache import __version__
from otel_hicache import semconv as sc
from otel_hicache.config import DEFAULTS, PROTOCOLS, Arguments, ConfigError, check_host, check_url, validate
from otel_hicache.package import DEMO_MODULES, demo_missing

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
    "--device-tokens",
    type=click.IntRange(min=16),
    default=1536,
    show_default=True,
    help="Capacity of the device (L1) tier in tokens.",
)
@click.option(
    "--host-tokens",
    type=click.IntRange(min=16),
    default=1536,
    show_default=True,
    help="Capacity of the host (L2) tier in tokens.",
)
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
    default=DEFAULTS.prometheus_host,
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
    device_tokens: int,
    host_tokens: int,
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
    arguments = Arguments(
        service_name=service_name,
        endpoint=endpoint,
        protocol=protocol,
        prometheus_port=prometheus_port,
        prometheus_host=prometheus_host,
        resource_attributes={sc.RESOURCE_ENGINE: sc.Engine.REFERENCE.value},
    )
    try:
        # before anything imports the OTel API or SDK: they read some variables on import and log tracebacks
        validate(os.environ, arguments)
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
        from otel_hicache.rendering import jsonable, render
        from otel_hicache.sdk import configure
        from otel_hicache.summary import summarize

        # pools pre-seeded at 0 so every series exists from the first scrape
        setup = configure(**replace(arguments, pools=tuple(p.name for p in DEMO_POOLS)).keywords())
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
                    device_tokens=device_tokens,
                    host_tokens=host_tokens,
                )
            summary = summarize(setup, prefill_seconds_per_token)
            if as_json:
                click.echo(json.dumps(jsonable(summary, result, setup), indent=2, sort_keys=True))
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


if __name__ == "__main__":  # python -m otel_hicache.cli
    main()
