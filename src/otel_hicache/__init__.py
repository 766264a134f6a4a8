"""otel_hicache: OpenTelemetry traces and metrics for the tiered KV cache of LLM servers.

SGLang's HiCache and engines like it keep KV cache in tiers: GPU memory (L1, ``device``), host DRAM (L2,
``host``) and storage (L3). otel_hicache turns every merged transfer between them into one OTel span and into
counters and histograms (backup / load-back / dropped tokens and bytes per pool, per-tier prefix hits, copy
durations measured on the device), exported over OTLP.

Data flow: producer -> record -> :class:`HiCacheTelemetry` -> OTel SDK -> exporter.

Report from your own engine (runs as is; with no ``OTEL_EXPORTER_OTLP_ENDPOINT`` the data stays in-process)::

    >>> from otel_hicache import configure, TransferRecord, TransferOperation, now_ns
    >>> setup = configure()                      # OTLP if OTEL_EXPORTER_OTLP_ENDPOINT is set, else embedded
    >>> t0 = now_ns()
    >>> setup.telemetry.record_transfer(TransferRecord(
    ...     operation=TransferOperation.BACKUP, tokens_by_pool={"kv": 256}, num_bytes=256 * 4096,
    ...     submit_time_ns=t0, complete_time_ns=t0 + 2_000_000, copy_duration_s=0.0015,
    ...     timing_source="host_clock", merged_ops=3, node_count=3))
    >>> setup.telemetry.snapshot()["hicache.transfer.tokens"][("backup", "kv")]
    256
    >>> setup.shutdown()

Time a copy the way SGLang does, on the device where CUDA is present, without synchronising::

    >>> from otel_hicache import make_timing_event_pair, elapsed_seconds
    >>> start, finish, source = make_timing_event_pair("cpu")
    >>> start.record(); finish.record()          # around the copy loop, on the transfer stream
    >>> elapsed_seconds(start, finish) >= 0.0
    True

API, each name importable from ``otel_hicache`` (``help(otel_hicache.<name>)`` shows one in full)::

    configure(*, service_name=None, endpoint=None, protocol=None, prometheus_port=None, prometheus_host='127.0.0.1',
              ranks=None, resource_attributes=None, pools=('kv',), extra_pools=(), cardinality_limit=2000,
              token_metrics=True, set_global=False, env=None) -> TelemetrySetup
        The telemetry and its exporters, from the arguments, then the standard OTEL_* variables of env (OTLP when an
        endpoint is set, else in-process). A bad value raises ConfigError naming it, before anything starts.
    TelemetrySetup: .telemetry (the HiCacheTelemetry), .mode, .force_flush(timeout_s=5.0), .shutdown(timeout_s=2.0)
    HiCacheTelemetry: its record_* methods never raise into the caller and never block it
        .record_transfer(record)                 a TransferRecord: counters, histograms and one span
        .record_failure(failure)                 a TransferFailure: a transfer not issued or not completed
        .record_drop(drop)                       a DropRecord: device KV destroyed without a host copy
        .record_eviction(eviction)               an EvictionRecord, with an EvictedEntry per entry (reuse, age)
        .record_kv_wait(wait, request_span=None) a KvWait: how long a prefill waited for its KV from a tier
        .record_prefix_split(split, request_span=None, *, other_hit=0)
                                                 a PrefixSplit: where a prefill's tokens came from
        .record_prefix_splits(rows)              many at once: (input, device, host, storage, other hit) rows
        .add_pool_usage_source(source)           a callable returning PoolUsage values, read about once a second
        .record_transfer_at(site, ...), .record_transfer_deferred(build, payload),
        .deferred_queue(build, *, batched=False, patient=False)
                                                 the tightest hot paths (docs/api.md)
        .capacity_feed(page_tokens, tiers, keys=None)
                                                 each admitted request's prefix lookup, for each tier's hit ratio at
                                                 other sizes (otel_hicache.capacity: TierCapacity, page_keys)
        .snapshot()                              the exact counter totals; .flush(timeout_s=5.0); .shutdown(...)
    TransferRecord(operation, tokens_by_pool, num_bytes, submit_time_ns, complete_time_ns, copy_duration_s=None,
                   timing_source=TimingSource.NONE, merged_ops=1, node_count=0, bytes_by_pool=None,
                   write_policy=None, io_backend=None, links=())
    TransferFailure(operation, error_type, tokens_by_pool, time_ns)
    DropRecord(reason, tokens_by_pool, time_ns)
    EvictionRecord(tier, num_tokens, duration_s, time_ns, entries=())
    EvictedEntry(tokens, idle_s=None, reused=None, unread_bytes=0, written_by=None)
    KvWait(tier, wait_s, time_ns)
    PrefixSplit(input_tokens, device_hit, host_hit, storage_hit)
    PoolUsage(tier, pool, used, limit)
    make_timing_event_pair(device=None) -> (start, finish, TimingSource); elapsed_seconds(start, finish); now_ns()
    TransferOperation: backup, load_back, storage_backup, storage_prefetch
    Tier: device, host, storage
    DropReason: host_pressure, write_through_unbacked_eviction, other
    PrefillMode: input, device_hit, host_hit, storage_hit, other
    TimingSource: cuda_event, host_clock, none
    ConfigError: a ValueError naming the bad argument or variable

SGLang and vLLM need no code change: installing the package registers a plugin each engine loads itself (SGLang's
``sglang.srt.plugins``, vLLM's ``vllm.general_plugins``); set the standard ``OTEL_*`` variables (see
:mod:`otel_hicache.integrations.sglang` and :mod:`otel_hicache.integrations.vllm`).

Modules: :mod:`~otel_hicache.semconv` (every engine-neutral name), :mod:`~otel_hicache.timing`,
:mod:`~otel_hicache.records`, :mod:`~otel_hicache.telemetry`, :mod:`~otel_hicache.sdk`, :mod:`~otel_hicache.capacity`
(each tier's hit ratio at other sizes);
:mod:`~otel_hicache.integrations` (engine adapters), :mod:`~otel_hicache.cache` (a reference tiered cache),
:mod:`~otel_hicache.testing` (helpers of the tests and benchmarks in a clone; not in the wheel). The pipeline's
mechanism lives in :mod:`otel_hicache._internal`, behind :mod:`~otel_hicache.telemetry` and :mod:`~otel_hicache.sdk`.
The core needs the OTel packages and wrapt only; ``otel-hicache demo`` and the reference cache need the ``demo`` extra.
"""

from typing import TYPE_CHECKING, Any

from otel_hicache.config import ConfigError
from otel_hicache.semconv import DropReason, PrefillMode, Tier, TimingSource, TransferOperation
from otel_hicache.timing import elapsed_seconds, make_timing_event_pair, now_ns
from otel_hicache.version import __version__

if TYPE_CHECKING:
    from otel_hicache.records import (
        DropRecord,
        EvictedEntry,
        EvictionRecord,
        KvWait,
        PoolUsage,
        PrefixSplit,
        TransferFailure,
        TransferRecord,
    )
    from otel_hicache.sdk import TelemetrySetup, configure
    from otel_hicache.telemetry import HiCacheTelemetry

#: Names whose modules import the OTel API, imported on first use: the API reads ``OTEL_PYTHON_CONTEXT`` on import and
#: logs a traceback for a bad value, and ``import otel_hicache`` (the CLI's first step) must get to check it first.
_RECORDS = (
    "DropRecord",
    "EvictedEntry",
    "EvictionRecord",
    "KvWait",
    "PoolUsage",
    "PrefixSplit",
    "TransferFailure",
    "TransferRecord",
)


def __getattr__(name: str) -> Any:
    if name in _RECORDS:
        from otel_hicache import records

        return getattr(records, name)
    if name == "HiCacheTelemetry":
        from otel_hicache.telemetry import HiCacheTelemetry

        return HiCacheTelemetry
    # Importing the OTel SDK reads OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT and raises a bare ValueError on a bad value.
    # Checked first, so `import otel_hicache` never fails on the environment and a bad value is a ConfigError.
    if name in ("configure", "TelemetrySetup"):
        from otel_hicache.config import check_sdk_import

        check_sdk_import()
        from otel_hicache import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'otel_hicache' has no attribute {name!r}")


#: The functions ``dir()`` lists, and so ``help()`` documents after the docstring's API list (which names every class:
#: pydoc would print each class in full, each enum with ~450 lines of inherited ``str`` methods).
_FUNCTIONS = ("configure", "elapsed_seconds", "make_timing_event_pair", "now_ns")


def __dir__() -> list[str]:
    return sorted({"__doc__", "__file__", "__name__", "__path__", "__version__", *_FUNCTIONS})


__all__ = [
    "ConfigError",
    "DropReason",
    "DropRecord",
    "EvictedEntry",
    "EvictionRecord",
    "HiCacheTelemetry",
    "KvWait",
    "PoolUsage",
    "PrefillMode",
    "PrefixSplit",
    "TelemetrySetup",
    "Tier",
    "TimingSource",
    "TransferFailure",
    "TransferOperation",
    "TransferRecord",
    "__version__",
    "configure",
    "elapsed_seconds",
    "make_timing_event_pair",
    "now_ns",
]
