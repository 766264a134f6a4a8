"""The user manual stays true: the README's vocabulary is the code's and its examples run.

Docstring examples run as doctests of every module (``--doctest-modules`` in pyproject.toml).
"""

from __future__ import annotations

import re
from pathlib import Path

from otel_hicache import semconv as sc
from otel_hicache.integrations.sglang.semconv import SGLANG_SERIES
from otel_hicache.integrations.vllm.semconv import VLLM_SERIES
from otel_hicache.sdk import TelemetrySetup

README = Path(__file__).parents[1] / "README.md"


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
    for sglang, ours in SGLANG_SERIES:
        assert f"`{sglang}`" in text and f"`{ours}`" in text, sglang


def test_readme_python_examples_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    for block in blocks:
        namespace: dict[str, object] = {}
        exec(compile(block, str(README), "exec"), namespace)
        setup = namespace.get("setup")
        if isinstance(setup, TelemetrySetup):
            setup.shutdown()


def test_readme_add_an_engine_names_files_that_exist() -> None:
    section = README.read_text().split("## Add an engine", 1)[1].split("\n## ", 1)[0]
    paths = [p for p in re.findall(r"`([\w./<>]+\.(?:py|toml))`", section) if "<" not in p]
    assert "otel_hicache/integrations/_base.py" in paths and "tests/integrations/test_base.py" in paths
    for path in paths:
        assert (README.parent / path).is_file(), path


def test_readme_vllm_table_is_vllm_series() -> None:
    section = README.read_text().split("## Instrument vLLM", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(.+)` \| `(.+)` \|$", section, re.M)
    assert rows == list(VLLM_SERIES)
