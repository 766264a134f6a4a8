"""Instructions per merged transfer on SGLang's real classes, counted by valgrind's callgrind: a figure that does not
move with what else the machine runs, beside the timings of ``benchmarks sglang``, which do.

``python -m benchmarks instructions`` (needs valgrind; runs itself in ``.venv-sglang``). Per path - uninstrumented,
prometheus_client (SGLang's own ``--enable-metrics`` series), otel_hicache (the instrumentor, spans on, OTLP to a
receiver child) - a host process runs under ``valgrind --tool=callgrind --instr-atstart=no --separate-threads=yes``:
it builds a fresh cache, runs :data:`WARM` scheduler steps (the telemetry built, its export process up) and waits;
the driver switches callgrind's instrumentation on (``callgrind_control -i on``), the host runs the measured steps
(:class:`benchmarks.sglang_path.SchedulerStep`, pattern ``writing_check(finish_count=n)``: one merged transfer and
one admission each), and the driver switches it off. Counted: every instruction of the host process in that window,
per thread (the scheduler thread, and our host thread's builds where it has one); the export process and the
receiver are other processes, run natively. Per transfer, each path's count less the uninstrumented one's. Goals
(issue 47), judged on these counts as on ``benchmarks sglang``'s timings: the scheduler thread's added instructions
at most 0.5x prometheus_client's, the whole process's at most prometheus_client's. Under valgrind the process runs
some 50x slower while the telemetry's host thread keeps its wall-clock ticks, so it wakes more often per step than
natively: its instructions are an upper bound of its native work per transfer. Three runs per path, interleaved.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._common import Table, median

ROOT = Path(__file__).resolve().parent.parent
SGLANG_VENV_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
UNINSTRUMENTED = "uninstrumented"
PROMETHEUS = "prometheus_client (SGLang --enable-metrics)"
OURS = "otel_hicache instrumentor, OTLP"
PATHS = (UNINSTRUMENTED, PROMETHEUS, OURS)
#: Steps before the measured window: the caches and the telemetry warm, the export process up.
WARM = 40
SEQ_TOKENS = 64
PAGE_TOKENS = 16
WHOLE_GOAL = 0.5
_TOTALS = re.compile(r"^totals:\s+(\d+)", re.MULTILINE)


def run(smoke: bool, command: str) -> Table | None:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("benchmarks instructions: skipped: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return None
    python = Path(sys.executable) if _has_sglang() else SGLANG_VENV_PYTHON
    if not python.exists():
        print("benchmarks instructions: skipped: no sglang here and no .venv-sglang", file=sys.stderr)
        return None
    steps, reps = (20, 1) if smoke else (200, 3)
    counts: dict[str, list[tuple[int, int, int]]] = {path: [] for path in PATHS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for path in PATHS[rep % len(PATHS) :] + PATHS[: rep % len(PATHS)]:  # interleaved
                counts[path].append(_measure(python, path, steps, Path(tmp) / f"{rep}-{PATHS.index(path)}"))
    table = Table(
        key="instructions",
        title="Instructions per merged transfer (callgrind), SGLang's real classes",
        columns=["Path", "Scheduler thread / transfer", "added", "Whole process / transfer", "added", "vs. prom"],
        command=command,
    )
    per = {
        path: (median([t / n for t, _, n in runs]), median([p / n for _, p, n in runs]), [n for *_, n in runs])
        for path, runs in counts.items()
    }
    base_thread, base_process, _ = per[UNINSTRUMENTED]
    added = {path: (thread - base_thread, process - base_process) for path, (thread, process, _) in per.items()}
    prom_thread, prom_process = added[PROMETHEUS]
    for path, (thread, process, _) in per.items():
        ours_thread, ours_process = added[path]
        ratio = (
            "-"
            if path in (UNINSTRUMENTED, PROMETHEUS)
            else f"{_ratio(ours_thread, prom_thread):.2f}x thread, {_ratio(ours_process, prom_process):.2f}x process"
        )
        table.rows.append(
            [path, f"{thread:,.0f}", f"{ours_thread:+,.0f}", f"{process:,.0f}", f"{ours_process:+,.0f}", ratio]
        )
    ours_thread, ours_process = added[OURS]
    table.data = {
        "per_transfer": {path: {"thread": t, "process": p} for path, (t, p, _) in per.items()},
        "added": {path: {"thread": t, "process": p} for path, (t, p) in added.items()},
        "goals": {
            "scheduler_thread": bool(ours_thread <= WHOLE_GOAL * prom_thread),
            "process": bool(ours_process <= prom_process),
        },
        "runs": {
            path: [{"thread": t, "process": p, "transfers": n} for t, p, n in runs] for path, runs in counts.items()
        },
    }
    table.checks["every measured step consumed one merged transfer, on every path"] = all(
        n == steps for runs in counts.values() for *_, n in runs
    )
    goals = table.data["goals"]
    table.notes.append(
        f"Medians of {reps} run(s) per path of {steps} measured steps each (after {WARM} unmeasured), interleaved; "
        f"in {python}. Goals for otel_hicache: scheduler thread's added instructions <= {WHOLE_GOAL:g}x "
        f"prometheus_client's: {'met' if goals['scheduler_thread'] else 'NOT met'} "
        f"({_ratio(ours_thread, prom_thread):.2f}x); the whole process's <= prometheus_client's: "
        f"{'met' if goals['process'] else 'NOT met'} ({_ratio(ours_process, prom_process):.2f}x)."
    )
    return table


def _ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs > 0 else float("inf")


def _has_sglang() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def _measure(python: Path, path: str, steps: int, out: Path) -> tuple[int, int, int]:
    """One host process of ``path`` under callgrind: (scheduler thread's instructions, every thread's, transfers)
    over the measured steps."""
    argv = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--separate-threads=yes",
        f"--callgrind-out-file={out}",
        str(python),
        "-m",
        "benchmarks.instructions",
        path,
        str(steps),
    ]
    with open(f"{out}.log", "w") as log:
        host = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        assert host.stdin is not None and host.stdout is not None
        try:
            _expect(host, "ready")
            _callgrind_control(host.pid, "on")
            host.stdin.write("go\n")
            host.stdin.flush()
            transfers = int(_expect(host, "done").split()[1])
            _callgrind_control(host.pid, "off")
            host.stdin.write("end\n")
            host.stdin.flush()
            if host.wait(timeout=600) != 0:
                raise RuntimeError(
                    f"the {path} host exited {host.returncode}: {Path(f'{out}.log').read_text()[-2000:]}"
                )
        finally:
            if host.poll() is None:
                host.kill()
    files = sorted(out.parent.glob(f"{out.name}-*"), key=lambda f: int(f.name.rsplit("-", 1)[1]))
    threads = [_instructions(f) for f in files]
    return threads[0], sum(threads), transfers  # thread 1 is the main (scheduler) thread


def _expect(host: subprocess.Popen[str], word: str) -> str:
    assert host.stdout is not None
    while line := host.stdout.readline():
        if line.startswith(word):
            return line
    raise RuntimeError(f"the host ended before saying {word!r} (exit {host.wait()})")


def _callgrind_control(pid: int, state: str) -> None:
    done = subprocess.run(["callgrind_control", "-i", state, str(pid)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or "OK" not in done.stdout:
        raise RuntimeError(f"callgrind_control -i {state} {pid}: {done.stdout[-500:]} {done.stderr[-500:]}")


def _instructions(dump: Path) -> int:
    """The instructions one thread's dump counts (its ``totals:`` line)."""
    found = _TOTALS.findall(dump.read_text())
    if not found:
        raise RuntimeError(f"{dump} has no totals line")
    return int(found[-1])


def _host(path: str, steps: int) -> None:
    """The host process of one path (run under callgrind by :func:`_measure`): warm, wait, ``steps`` measured."""
    import logging

    from otel_hicache.testing.sglang import build_hicache, install_cpu_shims

    logging.getLogger("sglang").setLevel(logging.ERROR)
    install_cpu_shims()
    from benchmarks._collector import CollectorProcess
    from benchmarks.sglang_path import EXPLICIT, PrometheusPath, SchedulerStep
    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor
    from otel_hicache.sdk import configure

    collector = otlp = instrumentor = None
    admitted = None
    if path == OURS:
        collector = CollectorProcess()
        otlp = configure(endpoint=collector.grpc_endpoint, protocol="grpc", service_name="bench-instructions")
        instrumentor = SGLangHiCacheInstrumentor()
        instrumentor.instrument(telemetry=otlp.telemetry, stat_loggers=False)  # before the cache: init_hicache too
    kv_size = 2 * (WARM + steps) * (SEQ_TOKENS + 16)
    cache, allocator, _ = build_hicache("write_through", kv_size=kv_size, page_size=PAGE_TOKENS)
    if path == PROMETHEUS:
        prometheus = PrometheusPath()
        prometheus.setup(cache)
        admitted = prometheus.admitted
    step = SchedulerStep(SEQ_TOKENS)
    for _ in range(WARM):
        step(cache, allocator, EXPLICIT, admitted)
    if otlp is not None:
        otlp.force_flush()  # the export process is up and has exported once
    print("ready", flush=True)
    sys.stdin.readline()
    transfers = sum(step(cache, allocator, EXPLICIT, admitted).consumed for _ in range(steps))
    print(f"done {transfers}", flush=True)
    sys.stdin.readline()
    if instrumentor is not None and otlp is not None and collector is not None:
        instrumentor.uninstrument()
        otlp.shutdown()
        collector.close()
    os._exit(0)  # no interpreter teardown under valgrind (minutes of it)


if __name__ == "__main__":
    _host(sys.argv[1], int(sys.argv[2]))
