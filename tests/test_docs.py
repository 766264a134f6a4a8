"""The user manual stays true: the README and docs/ name what the code names, and their examples run.

Docstring examples run as doctests of every module (``--doctest-modules`` in pyproject.toml).
"""

from __future__ import annotations

import ast
import enum
import inspect
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

import otel_hicache
from otel_hicache import semconv as sc
from otel_hicache.integrations.sglang.semconv import SGLANG_SERIES
from otel_hicache.integrations.vllm.semconv import VLLM_SERIES
from otel_hicache.sdk import TelemetrySetup
from otel_hicache.telemetry import HiCacheTelemetry

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PACKAGE = ROOT / "src" / "otel_hicache"


def section(path: Path, title: str) -> str:
    """The text of the ``## title`` section of ``path`` (the whole file when it is the file's own title)."""
    text = path.read_text()
    if text.startswith(f"# {title}\n"):
        return text
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_vocabulary_table_lists_every_instrument_with_its_unit_and_attributes() -> None:
    rows = {}
    for line in (DOCS / "vocabulary.md").read_text().splitlines():
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


def test_the_vocabulary_maps_every_sglang_series() -> None:
    text = section(DOCS / "vocabulary.md", "Porting SGLang dashboards")
    for sglang, ours in SGLANG_SERIES:
        assert f"`{sglang}`" in text and f"`{ours}`" in text, sglang


def test_python_examples_of_the_readme_and_docs_run() -> None:
    pages = [README, *sorted(DOCS.glob("*.md"))]
    blocks = [(page, block) for page in pages for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]
    assert {page.name for page, _ in blocks} >= {"README.md", "api.md"}
    for page, block in blocks:
        namespace: dict[str, object] = {}
        exec(compile(block, str(page), "exec"), namespace)
        setup = namespace.get("setup")
        if isinstance(setup, TelemetrySetup):
            setup.shutdown()


def test_adding_an_engine_names_files_that_exist() -> None:
    text = section(DOCS / "adding-an-engine.md", "Add an engine")
    paths = [p for p in re.findall(r"`([\w./<>]+\.(?:py|toml))`", text) if "<" not in p]
    assert "src/otel_hicache/integrations/_base.py" in paths and "tests/integrations/test_base.py" in paths
    for path in paths:
        assert (ROOT / path).is_file(), path


def test_the_vllm_table_is_vllm_series() -> None:
    rows = re.findall(r"^\| `(.+)` \| `(.+)` \|$", section(DOCS / "vllm.md", "Instrument vLLM"), re.M)
    assert rows == list(VLLM_SERIES)


def test_every_link_between_the_readme_and_docs_resolves() -> None:
    for page in [README, *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}"


def test_every_page_of_docs_is_linked_from_the_readme() -> None:
    linked = set(re.findall(r"\]\(docs/([a-z-]+\.md)\)", README.read_text()))
    assert linked == {page.name for page in DOCS.glob("*.md")}


def test_help_of_the_package_is_a_short_manual_of_the_api() -> None:
    """``help(otel_hicache)``: under 200 lines, naming every public name, no class printed in full."""
    command = [sys.executable, "-c", "import otel_hicache; help(otel_hicache)"]
    shown = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    assert 20 < len(shown.splitlines()) < 200
    assert "inherited from builtins.str" not in shown
    words = set(re.findall(r"[A-Za-z_]+", shown))
    assert set(otel_hicache.__all__) - {"__version__"} <= words
    assert {name for name in vars(HiCacheTelemetry) if name.startswith("record_")} <= words

    def spelled(name: str, call: Any) -> str:  # how the API list writes a call: its parameters and defaults
        parts: list[str] = []
        for p in inspect.signature(call).parameters.values():
            if p.kind is p.KEYWORD_ONLY and "*" not in parts:
                parts.append("*")
            if p.default is p.empty:
                parts.append(p.name)
            elif isinstance(p.default, enum.Enum):
                parts.append(f"{p.name}={type(p.default).__name__}.{p.default.name}")
            else:
                parts.append(f"{p.name}={p.default!r}")
        return f"{name}({', '.join(parts)})"

    text = " ".join(str(otel_hicache.__doc__).split())
    for name in ("configure", *otel_hicache._RECORDS):
        assert spelled(name, getattr(otel_hicache, name)) in text, name
    for cls in (sc.TransferOperation, sc.Tier, sc.DropReason, sc.PrefillMode, sc.TimingSource):
        assert f"{cls.__name__}: {', '.join(m.value for m in cls)} " in text, cls


def _engine_places() -> list[str]:
    """The places docs/adding-an-engine.md lists for a new engine, in order."""
    text = section(DOCS / "adding-an-engine.md", "Every place an engine touches")
    return re.findall(r"^- `([^`]+)`:", text, flags=re.MULTILINE)


def _checks(engine: str, markers: list[str]) -> dict[str, Callable[[], bool]]:
    """For each place of the list, whether ``engine`` is there (``markers``: pytest's registered markers)."""
    from importlib.metadata import distribution

    from otel_hicache import integrations
    from otel_hicache import package as package_module

    registry = yaml.safe_load((ROOT / "registry" / "hicache" / "registry.yaml").read_text())
    (engines,) = [a for g in registry["groups"] for a in g.get("attributes", []) if a.get("id") == sc.RESOURCE_ENGINE]
    dist = distribution("otel-hicache")  # pyproject.toml as installed
    package = f"otel_hicache.integrations.{engine}"
    instrumentors = [ep.value for ep in dist.entry_points if ep.group == "opentelemetry_instrumentor"]
    plugins = [ep.value for ep in dist.entry_points if ep.group != "opentelemetry_instrumentor"]
    instrument = next((t for t in _titles() if t.lower() == f"instrument {engine}"), None)
    return {
        "src/otel_hicache/integrations/<engine>/": lambda: (PACKAGE / "integrations" / engine).is_dir(),
        "src/otel_hicache/semconv.py": lambda: engine in {e.value for e in sc.Engine},
        "registry/hicache/registry.yaml": lambda: engine in {m["value"] for m in engines["type"]["members"]},
        "src/otel_hicache/package.py": lambda: (
            hasattr(package_module, f"_instruments_{engine}") and f"instruments-{engine}" in package_module.EXTRAS
        ),
        "pyproject.toml": lambda: (
            f"instruments-{engine}" in (dist.metadata.get_all("Provides-Extra") or [])
            and any(v.startswith(f"{package}:") for v in instrumentors)
            and any(v.startswith(f"{package}.plugin:") for v in plugins)
            and any(m.startswith(f"{engine}:") for m in markers)
        ),
        "src/otel_hicache/integrations/__init__.py": lambda: f":mod:`{package}`" in str(integrations.__doc__),
        "docs/<engine>.md": lambda: (
            (DOCS / f"{engine}.md").is_file()
            and instrument is not None
            and f"](docs/{engine}.md)" in section(README, instrument)
        ),
        "tests/<engine>/": lambda: (
            (ROOT / "tests" / engine).is_dir()
            and (ROOT / "scripts" / f"setup-{engine}-venv.sh").is_file()
            and f"tests/{engine}" in (ROOT / "scripts" / "test.sh").read_text()
        ),
        "tests/integrations/test_<engine>_names.py": lambda: (
            ROOT / "tests" / "integrations" / f"test_{engine}_names.py"
        ).is_file(),
    }


def _titles() -> list[str]:
    return re.findall(r"^## (.+)$", README.read_text(), flags=re.MULTILINE)


def test_every_engine_is_in_every_place_adding_an_engine_lists(pytestconfig: pytest.Config) -> None:
    """The list and the checks are one-to-one, and every engine adapter of the package passes every check."""
    engines = sorted(p.name for p in (PACKAGE / "integrations").iterdir() if (p / "__init__.py").is_file())
    assert engines == ["sglang", "vllm"]
    for engine in engines:
        checks = _checks(engine, pytestconfig.getini("markers"))
        assert _engine_places() == list(checks)
        for place, check in checks.items():
            assert check(), f"{engine} is missing from {place}"


def _benchmarks_help() -> dict[str, str]:
    """``python -m benchmarks --help``'s list: each benchmark's name and its one line."""
    command = [sys.executable, "-m", "benchmarks", "--help"]
    shown = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    listed = shown.split("\nbenchmarks:\n", 1)[1].split("\n\n", 1)[0]
    return dict(re.findall(r"^  (\w+) +(\S.*)$", listed, flags=re.MULTILINE))


#: The benchmarks whose module is not named as they are.
BENCHMARK_MODULES = {"sglang": "sglang_path", "vllm": "vllm_serving"}


def test_the_benchmarks_help_lists_every_benchmark_with_one_line() -> None:
    listed = _benchmarks_help()
    assert listed.pop("all") == "every one of them"
    assert len(listed) >= 9
    for name in listed:
        assert (ROOT / "benchmarks" / f"{BENCHMARK_MODULES.get(name, name)}.py").is_file(), name


def test_every_benchmarks_module_that_is_no_benchmark_is_a_measuring_device_its_users_import() -> None:
    """A module of benchmarks/ a user does not run says whose measuring device it is, and each of them imports it."""
    names = [name for name in _benchmarks_help() if name != "all"]
    runs = {BENCHMARK_MODULES.get(name, name) for name in names} | {"__init__", "__main__", "engine_capacity"}
    devices = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in runs)
    assert {p.stem for p in devices} >= {"_collector", "_common", "ackpath"}
    for path in devices:
        doc = " ".join(str(ast.get_docstring(ast.parse(path.read_text()))).split())
        match = re.search(r"A measuring device of [^.]+, used by ([^.]+)\.", doc)
        assert match, f"benchmarks/{path.name} does not say whose measuring device it is"
        users = names if match.group(1) == "every benchmark" else re.split(r", | and ", match.group(1))
        assert set(users) <= set(names), path.name
        for user in users:
            source = (ROOT / "benchmarks" / f"{BENCHMARK_MODULES.get(user, user)}.py").read_text()
            imports = (f"from benchmarks.{path.stem} import", f"from benchmarks import {path.stem}\n")
            assert any(i in source for i in imports), f"{user} does not use benchmarks/{path.name}"


#: The columns of an engine's overhead table (RESULTS.md's current tables add where each row was measured).
OVERHEAD_COLUMNS = ["what is measured", "ours", "the engine's own metrics", "goal", "met", "command"]


def _rows(text: str, columns: list[str]) -> list[list[str]]:
    """The rows of the one markdown table in ``text``, each a list of its cells, under the header ``columns``."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header, *rows = [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in lines]
    assert header == columns, header
    assert all(len(row) == len(columns) for row in rows), rows
    return rows


def _overhead(path: Path = README, title: str = "Overhead") -> dict[str, list[list[str]]]:
    """The ``### engine`` tables of the ``## title`` section of ``path``, by engine."""
    blocks = section(path, title).split("\n### ")[1:]
    return {block.split("\n", 1)[0]: _rows(block, OVERHEAD_COLUMNS) for block in blocks}


def _results_current() -> dict[str, list[list[str]]]:
    """RESULTS.md's ``## Current: engine`` tables, by engine."""
    path = ROOT / "benchmarks" / "RESULTS.md"
    engines = re.findall(r"^## Current: (.+)$", path.read_text(), flags=re.MULTILINE)
    return {e: _rows(section(path, f"Current: {e}"), [*OVERHEAD_COLUMNS, "measured"]) for e in engines}


def test_the_readmes_overhead_quotes_the_current_results_row_for_row() -> None:
    """One table per engine in each; the README's rows are RESULTS' current rows, less where each was measured."""
    readme = _overhead()
    results = _results_current()
    assert set(readme) == set(results) == {"SGLang", "vLLM"}
    for engine, rows in readme.items():
        assert [row[:6] for row in results[engine]] == rows, f"README's {engine} overhead differs from RESULTS.md's"
        assert all(row[6] for row in results[engine]), f"a RESULTS.md {engine} row says not where it was measured"
    assert _overhead(DOCS / "overhead.md", "The current figures") == readme, "docs/overhead.md's figures differ"


def test_every_current_figure_is_one_that_results_reports_below_its_current_tables() -> None:
    """A figure of the current tables (ours, the engine's own) is one of a table or a dated entry of RESULTS.md."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    below = text.split("\n## The latest table of each benchmark\n", 1)[1]
    for engine, rows in _results_current().items():
        for row in rows:
            for figure in re.findall(r"\d[\d,]*\.?\d*", f"{row[1]} {row[2]}"):
                assert re.search(rf"(?<![\d.,]){re.escape(figure)}(?![\d,]|\.\d)", below), f"{engine}: {figure}"


def test_every_overhead_row_names_a_benchmark_that_exists() -> None:
    names = set(_benchmarks_help()) - {"all"}
    for engine, rows in _overhead().items():
        for row in rows:
            match = re.fullmatch(r"`(?:\.venv[\w-]*/bin/)?python -m benchmarks(?: (\w+)|\.(\w+) \w+)`", row[5])
            assert match, f"{engine}: {row[5]}"
            name, module = match.groups()
            assert name in names if name else (ROOT / "benchmarks" / f"{module}.py").is_file(), row[5]


def test_the_readme_is_a_short_manual_with_no_history() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\bsession|\b(?:earlier|later) (?:code|run|machine)", text, flags=re.I)
