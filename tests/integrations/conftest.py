"""Fixtures of the adapter tests (:mod:`tests.integrations.support`)."""

from tests.integrations.support import fresh_warnings

__all__ = ["fresh_warnings"]
