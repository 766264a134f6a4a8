"""The distribution says what the code says: one version, the instrumented engines, the licence, the type marker."""

from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import distribution, metadata, requires
from pathlib import Path

import otel_hicache
from otel_hicache import package, version

ROOT = Path(__file__).parents[1]


def test_the_version_is_written_once_and_the_build_reads_it() -> None:
    assert otel_hicache.__version__ == version.__version__ == metadata("otel-hicache")["Version"]


def test_each_engine_extra_lists_what_its_integration_instruments() -> None:
    from packaging.requirements import Requirement

    def parsed(requirements: Iterable[str]) -> set[tuple[str, str]]:
        return {(r.name, str(r.specifier)) for r in map(Requirement, requirements)}

    for name, entry in package.EXTRAS.items():
        extra = [r.split(";")[0] for r in requires("otel-hicache") or () if f'extra == "{name}"' in r]
        assert parsed(extra) == parsed(entry)


def test_opentelemetry_instrument_applies_no_package_wide_requirement_to_our_instrumentors() -> None:
    """It checks a distribution's ``instruments`` / ``instruments-any`` extras against each of its instrumentors:
    an SGLang requirement there would keep the vLLM instrumentor from loading (and the reverse)."""
    from opentelemetry.instrumentation.dependencies import get_dist_dependency_conflicts

    assert get_dist_dependency_conflicts(distribution("otel-hicache")) is None


def test_each_supported_engine_range_has_an_upper_bound() -> None:
    from packaging.requirements import Requirement

    for requirement in (*package._instruments_sglang, *package._instruments_vllm):
        assert any(spec.operator in ("<", "<=", "==", "~=") for spec in Requirement(requirement).specifier)


def test_the_declared_licence_is_the_shipped_licence_text() -> None:
    assert metadata("otel-hicache")["License-Expression"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]


def test_the_package_ships_its_type_marker() -> None:
    assert (Path(otel_hicache.__file__).parent / "py.typed").is_file()
