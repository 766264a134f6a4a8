"""What the vLLM plugin costs a real vLLM engine, against vLLM's own metrics (run in ``.venv-vllm``).

Real vLLM 0.32 engines on the CPU (:mod:`otel_hicache.testing.vllm`: the tiny Llama, vLLM's ``OffloadingConnector``
with the host-copy spec as its CPU tier), each vLLM's offline ``LLM`` in a process of its own (main, engine core,
worker), alive for the whole benchmark and told what to run over a pipe:

* ``on``: our plugin loaded by vLLM (``VLLM_PLUGINS=vllm_kv_offload``), exporting over OTLP gRPC into a receiver in
  this process, vLLM's own stats on (``disable_log_stats=False``: its Prometheus metrics);
* ``off``: the same with no plugin (``VLLM_PLUGINS=`` empty: vLLM loads none);
* ``bare``: no plugin and vLLM's stats off (``disable_log_stats=True``): what vLLM's own metrics cost is ``off``
  minus ``bare``.

One seeded workload per round, the same for every engine: prompts made of 10 documents of 192-320 tokens, document
``i`` drawn with weight ``1 / (i + 1) ** 1.2`` (Pareto-like reuse), each followed by 16 tokens of its own;
``generate`` takes 4 prompts at a time, 8 output tokens each. The engine's KV cache holds 32 blocks of 32 tokens
(about three documents), the CPU tier 128: a document that comes back is mostly loaded from the CPU tier, and every new
one stored there. Each round's documents are new, so every round stores and loads. Within a round the engines take
turns (``per_turn`` requests each, the whole round by default; rotating who goes first), so that the load of a shared
machine falls on all of them alike; each turn starts once the other engines' processes are idle (vLLM's processes
spin on their queues for a second after work: an engine timed beside another's spin would pay for it; the first run of
this benchmark on a quiet machine, with turns of one ``generate`` and no such wait, read every engine 8x slower and
their differences backwards from round to round), each engine first serves a warm-up it is not timed on, and every
round starts after a pause.

Per engine and round: wall time of its ``generate`` calls (requests/s, output tokens/s), vLLM's own time to first
token per request (``RequestOutput.metrics``: stats on only), the CPU time (``/proc``: user + system) of each of
vLLM's processes over its turns, and the engine core's steps (vLLM's ``vllm:iteration_tokens_total`` count: stats on
only). The export processes' CPU is reported apart. The table gives the median over rounds and ``on`` against
``off`` as the median of the per-round ratios (rounds are the pairs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from benchmarks import _vllm_busy
from benchmarks._common import Table, median, percentile
from otel_hicache.testing.otlp_receiver import OtlpReceiver
from otel_hicache.testing.vllm import BLOCK_TOKENS, WORDS, build_model, engine_arguments, environment

ROOT = Path(__file__).resolve().parents[1]
#: The engines, in this order in the tables.
ENGINES = ("off", "on", "bare")
#: vLLM's processes of one offline engine, as this benchmark names them (by their process titles).
PROCESSES = ("main", "engine core", "worker")
#: Marks every process of one engine (and the export processes it launches, which inherit it) in its environment:
#: ``<engine>-<the driver's pid>``, so that another run of the benchmark on the machine is not counted.
MARK = "HICACHE_BENCH_ENGINE"
GPU_BLOCKS = 32
CPU_CHUNKS = 128
MAX_MODEL_LEN = 512
DOCUMENTS = 10
DOCUMENT_TOKENS = (192, 320)
TAIL_TOKENS = 16
PER_GENERATE = 4
OUTPUT_TOKENS = 8
PAUSE_S = 2.0  # longer than vLLM's spin on its message queues (1 s): every engine starts a round idle
QUIET_WINDOW_S = 0.1  # before each turn the other engines are idle: no more than a tick of CPU in this window
QUIET_TIMEOUT_S = 5.0
START_TIMEOUT_S = 600.0
RUN_TIMEOUT_S = 300.0


@dataclass
class Params:
    rounds: int = 20
    requests: int = 64  # per engine and round
    per_turn: int = 64  # requests an engine serves in one turn (PER_GENERATE per generate)
    warmup: int = 32
    engines: tuple[str, ...] = ENGINES

    @staticmethod
    def smoke() -> Params:
        return Params(rounds=1, requests=16, per_turn=8, warmup=4, engines=("off", "on"))


# ---------------------------------------------------------------------------------------------- the workload
def workload(seed: int, requests: int) -> list[str]:
    """``requests`` prompts: a document of this seed's 10 (Pareto-like reuse) and 16 tokens of its own each."""
    rng = random.Random(seed)
    documents = [[f"w{rng.randrange(WORDS)}" for _ in range(rng.randint(*DOCUMENT_TOKENS))] for _ in range(DOCUMENTS)]
    weights = [1 / (i + 1) ** 1.2 for i in range(DOCUMENTS)]
    prompts = []
    for _ in range(requests):
        (document,) = rng.choices(documents, weights)
        prompts.append(" ".join(document + [f"w{rng.randrange(WORDS)}" for _ in range(TAIL_TOKENS)]))
    return prompts


# ---------------------------------------------------------------------------------------------- in the engine's process
def app(model: str, stats: bool, result_fd: int) -> None:
    """One engine: build vLLM's ``LLM``, then answer each command line on stdin with one JSON line on ``result_fd``:
    ``seed requests start count`` serves prompts ``start`` ... ``start + count`` of that workload (the warm-up is the
    first), ``counts`` reads vLLM's own counters (steps, bytes stored and loaded)."""
    import prometheus_client
    from vllm import LLM, SamplingParams

    # what the engine core and the worker count (their plugin)
    busy = _vllm_busy.BusyCounters(os.environ[_vllm_busy.COUNTERS_ENV])
    out = os.fdopen(result_fd, "w", buffering=1)
    arguments = engine_arguments(model, CPU_CHUNKS, gpu_blocks=GPU_BLOCKS, max_model_len=MAX_MODEL_LEN)
    llm = LLM(**arguments, disable_log_stats=not stats)
    sampling = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)

    def vllm_counts() -> dict[str, float]:
        wanted = {
            "vllm:iteration_tokens_total_count": "steps",
            "vllm:kv_offload_store_bytes_total": "stored",
            "vllm:kv_offload_load_bytes_total": "loaded",
        }
        counts = dict.fromkeys(wanted.values(), 0.0)
        for family in prometheus_client.REGISTRY.collect():
            for sample in family.samples:
                if sample.name in wanted:
                    counts[wanted[sample.name]] += sample.value
        return counts

    prompts: dict[tuple[int, int], list[str]] = {}

    def run(seed: int, requests: int, start: int, count: int) -> dict[str, Any]:
        """Prompts ``start`` ... ``start + count`` of the workload, ``PER_GENERATE`` per ``generate``."""
        batch = prompts.setdefault((seed, requests), workload(seed, requests))[start : start + count]
        ttft, tokens, cached, wall = [], 0, 0, 0.0
        first = time.clock_gettime(time.CLOCK_BOOTTIME)  # the clock of a process's start time in /proc
        before = busy.read()
        for i in range(0, len(batch), PER_GENERATE):
            began = time.monotonic()
            outputs = llm.generate(batch[i : i + PER_GENERATE], sampling, use_tqdm=False)
            wall += time.monotonic() - began
            for output in outputs:
                tokens += len(output.outputs[0].token_ids)
                cached += output.num_cached_tokens or 0
                if output.metrics is not None:
                    ttft.append(output.metrics.first_token_latency)
        after = busy.read()
        return {"first": first, "wall_s": wall, "requests": len(batch), "tokens": tokens, "cached": cached,
                "ttft_s": ttft, "busy": {key: after[key] - before[key] for key in after}}  # fmt: skip

    for line in sys.stdin:  # "counts", or "seed requests start count"
        words = line.split()
        answer = vllm_counts() if words == ["counts"] else run(*map(int, words))
        out.write(json.dumps(answer) + "\n")


# ---------------------------------------------------------------------------------------------- the driver
def _ticks(pid: int) -> int | None:
    """User + system CPU of ``pid`` in clock ticks (``None`` once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


def _start_s(pid: int) -> float | None:
    """When ``pid`` started, in seconds since boot (``CLOCK_BOOTTIME``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return found


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


#: What an export process's command line holds (``python -m otel_hicache._internal.export.boot``).
_EXPORTER = "otel_hicache._internal.export.boot"


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _marked(name: str) -> list[int]:
    """Every process whose environment carries this engine's mark."""
    wanted = f"{MARK}={name}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if wanted in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


class Engine:
    """One engine's ``LLM`` process and the pipe it answers on."""

    def __init__(self, name: str, model: Path, endpoint: str, log: IO[str], timers: Path) -> None:
        """``timers``: where the busy timers' plugin is (:func:`~benchmarks._vllm_busy.plugin_path`); this engine's
        counters are written there too."""
        self.name = name
        plugin = name == "on"
        plugins = ["vllm_kv_offload", _vllm_busy.PLUGIN] if plugin else [_vllm_busy.PLUGIN]
        counters = _vllm_busy.BusyCounters.create(timers / f"{name}.busy")
        extra = {
            MARK: f"{name}-{os.getpid()}",
            "VLLM_PLUGINS": ",".join(plugins),
            _vllm_busy.COUNTERS_ENV: str(counters),
        }
        if plugin:
            extra |= {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
            extra |= {"OTEL_SERVICE_NAME": "vllm-bench"}
        env = environment(**extra)
        env["PYTHONPATH"] = os.pathsep.join([str(timers), env["PYTHONPATH"]])
        read, write = os.pipe()
        argv = [sys.executable, "-m", "benchmarks.vllm_serving", "app", str(model), "--result-fd", str(write)]
        self.process = subprocess.Popen(
            [*argv, *(["--stats"] if name != "bare" else [])],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            pass_fds=(write,),
            start_new_session=True,
        )
        os.close(write)
        self._results = os.fdopen(read)
        self.processes: dict[str, int] = {}

    def send(self, *command: object) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(" ".join(map(str, command)) + "\n")
        self.process.stdin.flush()

    def ask(self, *command: object, timeout_s: float = RUN_TIMEOUT_S) -> dict[str, Any]:
        self.send(*command)
        return self.answer(timeout_s)

    def answer(self, timeout_s: float) -> dict[str, Any]:
        ready, _, _ = select.select([self._results], [], [], timeout_s)
        line = self._results.readline() if ready else ""
        if not line:
            code = self.process.poll()
            raise RuntimeError(f"engine {self.name!r} gave no answer (exit code {code}); see its log")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def find_processes(self) -> None:
        """vLLM's processes of this engine, by their titles (``VLLM::EngineCore``, ``VLLM::Worker...``)."""
        self.processes = {"main": self.process.pid}
        for pid in _descendants(self.process.pid):
            title = _title(pid)
            if "EngineCore" in title:
                self.processes["engine core"] = pid
            elif "Worker" in title:
                self.processes["worker"] = pid

    def cpu(self) -> dict[str, int]:
        return {name: _ticks(pid) or 0 for name, pid in self.processes.items()}

    def exporters(self) -> list[int]:
        """The export processes this engine's processes launched (marked, not vLLM's, not their launchers)."""
        ours = {self.process.pid, *_descendants(self.process.pid)}
        return [pid for pid in _marked(f"{self.name}-{os.getpid()}") if pid not in ours and _EXPORTER in _title(pid)]

    def exporter_ticks(self) -> dict[int, int]:
        """CPU ticks of each export process so far."""
        return {pid: ticks for pid in self.exporters() if (ticks := _ticks(pid)) is not None}

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait()
        self._results.close()


@dataclass
class Exporters:
    """The export processes of the engine with the plugin: their CPU ticks after the warm-up and at the end, and how
    long each started before the engine's first request (the warm-up's)."""

    started: dict[int, int]
    ended: dict[int, int]
    lead_s: list[float]


@contextmanager
def _engines(params: Params, model: Path, endpoint: str, logs: Path) -> Iterator[dict[str, Engine]]:
    with ExitStack() as stack:
        engines = {}
        timers = _vllm_busy.plugin_path(logs / "timers")
        for name in params.engines:
            log = stack.enter_context(open(logs / f"{name}.log", "w"))
            engines[name] = Engine(name, model, endpoint, log, timers)
            stack.callback(engines[name].stop)
        yield engines


def run_here(smoke: bool, command: str) -> Table | None:
    """The benchmark, where vLLM is importable (``.venv-vllm``); skipped elsewhere."""
    if importlib.util.find_spec("vllm") is None:
        print("benchmarks vllm: skipped: vllm is not importable here (run it in .venv-vllm)", file=sys.stderr)
        return None
    return run(Params.smoke() if smoke else Params(), command)


def run(params: Params, command: str) -> Table:
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    table = Table(
        key="vllm",
        title="What the plugin costs a real vLLM 0.32 engine on the CPU, against vLLM's own metrics",
        columns=[
            "engine",
            "requests/s",
            "output tokens/s",
            "TTFT p50 (ms)",
            "TTFT p99 (ms)",
            "engine-core CPU/step (ms)",
            "engine-core scheduler busy/step (us)",
            "of it, KV connector (us)",
            "worker busy/step (ms)",
            "of it, KV connector (us)",
            *(f"{p} CPU/request (ms)" for p in PROCESSES),
            "vLLM's processes CPU/request (ms)",
        ],
        command=command,
    )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in params.engines}
    with tempfile.TemporaryDirectory(prefix="otel-hicache-bench-vllm-") as tmp, OtlpReceiver() as receiver:
        model = build_model(Path(tmp) / "model")
        logs = Path(tmp)
        with _engines(params, model, receiver.grpc_endpoint, logs) as engines:
            try:
                warmups = _start(engines, params)
                exporters = Exporters({}, {}, [])
                if "on" in engines:
                    exporters.started = engines["on"].exporter_ticks()
                    exporters.lead_s = [warmups["on"]["first"] - (_start_s(pid) or 0.0) for pid in exporters.started]
                for r in range(params.rounds):
                    for name, run in _round(engines, 1000 + r, params.requests, params.per_turn, tick).items():
                        runs[name].append(run)
                if "on" in engines:
                    exporters.ended = engines["on"].exporter_ticks()
            except Exception:
                for name in params.engines:
                    print(f"--- {name}.log\n{(logs / f'{name}.log').read_text()[-3000:]}", file=sys.stderr)
                raise
    _tabulate(table, params, runs, exporters, tick)
    return table


def _start(engines: dict[str, Engine], params: Params) -> dict[str, dict[str, Any]]:
    """Start-up and warm-up of every engine, all at once; returns each warm-up's answer."""
    for engine in engines.values():
        engine.send(1, params.warmup, 0, params.warmup)
    answers = {name: engine.answer(START_TIMEOUT_S) for name, engine in engines.items()}
    for engine in engines.values():
        engine.find_processes()
        missing = set(PROCESSES) - set(engine.processes)
        if missing:
            raise RuntimeError(f"engine {engine.name!r}: no {', '.join(sorted(missing))} process found")
    return answers


def _round(
    engines: dict[str, Engine], seed: int, requests: int, per_turn: int, tick: float
) -> dict[str, dict[str, Any]]:
    """One round: the workload of ``seed`` on every engine, ``per_turn`` requests at a time (``PER_GENERATE`` per
    ``generate``), the engines taking turns in rotating order, so that what the machine's load does to one it does to
    the others; each engine's CPU counted over its own turns."""
    time.sleep(PAUSE_S)
    names = list(engines)
    runs: dict[str, dict[str, Any]] = {
        name: {"wall_s": 0.0, "requests": 0, "tokens": 0, "cached": 0, "ttft_s": [], "cpu_s": {}, "busy": {}}
        for name in names
    }
    counts = {name: engines[name].ask("counts") for name in names}
    for turn, start in enumerate(range(0, requests, per_turn)):
        for name in names[(seed + turn) % len(names) :] + names[: (seed + turn) % len(names)]:
            engine, run = engines[name], runs[name]
            _quiet([other for other in engines.values() if other is not engine])
            before = engine.cpu()
            answer = engine.ask(seed, requests, start, per_turn)
            after = engine.cpu()
            for key in ("wall_s", "requests", "tokens", "cached", "ttft_s"):
                run[key] += answer[key]
            for process, ticks in after.items():
                run["cpu_s"][process] = run["cpu_s"].get(process, 0.0) + (ticks - before[process]) * tick
            for key, value in answer["busy"].items():
                run["busy"][key] = run["busy"].get(key, 0) + value
    for name in names:
        after = engines[name].ask("counts")
        runs[name].update({key: after[key] - counts[name][key] for key in after})
    return runs


def _quiet(others: list[Engine]) -> None:
    """Wait (at most ``QUIET_TIMEOUT_S``) until the other engines' processes have stopped spinning after their last
    turn (vLLM's spin for a second after work): each engine is timed with the machine to itself."""
    pids = [pid for engine in others for pid in [*engine.processes.values(), *engine.exporters()]]
    deadline = time.monotonic() + QUIET_TIMEOUT_S
    before = [_ticks(pid) or 0 for pid in pids]
    while time.monotonic() < deadline:
        time.sleep(QUIET_WINDOW_S)
        after = [_ticks(pid) or 0 for pid in pids]
        if sum(after) - sum(before) <= 1:  # at most one tick (10 ms) of CPU in the window, all of them together
            return
        before = after


def _tabulate(
    table: Table,
    params: Params,
    runs: dict[str, list[dict[str, Any]]],
    exporters: Exporters,
    tick: float,
) -> None:
    def stats(run: dict[str, Any]) -> dict[str, float]:
        n = run["requests"]
        ttft = [t * 1000 for t in run["ttft_s"]]
        cpu, busy = run["cpu_s"], run["busy"]
        core, worker = busy["steps"] or math.nan, busy["worker_steps"] or math.nan
        return {
            "rps": n / run["wall_s"],
            "tps": run["tokens"] / run["wall_s"],
            "ttft50": percentile(ttft, 50) if ttft else float("nan"),
            "ttft99": percentile(ttft, 99) if ttft else float("nan"),
            "step": cpu["engine core"] * 1000 / run["steps"] if run["steps"] else float("nan"),
            "busy_sched": busy["scheduler_ns"] / core / 1e3,
            "busy_core_conn": busy["core_connector_ns"] / core / 1e3,
            "busy_worker": busy["worker_ns"] / worker / 1e6,
            "busy_worker_conn": busy["worker_connector_ns"] / worker / 1e3,
            "steps_per_request": busy["steps"] / n,
            **{p: cpu[p] * 1000 / n for p in PROCESSES},
            "all": sum(cpu[p] for p in PROCESSES) * 1000 / n,
        }

    per_run = {name: [stats(r) for r in rs] for name, rs in runs.items()}
    keys = [
        "rps",
        "tps",
        "ttft50",
        "ttft99",
        "step",
        "busy_sched",
        "busy_core_conn",
        "busy_worker",
        "busy_worker_conn",
        *PROCESSES,
        "all",
    ]
    for name in params.engines:
        table.rows.append([name, *(median([s[k] for s in per_run[name]]) for k in keys)])
    for label, (a, b) in {
        "on vs off: our plugin (median of pairs, %)": ("on", "off"),
        "off vs bare: vLLM's own stats (median of pairs, %)": ("off", "bare"),
    }.items():
        if a in per_run and b in per_run:
            pairs = list(zip(per_run[a], per_run[b], strict=True))
            table.rows.append([label, *(median([(x[k] / y[k] - 1) * 100 for x, y in pairs]) for k in keys)])
    table.data["runs"] = runs
    if "on" in per_run and "off" in per_run:
        pairs = list(zip(per_run["on"], per_run["off"], strict=True))
        added = {
            k: median([x[k] - y[k] for x, y in pairs])
            for k in ("busy_sched", "busy_core_conn", "busy_worker", "busy_worker_conn")
        }
        steps = median([x["steps_per_request"] for x in per_run["on"]])
        step_ms = median([y["busy_worker"] for _, y in pairs])
        table.notes.append(
            "Busy CPU the plugin adds (median over rounds of 'on' less 'off'): the engine core's scheduler "
            f"{added['busy_sched']:+.1f} us a step (its KV connector {added['busy_core_conn']:+.1f} us), the worker "
            f"{added['busy_worker'] * 1000:+.1f} us a step ({added['busy_worker'] / step_ms * 100:+.2f} % of its "
            f"{step_ms:.2f} ms; its KV connector {added['busy_worker_conn']:+.1f} us); {steps:.2f} steps per request."
        )
        table.data["added_busy"] = {**added, "steps_per_request": steps, "worker_step_ms": step_ms}
        host = {
            side: median([run["busy"][f"{side}_host_ns"] / run["requests"] / 1e3 for run in runs["on"]])
            for side in ("core", "worker")
        }
        table.notes.append(
            f"Our host threads in vLLM's processes ('on', off the steps; median over rounds): the engine core's "
            f"{host['core']:.1f} us and the worker's {host['worker']:.1f} us of CPU per request."
        )
        table.data["host_threads_us_per_request"] = host

    if "on" in runs:
        timed = params.requests * len(runs["on"])
        start_ms = sum(exporters.started.values()) * tick * 1000
        timed_ms = (sum(exporters.ended.values()) - sum(exporters.started.values())) * tick * 1000
        table.notes.append(
            f"Export processes of 'on' (engine core and worker; CPU not in the rows above): {len(exporters.started)}, "
            f"started {', '.join(f'{s:.1f}' for s in exporters.lead_s)} s before the engine's first request; "
            f"{start_ms:,.0f} ms of CPU up to the end of the warm-up (their start), then {timed_ms:,.0f} ms over the "
            f"timed runs and the pauses between them: {timed_ms / timed:.2f} ms per request."
        )
        table.data["exporters"] = {"start_ms": start_ms, "timed_ms": timed_ms, "lead_s": exporters.lead_s}
        table.checks["the export processes started before the engine served its first request"] = bool(
            exporters.lead_s
        ) and all(lead > 0 for lead in exporters.lead_s)
    counted = [r for name in ("on", "off") for r in runs.get(name, [])]
    table.checks["every timed run with vLLM's stats stored KV to the CPU tier and loaded KV from it"] = bool(
        counted
    ) and all(r["stored"] > 0 and r["loaded"] > 0 for r in counted)
    table.checks["every request got its output tokens"] = all(
        r["tokens"] == r["requests"] * OUTPUT_TOKENS for rs in runs.values() for r in rs
    )
    table.notes += [
        f"{params.rounds} rounds x {params.requests} requests per engine, the engines taking turns of "
        f"{params.per_turn} requests ({PER_GENERATE} per generate; rotating who goes first), each turn once the "
        f"other engines' processes are idle (at most one CPU tick in {QUIET_WINDOW_S:g} s), {PAUSE_S:g} s pause "
        f"before each round; warm-up {params.warmup} requests "
        "per engine, not timed. Engines: "
        "'on' = our plugin (VLLM_PLUGINS=vllm_kv_offload, OTLP gRPC to a receiver in the driver), 'off' = no plugin "
        "(VLLM_PLUGINS empty), both with vLLM's stats on; 'bare' = no plugin, vLLM's stats off (disable_log_stats).",
        f"Workload: {DOCUMENTS} documents of {DOCUMENT_TOKENS[0]}-{DOCUMENT_TOKENS[1]} tokens per round (new each "
        f"round, the same for every engine), document i drawn with weight 1/(i+1)^1.2, {TAIL_TOKENS} tokens of its "
        f"own per prompt, {PER_GENERATE} prompts per generate, {OUTPUT_TOKENS} output tokens (ignore_eos); KV cache "
        f"{GPU_BLOCKS} blocks of {BLOCK_TOKENS} tokens, CPU tier {CPU_CHUNKS} chunks of one block.",
        "Rows 'on', 'off', 'bare': medians over rounds. 'on vs off': median over rounds of on / off - 1 (for TTFT "
        "and CPU, + is worse; for throughput, - is worse). CPU = user + system of the process over the engine's own "
        "turns (/proc, 10 ms ticks); vLLM's processes spin on their shared-memory queues while they wait for each "
        "other (and for a second after), so their CPU follows the wall time. Engine-core CPU/step: its CPU over its "
        "turns / the steps vLLM counted (vllm:iteration_tokens_total; n/a without vLLM's stats). Busy/step: the "
        "thread CPU (no spin, no other process) of the engine core's Scheduler.schedule, update_from_output and "
        "add_request, and of the worker's execute_model and sample_tokens (the forward included), per step; of it, "
        "the calls into vLLM's OffloadingConnector on each side, where the plugin's hooks run (benchmarks/"
        "_vllm_busy.py). TTFT: vLLM's first_token_latency per request (n/a without vLLM's stats).",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_serving")
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("app", help="one engine, driven over stdin (the benchmark starts it)")
    one.add_argument("model")
    one.add_argument("--stats", action="store_true", help="vLLM's stats (its Prometheus metrics) on")
    one.add_argument("--result-fd", type=int, required=True)
    args = parser.parse_args()
    app(args.model, args.stats, args.result_fd)


if __name__ == "__main__":
    main()
