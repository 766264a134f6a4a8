"""OpenTelemetry for vLLM's KV offloading (``vllm >= 0.32``, CUDA or CPU build), with no change to vLLM's code.

Zero-code, two ways. vLLM loads the ``vllm.general_plugins`` entry point ``vllm_kv_offload`` in every one of its
processes (:mod:`.plugin`); each process that offloads configures telemetry from the ``OTEL_*`` environment at its
first transfer (``OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4317`` and vLLM's usual
``--kv-transfer-config '{"kv_connector": "OffloadingConnector", ...}'`` are all it takes). Or, as every
OpenTelemetry instrumentor, through the ``opentelemetry_instrumentor`` entry point (``opentelemetry-instrument vllm
serve ...``) or in code::

    from otel_hicache.integrations.vllm import VLLMOffloadInstrumentor
    VLLMOffloadInstrumentor().instrument()            # or (tracer_provider=..., meter_provider=...)

What is reported, all through :class:`~otel_hicache.telemetry.HiCacheTelemetry`:

============================================  ========================================================================
vLLM (wrapped)                                becomes
============================================  ========================================================================
``OffloadingConnectorWorker.prepare_store_    the job's direction and GPU blocks; submission time (stores: when the
kv`` / ``handle_preemptions`` /               next step submits them)
``start_kv_transfers``
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
                                              bytes and no duration (timing source ``none``)
``OffloadingConnectorWorker.build_connector_  the self-check: what vLLM's worker counted (bytes, timed transfers,
worker_meta``                                 seconds per direction), handed over each step, beside what we recorded;
                                              an instrument that drifts from it counts ``otel_hicache.engine.mismatch``
                                              (one warning)
``OffloadingConnectorStats.increase_counter`` ``hicache.transfer.failures{operation=backup, error.type=host_pool_full}``
(``vllm:kv_offload_allocation_failure``)      per failed CPU-tier allocation
``CPUOffloadingSpec.get_manager``             ``hicache.pool.usage`` / ``.limit`` of tier ``host`` from the start:
                                              chunks holding KV (cached or in flight) and capacity, x tokens per chunk
``CPUOffloadingManager.prepare_store`` with   ``hicache.eviction.tokens`` / ``.duration`` of tier ``host``: chunks the
``_free_chunk``; ``prepare_load``             call evicted x tokens per chunk, host-clock timed; per chunk
                                              ``hicache.eviction.reused`` (a load read it), ``hicache.eviction.age``
                                              (idle since it was written or read) and, unread,
                                              ``hicache.wasted.size{operation=backup}`` (:mod:`.cpu_tier`)
``OffloadingConnectorScheduler.update_state_  per admitted request, once: ``hicache.prefill.tokens{mode}`` from vLLM's
after_alloc``                                 ``PrefillStats`` and the connector's hits by source (``input``,
                                              ``device_hit``, ``host_hit``, ``storage_hit``, ``other``); a request that
                                              loads KV starts waiting
``Scheduler._update_waiting_for_remote_kv``   ``hicache.request.kv_wait{tier=host}``: the time the request spent in
                                              ``WAITING_FOR_REMOTE_KVS``, vLLM's state for a request whose KV the
                                              connector loads (its exemplar: the request's trace)
``KVCacheManager.record_prefix_cache_stats``  ``hicache.capacity.hit_ratio{tier, factor}`` (engine core): each request
                                              admitted after a prefix-cache lookup, its block hashes handed to the
                                              capacity estimator (:mod:`.capacity`: what the model assumes)
``Scheduler.add_request``,                    with vLLM's tracing on (``--otlp-traces-endpoint``): vLLM's request
``OffloadingConnectorScheduler.build_         span ``llm_request`` gets ``hicache.prefix.tokens.<mode>`` and
connector_meta``, ``OutputProcessor.          ``hicache.kv_wait.host``, and each transfer span links to the request
do_tracing``, ``instrument_manual``           span it served, across the frontend, engine-core and worker processes
                                              (:mod:`.per_request`)
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
