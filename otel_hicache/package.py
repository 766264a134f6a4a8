"""What each engine integration instruments, as requirement strings (the ``instruments`` extra lists the same).

An engine adapter's ``instrumentation_dependencies()`` returns its entry here, so ``opentelemetry-instrument`` loads it
only where that engine is installed at a supported version.
"""

#: SGLang releases whose HiCache shape (UnifiedRadixCache, HiCacheAck with per-pool tokens and bytes) the wrappers fit.
_instruments_sglang = ("sglang >= 0.5.23",)

_instruments = (*_instruments_sglang,)
