"""The package's import graph: no cycle anywhere, the pipeline's mechanism behind its facades, and its folders by
process importing only what their process may.

Every ``import`` of every module of ``otel_hicache`` counts, wherever it stands: at module level, in a function (a
lazy import), under ``TYPE_CHECKING``. ``from package import name`` is an edge to the submodule when ``name`` is one,
else to the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import otel_hicache

PACKAGE = Path(otel_hicache.__file__).parent
INTERNAL = "otel_hicache._internal"
#: The public modules that may import the internal subpackage: they are the API over it.
FACADES = {"otel_hicache.telemetry", "otel_hicache.sdk"}
#: Each folder of the internal subpackage, by where it runs, and the folders it may import besides itself: the shared
#: formats nothing of either process; what both build the formats; the export process nothing of the host side; the
#: host side all of them (it launches and tends the export process through its handle).
MAY_IMPORT = {
    "shared": set(),
    "emit": {"shared"},
    "export": {"shared", "emit"},
    "host": {"shared", "emit", "export"},
}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    known = modules()

    def owner(name: str) -> str:  # the module a dotted name lives in
        while name not in known:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
            else:
                continue
            edges[name] |= {owner(t) for t in targets if t == "otel_hicache" or t.startswith("otel_hicache.")}
        edges[name].discard(name)
    return edges


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_package_has_no_import_cycle() -> None:
    edges = graph()
    assert len(edges) > 40 and edges["otel_hicache.sdk"]  # the whole package was read
    assert cycle(edges) is None, " -> ".join(cycle(edges) or [])


def test_only_the_facades_import_the_internal_subpackage() -> None:
    importers = {
        module
        for module, imported in graph().items()
        if not module.startswith(INTERNAL) and any(target.startswith(INTERNAL) for target in imported)
    }
    assert importers == FACADES


def test_each_internal_folder_imports_only_what_its_process_may() -> None:
    edges = graph()
    folders = {name.split(".")[2] for name in edges if name.startswith(f"{INTERNAL}.")}
    assert folders == set(MAY_IMPORT)  # every module of the internal subpackage lives in one of the folders
    for module, imported in edges.items():
        if not module.startswith(f"{INTERNAL}."):
            continue
        folder = module.split(".")[2]
        reached = {target.split(".")[2] for target in imported if target.startswith(f"{INTERNAL}.")}
        assert reached <= MAY_IMPORT[folder] | {folder}, f"{module} imports {sorted(reached - MAY_IMPORT[folder])}"
    assert f"{INTERNAL}.export.handle" in edges[f"{INTERNAL}.host.fork"]  # the one module owning every at-fork hook


def test_every_at_fork_hook_is_registered_in_one_module() -> None:
    registering = {name for name, path in modules().items() if "register_at_fork" in path.read_text()}
    assert registering == {f"{INTERNAL}.host.fork"}


def test_the_graph_sees_every_kind_of_import() -> None:
    """The reader of the graph is itself checked: it finds a cycle, and the imports that hide best."""
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    imports = graph()
    assert "otel_hicache.sdk" in imports["otel_hicache"]  # lazily, in __getattr__ (and under TYPE_CHECKING)
    assert "otel_hicache.cache.demo" in imports["otel_hicache.cli"]  # in a function
    assert "otel_hicache.version" in imports["otel_hicache"]  # a name from a module


def test_the_package_exports_what_users_call() -> None:
    for name in otel_hicache.__all__:
        assert getattr(otel_hicache, name) is not None, name
    assert {"configure", "HiCacheTelemetry", "TelemetrySetup", "TransferRecord", "ConfigError"} <= set(
        otel_hicache.__all__
    )
