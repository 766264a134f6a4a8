"""Fixtures of the core tests: a collector that never answers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.core.support import black_hole_server


@pytest.fixture
def black_hole() -> Iterator[str]:
    """The endpoint of a collector that accepts connections and never answers."""
    yield from black_hole_server()
