"""No module of grain_replay touches a private name of grain or jax.

grain and jax promise nothing about names that start with one underscore: any
release may rename them. So grain_replay uses their public API only, and this
test fails when a module of ``grain_replay/`` does any of the following:

1. imports a private module or name of theirs (``grain._src``, ``from jax._src
   import x``, ``from grain import _x``);
2. reads or writes ``x._name`` where ``x`` is one of theirs: a name imported from
   grain, jax or jaxlib (module, class or function), an attribute chain rooted at
   one, a variable or parameter bound to a call of theirs or annotated with a
   type of theirs, or a variable conventionally holding a ``grain.DataLoader``
   (``loader``, ``data_loader``: grain_replay's loaders are grain DataLoaders);
3. in a class deriving from one of theirs, defines or assigns a private name
   that one of their classes in its MRO defines or assigns (overriding or
   clobbering their internals, e.g. a ``grain.DataLoaderIterator`` subclass
   setting ``self._data_loader``).

``ALLOWED`` lists the exceptions, each with the reason; dunder names are public.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import grain_replay

PACKAGE = Path(grain_replay.__file__).parent
THEIRS = ("grain", "jax", "jaxlib")
LOADER_NAMES = {"loader", "data_loader", "_data_loader"}

# (module, private name) -> why it is allowed.
ALLOWED: dict[tuple[str, str], str] = {
    ("grain_replay.pipeline.loader", "_element_spec"): (
        "grain.experimental.get_element_spec(ds) returns ds._element_spec: the "
        "property grain's dataset subclasses implement to answer it (grain 0.2.17+ "
        "offers no public hook). _BatchesMapDataset defines it; nothing reads it."
    ),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_theirs(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in THEIRS


def _root(node: ast.AST) -> str | None:
    """``a`` for ``a.b.c``, ``a(...).b`` or ``a[...]``; None for anything else."""
    while True:
        if isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Name):
            return node.id
        else:
            return None


def _annotation_names(node: ast.AST | None) -> set[str]:
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval")
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _module_files() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _static_violations(module: str, source: str) -> list[str]:
    tree = ast.parse(source)
    out: list[str] = []
    bound: set[str] = set()  # module-level names that are grain/jax modules or objects
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_theirs(alias.name):
                    if any(_private(p) for p in alias.name.split(".")):
                        out.append(f"{module}:{node.lineno}: imports private {alias.name}")
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and _is_theirs(node.module):
            assert node.module is not None
            if any(_private(p) for p in node.module.split(".")):
                out.append(f"{module}:{node.lineno}: imports from private {node.module}")
            for alias in node.names:
                if _private(alias.name):
                    out.append(f"{module}:{node.lineno}: imports private {alias.name}")
                bound.add(alias.asname or alias.name)

    def theirs(expr: ast.AST, local: set[str]) -> bool:
        root = _root(expr)
        if root in bound or root in local:
            return True
        last = expr.attr if isinstance(expr, ast.Attribute) else getattr(expr, "id", None)
        return last in LOADER_NAMES

    def visit_scope(body: list[ast.stmt], args: ast.arguments | None) -> None:
        local: set[str] = set()
        if args is not None:
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if a is not None and _annotation_names(a.annotation) & bound:
                    local.add(a.arg)
        for stmt in body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Assign) and _root(node.value) in bound:
                    local |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    if _annotation_names(node.annotation) & bound or (
                        node.value is not None and _root(node.value) in bound
                    ):
                        local.add(node.target.id)
        for stmt in body:
            for node in ast.walk(stmt):
                if (
                    isinstance(node, ast.Attribute)
                    and _private(node.attr)
                    and theirs(node.value, local)
                    and (module, node.attr) not in ALLOWED
                ):
                    out.append(
                        f"{module}:{node.lineno}: {ast.unparse(node)} is a private name of "
                        "grain or jax"
                    )

    visit_scope(tree.body, None)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            visit_scope(node.body, node.args)
    return sorted(set(out))


def _self_names(cls: type) -> set[str]:
    """Private names a class defines, or assigns/reads on ``self`` in its own source."""
    names = {n for n in vars(cls) if _private(n) and n != "_abc_impl"}  # abc's, in every ABC
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return names
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and _private(node.attr)
        ):
            names.add(node.attr)
    return names


def _subclass_violations() -> list[str]:
    out: list[str] = []
    for info in pkgutil.walk_packages([str(PACKAGE)], "grain_replay."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional dependency that is not installed
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            mro = cls.__mro__
            their_classes = [c for c in mro if _is_theirs(c.__module__)]
            if not their_classes:
                continue
            ours = {c for c in mro if c.__module__.startswith("grain_replay")}
            their_names: set[str] = set().union(*(_self_names(c) for c in their_classes))
            for klass in ours:
                for name in sorted(_self_names(klass) & their_names):
                    if (klass.__module__, name) not in ALLOWED:
                        out.append(
                            f"{klass.__module__}.{klass.__qualname__} uses {name}, a private "
                            f"name of {', '.join(c.__qualname__ for c in their_classes)} "
                            f"(in the MRO of {cls.__qualname__})"
                        )
    return sorted(set(out))


def test_no_module_touches_a_private_grain_or_jax_name() -> None:
    violations: list[str] = []
    for module, path in _module_files():
        violations += _static_violations(module, path.read_text())
    violations += _subclass_violations()
    assert not violations, "\n".join(violations)


def test_allowed_exceptions_are_still_needed() -> None:
    """An entry of ALLOWED that nothing uses any more is removed."""
    used = set()
    for module, path in _module_files():
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node, "attr", None) or getattr(node, "name", None)
            if (module, name) in ALLOWED:
                used.add((module, name))
    assert used == set(ALLOWED)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import grain\nx = grain._src", "grain._src"),
        ("import jax.numpy as jnp\ny = jnp.zeros(1)._value", "jnp.zeros(1)._value"),
        ("from grain._src.python import data_loader", "private grain._src.python"),
        ("from jax import _src", "imports private _src"),
        ("def f(loader):\n    return loader._sampler", "loader._sampler"),
        ("def f(x):\n    return x.it._data_loader._validate_state", "_validate_state"),
        ("import grain\ndef f(ds: grain.MapDataset):\n    return ds._parents", "ds._parents"),
        ("import grain\ndef f():\n    d = grain.MapDataset.range(3)\n    d._x = 1", "d._x"),
        ("from jax.sharding import Mesh\nMesh._cache", "Mesh._cache"),
    ],
)
def test_scan_finds_private_access(source: str, expected: str) -> None:
    found = _static_violations("m", source)
    assert any(expected in v for v in found), found


@pytest.mark.parametrize(
    "source",
    [
        "import grain\nclass A:\n    def f(self):\n        return self._x",
        "def f(other):\n    return other._y",  # not theirs
        "import jax\nx = jax.numpy.zeros(1).__array__",  # dunder: public
        "from grain_replay import tree\ntree._x",  # ours
    ],
)
def test_scan_leaves_our_own_names_alone(source: str) -> None:
    assert _static_violations("m", source) == []


def test_subclass_check_finds_clobbered_internals() -> None:
    import grain

    class Clobbers(grain.DataLoaderIterator):  # type: ignore[misc]
        def __init__(self) -> None:
            self._data_loader = None

    their = set().union(*(_self_names(c) for c in Clobbers.__mro__[1:] if _is_theirs(c.__module__)))
    assert "_data_loader" in _self_names(Clobbers) & their
