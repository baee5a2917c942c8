"""What a dataclass's source says beyond what Python keeps at run time: each field's docstring (the string
literal after it, read with `ast`, as torchtitan and tyro do) and its annotation evaluated, names imported only
under `if TYPE_CHECKING:` included. `swarm.flags` generates flags' help and types from them.

This module is the bottom of the `swarm` package: it imports nothing from it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import types
from typing import Any

__all__ = ["field_docs", "field_hints"]


def field_docs(cls: type) -> dict[str, str]:
    """`{field: docstring}` of a dataclass and its dataclass bases: the string literal after each field."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_docs(klass))
    return docs


_DOCS: dict[type, dict[str, str]] = {}


def _class_node(cls: type) -> ast.ClassDef | None:
    """The class statement of `cls` in its module's source, found by its qualified name (None: no source).

    Not `inspect.getsource`: to find a class's file that asks `inspect.getmodule`, which walks every module loaded
    (thousands once torch is) on its first call; 87 ms of every process that imported `swarm.options`."""
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return _find_class(_module_tree(path), cls.__qualname__.split("."), []) if path else None


def _find_class(node: ast.AST, target: list[str], scope: list[str]) -> ast.ClassDef | None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = [*scope, child.name]
            if isinstance(child, ast.ClassDef) and name == target:
                return child
            inner = name if isinstance(child, ast.ClassDef) else [*name, "<locals>"]
            if target[: len(inner)] == inner and (found := _find_class(child, target, inner)) is not None:
                return found
        elif (found := _find_class(child, target, scope)) is not None:  # inside an `if`, a `with`, a `try`
            return found
    return None


_TREES: dict[str, ast.Module] = {}


def _module_tree(path: str) -> ast.Module:
    if path not in _TREES:
        with open(path, encoding="utf-8") as f:
            _TREES[path] = ast.parse(f.read())
    return _TREES[path]


def _own_docs(cls: type) -> dict[str, str]:
    if cls not in _DOCS:
        try:
            node = _class_node(cls)
        except (OSError, SyntaxError, UnicodeDecodeError):
            node = None
        if node is None:  # no source (a REPL class): flags without help
            _DOCS[cls] = {}
            return {}
        body = node.body
        docs = {}
        for node, after in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
        _DOCS[cls] = docs
    return _DOCS[cls]


def field_hints(cls: type) -> dict[str, Any]:
    """`{field: annotation}` of a dataclass and its bases, evaluated; names its module imports only under
    `if TYPE_CHECKING:` are imported for it (an annotation naming none it can find: `Any`)."""
    module = sys.modules.get(cls.__module__)
    namespace = dict(vars(module)) if module else {}
    hints = {}
    for klass in reversed(cls.__mro__):
        for name, ann in getattr(klass, "__annotations__", {}).items():
            if isinstance(ann, str):
                try:
                    ann = eval(ann, namespace, dict(vars(klass)))  # noqa: S307 - the class's own annotation
                except NameError:
                    namespace.update(_type_checking_imports(module))
                    try:
                        ann = eval(ann, namespace, dict(vars(klass)))  # noqa: S307
                    except NameError:
                        ann = Any
            hints[name] = ann
    return hints


def _type_checking_imports(module: types.ModuleType | None) -> dict[str, Any]:
    """The names a module imports under `if TYPE_CHECKING:`, imported."""
    if module is None:
        return {}
    try:
        tree = _module_tree(module.__file__)
    except (OSError, TypeError, SyntaxError, UnicodeDecodeError):
        return {}
    namespace: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            imports = [n for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            exec(compile(ast.Module(imports, []), module.__name__, "exec"), namespace)  # noqa: S102 - its imports
    return namespace
