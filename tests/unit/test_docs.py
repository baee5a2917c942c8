"""The docs stay a map and stay true: ARCHITECTURE.md within its size, every relative link in README.md and docs/
resolves, and every code name they quote in backticks (a file path, a `swarm.x.y` module and the name it is
followed by) exists (a moved section, a renamed page or a renamed module breaks a test, not a reader)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MAX_ARCHITECTURE_LINES = 250
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_CODE = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^(?:[\w.-]+/)+[\w.-]+\.(?:py|proto|md|sh|toml|json)$")
_BASENAME = re.compile(r"^(?!swarm\.)\w+\.(?:py|proto)$")
_MODULE = re.compile(r"^swarm(?:\.\w+)+")
_PLACEHOLDERS = ("NAME", "<", "*", "{", "...")
_TOP_FOLDERS = ("compression", "kernels", "peers", "proto", "scripts", "docs", "tests", "swarm", "docker")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return found


def test_architecture_is_a_map_not_a_log():
    lines = (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines()
    assert len(lines) <= MAX_ARCHITECTURE_LINES, f"docs/ARCHITECTURE.md has {len(lines)} lines"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here (no network)
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        missing_anchor = bool(anchor) and dest.suffix == ".md" and dest.exists() and anchor not in _anchors(dest)
        if not dest.exists() or missing_anchor:
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def _quoted(page: Path) -> list[str]:
    return [code.strip() for code in _CODE.findall(page.read_text()) if not any(p in code for p in _PLACEHOLDERS)]


def _path_exists(path: str, page: Path) -> bool:
    """A quoted path is read from the repository root, from `swarm/` (`runtime/host.py`), or beside the page."""
    return any(
        (base / path).exists()
        for base in (ROOT, ROOT / "swarm", page.parent)
        if path.split("/")[0] in _TOP_FOLDERS or base != ROOT or (ROOT / "swarm" / path.split("/")[0]).is_dir()
    )


def _basenames() -> set[str]:
    """Names of the repository's Python and proto files, for a page that quotes a bare `host.py`."""
    folders = ("swarm", "compression", "kernels", "peers", "proto", "scripts", "tests")
    return {p.name for folder in folders for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".proto")}


def _defined_names(node: ast.AST) -> set[str]:
    """Names bound at the top of a module or class body: classes, functions, assignments, imports."""
    names: set[str] = set()
    for child in getattr(node, "body", []):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(child.name)
        elif isinstance(child, ast.Assign):
            names |= {t.id for t in child.targets if isinstance(t, ast.Name)}
        elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
            names.add(child.target.id)
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in child.names}
    return names


def _unresolved(dotted: str) -> str | None:
    """Why `swarm.a.b.Name.attr` does not resolve, or None: the longest module prefix must be found
    (`importlib.util.find_spec`, which imports only the parent packages), its next part must be defined in that
    module's source, and a part after a class must be defined in the class body. Nothing heavy is imported."""
    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        try:
            spec = importlib.util.find_spec(".".join(parts[:cut]))
        except ModuleNotFoundError:
            spec = None
        if spec is not None:
            break
    else:
        return "no such module"
    rest = parts[cut:]
    if not rest or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    tree = ast.parse(Path(spec.origin).read_text())
    scope: ast.AST = tree
    for name in rest:
        if name not in _defined_names(scope):
            return f"{'.'.join(parts[:cut])} defines no {name}" if scope is tree else f"no {name} in its class"
        found = [c for c in getattr(scope, "body", []) if isinstance(c, ast.ClassDef) and c.name == name]
        if not found:
            return None  # a function or a value: its attributes are not checked
        scope = found[0]
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_paths_exist(page: Path):
    names = _basenames()
    missing = [
        code
        for code in _quoted(page)
        if (_PATH.match(code) and not _path_exists(code, page)) or (_BASENAME.match(code) and code not in names)
    ]
    assert not missing, f"{page.relative_to(ROOT)}: no such files {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_modules_resolve(page: Path):
    broken = {}
    for code in _quoted(page):
        match = _MODULE.match(code)
        if match and (why := _unresolved(match.group(0))):
            broken[match.group(0)] = why
    assert not broken, f"{page.relative_to(ROOT)}: unresolved names {broken}"


def test_the_name_check_can_fail():
    assert _unresolved("swarm.peers.plan.PlanDocument") is None
    assert _unresolved("swarm.scheduler.precision") is not None
    assert _unresolved("swarm.nowhere") == "no such module"
    assert _unresolved("swarm.testbed.churn_control.Action") is not None
    assert not _path_exists("swarm/testbed/nat.py", ROOT / "docs" / "NAT.md")
    assert _path_exists("runtime/outbox.py", ROOT / "docs" / "ARCHITECTURE.md")
    assert "outbox.py" in _basenames() and "neighbours.py" not in _basenames()


def _layer_table() -> list[tuple[str, ...]]:
    """The layers of ARCHITECTURE.md's table, bottom first: a row's backticked names in its first cell, joined to
    the row above where the cell says "same layer"."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers: list[tuple[str, ...]] = []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cell = line.split("|")[1]
        names = tuple(_CODE.findall(cell))
        if "same layer" in cell and layers:
            layers[-1] += names
        else:
            layers.append(names)
    return layers


def test_layer_table_is_the_checked_list():
    from swarm.layers import LAYERS

    assert _layer_table() == [tuple(names) for names in LAYERS]
