"""The layout's rules, read from the source with `ast`: arrows point down, pure packages stay pure.

Every import counts: module level, inside functions, and behind `if TYPE_CHECKING:` (a type-only
import still ties two modules together). A package here is a folder under kvfs/; a top-level module
(kvfs/cli.py) is a unit of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "kvfs"

# Packages that hold logic only: no event loop, no sockets, no FUSE. Their code is driven by the
# shells around them and tested with plain values.
PURE_PACKAGES = {"cluster", "policy", "wire"}
# Pure modules inside packages that also hold shells (kvfs.store: the trio store around its books).
PURE_MODULES = {"kvfs.store.residency"}
FORBIDDEN_IN_PURE = {"trio", "socket", "pyfuse3"}

# The packages from the top down, as docs/architecture.md draws them: each imports only
# packages of later layers (and the top-level modules, which are units of their own).
LAYERS = ["daemons", "metrics", "fuse", "node", "net", "store", "disk", "cluster", "security", "wire", "policy"]



def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported_names(path: Path, name: str) -> set[str]:
    """Every absolute dotted name `path` imports, wherever the import statement sits."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            # `from kvfs.wire import messages` imports the module kvfs.wire.messages.
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def module_graph() -> dict[str, set[str]]:
    modules = all_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_names(path, name):
            # The longest prefix that is a kvfs module is what the statement loads.
            parts = imported.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and ".".join(parts) != name:
                targets.add(".".join(parts))
        graph[name] = targets
    return graph


def unit(module: str) -> str:
    """The package a module belongs to: kvfs.net.rpc -> net, kvfs.cli -> cli."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for source, targets in graph.items():
        packages.setdefault(unit(source), set()).update(unit(t) for t in targets if unit(t) != unit(source))
    return packages


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def describe(found: set[frozenset[str]]) -> list[str]:
    return sorted(" <-> ".join(sorted(c)) for c in found)


def test_no_module_imports_another_that_imports_it_back() -> None:
    found = cycles(module_graph())
    assert describe(found) == [], "import cycles between modules"


def test_no_package_imports_another_that_imports_it_back() -> None:
    found = cycles(package_graph(module_graph()))
    assert describe(found) == [], "import cycles between packages"


def test_packages_import_only_the_layers_below_them() -> None:
    packages = package_graph(module_graph())
    assert set(LAYERS) == {name for name in packages if (ROOT / name).is_dir()}, "a package missing from LAYERS"
    upward = sorted(f"kvfs/{source} imports kvfs/{target}" for source in LAYERS for target in packages[source]
                    if target in LAYERS and LAYERS.index(target) <= LAYERS.index(source))
    assert upward == [], "imports against the layers of docs/architecture.md"


def test_pure_packages_import_no_event_loop_socket_or_fuse() -> None:
    offences = []
    for name, path in all_modules().items():
        if unit(name) not in PURE_PACKAGES and name not in PURE_MODULES:
            continue
        for imported in imported_names(path, name):
            if imported.split(".")[0] in FORBIDDEN_IN_PURE:
                offences.append(f"{path.relative_to(ROOT.parent)} imports {imported}")
    assert sorted(offences) == []


def test_the_pure_packages_exist() -> None:
    # A renamed package must not turn the purity check into a check of nothing.
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert PURE_PACKAGES <= packages
    assert PURE_MODULES <= set(all_modules())


def test_the_walk_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from kvfs.node.service import Node\n"
                      "def f():\n    import trio\n    from . import sibling\n")
    names = imported_names(source, "kvfs.pkg.sample")
    assert {"kvfs.node.service", "trio", "kvfs.pkg", "kvfs.pkg.sibling"} <= names
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset({"a", "b", "c"})}
