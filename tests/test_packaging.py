"""The distribution says what the code says: one version, the instrumented engines, the licence, the type marker."""

from __future__ import annotations

from importlib.metadata import metadata, requires
from pathlib import Path

import otel_hicache
from otel_hicache import package, version

ROOT = Path(__file__).parents[1]


def test_the_version_is_written_once_and_the_build_reads_it() -> None:
    assert otel_hicache.__version__ == version.__version__ == metadata("otel-hicache")["Version"]


def test_the_instruments_extra_lists_what_the_integrations_instrument() -> None:
    extra = {r.split(";")[0].replace(" ", "") for r in requires("otel-hicache") or () if 'extra == "instruments"' in r}
    assert extra == {r.replace(" ", "") for r in package._instruments}


def test_the_declared_licence_is_the_shipped_licence_text() -> None:
    assert metadata("otel-hicache")["License-Expression"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]


def test_the_package_ships_its_type_marker() -> None:
    assert (Path(otel_hicache.__file__).parent / "py.typed").is_file()
