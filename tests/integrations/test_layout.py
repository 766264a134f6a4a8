"""Every engine adapter has the layout ``integrations._base`` names and docs/adding-an-engine.md lists, and its
modules import in one direction only (no cycle): ``semconv <- (engine-only modules) <- hooks <- instrumentor <-
plugin``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from otel_hicache.integrations._base import ADAPTER_LAYOUT

ROOT = Path(__file__).parents[2]
INTEGRATIONS = ROOT / "src" / "otel_hicache" / "integrations"
ADAPTERS = sorted(p for p in INTEGRATIONS.iterdir() if (p / "__init__.py").is_file())
#: Each layout module's layer; a module may import only modules of lower layers (engine-only modules: 1).
LAYERS = {"semconv.py": 0, "hooks.py": 2, "instrumentor.py": 3, "plugin.py": 4, "__init__.py": 5}


def readme_layout() -> list[str]:
    text = (ROOT / "docs" / "adding-an-engine.md").read_text()
    return re.findall(r"^- `<engine>/([a-z_]+\.py)`:", text, flags=re.MULTILINE)


def test_the_docs_list_the_layout_of_the_base() -> None:
    assert sorted(readme_layout()) == sorted(ADAPTER_LAYOUT) == sorted(LAYERS)


@pytest.mark.parametrize("adapter", ADAPTERS, ids=[p.name for p in ADAPTERS])
def test_each_adapter_has_the_layout_and_imports_downwards_only(adapter: Path) -> None:
    modules = {p.name for p in adapter.glob("*.py")}
    assert set(ADAPTER_LAYOUT) <= modules
    package = f"otel_hicache.integrations.{adapter.name}"
    for module in sorted(modules):
        layer = LAYERS.get(module, 1)
        for imported in _imports(adapter / module, package):
            assert LAYERS.get(f"{imported}.py", 1) < layer, f"{adapter.name}/{module} imports {imported}"


def _imports(path: Path, package: str) -> set[str]:
    """The sibling modules ``path`` imports (absolute or relative), at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            name = node.module if node.level == 0 else f"{package}.{node.module}"
            if name.startswith(f"{package}."):
                found.add(name.removeprefix(f"{package}.").split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {
                a.name.removeprefix(f"{package}.").split(".")[0] for a in node.names if a.name.startswith(package)
            }
    return found
