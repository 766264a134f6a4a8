"""Item 1 on the real SGLang 0.5.23 ack path (CPU): ``UnifiedRadixCache.writing_check`` of real ``HiCacheAck`` s.

Needs the real sglang package (``scripts/setup-sglang-venv.sh`` builds ``.venv-sglang``). Run there::

    .venv-sglang/bin/python -m benchmarks sglang

From an interpreter without sglang, ``python -m benchmarks sglang`` re-runs itself in ``.venv-sglang`` when that
exists, and otherwise says so and skips.

A real ``UnifiedRadixCache`` with HiCache (write_through, ``direct`` io backend, layer-first host layout) is built from
SGLang's own classes on the CPU (:mod:`otel_hicache.testing.sglang`). Per step a sequence is inserted,
``flush_pending_backups()`` makes one merged op -> one real ``HiCacheAck`` (the copy done by the CPU shim), then
``writing_check`` consumes it: pop, synchronise, finish the write-through (tree and lock work), report; a second check
finds nothing completed. Both call patterns are measured: ``writing_check(finish_count=n)`` (what
``check_hicache_events`` does) and ``writing_check()`` (default arguments: it counts the ready acks and all-reduces the
count itself). Timed with ``time.thread_time_ns()`` around ``writing_check`` (the reporting site) and, separately,
around ``flush_pending_backups()`` (the submission site, where the instrumentor also hooks ``start_writing``); the whole
process's CPU per block too. Paths, interleaved per block (a fresh cache per block):

* uninstrumented: ``metrics_collector = None``;
* prometheus_client: SGLang's own ``RadixCacheMetricsCollector`` (what ``--enable-metrics`` installs);
* naive OTel SDK: SGLang's ``_log_write_ack_metrics`` replaced by one span + counters + histogram per ack;
* otel_hicache: ``SGLangHiCacheInstrumentor().instrument(telemetry=...)`` (spans on; OTLP to a child process).

CPU shims and the cache builder: :mod:`otel_hicache.testing.sglang` (the SGLang tests use the same). On CPU,
``torch.cpu.Event`` cannot time, so SGLang's acks carry ``timing_enabled=False`` and no duration is observed on any
path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._common import Table, median, percentile

ROOT = Path(__file__).resolve().parent.parent
SGLANG_VENV_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"


@dataclass
class Params:
    # A block (~0.4 s) spans many ticks of the telemetry's host thread (50 ms), so its work lands among the steps, as
    # in serving, and not in the flush after the block (outside the timed checks), as it would in a short block.
    reps: int = 12
    batches_per_block: int = 64
    batch: int = 32
    seq_tokens: int = 64

    @classmethod
    def smoke(cls) -> Params:
        return cls(reps=1, batches_per_block=2, batch=4)


def run(smoke: bool, command: str) -> Table | None:
    if importlib.util.find_spec("sglang") is None:
        return _run_elsewhere(smoke, command)
    import torch

    # One intra-op thread: the CPU shim's copies would otherwise leave OpenMP workers spinning, process CPU that
    # belongs to no path (on a GPU the copy is a kernel).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(Params.smoke() if smoke else Params(), command)
    finally:
        torch.set_num_threads(threads)


def _run_elsewhere(smoke: bool, command: str) -> Table | None:
    if not SGLANG_VENV_PYTHON.exists():
        print(
            "benchmarks sglang: skipped: sglang is not importable here and .venv-sglang does not exist "
            "(build it with scripts/setup-sglang-venv.sh).",
            file=sys.stderr,
        )
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sglang.json")
        argv = [str(SGLANG_VENV_PYTHON), "-m", "benchmarks", "sglang", "--json", out, *(["--smoke"] if smoke else [])]
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if proc.returncode not in (0, 1) or not os.path.exists(out):
            print(
                f"benchmarks sglang: the run in .venv-sglang failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}",
                file=sys.stderr,
            )
            return None
        with open(out) as f:
            tables = json.load(f)["tables"]
    if not tables:
        return None
    table = Table(**tables[0])
    table.notes = [n for n in table.notes if not n.startswith("Ran in ")]  # the caller adds its own
    table.command = f".venv-sglang/bin/python -m benchmarks sglang{' --smoke' if smoke else ''}"
    return table


# ---------------------------------------------------------------------------------------------------- the run
#: The two ways writing_check is called: with the count the scheduler already synchronised
#: (check_hicache_events today), and with its default arguments (it counts the ready acks itself, then
#: all-reduces the count over the TP group; a single rank has no group to reduce over, so only the count tensor
#: and its .item() remain).
EXPLICIT = "writing_check(finish_count=n)"
DEFAULT = "writing_check()"
PATTERNS = (EXPLICIT, DEFAULT)
RATIO_GOAL = 0.3
PROMETHEUS = "prometheus_client (SGLang --enable-metrics)"


@dataclass
class _Stats:
    check_ns: list[float] = field(default_factory=list)  # consuming writing_check thread CPU per ack, per batch
    submit_ns: list[float] = field(default_factory=list)  # flush_pending_backups thread CPU per ack, per batch
    empty_ns: list[float] = field(default_factory=list)  # writing_check with nothing completed, per call
    host_ns: list[float] = field(default_factory=list)  # host-process CPU per ack, per block
    acks: int = 0
    tokens: int = 0


@dataclass
class _Path:
    name: str
    setup: Any  # callable(cache) before a block
    flush: Any = None  # exports what the block reported (its CPU is the host's)
    teardown: Any = None
    stats: dict[str, _Stats] = field(default_factory=lambda: {p: _Stats() for p in PATTERNS})


def _run(params: Params, command: str) -> Table:
    import logging

    from otel_hicache.testing.sglang import build_hicache, install_cpu_shims

    logging.getLogger("sglang").setLevel(logging.ERROR)
    install_cpu_shims()
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector

    from benchmarks._collector import CollectorProcess
    from benchmarks._common import flush_cpu_ns
    from benchmarks.ackpath import NaiveOtelReporter
    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor
    from otel_hicache.sdk import configure

    collector = CollectorProcess()
    otlp = configure(endpoint=collector.grpc_endpoint, protocol="grpc", service_name="bench-sglang")
    prom = RadixCacheMetricsCollector(
        labels={"cache_type": "UnifiedRadixCache", "tp_rank": 0, "pp_rank": 0, "dp_rank": 0}
    )
    naive = NaiveOtelReporter(otlp.tracer_provider, otlp.meter_provider)
    instrumentor = SGLangHiCacheInstrumentor()

    def set_prom(cache: Any) -> None:
        cache.metrics_collector = prom

    def set_naive(cache: Any) -> None:
        cache._log_write_ack_metrics = naive.write_ack  # SGLang's reporting function, replaced on the instance

    def set_hicache(cache: Any) -> None:
        instrumentor.instrument(telemetry=otlp.telemetry, stat_loggers=False)

    paths = [
        _Path("uninstrumented", lambda cache: None),
        _Path(PROMETHEUS, set_prom),
        _Path("naive OTel SDK, OTLP", set_naive, otlp.force_flush),
        _Path("otel_hicache instrumentor, OTLP", set_hicache, otlp.force_flush, instrumentor.uninstrument),
    ]
    kv_size = 2 * params.batches_per_block * params.batch * params.seq_tokens
    seq = [0]

    def block(path: _Path, pattern: str, record: bool) -> None:
        # before instrument(): init_hicache is wrapped too
        cache, allocator, _ = build_hicache("write_through", kv_size=kv_size, page_size=16)
        path.setup(cache)
        stats = path.stats[pattern]
        cc = cache.cache_controller
        clock, check = time.thread_time_ns, cache.writing_check
        p0 = time.process_time_ns()
        acks = 0
        try:
            for _ in range(params.batches_per_block):
                submit = checked = empty = n = 0
                # One scheduler step per ack: submit it, consume it (queue length 1, as in serving), then a step
                # where nothing completed (the check still runs).
                for _ in range(params.batch):
                    seq[0] += 1
                    tokens = list(range(seq[0] * 1_000_000, seq[0] * 1_000_000 + params.seq_tokens))
                    value = allocator.alloc(len(tokens))
                    cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=value[: len(tokens)]))
                    c0 = clock()
                    cache.flush_pending_backups()
                    c1 = clock()
                    ready = len(cc.ack_write_queue)
                    if pattern is EXPLICIT:
                        c2 = clock()
                        check(finish_count=ready)
                        c3 = clock()
                        check(finish_count=0)
                        c4 = clock()
                    else:
                        c2 = clock()
                        check()
                        c3 = clock()
                        check()
                        c4 = clock()
                    n += ready - len(cc.ack_write_queue)
                    submit, checked, empty = submit + c1 - c0, checked + c3 - c2, empty + c4 - c3
                stats.acks += n
                acks += n
                if record and n:
                    stats.check_ns.append(checked / n)
                    stats.empty_ns.append(empty / params.batch)
                    stats.submit_ns.append(submit / n)
                stats.tokens += params.batch * params.seq_tokens
            cpu = time.process_time_ns() - p0 + (flush_cpu_ns(path.flush) if path.flush is not None else 0)
            if record and acks:
                stats.host_ns.append(cpu / acks)
        finally:
            if path.teardown is not None:
                path.teardown()

    try:
        for pattern in PATTERNS:
            for path in paths:
                block(path, pattern, record=False)
        for rep in range(params.reps):
            for pattern in PATTERNS[rep % 2 :] + PATTERNS[: rep % 2]:
                for path in paths[rep % len(paths) :] + paths[: rep % len(paths)]:
                    block(path, pattern, record=True)
        otlp.force_flush()
        prom_tokens = _prom_total(prom, "sglang:hicache_backup_tokens")
        ours = otlp.telemetry.snapshot()["hicache.transfer.tokens"].get(("backup", "kv"), 0)
    finally:
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
        otlp.shutdown()
        collector.close()
    by = {p.name: p for p in paths}

    def tokens(name: str) -> int:
        return sum(s.tokens for s in by[name].stats.values())

    checks = {
        "every batch produced one real HiCacheAck per insert, consumed by writing_check": all(
            s.acks == s.tokens // params.seq_tokens and len(s.check_ns) == params.reps * params.batches_per_block
            for p in paths
            for s in p.stats.values()
        ),
        "prometheus_client backup tokens == tokens backed up": prom_tokens == tokens(PROMETHEUS),
        "otel_hicache backup tokens == tokens backed up": ours == tokens("otel_hicache instrumentor, OTLP"),
    }
    return _table(paths, params, checks, command)


def _prom_total(collector: Any, name: str) -> float:
    total = 0.0
    metric = collector.backup_num_tokens
    for family in metric.collect():
        if family.name == name:
            total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


def _table(paths: list[_Path], params: Params, checks: dict[str, bool], command: str) -> Table:
    table = Table(
        key="sglang",
        title="1b. Reporting cost per backup ack on the real SGLang 0.5.23 writing_check, both call patterns (CPU)",
        columns=[
            "call pattern",
            "path",
            "writing_check CPU/ack p50 (ns)",
            "p99 (ns)",
            "added p50 (ns)",
            "x prometheus_client",
            "empty check added (ns/step)",
            "x prometheus_client, ack + empty check",
            "submit CPU/ack p50 (ns)",
            "submit added (ns)",
            "host-process CPU/ack added (ns)",
        ],
        command=command,
        checks=checks,
    )
    goals = {}
    for pattern in PATTERNS:
        base, prom = paths[0].stats[pattern], paths[1].stats[pattern]
        base_check, base_submit, base_empty = median(base.check_ns), median(base.submit_ns), median(base.empty_ns)
        base_host = median(base.host_ns)
        prom_added = median(prom.check_ns) - base_check
        prom_both = prom_added + median(prom.empty_ns) - base_empty
        for p in paths:
            s = p.stats[pattern]
            added = median(s.check_ns) - base_check
            ratio = added / prom_added if prom_added > 0 else float("nan")
            empty_added = median(s.empty_ns) - base_empty
            both = (added + empty_added) / prom_both if prom_both > 0 else float("nan")
            submit = median(s.submit_ns)
            host = median(s.host_ns) - base_host
            table.rows.append(
                [
                    pattern,
                    p.name,
                    median(s.check_ns),
                    percentile(s.check_ns, 99),
                    added,
                    "-" if p is paths[0] else ratio,
                    empty_added,
                    "-" if p is paths[0] else both,
                    submit,
                    submit - base_submit,
                    "-" if p is paths[0] else host,
                ]
            )
            table.data[f"{pattern}/{p.name}"] = {
                "pattern": pattern,
                "check_p50": median(s.check_ns),
                "added_p50": added,
                "ratio_vs_prometheus": ratio,
                "submit_p50": submit,
                "empty_added": empty_added,
                "ratio_with_empty_check": both,
                "host_cpu_added": host,
            }
        ours = table.data[f"{pattern}/otel_hicache instrumentor, OTLP"]["ratio_vs_prometheus"]
        goals[pattern] = bool(ours <= RATIO_GOAL)
        table.notes.append(
            f"Goal for otel_hicache on {pattern}: <= {RATIO_GOAL:g}x prometheus_client's added "
            f"calling-thread CPU: {'met' if goals[pattern] else 'NOT met'} ({ours:.2f}x)."
        )
    table.data["goals"] = goals
    table.notes += [
        f"{params.reps} interleaved repetitions x {params.batches_per_block} batches x {params.batch} acks per path "
        f"and call pattern (one {params.seq_tokens}-token sequence per ack, page 16, 2 layers); fresh "
        "UnifiedRadixCache per block; patterns and paths in rotating order. A block spans many ticks of the "
        "telemetry's host thread, so the records it builds are built among the steps, as in serving (in a block "
        "shorter than a tick they would be built in the flush after it, where no check is timed).",
        f"One scheduler step per ack: insert, flush_pending_backups() (one ack), then the consuming check with that "
        f"single ack queued, then a check with nothing completed ('empty check', what every step without a "
        f"completed ack pays). {EXPLICIT}: writing_check(finish_count=1) then writing_check(finish_count=0), as "
        f"check_hicache_events calls it. {DEFAULT}: writing_check() twice: it counts the ready acks, builds the "
        "count tensor and all-reduces it (a single rank has no TP/PP group: no collective runs, the tensor and "
        ".item() remain), then consumes them.",
        "writing_check CPU = time.thread_time_ns() around the consuming call (count, pop, synchronise, "
        "finish_write_through: tree and locks, report), summed over a batch / acks; p50/p99 over batches. "
        "'x prometheus_client' = added CPU / prometheus_client's added CPU for the same pattern "
        f"(goal for otel_hicache: <= {RATIO_GOAL:g}); 'ack + empty check' = the same for one consuming check plus "
        "one empty check (a step pair), where a hook that cannot tell an empty check from its arguments "
        "(writing_check() has no finish_count) pays its bookkeeping on every step.",
        "submit CPU = time.thread_time_ns() around flush_pending_backups() per ack: merge, the CPU index copy "
        "(shim), the ack; otel_hicache's start_writing hook runs here (the copy dominates, so this column is noisy).",
        "host-process CPU/ack added = time.process_time_ns() of the whole process (every thread; the OTLP receiver "
        "is a child process) over a block, including the setup.force_flush() that exports its spans less a second, "
        "empty flush, per ack, median over blocks, minus the uninstrumented path's. The block also inserts and "
        "copies (~100+ us per ack), so this column is noisy; benchmarks hotpath measures it without them.",
        "SGLang on CPU: timing_enabled=False (torch.cpu.Event cannot time), so no duration histogram on any path.",
    ]
    return table
