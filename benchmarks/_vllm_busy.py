"""The busy CPU of vLLM's engine core and worker per step, read inside them (for ``benchmarks vllm``).

vLLM's processes spin on their shared-memory queues while they wait for each other, so their CPU (``/proc``) follows
the wall clock, and a shared machine's load moves it by tens of percent between rounds. What an engine's own work
costs is read here instead, as the CPU time of the thread that does it (``time.thread_time_ns``: another process
running meanwhile is not counted), summed over the steps:

* the engine core's scheduler: ``schedule``, ``update_from_output`` (one a step) and ``add_request`` - where the
  plugin's scheduler-side hooks and the CPU tier's run;
* of it, the scheduler side of the KV connector (``OffloadingConnector.get_num_new_matched_tokens``,
  ``update_state_after_alloc``, ``build_connector_meta``, ...);
* the worker's step: ``Worker.execute_model`` (one a step) and ``sample_tokens``, the model's forward included;
* of it, the worker side of the KV connector (``handle_preemptions``, ``start_load_kv``, ``get_finished``, ...) -
  where the plugin's transfer hooks run.

vLLM's CPU build spawns its processes, so the timers come in as a vLLM general plugin of their own
(:func:`register`, named :data:`PLUGIN`): :func:`plugin_path` writes its entry point where ``PYTHONPATH`` finds it,
and the engine's processes load it beside ours when ``VLLM_PLUGINS`` names both. Every timer wraps a method the
plugin under test does not wrap (the scheduler's own methods are wrapped on each scheduler object once it is built),
so it holds the plugin's wrappers, whichever plugin vLLM loads first. The counters are a file of int64s
(:data:`COUNTERS`, named by :data:`COUNTERS_ENV`) that each process maps shared; the engine's main process reads it.
A call made inside a timed call of the same counter is counted once, in the outer one. With our plugin loaded, the
file also says where the telemetry's host thread of the engine core and of the worker runs, so that the reader times
the work our plugin does off vLLM's steps too.

A measuring device of vLLM's engine core and worker busy CPU per step, used by vllm.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from time import thread_time_ns
from typing import Any

from benchmarks._common import host_thread_id, thread_cpu_ns

#: The vLLM plugin's name (for ``VLLM_PLUGINS``), and the environment variable naming the counters' file.
PLUGIN = "hicache_bench_busy"
COUNTERS_ENV = "HICACHE_BENCH_BUSY_FILE"
#: The counters, in this order in the file: nanoseconds of thread CPU, or calls; then where the telemetry's host thread
#: of the engine core and of the worker runs (process id, native thread id; 0 until seen), for the reader to time it.
COUNTERS = ("scheduler_ns", "steps", "core_connector_ns", "worker_ns", "worker_steps", "worker_connector_ns")
HOST_THREADS = ("core_host_pid", "core_host_tid", "worker_host_pid", "worker_host_tid")
_SLOT = {name: i for i, name in enumerate(COUNTERS + HOST_THREADS)}
_SCHEDULER = (("schedule", None), ("update_from_output", "steps"), ("add_request", None))
_CORE_CONNECTOR = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
)
_WORKER = (("execute_model", "worker_steps"), ("sample_tokens", None))
_WORKER_CONNECTOR = (
    "handle_preemptions",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
    "clear_connector_metadata",
)


def plugin_path(directory: Path) -> Path:
    """Write this plugin's entry point into ``directory`` (a distribution's metadata); put it on ``PYTHONPATH``."""
    info = directory / f"{PLUGIN}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN} = {__name__}:register\n")
    return directory


class BusyCounters:
    """The counters' file, mapped shared: :meth:`create` makes it (zeros), a process of the engine opens it."""

    def __init__(self, path: str) -> None:
        with open(path, "r+b") as f:
            self._memory = mmap.mmap(f.fileno(), 8 * len(_SLOT))
        self.values = memoryview(self._memory).cast("q")

    @staticmethod
    def create(path: Path) -> Path:
        path.write_bytes(bytes(8 * len(_SLOT)))
        return path

    def read(self) -> dict[str, int]:
        """The counters, and the CPU so far of each host thread seen (``core_host_ns``, ``worker_host_ns``)."""
        values = {name: self.values[_SLOT[name]] for name in COUNTERS}
        for side in ("core", "worker"):
            pid, tid = self.values[_SLOT[f"{side}_host_pid"]], self.values[_SLOT[f"{side}_host_tid"]]
            values[f"{side}_host_ns"] = thread_cpu_ns(pid, tid) if tid else 0
        return values


def register() -> None:
    """vLLM's plugin hook, in each of its processes: time its scheduler, worker and KV connector calls from now on,
    into the file :data:`COUNTERS_ENV` names (nothing without it)."""
    path = os.environ.get(COUNTERS_ENV)
    if not path:
        return
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_worker import Worker

    values = BusyCounters(path).values
    depth = threading.local()

    def time_calls(owner: Any, method: str, spent: str, calls: str | None = None) -> None:
        """Time ``owner.method`` (a method this vLLM lacks is left out)."""
        function = getattr(owner, method, None)
        if function is not None:
            count = None if calls is None else _SLOT[calls]
            setattr(owner, method, _timed(function, values, depth, _SLOT[spent], count))

    for method in _CORE_CONNECTOR:
        time_calls(OffloadingConnector, method, "core_connector_ns")
    for method in _WORKER_CONNECTOR:
        time_calls(OffloadingConnector, method, "worker_connector_ns")
    for method, calls in _WORKER:
        time_calls(Worker, method, "worker_ns", calls)
    ours = "vllm_kv_offload" in os.environ.get("VLLM_PLUGINS", "").split(",")  # a telemetry, so a host thread
    if ours:
        _note_host_thread(Worker, "execute_model", values, "worker")
    init = Scheduler.__init__

    def timed_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        for method, calls in _SCHEDULER:  # its methods as bound now: the plugin's wrappers of its class inside
            time_calls(self, method, "scheduler_ns", calls)
        if ours:
            _note_host_thread(self, "update_from_output", values, "core")

    Scheduler.__init__ = timed_init


def _note_host_thread(owner: Any, method: str, values: memoryview, side: str) -> None:
    """Once ``owner.method`` has run with the telemetry's host thread up (the plugin starts it while the engine
    starts), write where that thread runs into the counters, and call ``method`` as it was from then on."""
    function = getattr(owner, method, None)
    if function is None:
        return

    def noting(*args: Any, **kwargs: Any) -> Any:
        result = function(*args, **kwargs)
        tid = host_thread_id()
        if tid is not None and not values[_SLOT[f"{side}_host_tid"]]:
            values[_SLOT[f"{side}_host_pid"]], values[_SLOT[f"{side}_host_tid"]] = os.getpid(), tid
            setattr(owner, method, function)
        return result

    setattr(owner, method, noting)


def _timed(
    function: Callable[..., Any], values: memoryview, depth: threading.local, spent: int, calls: int | None
) -> Callable[..., Any]:
    """``function`` with its thread CPU added to ``values[spent]`` (and 1 to ``values[calls]``), unless a call of the
    same counter is already being timed on this thread."""
    group = f"d{spent}"

    def timed(*args: Any, **kwargs: Any) -> Any:
        if getattr(depth, group, 0):
            return function(*args, **kwargs)
        setattr(depth, group, 1)
        start = thread_time_ns()
        try:
            return function(*args, **kwargs)
        finally:
            values[spent] += thread_time_ns() - start
            if calls is not None:
                values[calls] += 1
            setattr(depth, group, 0)

    return timed
