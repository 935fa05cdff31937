"""The package's shape, as folder rules: every module imports on its own, imports run one way,
and each room keeps to what it may import (docs/architecture.md is the map).

The rooms, bottom first:

0. errors, tree, pipeline/flags.py, pipeline/shutdown.py (what is closed at exit), store/ (the
   on-disk contract), remote/ (fsspec access).
1. sources/reading/, sources/checks.py, sources/keys.py: the shared reading layer.
2. sources/surface.py, sources/base.py, sources/access.py, sources/capabilities.py: the
   source surface.
3. sources/<format>/ (hdf5, zarr, npy, npz: never each other) and writers/.
4. sources/parts/ (the many-writer reader, over every format's segments) and
   sources/__init__.py.
5. rl/ (views) and pipeline/ (the host loader and its workers).
6. datasets/<name>/: other libraries' datasets (never each other; may offer rl/'s views).
7. opening (open_source), sampling/, stats/.
8. device/ (everything jax), loading (make_data_loader).
9. cli/, and the package itself.

Every import counts, also those inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import subprocess
import sys

import pytest

import grain_replay

PACKAGE = pathlib.Path(grain_replay.__file__).parent

# (module or package prefix, layer); the longest matching prefix wins.
LAYERS = {
    "grain_replay.errors": 0,
    "grain_replay.tree": 0,
    "grain_replay.tree_layout": 0,
    "grain_replay.lazy": 0,
    "grain_replay.pipeline.flags": 0,
    "grain_replay.pipeline.shutdown": 0,
    "grain_replay.store": 0,
    "grain_replay.remote": 0,
    "grain_replay.sources.reading": 1,
    "grain_replay.sources.checks": 1,
    "grain_replay.sources.keys": 1,
    "grain_replay.sources.base": 2,
    "grain_replay.sources.surface": 2,
    "grain_replay.sources.access": 2,
    "grain_replay.sources.window_reads": 2,
    "grain_replay.sources.capabilities": 2,
    "grain_replay.sources.hdf5": 3,
    "grain_replay.sources.zarr": 3,
    "grain_replay.sources.npy": 3,
    "grain_replay.sources.npz": 3,
    "grain_replay.sources.parts": 4,
    "grain_replay.writers": 3,
    "grain_replay.sources": 4,
    "grain_replay.rl": 5,
    "grain_replay.pipeline": 5,
    "grain_replay.datasets": 6,
    "grain_replay.opening": 7,
    "grain_replay.sampling": 7,
    "grain_replay.stats": 7,
    "grain_replay.device": 8,
    "grain_replay.loading": 8,
    "grain_replay.cli": 9,
}
FORMAT_ROOMS = (
    "grain_replay.sources.hdf5",
    "grain_replay.sources.zarr",
    "grain_replay.sources.npy",
    "grain_replay.sources.npz",
    "grain_replay.datasets.rlds",
    "grain_replay.datasets.torchrl",
    "grain_replay.datasets.vault",
    "grain_replay.datasets.lerobot",
    "grain_replay.datasets.minari",
    "grain_replay.datasets.d4rl",
)
# Folders whose modules may import jax: the device room, the device writer, and the facades
# above every room (the package, cli/).
JAX_ROOMS = ("grain_replay.device", "grain_replay.writers.device", "grain_replay.cli")
DATASET_NAMES = re.compile(r"rlds|torchrl|vault|flashbax|lerobot|minari|d4rl", re.IGNORECASE)


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {
    _module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts
}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> set[str]:
    """The grain_replay modules ``name`` imports anywhere in its body."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name if _is_package(name) else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            # `from pkg import submodule` depends on the submodule itself.
            targets = [
                f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module
                for a in node.names
            ]
        else:
            continue
        out.update(t for t in targets if t in MODULES and t != name)
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def _layer(name: str) -> int:
    if name == "grain_replay":
        return 9
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len, default=None)
    assert best is not None, f"{name} is in no room: add its folder to LAYERS"
    return LAYERS[best]


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _room(name: str) -> str | None:
    return next((r for r in FORMAT_ROOMS if name == r or name.startswith(r + ".")), None)


def test_every_module_is_known_to_the_layering_test() -> None:
    assert len(MODULES) > 40
    assert {
        "grain_replay.store.formats",
        "grain_replay.remote",
        "grain_replay.sources.base",
    } <= set(GRAPH)
    # A parse that found nothing would make the layering tests pass trivially.
    assert "grain_replay.store.formats" in GRAPH["grain_replay.sources.hdf5.source"]
    assert "grain_replay.sources.reading.readers" in GRAPH["grain_replay.sources.npy"]


def test_imports_run_from_higher_layers_to_lower_ones() -> None:
    upward = [
        f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
        for a, deps in GRAPH.items()
        for b in deps
        if _layer(b) > _layer(a)
    ]
    assert not upward, "\n".join(upward)


def _crosses_rooms(a: str, b: str) -> bool:
    """Two format rooms of one folder (sources/ or datasets/): a dataset may read through an
    array store's room (D4RL is an HDF5 file), never through another dataset's."""
    ra, rb = _room(a), _room(b)
    return bool(ra and rb and ra != rb and _parent(ra) == _parent(rb))


def test_format_rooms_never_import_each_other_and_writers_import_no_source() -> None:
    crossing = [
        f"{a} imports {b}"
        for a, deps in GRAPH.items()
        for b in deps
        if _crosses_rooms(a, b)
        or (a.startswith("grain_replay.writers") and b.startswith("grain_replay.sources"))
        or (a.startswith("grain_replay.sources.reading") and _room(b))
    ]
    assert not crossing, "\n".join(crossing)


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(GRAPH[node]):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


_IMPORT_EACH = """
import importlib, importlib.machinery, sys, traceback
# Each module's code is compiled once and executed afresh at each import: what runs is
# what a fresh interpreter runs (no .pyc is written here, PYTHONDONTWRITEBYTECODE), but
# the ~200 imports below need not compile the package's modules ~6,000 times.
compiled = {}
to_code = importlib.machinery.SourceFileLoader.source_to_code
def source_to_code(self, data, path, *args, **kwargs):
    key = (path, bytes(data))
    if key not in compiled:
        compiled[key] = to_code(self, data, path, *args, **kwargs)
    return compiled[key]
importlib.machinery.SourceFileLoader.source_to_code = source_to_code
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "grain_replay" or m.startswith("grain_replay.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException:
        failed.append(name + ":\\n" + traceback.format_exc())
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.timeout(600)
def test_every_module_imports_first_in_a_fresh_package() -> None:
    # One interpreter (third-party imports stay cached); grain_replay is forgotten
    # before each module, so each is the first of the package to be imported.
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, *sorted(MODULES)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _trees() -> dict[str, ast.AST]:
    return {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


TREES = _trees()


def _folder(name: str) -> str:
    """The package a module lives in (a package's own ``__init__`` lives in itself)."""
    return name if _is_package(name) else name.rpartition(".")[0]


def _is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def test_readers_never_import_writers() -> None:
    readers = ("grain_replay.sources", "grain_replay.datasets", "grain_replay.rl")
    crossing = [
        f"{a} imports {b}"
        for a, deps in GRAPH.items()
        if a.startswith(readers)
        for b in deps
        if b.startswith("grain_replay.writers")
    ]
    assert not crossing, "\n".join(crossing)


def _private_imports(name: str) -> list[str]:
    out = []
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if not node.module.startswith("grain_replay"):
                continue
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                module = target if target in MODULES else node.module
                private = [p for p in module.split(".") if _is_private(p)]
                if module != target and _is_private(alias.name):
                    private.append(alias.name)
                if private and _folder(module) != _folder(name):
                    out.append(f"{name} imports {target}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "grain_replay" and any(map(_is_private, parts)):
                    if _folder(alias.name) != _folder(name):
                        out.append(f"{name} imports {alias.name}")
    return out


def test_no_module_imports_another_rooms_private_module_or_name() -> None:
    # A private module or name is its folder's business: another folder that needs it
    # needs a public name.
    found = [line for name in MODULES for line in _private_imports(name)]
    assert not found, "\n".join(found)


def test_the_private_import_rule_sees_a_break() -> None:
    # The rule above, fed a module that breaks it, must say so.
    name = "grain_replay.rl.episodes"
    saved = TREES[name]
    try:
        TREES[name] = ast.parse("from grain_replay.pipeline.shuffle import _permutation\n")
        assert _private_imports(name) == [
            f"{name} imports grain_replay.pipeline.shuffle._permutation"
        ]
        TREES[name] = ast.parse("from grain_replay.rl import _derived\n")
        assert _private_imports(name) == []  # its own folder's private module
    finally:
        TREES[name] = saved


# ``x._name`` (or getattr/hasattr/setattr of ``"_name"``) with ``x`` not self, cls or
# super() reaches into another object's privates. It passes where ``_name`` is its own
# family's: a class of the same module, or a grain_replay base of one, defines it (the
# class's __eq__ or merge, a source's handle class beside it). Otherwise only these,
# each with its reason. A namedtuple's own API (the _ keeps it clear of field names) is public.
NAMEDTUPLE_API = {"_replace", "_fields", "_asdict", "_make", "_field_defaults"}
FOREIGN_PRIVATE_ALLOWED = {
    "grain_replay.sources.reading.readers": {
        "_mmap": "np.memmap's map: numpy names it nowhere else (advise_random, best effort)"
    },
}
ATTR_CALLS = ("getattr", "hasattr", "setattr", "delattr")


def _own_private(name: str) -> set[str]:
    """Private names the classes of module ``name`` and their grain_replay bases define."""
    module = importlib.import_module(name)
    out: set[str] = set()
    for cls in [v for v in vars(module).values() if isinstance(v, type)]:
        for klass in cls.__mro__ if cls.__module__ == name else ():
            if not klass.__module__.startswith("grain_replay."):
                continue
            out |= {n for n in vars(klass) if _is_private(n)}
            for node in ast.walk(TREES[klass.__module__]):
                if isinstance(node, ast.ClassDef) and node.name == klass.__name__:
                    out |= {a for a in _assigned(node) if _is_private(a)}
    return out


def _assigned(node: ast.ClassDef) -> set[str]:
    """Names a class body assigns (annotated ones too) and ``self._x = ...`` targets."""
    out = {t.id for s in node.body if isinstance(s, ast.AnnAssign | ast.Assign)
           for t in (s.targets if isinstance(s, ast.Assign) else [s.target])
           if isinstance(t, ast.Name)}  # fmt: skip
    stores = [
        n for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
    ]
    return out | {n.attr for n in stores if ast.unparse(n.value) in ("self", "cls")}


def _foreign_private(tree: ast.AST) -> list[tuple[int, str, str]]:
    """``(line, owner, name)`` of each read, call or write of another object's private name."""
    out, attr = [], None  # attr: the name, or a getattr's argument (a str if private)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner, attr = node.value, node.attr
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ATTR_CALLS and node.args[1:]:
            owner, attr = node.args[0], getattr(node.args[1], "value", None)
        else:
            continue
        own = ast.unparse(owner) in ("self", "cls", "super()")
        if isinstance(attr, str) and _is_private(attr) and not own and attr not in NAMEDTUPLE_API:
            out.append((node.lineno, ast.unparse(owner), attr))
    return out


def test_no_module_reaches_into_another_objects_private_names() -> None:
    found, used = [], set()
    for name in MODULES:
        own, allowed = _own_private(name), FOREIGN_PRIVATE_ALLOWED.get(name, {})
        for line, owner, attr in _foreign_private(TREES[name]):
            if attr in allowed:
                used.add((name, attr))
            elif attr not in own:
                found.append(f"{MODULES[name]}:{line}: {owner}.{attr}")
    assert not found, "\n".join(found)
    listed = {(m, a) for m, names in FOREIGN_PRIVATE_ALLOWED.items() for a in names}
    assert listed == used, f"allowed but no longer used: {sorted(listed - used)}"


def test_the_foreign_private_rule_sees_a_break() -> None:
    tree = ast.parse(
        "def f(src, other):\n"
        "    getattr(src, '_handle', None); other.__len__(); super()._x; self._y\n"
        "    return src._read_windows_fixed({})\n"
    )
    found = sorted(_foreign_private(tree))
    assert found == [(2, "src", "_handle"), (3, "src", "_read_windows_fixed")]
    own = _own_private("grain_replay.sources.npy")  # NpyDataSource, via ReplaySource
    assert {"_layout", "_headers", "_get_handle"} <= own
    assert "_read_windows_fixed" not in _own_private("grain_replay.sources.access")


def _identifiers(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.alias):
            out.add(node.name)
            out.add(node.asname or "")
        elif isinstance(node, ast.ImportFrom):
            out.add(node.module or "")
    return out


@pytest.mark.parametrize("room", ["grain_replay.rl", "grain_replay.sources"])
def test_views_and_array_stores_name_no_other_librarys_dataset(room: str) -> None:
    # rl/ is views over any step source and sources/ array stores only: a dataset's own
    # rules live in datasets/<name>/ (docstrings may still cite them).
    named = sorted(
        f"{name}: {ident}"
        for name in MODULES
        if name == room or name.startswith(room + ".")
        for ident in _identifiers(TREES[name])
        if DATASET_NAMES.search(ident)
    )
    assert not named, "\n".join(named)


def _imports_jax(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(
            a.name.split(".")[0] in ("jax", "jaxlib") for a in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (
            "jax",
            "jaxlib",
        ):
            return True
    return False


def test_only_the_device_rooms_import_jax() -> None:
    # The loader workers' "no jax" rule as a folder rule: pipeline/, sources/, sampling/ and
    # the rest run in spawned workers or below them.
    outside = sorted(
        name
        for name in MODULES
        if name != "grain_replay" and not name.startswith(JAX_ROOMS) and _imports_jax(TREES[name])
    )
    assert not outside, "\n".join(outside)
    assert _imports_jax(TREES["grain_replay.device.put_iterator"])  # the check sees an import
