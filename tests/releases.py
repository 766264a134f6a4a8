"""An engine release simulated by its version string: a distribution record (``<name>-<version>.dist-info``, what
``importlib.metadata`` reads) put ahead of the installed one on the path. The ``installed_as`` fixture of
``tests/conftest.py`` puts one on this process's path; a child process is given the directory on its ``PYTHONPATH``."""

from __future__ import annotations

from pathlib import Path


def record_release(directory: Path, name: str, version: str) -> None:
    """``name`` installed at ``version`` as ``importlib.metadata`` reads it: a distribution record in ``directory``."""
    record = directory / f"{name.replace('-', '_')}-{version}.dist-info"
    record.mkdir()
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
