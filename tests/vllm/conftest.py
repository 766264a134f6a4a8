"""Fixtures for running vLLM 0.32's real KV offloading connector on a CPU (run in .venv-vllm, marker ``vllm``).

The connector-level engine builder lives in :mod:`tests.vllm.support`, the real engine's pieces (tiny model, server,
what the processes exported) in :mod:`tests.vllm.engine`; the SDK is :func:`otel_hicache.testing.sdk.make_sdk`, with
the production Views. Each test is a process family of its own for the one-warning rule (``fresh_warnings``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from otel_hicache.testing.sdk import Sdk
from tests.integrations.support import fresh_warnings
from tests.pipeline.conftest import prometheus  # noqa: F401  (the session's real Prometheus, for the e2e test)

__all__ = ["fresh_warnings"]

# vLLM (and libraries it imports) report usage over the network unless told not to.
for _name, _value in (("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1"), ("LMCACHE_TRACK_USAGE", "false")):
    os.environ.setdefault(_name, _value)


if importlib.util.find_spec("vllm") is None:  # the project's .venv: these modules import vLLM at the top
    collect_ignore_glob = ["*.py"]


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
    """The tiny random Llama and its tokenizer (:func:`tests.vllm.engine.build_model`), built once per session."""
    from tests.vllm.engine import build_model

    return build_model(tmp_path_factory.mktemp("tiny-llama"))
