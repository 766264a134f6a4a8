"""Shared fixtures: the in-memory SDK of :mod:`otel_hicache.testing.sdk`, and CUDA-only tests skipped without CUDA."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from otel_hicache.testing.sdk import Sdk, make_sdk


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def otel(sdk: Sdk) -> Sdk:
    """The in-memory SDK under the name the engine suites (tests/sglang, tests/vllm) give it."""
    return sdk


@pytest.fixture
def sdk() -> Iterator[Sdk]:
    made = make_sdk()
    yield made
    made.shutdown()
