"""Item 1 on the real SGLang 0.5.23 ack path (CPU): ``UnifiedRadixCache.writing_check`` of real ``HiCacheAck`` s.

Needs the real sglang package (``scripts/setup-sglang-venv.sh`` builds ``.venv-sglang``). Run there::

    .venv-sglang/bin/python -m benchmarks sglang

From an interpreter without sglang, ``python -m benchmarks sglang`` re-runs itself in ``.venv-sglang`` when that
exists, and otherwise says so and skips.

A real ``UnifiedRadixCache`` with HiCache (write_through, ``direct`` io backend, layer-first host layout) is built
with SGLang's own test kit on the CPU. Per batch, ``batch`` sequences are inserted, each followed by
``flush_pending_backups()`` (one merged op -> one real ``HiCacheAck`` each, the copy done by the CPU shim), then
``writing_check(finish_count=batch)`` consumes them: pop, synchronise, finish the write-through (tree and lock
work), report. Timed with ``time.thread_time_ns()`` around ``writing_check`` (the reporting site) and, separately,
around the ``flush_pending_backups()`` calls (the submission site, where the instrumentor also hooks
``start_writing``). Paths, interleaved per block (a fresh cache per block):

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
    reps: int = 12
    batches_per_block: int = 8
    batch: int = 32
    seq_tokens: int = 64

    @classmethod
    def smoke(cls) -> Params:
        return cls(reps=1, batches_per_block=2, batch=4)


def run(smoke: bool, command: str) -> Table | None:
    if importlib.util.find_spec("sglang") is None:
        return _run_elsewhere(smoke, command)
    return _run(Params.smoke() if smoke else Params(), command)


def _run_elsewhere(smoke: bool, command: str) -> Table | None:
    if not SGLANG_VENV_PYTHON.exists():
        print("benchmarks sglang: skipped: sglang is not importable here and .venv-sglang does not exist "
              "(build it with scripts/setup-sglang-venv.sh).", file=sys.stderr)  # fmt: skip
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sglang.json")
        argv = [str(SGLANG_VENV_PYTHON), "-m", "benchmarks", "sglang", "--json", out, *(["--smoke"] if smoke else [])]
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if proc.returncode not in (0, 1) or not os.path.exists(out):
            print(f"benchmarks sglang: the run in .venv-sglang failed (exit {proc.returncode}):\n"
                  f"{proc.stderr[-3000:]}", file=sys.stderr)  # fmt: skip
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
@dataclass
class _Path:
    name: str
    setup: Any  # callable(cache) before a block
    teardown: Any = None
    check_ns: list[float] = field(default_factory=list)  # writing_check thread CPU per ack, per batch
    submit_ns: list[float] = field(default_factory=list)  # flush_pending_backups thread CPU per ack, per batch
    empty_ns: list[float] = field(default_factory=list)  # writing_check(finish_count=0) thread CPU per call
    acks: int = 0
    tokens: int = 0


def _run(params: Params, command: str) -> Table:
    import logging

    from otel_hicache.testing.sglang import build_hicache, install_cpu_shims

    logging.getLogger("sglang").setLevel(logging.ERROR)
    install_cpu_shims()
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector

    from benchmarks._collector import CollectorProcess
    from benchmarks.ackpath import NaiveOtelReporter
    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor
    from otel_hicache.sdk import configure

    collector = CollectorProcess()
    otlp = configure(endpoint=collector.grpc_endpoint, protocol="grpc", service_name="bench-sglang")
    prom = RadixCacheMetricsCollector(labels={"cache_type": "UnifiedRadixCache", "tp_rank": 0, "pp_rank": 0,
                                              "dp_rank": 0})  # fmt: skip
    naive = NaiveOtelReporter(otlp.tracer_provider, otlp.meter_provider)
    instrumentor = SGLangHiCacheInstrumentor()

    def set_prom(cache: Any) -> None:
        cache.metrics_collector = prom

    def set_naive(cache: Any) -> None:
        cache._log_write_ack_metrics = naive.write_ack  # SGLang's reporting function, replaced on the instance

    def set_hicache(cache: Any) -> None:
        instrumentor.instrument(telemetry=otlp.telemetry, stat_loggers=False)

    def unset_hicache() -> None:
        otlp.telemetry.flush()
        otlp.tracer_provider.force_flush()  # type: ignore[attr-defined]
        instrumentor.uninstrument()

    def flush_naive() -> None:
        otlp.tracer_provider.force_flush()  # type: ignore[attr-defined]

    paths = [
        _Path("uninstrumented", lambda cache: None),
        _Path("prometheus_client (SGLang --enable-metrics)", set_prom),
        _Path("naive OTel SDK, OTLP", set_naive, flush_naive),
        _Path("otel_hicache instrumentor, OTLP", set_hicache, unset_hicache),
    ]
    kv_size = 2 * params.batches_per_block * params.batch * params.seq_tokens
    seq = [0]

    def block(path: _Path, record: bool) -> None:
        # before instrument(): init_hicache is wrapped too
        cache, allocator, _ = build_hicache("write_through", kv_size=kv_size, page_size=16)
        path.setup(cache)
        cc = cache.cache_controller
        clock, check = time.thread_time_ns, cache.writing_check
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
                    c2 = clock()
                    check(finish_count=ready)
                    c3 = clock()
                    check(finish_count=0)
                    c4 = clock()
                    submit, checked, empty, n = submit + c1 - c0, checked + c3 - c2, empty + c4 - c3, n + ready
                path.acks += n
                if record and n:
                    path.check_ns.append(checked / n)
                    path.empty_ns.append(empty / params.batch)
                    path.submit_ns.append(submit / n)
                path.tokens += params.batch * params.seq_tokens
        finally:
            if path.teardown is not None:
                path.teardown()

    try:
        for path in paths:
            block(path, record=False)
        for rep in range(params.reps):
            for path in paths[rep % len(paths) :] + paths[: rep % len(paths)]:
                block(path, record=True)
        prom_tokens = _prom_total(prom, "sglang:hicache_backup_tokens")
        ours = otlp.telemetry.snapshot()["hicache.transfer.tokens"].get(("backup", "kv"), 0)
    finally:
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
        otlp.shutdown()
        collector.close()
    by = {p.name: p for p in paths}
    checks = {
        "every batch produced one real HiCacheAck per insert": all(p.acks == p.tokens // params.seq_tokens
                                                                   for p in paths)
        and all(len(p.check_ns) == params.reps * params.batches_per_block for p in paths),
        "prometheus_client backup tokens == tokens backed up": prom_tokens
        == by["prometheus_client (SGLang --enable-metrics)"].tokens,
        "otel_hicache backup tokens == tokens backed up": ours == by["otel_hicache instrumentor, OTLP"].tokens,
    }  # fmt: skip
    return _table(paths, params, checks, command)


def _prom_total(collector: Any, name: str) -> float:
    total = 0.0
    metric = collector.backup_num_tokens
    for family in metric.collect():
        if family.name == name:
            total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


def _table(paths: list[_Path], params: Params, checks: dict[str, bool], command: str) -> Table:
    base, prom = paths[0], paths[1]
    base_check, base_submit, base_empty = median(base.check_ns), median(base.submit_ns), median(base.empty_ns)
    prom_added = median(prom.check_ns) - base_check
    table = Table(
        key="sglang",
        title="1b. Reporting cost per backup ack on the real SGLang 0.5.23 writing_check (CPU)",
        columns=["path", "writing_check CPU/ack p50 (ns)", "p99 (ns)", "added p50 (ns)", "x prometheus_client",
                 "empty check added (ns/step)", "submit CPU/ack p50 (ns)", "submit added (ns)"],
        command=command,
        checks=checks,
    )  # fmt: skip
    for p in paths:
        added = median(p.check_ns) - base_check
        ratio = added / prom_added if prom_added > 0 else float("nan")
        submit = median(p.submit_ns)
        table.rows.append([p.name, median(p.check_ns), percentile(p.check_ns, 99), added,
                           "-" if p is base else ratio, median(p.empty_ns) - base_empty, submit,
                           submit - base_submit])  # fmt: skip
        table.data[p.name] = {"check_p50": median(p.check_ns), "added_p50": added, "ratio_vs_prometheus": ratio,
                              "submit_p50": median(p.submit_ns),
                              "empty_added": median(p.empty_ns) - base_empty}  # fmt: skip
    table.notes += [
        f"{params.reps} interleaved repetitions x {params.batches_per_block} batches x {params.batch} acks per path "
        f"(one {params.seq_tokens}-token sequence per ack, page 16, 2 layers); fresh UnifiedRadixCache per block.",
        "One scheduler step per ack: insert, flush_pending_backups() (one ack), writing_check(finish_count=1) with "
        "that single ack queued, then writing_check(finish_count=0). writing_check CPU = time.thread_time_ns() "
        "around the consuming call (pop, synchronise, finish_write_through: tree and locks, report), summed over a "
        "batch / acks; p50/p99 over batches. 'empty check' = writing_check(finish_count=0), what every step without a "
        "completed ack pays. 'x prometheus_client' = "
        "added CPU / prometheus_client's added CPU (goal for otel_hicache: <= 0.5).",
        "submit CPU = time.thread_time_ns() around flush_pending_backups() per ack: merge, the CPU index copy "
        "(shim), the ack; otel_hicache's start_writing hook runs here (the copy dominates, so this column is noisy).",
        "SGLang on CPU: timing_enabled=False (torch.cpu.Event cannot time), so no duration histogram on any path.",
    ]
    return table
