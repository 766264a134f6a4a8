"""The whole scheduler-thread cost of a merged transfer on the real SGLang 0.5.23 HiCache path (CPU).

Needs the real sglang package (``scripts/setup-sglang-venv.sh`` builds ``.venv-sglang``). Run there::

    .venv-sglang/bin/python -m benchmarks sglang

From an interpreter without sglang, ``python -m benchmarks sglang`` re-runs itself in ``.venv-sglang`` when that
exists, and otherwise says so and skips.

A real ``UnifiedRadixCache`` with HiCache (write_through, ``direct`` io backend, layer-first host layout) is built from
SGLang's own classes on the CPU (:mod:`otel_hicache.testing.sglang`). One scheduler step per merged transfer, each
part timed with ``time.thread_time_ns()`` on the scheduler thread:

* **submission**: a sequence is inserted, ``flush_pending_backups()`` makes one merged op -> one real ``HiCacheAck``
  (``start_writing``; the copy done by the CPU shim);
* **consumption**: ``writing_check`` consumes it (pop, synchronise, finish the write-through, report), then a second
  check finds nothing completed ("empty check"). Both call patterns: ``writing_check(finish_count=n)`` (what
  ``check_hicache_events`` does) and ``writing_check()`` (default arguments: it counts the ready acks itself);
* **admission**: a request hitting that sequence is admitted by a real ``PrefillAdder`` (``add_one_req``), and
  prometheus_client counts SGLang's per-tier prefill series for the batch as ``--enable-metrics`` does
  (``PrefillStats.from_adder`` -> ``increment_effective_prefill_tokens``).

The whole is their sum per transfer. The process's CPU per block, the export process's and the OTLP receiver's are
measured apart. Every block runs twice, in two placements: unpinned, and pinned (every thread of the host on CPU 0;
the export process and the receiver on CPU 1; ``taskset`` by hand). Paths, interleaved per block (a fresh cache per
block):

* uninstrumented: ``metrics_collector = None``;
* prometheus_client: SGLang's own ``RadixCacheMetricsCollector`` and ``SchedulerMetricsCollector``;
* naive OTel SDK: SGLang's ``_log_write_ack_metrics`` replaced by one span + counters + histogram per ack;
* otel_hicache: ``SGLangHiCacheInstrumentor().instrument(telemetry=...)`` (spans on; OTLP to a child process);
* control: uninstrumented, beside a thread that keeps the schedule our host thread keeps while work waits (a slice
  holding the GIL, then a pause) and does nothing else (:class:`benchmarks._rounds.ScheduleControl`): what that
  schedule's wakes and GIL hand-overs alone cost the scheduler thread on this machine, per round;
* floor: each of our hooks writes its raw record into shared memory itself, and nothing of ours runs on another
  thread (:mod:`benchmarks._sglang_floor`, a measuring device, not the product): the least any design that keeps these
  hooks and moves everything else out of the host process could cost the scheduler thread;
* floor, token ids to the export process: the floor's raw records but the page hashes, and each admitted request
  handed to the product's capacity estimator as the instrumentor hands it (``CapacityHooks.admissions``: over OTLP,
  the prompt's token ids copied into the id ring, keyed and modelled by the export process): what the floor costs
  with the product's own hand-over of the capacity lookups.

CPU shims and the cache builder: :mod:`otel_hicache.testing.sglang` (the SGLang tests use the same). On CPU,
``torch.cpu.Event`` cannot time, so SGLang's acks carry ``timing_enabled=False`` and no duration is observed on any
path. Eviction and L3 prefetch do not run here (the cache is sized to hold every sequence; no L3 backend): their
wrappers run once per eviction pass and per prefetched request, not per transfer.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks._common import Table, host_thread_id, median, thread_cpu_ns

ROOT = Path(__file__).resolve().parent.parent
SGLANG_VENV_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"


@dataclass
class Params:
    # A block (~0.5 s) spans many ticks of the telemetry's host thread (50 ms), so its work lands among the steps, as
    # in serving, and not in the flush after the block (outside the timed steps), as it would in a short block.
    reps: int = 4
    batches_per_block: int = 32
    batch: int = 32
    seq_tokens: int = 64

    @classmethod
    def smoke(cls) -> Params:
        return cls(reps=1, batches_per_block=2, batch=4)


def run(smoke: bool, command: str, time_builds: bool = False) -> Table | None:
    """``time_builds``: time each record the host thread builds too (its figures then hold those clock reads)."""
    if importlib.util.find_spec("sglang") is None:
        return _run_elsewhere(smoke, command, time_builds)
    import torch

    # One intra-op thread: the CPU shim's copies would otherwise leave OpenMP workers spinning, process CPU that
    # belongs to no path (on a GPU the copy is a kernel).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(Params.smoke() if smoke else Params(), command, time_builds)
    finally:
        torch.set_num_threads(threads)


def _run_elsewhere(smoke: bool, command: str, time_builds: bool) -> Table | None:
    if not SGLANG_VENV_PYTHON.exists():
        print(
            "benchmarks sglang: skipped: sglang is not importable here and .venv-sglang does not exist "
            "(build it with scripts/setup-sglang-venv.sh).",
            file=sys.stderr,
        )
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sglang.json")
        flags = [*(["--smoke"] if smoke else []), *(["--time-builds"] if time_builds else [])]
        argv = [str(SGLANG_VENV_PYTHON), "-m", "benchmarks", "sglang", "--json", out, *flags]
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
    table.command = f".venv-sglang/bin/python -m benchmarks sglang{''.join(' ' + flag for flag in flags)}"
    return table


# ---------------------------------------------------------------------------------------------------- the run
#: The two ways writing_check is called: with the count the scheduler already synchronised
#: (check_hicache_events today), and with its default arguments (it counts the ready acks itself, then
#: all-reduces the count over the TP group; a single rank has no group to reduce over, so only the count tensor
#: and its .item() remain).
EXPLICIT = "writing_check(finish_count=n)"
DEFAULT = "writing_check()"
PATTERNS = (EXPLICIT, DEFAULT)
#: Goal for otel_hicache: the scheduler thread's whole added cost per transfer at most this times prometheus_client's.
WHOLE_GOAL = 0.5
UNPINNED = "unpinned"
PINNED = "pinned"
PROMETHEUS = "prometheus_client (SGLang --enable-metrics)"
OURS = "otel_hicache instrumentor, OTLP"
CONTROL = "control: our host thread's schedule alone"
FLOOR = "floor: our hooks' raw records to shared memory, no host thread"
LOOKUPS = "floor, token ids to the export process"
#: the paths whose host thread is the telemetry's: its CPU and rounds are reported
HOST_THREAD_PATHS = (OURS, LOOKUPS)


@dataclass
class _Stats:
    submit_ns: list[float] = field(default_factory=list)  # flush_pending_backups thread CPU per ack, per batch
    check_ns: list[float] = field(default_factory=list)  # consuming writing_check thread CPU per ack, per batch
    empty_ns: list[float] = field(default_factory=list)  # writing_check with nothing completed, per call
    admit_ns: list[float] = field(default_factory=list)  # one request's admission (+ its metrics), per step
    #: per block (one per repetition, in order): the medians of its batches' submit, check, empty and admit figures
    block_parts: list[tuple[float, float, float, float]] = field(default_factory=list)
    host_ns: list[float] = field(default_factory=list)  # host-process CPU per ack, per block
    host_thread_ns: list[float] = field(default_factory=list)  # otel_hicache's host thread's CPU per ack, per block
    rounds: list[float] = field(default_factory=list)  # ... its rounds per ack, per block
    step_rounds: list[float] = field(default_factory=list)  # ... of them, among the steps (before the flush)
    round_cpu_ns: list[float] = field(default_factory=list)  # ... its CPU inside those rounds per ack, per block
    left_for_flush: list[float] = field(default_factory=list)  # ... its entries still unbuilt per ack, block's end
    export_ns: list[float] = field(default_factory=list)  # the export process's CPU per ack, per block
    receiver_ns: list[float] = field(default_factory=list)  # the OTLP receiver's CPU per ack, per block
    acks: int = 0
    tokens: int = 0
    admitted: int = 0


@dataclass
class _Path:
    name: str
    setup: Any  # callable(cache) before a block
    admitted: Any = None  # callable(stats, adder) after an admission: the path's own prefill metrics
    flush: Any = None  # exports what the block reported (its CPU is the host's)
    teardown: Any = None
    stats: dict[tuple[str, str], _Stats] = field(default_factory=dict)  # (placement, pattern) -> stats

    def of(self, placement: str, pattern: str) -> _Stats:
        return self.stats.setdefault((placement, pattern), _Stats())


class _Placement:
    """Where the processes run: unpinned, or the host on one CPU and the export process and receiver on another."""

    def __init__(self, receiver_pid: int) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        self.all = set(cpus)
        self.split = ({cpus[0]}, {cpus[1]}) if len(cpus) >= 2 else None
        self.receiver_pid = receiver_pid
        self.export_pid: int | None = None

    def names(self) -> tuple[str, ...]:
        return (UNPINNED, PINNED) if self.split is not None else (UNPINNED,)

    def apply(self, placement: str) -> None:
        host, helpers = (self.all, self.all) if placement == UNPINNED or self.split is None else self.split
        _set_affinity(os.getpid(), host)
        for pid in (self.receiver_pid, self.export_pid):
            if pid is not None:
                _set_affinity(pid, helpers)

    def find_export_process(self, port: int) -> None:
        """The export process: the process (not this one) with a TCP connection to the receiver's port."""
        inodes = _sockets_to(port)
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in (os.getpid(), self.receiver_pid):
                continue
            try:
                fds = os.listdir(f"/proc/{entry}/fd")
                links = {os.readlink(f"/proc/{entry}/fd/{fd}") for fd in fds}
            except OSError:  # gone, or not ours to read
                continue
            if any(f"socket:[{inode}]" in links for inode in inodes):
                self.export_pid = int(entry)
                return


def _sockets_to(port: int) -> set[str]:
    """The inodes of the TCP sockets connected to ``port`` (``/proc/net/tcp``, ``tcp6``: remote address, inode)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def _set_affinity(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` on ``cpus`` (``sched_setaffinity`` of a pid moves its main thread only)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # the thread ended meanwhile
            continue


def _host_thread_cpu_ns() -> int:
    """CPU time so far of this process's otel_hicache host thread, in ns; 0 without one."""
    tid = host_thread_id()
    return 0 if tid is None else thread_cpu_ns(os.getpid(), tid)


def _cpu_ns(pid: int | None) -> int:
    """CPU time of process ``pid``'s live threads so far, in ns; 0 when unknown."""
    if pid is None:
        return 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    return sum(thread_cpu_ns(pid, int(tid)) for tid in tids)


class StepTimes(NamedTuple):
    """One scheduler step's parts (thread CPU, ns, as ``clock`` reads them) and what it did."""

    submit: int
    check: int
    empty: int
    admit: int
    consumed: int  # acks writing_check consumed
    admitted: bool


class SchedulerStep:
    """One scheduler step per ack, as serving runs it on SGLang's real classes: a new sequence of ``seq_tokens``
    inserted, its backup submitted (``flush_pending_backups``) and consumed by ``writing_check`` (queue length 1),
    a check where nothing completed (the step after), and the admission of a request hitting what it backed up (a
    real ``PrefillAdder.add_one_req`` and ``PrefillStats.from_adder``; ``admitted(stats, adder)``: a path's own
    prefill metrics). Needs sglang (imported at construction)."""

    def __init__(self, seq_tokens: int) -> None:
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
        from sglang.srt.managers.scheduler_components.metrics_reporter import PrefillStats
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        from otel_hicache.testing.sglang import make_request

        self._classes = (AddReqResult, PrefillAdder, PrefillStats, InsertParams, RadixKey, make_request)
        self.seq_tokens = seq_tokens
        self.seq = 0

    def __call__(
        self, cache: Any, allocator: Any, pattern: str, admitted: Any = None, clock: Any = time.thread_time_ns
    ) -> StepTimes:
        add_req_result, prefill_adder, prefill_stats, insert_params, radix_key, make_request = self._classes
        cc, check = cache.cache_controller, cache.writing_check
        self.seq += 1
        tokens = list(range(self.seq * 1_000_000, self.seq * 1_000_000 + self.seq_tokens))
        value = allocator.alloc(len(tokens))
        cache.insert(insert_params(key=radix_key(array("q", tokens)), value=value[: len(tokens)]))
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
        consumed = ready - len(cc.ack_write_queue)
        req = make_request([*tokens, *range(7, 23)], f"r{self.seq}")
        req.init_next_round_input(cache)
        adder = prefill_adder(cache.page_size, cache, allocator, None, 1.0, 4096, None)
        c5 = clock()
        added = adder.add_one_req(req, False, None)
        prefill = prefill_stats.from_adder(adder, running_reqs=[])  # the batch stats, metrics on or off
        if admitted is not None:
            admitted(prefill, adder)
        c6 = clock()
        return StepTimes(c1 - c0, c3 - c2, c4 - c3, c6 - c5, consumed, added is add_req_result.CONTINUE)


class PrometheusPath:
    """SGLang's own metrics (``--enable-metrics``) on a cache: its ``RadixCacheMetricsCollector``, and per admitted
    batch what the ``SchedulerMetricsCollector`` adds for these series. Needs sglang."""

    def __init__(self) -> None:
        from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector

        self.collector = RadixCacheMetricsCollector(
            labels={"cache_type": "UnifiedRadixCache", "tp_rank": 0, "pp_rank": 0, "dp_rank": 0}
        )
        self._scheduler: Any = None  # built once a cache published SGLang's runtime config

    def setup(self, cache: Any) -> None:
        cache.metrics_collector = self.collector

    def admitted(self, stats: Any, adder: Any) -> None:  # what --enable-metrics adds for these series, per batch
        if self._scheduler is None:
            from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector
            from sglang.srt.server_args import ServerArgs

            self._scheduler = SchedulerMetricsCollector(
                # string ranks, as the SGLang tests pass them: an int moe_ep_rank 0 asks for the MoE balancedness
                # series, which need a published runtime config
                labels={
                    "model_name": "dummy",
                    "engine_type": "unified",
                    "tp_rank": "0",
                    "pp_rank": "0",
                    "moe_ep_rank": "0",
                },
                server_args=ServerArgs(model_path="dummy"),
            )
        self._scheduler.increment_effective_prefill_tokens(
            input_tokens=stats.log_input_tokens - stats.reprocessed_log_input_tokens,
            device_hit_tokens=stats.log_device_hit_tokens,
            host_hit_tokens=stats.log_host_hit_tokens,
            storage_hit_tokens=stats.log_storage_hit_tokens,
        )


def _run(params: Params, command: str, time_builds: bool) -> Table:
    import logging
    from urllib.parse import urlparse

    from otel_hicache.testing.sglang import build_hicache, install_cpu_shims

    logging.getLogger("sglang").setLevel(logging.ERROR)
    install_cpu_shims()

    from benchmarks._collector import CollectorProcess
    from benchmarks._common import flush_cpu_ns
    from benchmarks._rounds import RoundTimer, ScheduleControl, wake_cpu_ns
    from benchmarks._sglang_floor import RawRecords
    from benchmarks.ackpath import NaiveOtelReporter
    from otel_hicache.integrations._sink import ProcessSink
    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor
    from otel_hicache.integrations.sglang.capacity import CapacityHooks
    from otel_hicache.sdk import configure
    from otel_hicache.semconv import Engine

    collector = CollectorProcess()
    otlp = configure(endpoint=collector.grpc_endpoint, protocol="grpc", service_name="bench-sglang")
    wake_floor = wake_cpu_ns()  # before the receiver, the export process or any block is busy
    timer = RoundTimer(otlp.telemetry, builds=time_builds)
    placement = _Placement(collector.pid)
    prometheus = PrometheusPath()
    prom = prometheus.collector
    naive = NaiveOtelReporter(otlp.tracer_provider, otlp.meter_provider)
    instrumentor = SGLangHiCacheInstrumentor()
    control = ScheduleControl()
    page_tokens = 16
    floor = RawRecords(page_tokens)

    def set_naive(cache: Any) -> None:
        cache._log_write_ack_metrics = naive.write_ack  # SGLang's reporting function, replaced on the instance

    def set_hicache(cache: Any) -> None:
        instrumentor.instrument(telemetry=otlp.telemetry, stat_loggers=False)

    lookups: list[CapacityHooks] = []  # the block's: its feed is made at its first admission, as the product's

    def set_lookups(cache: Any) -> None:
        floor.adopt(cache)
        lookups[:] = [CapacityHooks(ProcessSink(Engine.SGLANG, telemetry=otlp.telemetry))]

    def lookups_admitted(stats: Any, adder: Any) -> None:
        floor.split(stats)
        lookups[0].admissions(adder)

    paths = [
        _Path("uninstrumented", lambda cache: None),
        _Path(PROMETHEUS, prometheus.setup, prometheus.admitted),
        _Path("naive OTel SDK, OTLP", set_naive, None, otlp.force_flush),
        _Path(OURS, set_hicache, None, otlp.force_flush, instrumentor.uninstrument),
        _Path(CONTROL, lambda cache: control.start(), teardown=control.stop),
        _Path(FLOOR, floor.adopt, floor.admitted),
        _Path(LOOKUPS, set_lookups, lookups_admitted, otlp.force_flush),
    ]
    kv_size = 2 * params.batches_per_block * params.batch * (params.seq_tokens + 16)
    step = SchedulerStep(params.seq_tokens)

    def block(path: _Path, where: str, pattern: str, record: bool) -> None:
        placement.apply(where)
        gc.collect()  # the last block's cache goes now, outside the measurement
        # before instrument(): init_hicache is wrapped too
        cache, allocator, _ = build_hicache("write_through", kv_size=kv_size, page_size=page_tokens)
        path.setup(cache)
        stats = path.of(where, pattern)
        e0, r0, p0 = _cpu_ns(placement.export_pid), _cpu_ns(placement.receiver_pid), time.process_time_ns()
        # the rounds of the path's thread so far: the control's, else our host thread's (timed by the RoundTimer)
        thread_rounds = (lambda: control.rounds) if path.name == CONTROL else (lambda: len(timer.rounds))
        t0, first_round, first_thread_round = _host_thread_cpu_ns(), len(timer.rounds), thread_rounds()
        acks, first_batch = 0, len(stats.check_ns)
        try:
            for _ in range(params.batches_per_block):
                submit = checked = empty = admit = n = 0
                # One scheduler step per ack: submit it, consume it (queue length 1, as in serving), a check where
                # nothing completed (the step after), and the admission of a request that hits what it backed up.
                for _ in range(params.batch):
                    times = step(cache, allocator, pattern, path.admitted)
                    n += times.consumed
                    stats.admitted += times.admitted
                    submit, checked, empty = submit + times.submit, checked + times.check, empty + times.empty
                    admit += times.admit
                stats.acks += n
                acks += n
                if record and n:
                    stats.submit_ns.append(submit / n)
                    stats.check_ns.append(checked / n)
                    stats.empty_ns.append(empty / params.batch)
                    stats.admit_ns.append(admit / params.batch)
                stats.tokens += params.batch * params.seq_tokens
            unbuilt = otlp.telemetry._host.waiting()  # what the flush builds
            step_rounds = thread_rounds() - first_thread_round
            cpu = time.process_time_ns() - p0 + (flush_cpu_ns(path.flush) if path.flush is not None else 0)
            if record and acks:
                stats.block_parts.append(
                    (
                        median(stats.submit_ns[first_batch:]),
                        median(stats.check_ns[first_batch:]),
                        median(stats.empty_ns[first_batch:]),
                        median(stats.admit_ns[first_batch:]),
                    )
                )
                stats.host_ns.append(cpu / acks)
                stats.host_thread_ns.append((_host_thread_cpu_ns() - t0) / acks)
                rounds = timer.rounds[first_round:]
                stats.rounds.append((thread_rounds() - first_thread_round) / acks)
                stats.step_rounds.append(step_rounds / acks)
                stats.round_cpu_ns.append(sum(held for held, _, _ in rounds) / acks)
                stats.left_for_flush.append(unbuilt / acks)
                stats.export_ns.append((_cpu_ns(placement.export_pid) - e0) / acks)
                stats.receiver_ns.append((_cpu_ns(placement.receiver_pid) - r0) / acks)
        finally:
            if path.teardown is not None:
                path.teardown()

    try:
        for pattern in PATTERNS:
            for path in paths:
                block(path, UNPINNED, pattern, record=False)
        placement.find_export_process(urlparse(collector.grpc_endpoint).port or 0)
        timer.builds.clear()  # the records of the measured blocks only
        wheres = placement.names()
        for rep in range(params.reps):
            for where in wheres[rep % len(wheres) :] + wheres[: rep % len(wheres)]:
                for pattern in PATTERNS[rep % 2 :] + PATTERNS[: rep % 2]:
                    for path in paths[rep % len(paths) :] + paths[: rep % len(paths)]:
                        block(path, where, pattern, record=True)
        placement.apply(UNPINNED)
        otlp.force_flush()
        prom_tokens = _prom_total(prom, "sglang:hicache_backup_tokens")
        ours = otlp.telemetry.snapshot()["hicache.transfer.tokens"].get(("backup", "kv"), 0)
    finally:
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
        timer.close()
        otlp.shutdown()
        collector.close()
    by = {p.name: p for p in paths}

    def tokens(name: str) -> int:
        return sum(s.tokens for s in by[name].stats.values())

    checks = {
        "every step produced one real HiCacheAck, consumed by writing_check, and admitted one request": all(
            s.acks == s.tokens // params.seq_tokens == s.admitted
            and len(s.check_ns) == len(s.host_ns) * params.batches_per_block
            for p in paths
            for s in p.stats.values()
        ),
        "prometheus_client backup tokens == tokens backed up": prom_tokens == tokens(PROMETHEUS),
        "otel_hicache backup tokens == tokens backed up": ours == tokens(OURS),
        "the floor wrote one record per ack consumed": floor.acks
        == sum(s.acks for name in (FLOOR, LOOKUPS) for s in by[name].stats.values()),
    }
    return _table(paths, params, checks, command, placement, wake_floor, timer.builds)


def _prom_total(collector: Any, name: str) -> float:
    total = 0.0
    metric = collector.backup_num_tokens
    for family in metric.collect():
        if family.name == name:
            total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


def _ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs > 0 else float("nan")


@dataclass
class _Spread:
    """One goal judged in each repetition apart (its blocks of every path are interleaved, so a repetition is a
    paired comparison): ``ours`` per repetition (a ratio to prometheus_client's, or for the host CPU ours minus
    theirs in ns) and prometheus_client's own added figure per repetition."""

    ours: list[float]
    theirs: list[float]
    ratio: bool  # ours are ratios (goal: <= WHOLE_GOAL); else differences (goal: <= 0)

    @property
    def resolved(self) -> bool:
        """Every repetition tells the same: prometheus_client's own cost read above zero in each (else no ratio is
        meaningful), and the goal met in all or in none."""
        bound = WHOLE_GOAL if self.ratio else 0.0
        met = [value <= bound for value in self.ours]
        return all(cost > 0 for cost in self.theirs) and (all(met) or not any(met))

    def __str__(self) -> str:
        finite = [value for value in self.ours if math.isfinite(value)]
        if self.ratio:
            ours = f"{min(finite):.2f} to {max(finite):.2f}x" if finite else "no ratio"
        else:
            ours = f"ours less theirs {min(finite) / 1e3:+.1f} to {max(finite) / 1e3:+.1f} us"
        theirs = f"prometheus_client's own {min(self.theirs) / 1e3:+.1f} to {max(self.theirs) / 1e3:+.1f} us"
        verdict = "" if self.resolved else ": not resolved on this machine"
        return f"per repetition {ours}, {theirs}{verdict}"


def _repetitions(base: _Stats, prom: _Stats, ours: _Stats) -> dict[str, _Spread]:
    """Each goal judged per repetition (see :class:`_Spread`)."""
    added = {
        name: [
            [part - b for part, b in zip(block, base_block, strict=True)]
            for block, base_block in zip(stats.block_parts, base.block_parts, strict=True)
        ]
        for name, stats in (("prom", prom), ("ours", ours))
    }
    spreads = {}
    for goal, n in (("submission_consumption", 3), ("whole", 4)):
        theirs = [sum(rep[:n]) for rep in added["prom"]]
        spreads[goal] = _Spread(
            [_ratio(sum(rep[:n]), t) for rep, t in zip(added["ours"], theirs, strict=True)], theirs, True
        )
    host_theirs = [p - b for p, b in zip(prom.host_ns, base.host_ns, strict=True)]
    host_ours = [o - b for o, b in zip(ours.host_ns, base.host_ns, strict=True)]
    spreads["host_cpu"] = _Spread([o - t for o, t in zip(host_ours, host_theirs, strict=True)], host_theirs, False)
    return spreads


def _schedule_price(control: dict[str, Any], ours: dict[str, Any], slice_ns: int) -> dict[str, float]:
    """The control's added costs per round of its thread (the host CPU less the slice it spins: ours does its work
    there), that price times our host thread's rounds per transfer among the steps (the share of ours the schedule
    explains; the flush's rounds run back to back, no wake, nobody waiting), and the rest of ours."""
    rounds = control["host_thread_step_rounds"]
    each = 1 / rounds if rounds > 0 else math.nan
    per_round = {
        "paired": control["paired_added"] * each,
        "whole": control["whole_added"] * each,
        "host_cpu": control["host_cpu_added"] * each - slice_ns,
    }
    price: dict[str, float] = {"rounds": rounds}
    for part, value in per_round.items():
        share = value * ours["host_thread_step_rounds"]
        price[f"{part}_per_round"] = value
        price[f"{part}_share"] = share
        price[f"{part}_rest"] = ours[f"{part}_added"] - share
    return price


def _table(
    paths: list[_Path],
    params: Params,
    checks: dict[str, bool],
    command: str,
    placement: _Placement,
    wake_floor: float,
    builds: dict[str, tuple[list[int], list[int]]],
) -> Table:
    from otel_hicache._internal.host.worker import PAUSE_S, SLICE_NS

    table = Table(
        key="sglang",
        title="1b. The scheduler thread's whole cost per merged transfer on the real SGLang 0.5.23 HiCache path (CPU)",
        columns=[
            "placement",
            "call pattern",
            "path",
            "submission added (ns/transfer)",
            "consumption added (ns/transfer)",
            "empty check added (ns/step)",
            "admission added (ns/step)",
            "submission + consumption added (ns/transfer)",
            "x prometheus_client, submission + consumption",
            "whole added (ns/transfer)",
            "x prometheus_client, whole",
            "x prometheus_client, consumption",
            "host-process CPU/transfer added (ns)",
            "of which otel_hicache's host thread (ns/transfer)",
            "host-thread rounds/transfer",
            "host thread between rounds (ns/transfer)",
            "host-thread entries left for the flush (per transfer)",
            "export process CPU/transfer (ns)",
            "receiver CPU/transfer (ns)",
        ],
        command=command,
        checks=checks,
    )
    goals: dict[str, dict[str, bool]] = {}
    table.data["control"] = {}  # per placement and pattern: what the schedule alone costs (_schedule_price)
    resolved: dict[str, dict[str, bool]] = {}  # whether every repetition agrees with the verdict
    by_name = {p.name: p for p in paths}
    for where in placement.names():
        for pattern in PATTERNS:
            base = paths[0].of(where, pattern)
            parts = ("submit_ns", "check_ns", "empty_ns", "admit_ns")
            base_parts = [median(getattr(base, part)) for part in parts]
            base_host = median(base.host_ns)
            added: dict[str, list[float]] = {}
            for p in paths:
                s = p.of(where, pattern)
                added[p.name] = [median(getattr(s, part)) - b for part, b in zip(parts, base_parts, strict=True)]
            prom = added[PROMETHEUS]
            prom_host = median(paths[1].of(where, pattern).host_ns) - base_host
            for p in paths:
                s = p.of(where, pattern)
                submit, check, empty, admit = added[p.name]
                paired = submit + check + empty
                whole = paired + admit
                host = median(s.host_ns) - base_host
                first = p is paths[0]
                table.rows.append(
                    [
                        where,
                        pattern,
                        p.name,
                        submit,
                        check,
                        empty,
                        admit,
                        paired,
                        "-" if first else _ratio(paired, sum(prom[:3])),
                        whole,
                        "-" if first else _ratio(whole, sum(prom)),
                        "-" if first else _ratio(check, prom[1]),
                        "-" if first else host,
                        median(s.host_thread_ns) if p.name in HOST_THREAD_PATHS else "-",
                        median(s.rounds) if p.name in (*HOST_THREAD_PATHS, CONTROL) else "-",
                        median(s.host_thread_ns) - median(s.round_cpu_ns) if p.name in HOST_THREAD_PATHS else "-",
                        median(s.left_for_flush) if p.name in HOST_THREAD_PATHS else "-",
                        median(s.export_ns),
                        median(s.receiver_ns),
                    ]
                )
                table.data[f"{where}/{pattern}/{p.name}"] = {
                    "placement": where,
                    "pattern": pattern,
                    "submit_added": submit,
                    "check_added": check,
                    "empty_added": empty,
                    "admit_added": admit,
                    "paired_added": paired,
                    "ratio_paired": _ratio(paired, sum(prom[:3])),
                    "whole_added": whole,
                    "check_p50": median(s.check_ns),
                    "ratio_whole": _ratio(whole, sum(prom)),
                    "ratio_consumption": _ratio(check, prom[1]),
                    "host_cpu_added": host,
                    "host_thread_cpu": median(s.host_thread_ns),
                    "host_thread_rounds": median(s.rounds),
                    "host_thread_step_rounds": median(s.step_rounds),
                    "host_thread_between_rounds": median(s.host_thread_ns) - median(s.round_cpu_ns),
                    "left_for_flush": median(s.left_for_flush),
                    "export_cpu": median(s.export_ns),
                    "receiver_cpu": median(s.receiver_ns),
                }
            ours = table.data[f"{where}/{pattern}/{OURS}"]
            goals[f"{where}/{pattern}"] = {
                "submission_consumption": bool(ours["ratio_paired"] <= WHOLE_GOAL),
                "whole": bool(ours["ratio_whole"] <= WHOLE_GOAL),
                "host_cpu": bool(ours["host_cpu_added"] <= prom_host),
            }
            met = goals[f"{where}/{pattern}"]
            reps = _repetitions(base, by_name[PROMETHEUS].of(where, pattern), by_name[OURS].of(where, pattern))
            resolved[f"{where}/{pattern}"] = {goal: spread.resolved for goal, spread in reps.items()}
            table.notes.append(
                f"Goals for otel_hicache, {where}, {pattern}: submission + consumption <= {WHOLE_GOAL:g}x "
                f"prometheus_client's: {'met' if met['submission_consumption'] else 'NOT met'} "
                f"({ours['ratio_paired']:.2f}x: {ours['paired_added'] / 1e3:+.1f} us against "
                f"{sum(prom[:3]) / 1e3:+.1f} us; {reps['submission_consumption']}); whole scheduler-thread cost <= "
                f"{WHOLE_GOAL:g}x prometheus_client's: {'met' if met['whole'] else 'NOT met'} "
                f"({ours['ratio_whole']:.2f}x: {ours['whole_added'] / 1e3:+.1f} us against {sum(prom) / 1e3:+.1f} us; "
                f"{reps['whole']}); host-process CPU per transfer <= prometheus_client's: "
                f"{'met' if met['host_cpu'] else 'NOT met'} "
                f"({ours['host_cpu_added'] / 1e3:+.1f} us against {prom_host / 1e3:+.1f} us; {reps['host_cpu']})."
            )
            schedule = _schedule_price(table.data[f"{where}/{pattern}/{CONTROL}"], ours, SLICE_NS)
            table.data["control"][f"{where}/{pattern}"] = schedule
            prom_paired, prom_whole = sum(prom[:3]), sum(prom)
            table.notes.append(
                f"Control, {where}, {pattern}: our host thread's schedule alone (a thread holding the GIL "
                f"{SLICE_NS / 1e3:g} us, then sleeping {PAUSE_S * 1e3:g} ms; {schedule['rounds']:.2f} rounds per "
                f"transfer) cost per round {schedule['paired_per_round'] / 1e3:+.1f} us of submission + consumption, "
                f"{schedule['whole_per_round'] / 1e3:+.1f} us of the whole and "
                f"{schedule['host_cpu_per_round'] / 1e3:+.1f} us of host-process CPU beyond its slice. At that price "
                f"our host thread's {ours['host_thread_step_rounds']:.2f} rounds per transfer among the steps are "
                f"{schedule['paired_share'] / 1e3:+.1f} / "
                f"{schedule['whole_share'] / 1e3:+.1f} / {schedule['host_cpu_share'] / 1e3:+.1f} us of ours; the rest, "
                f"our hooks and the work in those rounds: {schedule['paired_rest'] / 1e3:+.1f} us "
                f"({_ratio(schedule['paired_rest'], prom_paired):.2f}x prometheus_client's) / "
                f"{schedule['whole_rest'] / 1e3:+.1f} us ({_ratio(schedule['whole_rest'], prom_whole):.2f}x) / "
                f"{schedule['host_cpu_rest'] / 1e3:+.1f} us (against {prom_host / 1e3:+.1f} us)."
            )
            lowest = table.data[f"{where}/{pattern}/{FLOOR}"]
            table.notes.append(
                f"Floor, {where}, {pattern}: our hooks writing raw records to shared memory, no host thread: "
                f"submission + consumption {lowest['paired_added'] / 1e3:+.1f} us ({lowest['ratio_paired']:.2f}x "
                f"prometheus_client's), whole {lowest['whole_added'] / 1e3:+.1f} us ({lowest['ratio_whole']:.2f}x), "
                f"host-process CPU {lowest['host_cpu_added'] / 1e3:+.1f} us per transfer (prometheus_client's "
                f"{prom_host / 1e3:+.1f} us)."
            )
            left = table.data[f"{where}/{pattern}/{LOOKUPS}"]
            table.notes.append(
                f"Floor with the token ids to the export process, {where}, {pattern}: submission + consumption "
                f"{left['paired_added'] / 1e3:+.1f} us ({left['ratio_paired']:.2f}x), whole "
                f"{left['whole_added'] / 1e3:+.1f} us ({left['ratio_whole']:.2f}x), host-process CPU "
                f"{left['host_cpu_added'] / 1e3:+.1f} us per transfer, "
                f"{'at most' if left['host_cpu_added'] <= prom_host else 'above'} prometheus_client's "
                f"({prom_host / 1e3:+.1f} us); our host thread {left['host_thread_cpu'] / 1e3:.1f} us of CPU and "
                f"{left['host_thread_step_rounds']:.2f} rounds per transfer among the steps, the export process "
                f"{left['export_cpu'] / 1e3:.1f} us."
            )
    table.data["goals"] = goals
    table.data["resolved"] = resolved
    table.data["export_process_found"] = placement.export_pid is not None
    table.data["wake_floor_ns"] = wake_floor
    table.data["builds"] = {
        name: {"first": len(first), "later": len(later), "first_p50_ns": median(first), "later_p50_ns": median(later)}
        for name, (first, later) in builds.items()
    }
    table.notes += [
        f"{params.reps} interleaved repetitions x {params.batches_per_block} batches x {params.batch} steps per "
        f"path, call pattern and placement (one {params.seq_tokens}-token sequence per step, page 16, 2 layers); a "
        "fresh UnifiedRadixCache per block; placements, patterns and paths in rotating order. A block spans many "
        "ticks of the telemetry's host thread, so it builds records among the steps, as in serving; at this step "
        "rate (steps back to back, no forward pass to wait for) it builds fewer than the steps hand it, and the "
        "flush after the block builds the rest (its CPU is in the host columns): 'entries left for the flush' = "
        "the host thread's queued entries at the block's end (a transfer's ack, a request's capacity lookup, a "
        "batch's split: three per step), per transfer.",
        f"One scheduler step per merged transfer: insert, flush_pending_backups() (submission: start_writing, one "
        f"ack), the consuming check with that single ack queued, a check with nothing completed (what every step "
        f"without a completed ack pays), then one request admitted by a real PrefillAdder.add_one_req, hitting the "
        f"sequence on the device (admission: otel_hicache's prefill wrappers run there; prometheus_client's row adds "
        f"increment_effective_prefill_tokens from SGLang's PrefillStats, what --enable-metrics adds per prefill "
        f"batch for these series; the naive OTel row reports no prefill). {EXPLICIT}: "
        f"writing_check(finish_count=1) then writing_check(finish_count=0), as check_hicache_events calls it. "
        f"{DEFAULT}: writing_check() twice: it "
        "counts the ready acks, builds the count tensor and all-reduces it (a single rank has no TP/PP group: no "
        "collective runs, the tensor and .item() remain), then consumes them.",
        "Each part = time.thread_time_ns() around it on the scheduler thread, per transfer (per step for the empty "
        "check and the admission: one of each per transfer here), median over batches, minus the uninstrumented "
        "path's median. 'submission + consumption' = submission + consumption + empty check (the transfer's own "
        "hooks); 'whole' = that + admission; each 'x prometheus_client' = ours / prometheus_client's same sum for "
        f"the same placement and pattern (goal for otel_hicache: <= {WHOLE_GOAL:g}); 'x prometheus_client, "
        "consumption' = the writing_check part alone, the earlier table's measure. Each goal is also judged per "
        "repetition (one repetition runs every path's block once, interleaved: a paired comparison; each block's "
        "parts are the medians of its batches): the notes give the range over the repetitions, and say 'not "
        "resolved on this machine' where they disagree with each other or prometheus_client's own added cost read "
        "zero or less in one of them. The submission and admission "
        "parts are mostly SGLang's own work (the CPU index copy of the shim, the tree's locks): what slows that work "
        "down (another process on the sibling CPU, the host thread) shows there, so they are the noisiest.",
        "host-process CPU/transfer added = time.process_time_ns() of the whole host process (every thread) over a "
        "block, including the setup.force_flush() that exports its spans less a second, empty flush, per transfer, "
        "median over blocks, minus the uninstrumented path's (the block also inserts, copies and admits, ~200 us "
        "per step, so this column is noisy). Of which otel_hicache's host thread = that thread's own CPU "
        "(/proc/self/task/TID/schedstat) over the same block and flush, per transfer: not a difference of two "
        "paths, so the steadiest figure of what the host thread builds (records, capacity lookups, prefill splits). "
        "Host-thread rounds/transfer: how many rounds that thread ran over the block and flush (each round timed "
        "from the holder's side, benchmarks._rounds.RoundTimer), per transfer; 'between rounds' = its CPU outside "
        "them: waking from each pause or tick and waiting for the GIL after it (the kernel's part, and the loop's "
        f"few lines). The floor of one wake on this machine, same run: a thread sleeping {PAUSE_S * 1e3:g} ms in a "
        f"loop, the process otherwise idle, is charged {wake_floor / 1e3:.1f} us of CPU per sleep. The round timing "
        "reads two clocks per round, inside the host thread's figure. "
        + (
            "With --time-builds, each record the host thread builds timed on it (a batched queue's build: its batch; "
            "thread CPU, two clock reads more per build, in its figure too; every placement and pattern), median for "
            "a round's first build / for the later ones (their counts): "
            + "; ".join(
                f"{name} {median(first) / 1e3:.1f} / {median(later) / 1e3:.1f} us ({len(first):,} / {len(later):,})"
                for name, (first, later) in sorted(builds.items())
            )
            + ". "
            if builds
            else ""
        )
        + "export process / receiver CPU = their own threads' CPU "
        "(/proc/PID/task/*/schedstat) over "
        "the same block and flush, per transfer: otel_hicache builds and exports spans and metrics in its export "
        "process (a separate process: not in the host's column); the OTLP receiver stands in for the collector."
        + ("" if placement.export_pid is not None else " The export process was not found: its column reads 0."),
        "Placement: 'unpinned' lets the OS place every process on the machine's CPUs; 'pinned' puts every thread of "
        "the host process on the first CPU and every thread of the export process and of the receiver on the second "
        "(os.sched_setaffinity per thread, what taskset does), so they no longer compete with the scheduler thread "
        "for its CPU.",
        "SGLang on CPU: timing_enabled=False (torch.cpu.Event cannot time), so no duration histogram on any path.",
        f"Control: the uninstrumented path beside a thread that keeps the schedule our host thread keeps while "
        f"records wait (holding the GIL {SLICE_NS / 1e3:g} us, spinning, then sleeping {PAUSE_S * 1e3:g} ms) and "
        "does nothing else (benchmarks._rounds.ScheduleControl); its rounds/transfer column counts that thread's "
        "slices. What it adds is what the schedule's wakes and GIL hand-overs cost on this machine, whoever does the "
        "work in the slices; its notes divide it by the control's rounds (its host CPU less the slices it spun) and "
        "multiply it by our host thread's rounds among the steps (not the flush's: those run back to back while "
        "nothing else runs). The goals are judged on ours as it is, never less the control.",
        "Floor: each of our hooks writes its raw record into an anonymous shared mapping itself (the ack as it is "
        "consumed, noted as it is appended; the prefill batch's split; each admitted request's page hashes, every "
        "page sampled) and nothing of ours runs on another thread (benchmarks._sglang_floor): the least a design "
        "that keeps these hooks and builds, counts and exports in another process could cost. A measuring device, "
        "not the product: no record is read back, and it leaves out the wrapper's own price (PrefillStats.from_adder "
        "is called directly) and what a GPU adds (an ack's copy time read from its events).",
        "Floor with the token ids to the export process: the floor's raw records but the page hashes, and each "
        "admitted request handed to the product's capacity estimator as the instrumentor hands it "
        "(CapacityHooks.admissions: over OTLP its token ids copied into the id ring in the channel's shared memory; "
        "the export process keys them and runs the model). What the floor costs with the product's own hand-over of "
        "the capacity lookups.",
    ]
    return table
