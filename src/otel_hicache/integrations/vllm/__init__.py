"""OpenTelemetry for vLLM's KV offloading (tested: ``vllm >= 0.32, < 0.35``, CUDA or CPU build; later releases by
shape), with no change to vLLM's code.

Zero-code, two ways. vLLM loads the ``vllm.general_plugins`` entry point ``vllm_kv_offload`` in every one of its
processes (:mod:`.plugin`); each process that offloads configures telemetry from the ``OTEL_*`` environment when the
engine builds its offloading (``OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4317`` and vLLM's usual
``--kv-transfer-config '{"kv_connector": "OffloadingConnector", ...}'`` are all it takes). Or, as every
OpenTelemetry instrumentor, through the ``opentelemetry_instrumentor`` entry point (``opentelemetry-instrument vllm
serve ...``) or in code::

    from otel_hicache.integrations.vllm import VLLMOffloadInstrumentor
    VLLMOffloadInstrumentor().instrument()            # or (tracer_provider=..., meter_provider=...)

What is reported, all through :class:`~otel_hicache.telemetry.HiCacheTelemetry`:

============================================  ========================================================================
vLLM (wrapped)                                becomes
============================================  ========================================================================
``OffloadingConnectorWorker.register_kv_      nothing reported: the worker's telemetry is built, and its export process
caches`` (the engine's start)                 up (at most 10 s), before the engine serves (``CPUOffloadingSpec.
                                              get_manager`` does the same in the scheduler)
``OffloadingConnectorWorker.handle_         the job's direction and GPU blocks, noted at the step's first call; its
preemptions`` / ``start_kv_transfers``        submission time (stores: when the next step submits them). A step whose
                                              later calls have nothing to note skips our wrappers of them
``OffloadingConnectorWorker.get_finished``    one ``hicache.backup`` (``GPU_to_CPU``) / ``hicache.load_back``
with ``DirectionalTransferStats.record`` and  (``CPU_to_GPU``) span and transfer record per finished ``TransferResult``:
``OffloadingWorkerMetadata.mark_completed``   its bytes and time exactly as vLLM counts them; tokens = the token
                                              positions it covers, per pool by KV cache group kind (``kv`` full
                                              attention, ``swa`` sliding window, ...: each group's GPU blocks x its
                                              tokens per block, the largest group of a kind); the blocks of every
                                              group as ``hicache.transfer.nodes``; timing source ``cuda_event`` for
                                              vLLM's ``CPUOffloadingWorker`` (device events), ``host_clock`` for
                                              another worker. A result without size and time (third-party workers),
                                              which vLLM does not count: a transfer of its tokens and blocks with no
                                              byte count (unknown) and no duration (timing source ``none``)
``DirectionalTransferStats.record``,          the self-check: what vLLM's worker counts (bytes, timed transfers,
``OffloadingWorkerMetadata.aggregate``        seconds per direction; every ``record``, also in a step that skips our
                                              ``get_finished``), beside what we recorded; an instrument that drifts
                                              from it counts ``otel_hicache.engine.mismatch`` (one warning); the wait
                                              of each sync load (vLLM >= 0.33: the time ``start_kv_transfers`` waited
                                              for it) rides to the scheduler on the worker metadata vLLM hands over
``OffloadingConnectorStats.increase_counter`` ``hicache.transfer.failures{operation=backup, error.type=host_pool_full}``
(``vllm:kv_offload_allocation_failure``)      per failed CPU-tier allocation
``CPUOffloadingSpec.get_manager``             ``hicache.pool.usage`` / ``.limit`` of tier ``host`` from the start:
                                              chunks holding KV (cached or in flight) x tokens per chunk, and the
                                              capacity vLLM states (``config_info()``, vLLM >= 0.33; else the
                                              manager's chunks), checked against the manager's chunks (self-check)
``CPUOffloadingManager.prepare_store`` with   ``hicache.eviction.tokens`` / ``.duration`` of tier ``host``: chunks the
``_free_chunk``; ``prepare_load``             call evicted x tokens per chunk, host-clock timed; per chunk
                                              ``hicache.eviction.reused`` (a load read it), ``hicache.eviction.age``
                                              (idle since it was written or read) and, unread,
                                              ``hicache.wasted.size{operation=backup}`` (:mod:`.cpu_tier`)
``TieringOffloadingSpec.get_manager``         vLLM's tiering: its CPU primary tier is the CPU tier above; behind it,
                                              tier ``storage`` (its ``fs`` tier, ``obj``, ``p2p``, out-of-tree ones)
``TieringMetricsTracker.on_job_finished``     one ``hicache.storage_backup`` (cascade: CPU tier -> secondary tier) /
                                              ``hicache.storage_prefetch`` (promotion) span and record per finished
                                              job: its chunks' tokens, the bytes and seconds vLLM counts
                                              (``vllm:kv_offload_tiering_write_bytes`` / ``_time``, ``read_...``); a
                                              failed job ``hicache.transfer.failures{error.type=storage_write_failed
                                              | storage_read_failed}`` as ``..._job_failures`` counts it; a promotion
                                              that failed part way also its loaded chunks (:mod:`.storage_tier`)
``OffloadingConnectorScheduler.get_num_new_  per admitted request, once: ``hicache.prefill.tokens{mode}`` from vLLM's
matched_tokens``, ``update_state_after_      ``PrefillStats`` and the connector's hits by source (``input``,
alloc``                                       ``device_hit``, ``host_hit``, ``storage_hit``, ``other``); a request that
                                              loads KV asynchronously waits from its admission (a deferred load's
                                              deferral included)
``Scheduler._update_waiting_for_remote_kv``,  ``hicache.request.kv_wait{tier=host}``: the time the request spent in
``Scheduler.update_from_output``              ``WAITING_FOR_REMOTE_KVS``, vLLM's state for a request whose KV the
                                              connector loads; for a sync load
                                              (vLLM >= 0.33), the time the workers waited for it inside the step
``KVCacheManager.record_prefix_cache_stats``  ``hicache.capacity.hit_ratio{tier, factor}`` (engine core): each request
                                              admitted after a prefix-cache lookup, its block hashes handed to the
                                              capacity estimator (over OTLP in the export process; :mod:`.capacity`:
                                              what the model assumes)
``Scheduler.add_request``,                    with vLLM's tracing on (``--otlp-traces-endpoint``): vLLM's request
``OffloadingConnectorScheduler.build_         span ``llm_request`` gets ``hicache.prefix.tokens.<mode>`` and
connector_meta``, ``OutputProcessor.          ``hicache.kv_wait.host``, and each transfer span links to the request
do_tracing``, ``instrument_manual``           span it served, across the frontend, engine-core and worker processes
                                              (:mod:`.per_request`); with it off, the connector's steps skip our
                                              ``build_connector_meta`` wrapper
============================================  ========================================================================

Process topology: transfers finish in the worker processes (one per GPU); the scheduler (engine core) only sees
their sums a step later, so the records are taken on the worker side, per rank, with ``hicache.rank.tp`` /
``.pp`` / ``.dp`` on the Resource. Token flows are logical (every rank of a TP x PP group moves the same tokens), so
only worker rank 0 reports the instruments counted in tokens (``token_metrics=False`` on the others); bytes, time and
spans are per rank, and their sum over ranks is vLLM's own (vLLM adds up its workers' stats). Allocation failures,
the CPU tier's occupancy and evictions, the prefill split and the KV waits are scheduler-side; the request span's
attributes are set in the frontend, which creates it. Every process sets the Resource attribute
``hicache.engine=vllm``.

Not reported: vLLM's lookup delays (``vllm:kv_offload_lookup_*_delay_seconds``: a scheduler latency, no transfer).
Patching and failure rules are those of every adapter (:mod:`otel_hicache.integrations._base`).
"""

from otel_hicache.integrations.vllm.instrumentor import VLLMOffloadInstrumentor

__all__ = ["VLLMOffloadInstrumentor"]
