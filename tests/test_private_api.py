"""No module of grain_replay touches a private name of grain, jax or zarr.

grain, jax and zarr promise nothing about names that start with one underscore:
any release may rename them. So grain_replay uses their public API only, and this
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

For zarr, "private" also covers the modules its API reference does not
document. The rule: zarr's public modules are ``ZARR_PUBLIC`` (``zarr`` and what
zarr 3's API reference lists: ``zarr.abc.*``, ``zarr.api.*``, ``zarr.buffer``,
``zarr.codecs``, ``zarr.dtype``, ``zarr.errors``, ``zarr.metadata``,
``zarr.registry``, ``zarr.storage``); everything else is zarr's implementation,
``zarr.core.*`` first of all, even where its names carry no underscore
(``zarr.core.sync.sync``, ``zarr.core.chunk_grids.RegularChunkGrid``: the latter
is gone in zarr 3.4). A class of ``zarr.core`` is public only through a public
re-export (``zarr.AsyncArray`` is ``zarr.core.array.AsyncArray``), and then only
its public attributes. So, beyond 1-3:

4. importing a zarr module outside ``ZARR_PUBLIC``, or naming one in an
   attribute chain (``zarr.core.sync``), fails;
5. ``x._name``, ``getattr(x, "_name")`` or ``hasattr(x, "_name")`` fails
   wherever ``_name`` is a private name that zarr's sources define (as a
   method, class attribute or ``self._name``) and grain_replay does not: zarr's
   objects reach grain_replay as ``Any`` (``import_zarr()``, untyped
   parameters), so their private names are recognised by name, e.g.
   ``group._async_group`` or ``hasattr(codec, "_decode_sync")``.

``ALLOWED`` lists the exceptions, each with the reason; dunder names are public.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import grain_replay

PACKAGE = Path(grain_replay.__file__).parent
THEIRS = ("grain", "jax", "jaxlib", "zarr")
LOADER_NAMES = {"loader", "data_loader", "_data_loader"}
# zarr's modules that its API reference documents (and their submodules); the rest,
# zarr.core.* above all, is its implementation.
ZARR_PUBLIC = (
    "zarr.abc",
    "zarr.api",
    "zarr.buffer",
    "zarr.codecs",
    "zarr.dtype",
    "zarr.errors",
    "zarr.metadata",
    "zarr.registry",
    "zarr.storage",
)
# Subpackages of zarr outside ZARR_PUBLIC, seen as attributes (``zarr.core.sync``).
ZARR_INTERNAL = {"core", "testing"}

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


def _zarr_private_module(module: str) -> bool:
    """True for a zarr module outside ``ZARR_PUBLIC`` (``zarr`` itself is public)."""
    if module.split(".")[0] != "zarr" or module == "zarr":
        return False
    return not any(module == p or module.startswith(p + ".") for p in ZARR_PUBLIC)


def _defined_private_names(files: list[Path]) -> set[str]:
    """Private names the sources define: functions, class attributes, ``self._x``, module names."""
    names: set[str] = set()
    for path in files:
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                continue
    return {n for n in names if _private(n)}


@functools.cache  # parses every file of zarr and of grain_replay: once per process
def _zarr_private_names() -> frozenset[str]:
    """Private names zarr defines that grain_replay does not (so ``x._name`` is zarr's)."""
    try:
        import zarr
    except ImportError:
        return frozenset()
    theirs = _defined_private_names(sorted(Path(zarr.__file__).parent.rglob("*.py")))
    ours = _defined_private_names([path for _, path in _module_files()])
    return frozenset(theirs - ours)


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


def _subtrees(tree: ast.AST) -> Callable[[ast.AST], list[ast.AST]]:
    """``nodes(x)``: every node under ``x`` and ``x`` itself, as ``ast.walk(x)`` yields them
    but in another order; each node's children are listed once for the whole tree (a scope
    and every scope around it walk the same statements: ast.walk listed them again each time).
    """
    memo: dict[int, list[ast.AST]] = {}

    def nodes(node: ast.AST) -> list[ast.AST]:
        found = memo.get(id(node))
        if found is None:
            found = [node]
            for child in ast.iter_child_nodes(node):
                found += nodes(child)
            memo[id(node)] = found
        return found

    nodes(tree)
    return nodes


def _static_violations(
    module: str, source: str, zarr_private: set[str] | frozenset[str] = frozenset()
) -> list[str]:
    tree = ast.parse(source)
    walk = _subtrees(tree)  # the scopes' walks below, each node's children listed once
    out: list[str] = []
    bound: set[str] = set()  # module-level names that are grain/jax/zarr modules or objects
    zarr_names = {"zarr"}  # names bound to the zarr module (also by import_zarr())
    for node in walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_theirs(alias.name):
                    if any(_private(p) for p in alias.name.split(".")):
                        out.append(f"{module}:{node.lineno}: imports private {alias.name}")
                    elif _zarr_private_module(alias.name):
                        out.append(f"{module}:{node.lineno}: imports zarr's internal {alias.name}")
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and _is_theirs(node.module):
            assert node.module is not None
            if any(_private(p) for p in node.module.split(".")):
                out.append(f"{module}:{node.lineno}: imports from private {node.module}")
            elif _zarr_private_module(node.module):
                out.append(f"{module}:{node.lineno}: imports from zarr's internal {node.module}")
            for alias in node.names:
                if _private(alias.name):
                    out.append(f"{module}:{node.lineno}: imports private {alias.name}")
                elif node.module == "zarr" and alias.name in ZARR_INTERNAL:
                    out.append(f"{module}:{node.lineno}: imports zarr's internal zarr.{alias.name}")
                bound.add(alias.asname or alias.name)
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id == "import_zarr"
        ):
            zarr_names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in zarr_names and node.attr in ZARR_INTERNAL:
                out.append(f"{module}:{node.lineno}: {ast.unparse(node)} is zarr's internal module")
        if isinstance(node, ast.Attribute) and node.attr in zarr_private:
            out.append(f"{module}:{node.lineno}: {ast.unparse(node)} is a private name of zarr")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in zarr_private
        ):
            out.append(f"{module}:{node.lineno}: {ast.unparse(node)} reads a private name of zarr")

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
            for node in walk(stmt):
                if isinstance(node, ast.Assign) and _root(node.value) in bound:
                    local |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    if _annotation_names(node.annotation) & bound or (
                        node.value is not None and _root(node.value) in bound
                    ):
                        local.add(node.target.id)
        for stmt in body:
            for node in walk(stmt):
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
    for node in walk(tree):
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


def test_no_module_touches_a_private_grain_jax_or_zarr_name() -> None:
    violations: list[str] = []
    zarr_private = _zarr_private_names()
    for module, path in _module_files():
        violations += _static_violations(module, path.read_text(), zarr_private)
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
        ("from zarr.core.sync import sync", "zarr's internal zarr.core.sync"),
        ("import zarr.core.buffer", "zarr's internal zarr.core.buffer"),
        ("from zarr import core", "zarr's internal zarr.core"),
        (
            "from grain_replay.store.formats import import_zarr\nz = import_zarr()\nz.core.sync",
            "z.core",
        ),
        ("import zarr\ndef f(a):\n    return zarr.core.array.AsyncArray", "zarr.core"),
        ("import zarr\ndef f(g: zarr.Group):\n    return g._async_group", "g._async_group"),
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


@pytest.mark.parametrize(
    "source",
    [
        "import zarr\nfrom zarr.codecs import BytesCodec\nfrom zarr.storage import LocalStore",
        "import zarr.api.asynchronous\nfrom zarr.abc.codec import BytesBytesCodec",
        "import zarr\nzarr.AsyncArray, zarr.AsyncGroup, zarr.open_group",
    ],
)
def test_scan_lets_zarrs_public_api_pass(source: str) -> None:
    assert _static_violations("m", source, _zarr_private_names()) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(group):\n    return group._async_group", "group._async_group"),
        ('def f(codec):\n    return hasattr(codec, "_decode_sync")', "_decode_sync"),
        ("def f(arr):\n    return arr._async_array.getitem(0)", "arr._async_array"),
    ],
)
def test_scan_finds_zarrs_private_names_on_untyped_objects(source: str, expected: str) -> None:
    pytest.importorskip("zarr")
    found = _static_violations("m", source, _zarr_private_names())
    assert any(expected in v for v in found), found


def test_zarr_private_names_leave_ours_out() -> None:
    pytest.importorskip("zarr")
    names = _zarr_private_names()
    assert {"_async_group", "_decode_sync", "_async_array"} <= names
    assert "_path" not in names  # ours too (ZarrDataSource._path): not recognisable by name


def test_subclass_check_finds_clobbered_internals() -> None:
    import grain

    class Clobbers(grain.DataLoaderIterator):  # type: ignore[misc]
        def __init__(self) -> None:
            self._data_loader = None

    their = set().union(*(_self_names(c) for c in Clobbers.__mro__[1:] if _is_theirs(c.__module__)))
    assert "_data_loader" in _self_names(Clobbers) & their
