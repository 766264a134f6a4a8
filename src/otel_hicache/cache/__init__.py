"""A reference tiered KV cache in torch: L1 device / L2 host / L3 file pools, reporting through the telemetry core.

Faithful to SGLang HiCache's semantics, small enough to run anywhere (CPU or CUDA), and a model for other engines:
every merged transfer becomes one :class:`~otel_hicache.records.TransferRecord` handed to
:class:`~otel_hicache.telemetry.HiCacheTelemetry`; this package never touches an OTel instrument.

Run the demo workload (CPU, a temporary L3 directory)::

    >>> from otel_hicache import configure
    >>> from otel_hicache.cache import run_demo
    >>> setup = configure()
    >>> result = run_demo(setup.telemetry, requests=40, device="cpu")
    >>> result.requests
    40
    >>> setup.shutdown()

Modules, one job each: :mod:`.pools` (device / host buffers and page allocators per pool kind),
:mod:`.controller` (merged D<->H transfers, streams, timing events, FIFO acks), :mod:`.radix` (the tree),
:mod:`.hicache` (policies: write-through / selective / write-back, eviction, drops, load back, prefix split),
:mod:`.storage` (L3 files in per-model namespaces, checked on every read; background backup / prefetch),
:mod:`.content` (page names and the stand-in model's KV), :mod:`.workload` (seeded chat workload), :mod:`.demo`
(:func:`run_demo`).
"""

from otel_hicache.cache.demo import DemoResult, run_demo
from otel_hicache.cache.hicache import Admission, CacheConfig, HiCache
from otel_hicache.cache.pools import PoolSpec

__all__ = ["Admission", "CacheConfig", "DemoResult", "HiCache", "PoolSpec", "run_demo"]
