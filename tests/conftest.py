"""Shared fixtures: the in-memory SDK of :mod:`otel_hicache.testing.sdk`, an engine release simulated by its version
string (:func:`installed_as`), and CUDA-only tests skipped without CUDA."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from otel_hicache.testing.sdk import Sdk, make_sdk
from tests.releases import record_release


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


@pytest.fixture
def installed_as(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], str]:
    """``installed_as(name, version)``: the distribution ``name`` reads as ``version`` from now on (a record put ahead
    of the installed one on the path; the code stays what is installed); returns ``"name version"``."""

    def installed(name: str, version: str) -> str:
        directory = tmp_path / "releases"
        directory.mkdir(exist_ok=True)
        record_release(directory, name, version)
        monkeypatch.setattr(sys, "path", [str(directory), *sys.path])
        assert importlib.metadata.version(name) == version
        return f"{name} {version}"

    return installed
