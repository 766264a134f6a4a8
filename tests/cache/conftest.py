"""Fixtures of the reference-cache tests: the in-memory SDK with the cache's pools pre-seeded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from otel_hicache.testing.sdk import Sdk, make_sdk
from tests.cache.support import POOLS


@pytest.fixture
def csdk() -> Iterator[Sdk]:
    """In-memory span exporter and metric reader, with the cache's pools pre-seeded."""
    made = make_sdk(pools=[p.name for p in POOLS])
    yield made
    made.shutdown()
