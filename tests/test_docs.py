"""The user manual stays true: package docstring examples run, and the README's vocabulary is the code's."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import otel_hicache
from otel_hicache import semconv as sc
from otel_hicache.testing import otlp_receiver

README = Path(__file__).parents[1] / "README.md"


def test_package_docstring_examples_run() -> None:
    for module in (otel_hicache, otlp_receiver):
        result = doctest.testmod(module, raise_on_error=False)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_readme_vocabulary_table_lists_every_instrument_with_its_unit_and_attributes() -> None:
    rows = {}
    for line in README.read_text().splitlines():
        match = re.match(r"^\| `([a-z_.]+)` \| ([a-z_ ]+), `([^`]+)` \| (.*) \|$", line)
        if match:
            rows[match.group(1)] = (
                match.group(2).strip(),
                match.group(3),
                set(re.findall(r"`([a-z_.]+)`", match.group(4))),
            )
    for spec in sc.INSTRUMENTS:
        assert spec.name in rows, f"README vocabulary lacks {spec.name}"
        kind, unit, attributes = rows[spec.name]
        assert (kind, unit, attributes) == (spec.kind.replace("_", " "), spec.unit, set(spec.attributes)), spec.name
    assert set(rows) == {spec.name for spec in sc.INSTRUMENTS}


def test_readme_maps_every_sglang_series() -> None:
    text = README.read_text()
    for sglang, ours in sc.SGLANG_SERIES:
        assert f"`{sglang}`" in text and f"`{ours}`" in text, sglang


def test_readme_python_examples_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    for block in blocks:
        namespace: dict[str, object] = {}
        exec(compile(block, str(README), "exec"), namespace)
        setup = namespace.get("setup")
        if setup is not None:
            setup.shutdown()  # type: ignore[attr-defined]
