"""What ``opentelemetry-instrument`` costs a Python process that never uses SGLang, with our instrumentor on and off.

``opentelemetry-instrument`` runs every registered instrumentor's ``instrument()`` in every Python process it starts
(an SGLang launcher, its tokenizer and detokenizer, multiprocessing's resource tracker). Ours must only arm
post-import hooks there: no SGLang, no torch, no telemetry. Measured: wall time and peak RSS of
``opentelemetry-instrument python -c pass``, with ``sglang_hicache`` enabled and listed in
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``, and plain ``python -c pass`` for reference (medians of ``repeats`` runs,
alternated). Exporters are ``none``: the distro's exporter set-up is the same on both sides. Goal (issue 9): within
0.5 s and 50 MiB of the disabled run; reported, never a check (benchmarks are not timed tests). Run it in the venv
that has SGLang installed (``.venv-sglang``): that is where an eager import would cost the most.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks._common import Table, median
from otel_hicache.integrations.sglang.plugin import ENTRY_POINT

MIB = 1024 * 1024


#: Runs argv from a bare interpreter (a fork inherits its parent's RSS into the child's peak: this parent is small)
#: and prints the child's wall seconds and peak RSS in KiB (``wait4`` reports the child's own peak).
_MEASURE = (
    "import os, subprocess, sys, time\n"
    "t0 = time.perf_counter()\n"
    "proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
    "_, status, usage = os.wait4(proc.pid, 0)\n"
    "print(time.perf_counter() - t0, usage.ru_maxrss, os.waitstatus_to_exitcode(status))\n"
)


def _one(argv: list[str], env: dict[str, str]) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of one run of ``argv``."""
    out = subprocess.run([sys.executable, "-S", "-c", _MEASURE, *argv], env=env, capture_output=True, text=True)
    seconds, rss_kib, code = out.stdout.split()
    if out.returncode != 0 or code != "0":
        raise RuntimeError(f"{' '.join(argv)} exited {code}: {out.stderr[-2000:]}")
    return float(seconds), int(rss_kib) * 1024


def run(smoke: bool, command: str) -> Table | None:
    instrument = Path(sys.executable).with_name("opentelemetry-instrument")
    table = Table(
        key="importtax",
        title="Import tax: `opentelemetry-instrument python -c pass`",
        columns=["Process", "Wall time (s)", "Peak RSS (MiB)", "vs. ours disabled"],
        command=command,
    )
    if not instrument.exists():
        print(f"importtax: skipped, {instrument} is not installed", file=sys.stderr)
        return None
    base = {k: v for k, v in os.environ.items() if k != "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"}
    base.update(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none")
    runs = {
        "python -c pass": ([sys.executable, "-c", "pass"], base),
        "opentelemetry-instrument, ours disabled": (
            [str(instrument), sys.executable, "-c", "pass"],
            {**base, "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": ENTRY_POINT},
        ),
        "opentelemetry-instrument, ours enabled": ([str(instrument), sys.executable, "-c", "pass"], base),
    }
    repeats = 1 if smoke else 7
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (argv, env) in runs.items():  # alternated: machine noise hits every variant alike
            samples[name].append(_one(argv, env))
    results = {name: (median([s[0] for s in xs]), median([s[1] for s in xs])) for name, xs in samples.items()}
    off = results["opentelemetry-instrument, ours disabled"]
    for name, (seconds, rss) in results.items():
        delta = "" if name == "python -c pass" else f"{seconds - off[0]:+.3f} s, {(rss - off[1]) / MIB:+.1f} MiB"
        table.rows.append([name, f"{seconds:.3f}", f"{rss / MIB:.1f}", delta])
    on = results["opentelemetry-instrument, ours enabled"]
    table.data = {name: {"seconds": s, "max_rss_bytes": r} for name, (s, r) in results.items()}
    table.notes.append(
        f"Medians of {repeats} alternated runs in {sys.prefix}. Goal: ours enabled within 0.5 s and 50 MiB of ours "
        f"disabled (here {on[0] - off[0]:+.3f} s, {(on[1] - off[1]) / MIB:+.1f} MiB)."
    )
    imported = subprocess.run(
        [
            str(instrument),
            sys.executable,
            "-c",
            "import sys; print(sorted({m.split('.')[0] for m in sys.modules} & {'sglang', 'torch'}))",
        ],
        env=base,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.strip()
    table.checks["instrument() imports neither sglang nor torch"] = imported == "[]"
    return table
