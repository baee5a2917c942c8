"""The layering holds: every import of every module (eager, in-function, under TYPE_CHECKING, relative), with
the `swarm.*` folder mapping resolved as Python resolves it, goes to the importer's own package or to a
package in a lower layer of `swarm.layers.LAYERS`, so no package-level import cycle exists."""

from __future__ import annotations

import ast
import importlib.util
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from swarm.layers import LAYERS, layer_of


@dataclass(frozen=True)
class Import:
    """One internal import: the importing module's file and line, the imported module, whether in a function."""

    path: Path
    line: int
    source: str
    target: str
    in_function: bool

    @property
    def where(self) -> str:
        root = _package_folder("swarm").parent
        path = self.path.relative_to(root) if self.path.is_relative_to(root) else self.path
        return f"{path}:{self.line}"


def _package_folder(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, f"{name} does not import"
    return Path(spec.origin).parent


def module_files() -> dict[str, Path]:
    """Every module of the `swarm` namespace by dotted name: swarm/ walked whole, and the folders mapped into
    it (compression/, kernels/, peers/, proto/) found where the import system finds them."""
    root = _package_folder("swarm")
    roots = {"swarm": root}
    for names in LAYERS:
        for name in names:
            spec = importlib.util.find_spec(f"swarm.{name}")
            assert spec is not None, f"swarm.{name} (in swarm.layers.LAYERS) does not exist"
            folder = spec.submodule_search_locations and Path(spec.submodule_search_locations[0])
            if folder and folder.parent != root:
                roots[f"swarm.{name}"] = folder
    files: dict[str, Path] = {}
    for prefix, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join([prefix, *parts])] = path
    return files


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    # `from swarm.x import y` imports module swarm.x.y where there is one, else a name of swarm.x
    return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]


def _walk(node: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under `node`, and whether it sits inside a function."""
    for child in ast.iter_child_nodes(node):
        inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, inside
        yield from _walk(child, inside)


def internal_imports(files: dict[str, Path]) -> list[Import]:
    """Each (statement, imported swarm module) once."""
    known = set(files)
    found = []
    for module, path in files.items():
        for node, inside in _walk(ast.parse(path.read_text(), str(path))):
            targets = _imported(node, module, path.name == "__init__.py", known)
            for target in dict.fromkeys(t for t in targets if t.startswith("swarm.")):
                found.append(Import(path, node.lineno, module, target, inside))
    return found


def package_of(module: str) -> str | None:
    """`options` of swarm.options, `daemon` of swarm.daemon.peer; None of the namespace root `swarm`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def package_cycles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        a, b = package_of(imp.source), package_of(imp.target)
        if a and b and a != b:
            graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return internal_imports(module_files())


def test_every_package_has_one_layer():
    names = [name for layer in LAYERS for name in layer]
    assert len(names) == len(set(names)), "a package is in two layers"
    packages = {package_of(module) for module in module_files()} - {None}
    missing, gone = sorted(packages - set(names)), sorted(set(names) - packages)
    assert not missing and not gone, f"in no layer of swarm.layers.LAYERS: {missing}; listed but gone: {gone}"


def test_no_import_goes_upward_or_sideways(imports):
    offending = []
    for imp in imports:
        source, target = package_of(imp.source), package_of(imp.target)
        if source is None or target is None or source == target:
            continue
        if layer_of(target) >= layer_of(source):
            offending.append(f"{imp.where}: {imp.source} imports {imp.target} ({source} -> {target})")
    assert not offending, "imports against swarm.layers.LAYERS:\n" + "\n".join(offending)


def test_no_package_level_cycle(imports):
    cycles = package_cycles(imports)
    lines = []
    for component in cycles:
        lines.append(" <-> ".join(component))
        between: dict[tuple[str, str], list[Import]] = defaultdict(list)
        for imp in imports:
            a, b = package_of(imp.source), package_of(imp.target)
            if a in component and b in component and a != b:
                between[a, b].append(imp)
        for (a, b), found in sorted(between.items()):
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            lines.append(f"  {a} -> {b}: {found[0].where}: {found[0].source} imports {found[0].target}{more}")
    assert not cycles, "package-level import cycles:\n" + "\n".join(lines)


def test_the_checker_sees_in_function_and_relative_imports(tmp_path):
    """What the checks rest on: an import inside a function and a `from . import x` both count."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from swarm.cli import main\n")
    (pkg / "high.py").write_text("from . import low\nfrom .low import f\n")
    files = {"swarm.pkg": pkg / "__init__.py", "swarm.pkg.low": pkg / "low.py", "swarm.pkg.high": pkg / "high.py"}
    found = {(i.source, i.target, i.line, i.in_function) for i in internal_imports(files)}
    assert ("swarm.pkg.low", "swarm.cli", 2, True) in found
    assert ("swarm.pkg.high", "swarm.pkg.low", 1, False) in found
    assert ("swarm.pkg.high", "swarm.pkg.low", 2, False) in found
    edges = [Import(Path("a.py"), 1, "swarm.a.x", "swarm.b", False)]
    edges.append(Import(Path("b.py"), 2, "swarm.b", "swarm.a", True))
    assert package_cycles(edges) == [["a", "b"]]


if __name__ == "__main__":  # the in-function share: python tests/unit/test_layers.py
    found = internal_imports(module_files())
    inside = sum(i.in_function for i in found)
    print(f"{len(found)} internal imports, {inside} in functions ({100 * inside / len(found):.1f}%)")
