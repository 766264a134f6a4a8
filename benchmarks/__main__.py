"""``python -m benchmarks NAME ... [--smoke]``: the benchmarks a user runs, each printing one markdown table.

Prints one markdown table per benchmark (plus the machine line); --markdown FILE and --json FILE also write
them. Exits 1 when a correctness check (ground truth, accounting) failed; never because of a timing.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from benchmarks._common import Table, dump_json, machine_line

BENCHMARKS = {
    "hotpath": "reporting one merged transfer on the scheduler thread, ours against prometheus_client (synthetic)",
    "loop": "a scheduler loop at a paced transfer rate: step time, host CPU per transfer, GIL holds",
    "transfer": "the reference controller's merged transfers against raw torch copies of the same bytes",
    "soak": "minutes of paced then burst transfers over OTLP: exact counters, span drops, flat memory",
    "sglang": "the scheduler thread's and process's cost per transfer on real SGLang classes (.venv-sglang)",
    "instructions": "instructions per transfer on real SGLang classes, counted by callgrind (valgrind, .venv-sglang)",
    "importtax": "what `opentelemetry-instrument python -c pass` costs with our instrumentor on and off",
    "sigkill": "what a SIGKILL of the host loses: acks handed over but not yet exported",
    "capacity": "the capacity estimator's cost per admitted 4,096-token request",
    "capacity_reruns": "the demo's capacity curve against re-running it at each size, with and without mamba and L3",
    "vllm": "the plugin on against off on a real vLLM engine on the CPU, against vLLM's own metrics (.venv-vllm)",
}
NAMES = tuple(BENCHMARKS)
EPILOG = (
    "benchmarks:\n"
    + "\n".join(f"  {name:<15} {line}" for name, line in BENCHMARKS.items())
    + (
        "\n  all             every one of them"
        "\n\nrun as its own module (in the engine's venv):"
        "\n  python -m benchmarks.engine_capacity {sglang,vllm}   the capacity estimator on each engine's own path"
    )
)


def _command(args: argparse.Namespace, name: str) -> str:
    parts = ["python -m benchmarks", name]
    if args.smoke:
        parts.append("--smoke")
    if args.device != "cpu":
        parts += ["--device", args.device]
    if name == "soak" and args.soak_seconds is not None:
        parts += ["--soak-seconds", f"{args.soak_seconds:g}"]
    if name == "soak" and args.soak_rate is not None:
        parts += ["--soak-rate", f"{args.soak_rate:g}"]
    if name == "sglang" and args.time_builds:
        parts.append("--time-builds")
    if name == "loop" and args.rates is not None:
        parts += ["--rates", ",".join(f"{r:g}" for r in args.rates)]
    return " ".join(parts)


def _runner(name: str, args: argparse.Namespace) -> Callable[[], Table | None]:
    command = _command(args, name)
    if name == "hotpath":
        from benchmarks import hotpath

        return lambda: hotpath.run(hotpath.Params.smoke() if args.smoke else hotpath.Params(), args.device, command)
    if name == "loop":
        from benchmarks import loop

        loop_params = loop.Params.smoke() if args.smoke else loop.Params()
        if args.rates is not None:
            loop_params.rates = args.rates
        return lambda: loop.run(loop_params, args.device, command)
    if name == "soak":
        from benchmarks import soak

        params = soak.Params.smoke() if args.smoke else soak.Params()
        if args.soak_seconds is not None:
            params.seconds = args.soak_seconds
        if args.soak_rate is not None:
            params.rate = args.soak_rate
        return lambda: soak.run(params, args.device, command)
    if name == "transfer":
        from benchmarks import transfer

        return lambda: transfer.run(transfer.Params.smoke() if args.smoke else transfer.Params(), args.device, command)
    if name == "sigkill":
        from benchmarks import sigkill

        return lambda: sigkill.run(args.smoke, command)
    if name == "capacity":
        from benchmarks import capacity

        return lambda: capacity.run(capacity.Params.smoke() if args.smoke else capacity.Params(), command)
    if name == "capacity_reruns":
        from benchmarks import capacity_reruns

        reruns = capacity_reruns.Params.smoke() if args.smoke else capacity_reruns.Params()
        return lambda: capacity_reruns.run(reruns, command)
    if name == "instructions":
        from benchmarks import instructions

        return lambda: instructions.run(args.smoke, command)
    if name == "importtax":
        from benchmarks import importtax

        return lambda: importtax.run(args.smoke, command)
    if name == "vllm":
        from benchmarks import vllm_serving

        return lambda: vllm_serving.run_here(args.smoke, command)
    from benchmarks import sglang_path

    return lambda: sglang_path.run(args.smoke, command, args.time_builds)


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not all(0 < r <= 100_000 for r in rates):
        raise argparse.ArgumentTypeError(f"{text!r}: every rate must be in (0, 100000] transfers per second")
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.split("\n\n")[1],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "benchmark", nargs="+", choices=(*NAMES, "all"), metavar="NAME", help="which to run (listed below)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny iteration counts: checks that it runs (CI)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the tensors and events live")
    parser.add_argument("--markdown", metavar="FILE", help="also write the tables to FILE")
    parser.add_argument("--json", metavar="FILE", help="also write the raw numbers to FILE")
    parser.add_argument("--soak-seconds", type=float, default=None, help="paced phase of the soak (default 120)")
    parser.add_argument("--soak-rate", type=float, default=None, help="paced transfers per second (default 2000)")
    parser.add_argument(
        "--rates", type=_rates, default=None, help="loop: transfers per second, comma-separated (default 200,1000)"
    )
    parser.add_argument(
        "--time-builds",
        action="store_true",
        help="sglang: also time each record the host thread builds (two thread-clock reads more per record)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch.cuda.is_available() is False on this machine")

    names = NAMES if "all" in args.benchmark else tuple(dict.fromkeys(args.benchmark))
    header = f"Machine: {machine_line()}\n"
    print(header, flush=True)
    tables: list[Table] = []
    for name in names:
        t0 = time.monotonic()
        table = _runner(name, args)()
        if table is None:
            continue
        table.notes.append(f"Ran in {time.monotonic() - t0:.1f} s.")
        tables.append(table)
        print(table.markdown(), flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(header + "\n" + "\n".join(t.markdown() for t in tables))
    if args.json:
        dump_json(tables, args.json)
    failed = [f"{t.key}: {k}" for t in tables for k, ok in t.checks.items() if not ok]
    if failed:
        print("FAILED checks:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
