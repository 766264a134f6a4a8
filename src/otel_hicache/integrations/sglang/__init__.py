"""OpenTelemetry for SGLang HiCache (``sglang >= 0.5.23``), with no change to SGLang's code.

Zero-code, two routes (see the README, "Instrument SGLang"): the general plugin :func:`.plugin.load`, registered in
SGLang's ``sglang.srt.plugins`` entry-point group, which ``load_plugins()`` runs first thing in every scheduler
process::

    OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4317 python -m sglang.launch_server --enable-hierarchical-cache ...

or the same instrumentor through the ``opentelemetry_instrumentor`` group (``opentelemetry-instrument python -m
sglang.launch_server ...``). Either way each process builds its telemetry on its first HiCache event, from the
``OTEL_*`` environment, with the ranks SGLang published for it on the Resource and the instruments counted in tokens
reported by one rank per attention-TP x attention-CP x PP group only (:mod:`.instrumentor`); a process without
HiCache builds and exports nothing.
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=sglang_hicache`` turns both routes off. In code, with your providers::

    from otel_hicache.integrations.sglang import SGLangHiCacheInstrumentor
    SGLangHiCacheInstrumentor().instrument(tracer_provider=..., meter_provider=...)  # or telemetry=...

What is reported, all through :class:`~otel_hicache.telemetry.HiCacheTelemetry`:

========================================  =============================================================================
SGLang method (wrapped)                   becomes
========================================  =============================================================================
``HiCacheController.start_writing`` /     the first one on a controller makes its ``ack_write_queue`` /
``start_loading``                         ``ack_load_queue`` an :class:`.ack_queues.AckQueue` (a list, same acks) that
                                          notes each ack's submission as SGLang appends it and reports acks as they
                                          leave; the controller's later submissions skip the wrapper
each ack leaving a queue (not a wrapped   one ``hicache.backup`` / ``hicache.load_back`` span and transfer record per
method: ``pop(0)`` in ``writing_check``,  consumed ``HiCacheAck``: tokens per pool, bytes (one total; SGLang does not
``loading_check`` and PD decode's         split bytes by pool), node count, copy time from the ack's own events when
``_check_offload_progress``; ``clear()``  ``timing_enabled`` (none otherwise, e.g. on CPU)
under write-back)
``UnifiedRadixCache._record_dropped_      ``hicache.dropped.tokens{reason, pool="kv"}``
tokens``
``UnifiedRadixCache._evict``              ``hicache.eviction.tokens`` / ``.duration`` (tier ``device``; passes that
                                          free nothing are not reported, as in SGLang), with one entry per radix node
``_evict_device_leaf``, ``_demote``       it evicted: ``hicache.eviction.reused`` (SGLang's ``hit_count`` above the
                                          insert that made the node; unknown under write-back, where SGLang counts no
                                          hits) and ``hicache.eviction.age`` (since its ``last_access_time``)
``UnifiedRadixCache.evict_host``,         the same for tier ``host`` (SGLang 0.5.23 has no host-eviction metric):
``UnifiedTreeCore._evict_host_leaf``      reused = loaded back since its backup; a host copy never read back is
                                          ``hicache.wasted.size{operation="backup"}`` (its tokens x the host pool's
                                          bytes per token)
``PrefillStats.from_adder`` (SGLang's     ``hicache.prefill.tokens{mode}``: input (retracted re-counts excluded) and
stats of each prefill batch, built        device / host / storage hits, once per batch from the adder's counters
metrics on or off)                        (SGLang's ``prefill_effective_tokens_total`` is built from the same);
                                          ``hicache.capacity.hit_ratio{tier, factor}``: each request the batch
                                          admitted (``adder.can_run_list``, a chunked request's next chunk left out)
                                          handed to the capacity estimator, its page keys hashed on the telemetry's
                                          host thread (:mod:`.capacity`: what the model assumes)
``HiCacheController._page_backup_or_log`` ``hicache.storage_backup`` (L2 -> L3, storage thread, host-clock timed)
``UnifiedRadixCache._handle_prefetch_     ``hicache.storage_prefetch`` (L3 -> L2, from the prefetch's issue to its
result``                                  result)
``UnifiedRadixCache.load_back`` (with     ``hicache.request.kv_wait{tier="host"}``: from the admission that starts a
``req``)                                  request's load back until that load back is seen complete (upper bound, at
                                          scheduler-step resolution); with request tracing, also on its span
``UnifiedRadixCache.check_prefetch_       ``hicache.request.kv_wait{tier="storage"}``: from the prefetch's start until
progress``                                SGLang's stop policy lets the request go, recorded with its prefill batch
``load_back``, ``checkpoint_into_tree`` / with SGLang's request tracing on: the request's scheduler span, which the
``advance_unpublished_req``               ``hicache.load_back`` / ``hicache.backup`` spans of the transfers they start
                                          link to; its prefill batch (``PrefillStats.from_adder``) puts the
                                          request's own prefix split on it (and the KV waits put
                                          ``hicache.kv_wait.<tier>``)
``UnifiedRadixCache.init_hicache``        ``hicache.pool.usage`` / ``.limit`` of the host KV pool, read at collection
``HiCacheController.reset``               forgets acks the reset discarded (also under suppression)
========================================  =============================================================================

Span times: start = submission (when SGLang queued the ack, right after handing the merged copy to its transfer
stream), end = when the ack left its queue (SGLang consumes only completed acks); both on the monotonic clock, anchored
to the wall clock once. The merged-op count is the ack's node ids (one per merged op). The
device-measured copy time is the ``hicache.transfer.copy_duration`` attribute and the ``hicache.transfer.duration``
histogram. No device synchronisation is added.

SGLang's own ``sglang:*`` series also flow over OTel through its ``stat_loggers`` hook (``scheduler``, ``storage``,
``radix_cache`` roles; see :mod:`.stat_loggers`); the HiCache series above are not exported twice.

Agreement with SGLang's own collectors, checked by ``tests/sglang`` on SGLang's real classes: backup and load-back
tokens per pool (``kv`` and, on an SWA hybrid cache, ``swa``) and bytes; dropped tokens per reason
(``write_through_unbacked_eviction`` only under exactly ``write_through``, ``host_pressure`` under ``write_back``);
evicted tokens; prefill tokens per mode for a real ``PrefillAdder`` admitting device, host and L3 hits (equal to
``sglang:prefill_effective_tokens_total``); L3 backup / prefetch tokens through the file backend (equal to
``sglang:backuped_tokens_total`` / ``sglang:prefetched_tokens_total``, bytes equal to what lands on disk). Known
differences: ``hicache.*`` values are counted even when SGLang runs without ``--enable-metrics``; a hybrid prefetch that
SGLang discards after it arrived is still a completed ``storage_prefetch`` transfer here; L3 bytes are the KV pool's
tokens times its bytes per token (0 where the host pool is a group that does not state a size).

Eviction bookkeeping lives on SGLang's own objects: a load back marks the radix nodes whose host copies it reads
(an attribute on the node), and the age of a node comes from its ``last_access_time``, a logical counter, through
samples of that counter's value and the time (at admissions, eviction passes and as consumed transfers are reported;
bounded, see :data:`.eviction.CLOCK_SAMPLES`): a lower bound, at scheduler-step resolution. A node split after a load
back read it leaves its new half unmarked. L3 backups are never counted as wasted: SGLang's file backend does not
evict. The per-node detail needs SGLang's Python TreeCore (the suite's); with its Rust TreeCore the nodes stay inside
Rust: the eviction series then count every token with ``hicache.eviction.reused`` unknown, no age and no waste.

Never undercounting silently, on a release that changed: a drop reason this adapter does not know is counted as
``other``, and hits under a prefill-adder counter it does not know (``log_*_hit_tokens``) as prefill mode ``other``,
every time; an ack that leaves its queue any way a list allows (``pop``, ``clear``, ``del q[:n]``, slice assignment,
``remove``, ``*=``) is reported, and a queue that is not a list is left alone with one warning. Where SGLang keeps its
radix-cache collector in the same process (``--enable-metrics``), a self-check (:class:`.self_check.CountersCheck`,
about once a second and at each flush) compares our backup and load-back tokens and bytes, evicted and dropped tokens
with it; a difference that outlasts :data:`.self_check.CHECK_LAG_S` counts one ``otel_hicache.engine.mismatch`` per
instrument, with one warning. (L3 and prefill series are not self-checked: see the known differences above; the
prefill collector belongs to the scheduler, which no wrapper sees.)

Cost on the scheduler thread: neither the submissions (after a controller's first) nor the completion checks run
through a wrapper; each submitted ack costs a clock read, a suppression check and a dictionary entry as SGLang
appends it, each consumed ack one entry put on its queue's :class:`~otel_hicache.telemetry.DeferredQueue`
(:meth:`~otel_hicache.telemetry.HiCacheTelemetry.deferred_queue`), and the record is built and counted on the
telemetry's host thread; a prefill batch's split is counted there too, once per batch from the counters SGLang's
``PrefillStats`` reads, and in the same wrapper (the one wrapper of a prefill batch; none runs per request) each
request the batch admitted costs one entry put on the capacity estimator's queue (with request tracing on, its split
put on its span).
``.venv-sglang/bin/python -m benchmarks sglang`` measures the whole per transfer (submission, consumption, admission)
against SGLang's own prometheus metrics, for both ways ``writing_check`` is called (see docs/overhead.md).

Patching and failure rules (shared by every engine adapter, :mod:`otel_hicache.integrations._base`): ``instrument()``
imports nothing of SGLang (nor torch); each SGLang module is patched when it is imported (at once if it already is). A
missing or unsupported SGLang gives one warning and no patching (the version check runs even under
``skip_dep_check``, which ``opentelemetry-instrument`` passes: the wrappers rely on the supported releases' shapes); a
module this SGLang lacks, and a method that is missing, is not a function or has other parameters than its wrapper
reads, skips only its signal (one warning naming it); a wrapper whose own code fails logs once, and SGLang's call
runs exactly once with its own result or exception; every warning comes once per process family (SGLang's launcher
and its scheduler processes), not once per process; inside
``opentelemetry.instrumentation.utils.suppress_instrumentation()`` every wrapper passes straight through, and an ack
submitted there is not reported when it is consumed.
``uninstrument()`` restores every patched attribute to the original object and disarms patches for modules not imported
yet; ``instrument()`` twice wraps nothing twice.

SGLang's pool names beyond the core's (``auxiliary_swa``, ``deepseek_v4_*``, ...) are in :mod:`.semconv`; the
instrumentor declares them to its :class:`~otel_hicache.telemetry.HiCacheTelemetry` (``extra_pools``).
:func:`.prefix.split_cached_prefix_by_tier` attributes a cached prefix to device / host / storage as SGLang 0.5.23 does,
for producers holding SGLang-style match lengths.
"""

from otel_hicache.integrations.sglang.instrumentor import SGLangHiCacheInstrumentor
from otel_hicache.integrations.sglang.prefix import prefix_split, split_cached_prefix_by_tier

__all__ = ["SGLangHiCacheInstrumentor", "prefix_split", "split_cached_prefix_by_tier"]
