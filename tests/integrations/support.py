"""What the adapter suites share (tests/integrations, tests/sglang, tests/vllm)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from otel_hicache.integrations import _base


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Each test is a process family of its own for the adapters' one-warning rule: what an earlier test warned
    about (in this process, or as a marker its process group left) is not held against it. Returns the marker
    directory."""
    directory = tmp_path_factory.mktemp("warned")
    directory.chmod(0o700)
    monkeypatch.setattr(_base.ONCE, "seen", set())
    monkeypatch.setattr(_base.ONCE, "directory", directory)
    yield directory
