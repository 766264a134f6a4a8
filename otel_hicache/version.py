"""The package version: the single source (the build reads it, the instruments report it)."""

__version__ = "0.1.0"
