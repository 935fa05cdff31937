"""The package's shape: every module imports on its own, and imports run one way.

The layers, bottom first (see docs/architecture.md):

0. errors, tree, layout, parts, filesync, formats, remote/, integrity, watermark, learners,
   _flags: no source, no writer.
1. sources/reading/ and sources/checks.py: the shared reading layer; imports no format.
2. sources/surface.py (the source surface) and sources/base.py (stores as sources).
3. sources/hdf5/, sources/zarr/, sources/npy.py, sources/rlds/ (never each other) and
   writers/ (no source).
4. sources/__init__.py: ``open_source`` over the formats.
5. rl/, stats/, pipeline/ and any other module not listed.
6. sampling/: mixtures and replay streams, read through pipeline/'s iterators.
7. loading: the facade a user calls (make_data_loader), over pipeline/ and sampling/.
8. cli, and the package itself.

Every import counts, also those inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import grain_replay

PACKAGE = pathlib.Path(grain_replay.__file__).parent

# (module or package prefix, layer); the longest matching prefix wins.
LAYERS = {
    "grain_replay.errors": 0,
    "grain_replay.tree": 0,
    "grain_replay.layout": 0,
    "grain_replay.parts": 0,
    "grain_replay.filesync": 0,
    "grain_replay.formats": 0,
    "grain_replay.remote": 0,
    "grain_replay.integrity": 0,
    "grain_replay.watermark": 0,
    "grain_replay.learners": 0,
    "grain_replay._flags": 0,
    "grain_replay.sources.reading": 1,
    "grain_replay.sources.checks": 1,
    "grain_replay.sources.layouts": 1,
    "grain_replay.sources.base": 2,
    "grain_replay.sources.surface": 2,
    "grain_replay.sources.hdf5": 3,
    "grain_replay.sources.zarr": 3,
    "grain_replay.sources.npy": 3,
    "grain_replay.sources.rlds": 3,
    "grain_replay.sources.npz": 3,
    "grain_replay.sources.torchrl": 3,
    "grain_replay.sources.vault": 3,
    "grain_replay.writers": 3,
    "grain_replay.sources": 4,
    "grain_replay.sampling": 6,
    "grain_replay.loading": 7,
    "grain_replay.cli": 8,
}
DEFAULT_LAYER = 5  # rl, stats, pipeline and whatever joins them
FORMAT_ROOMS = (
    "grain_replay.sources.hdf5",
    "grain_replay.sources.zarr",
    "grain_replay.sources.npy",
    "grain_replay.sources.rlds",
    "grain_replay.sources.npz",
    "grain_replay.sources.torchrl",
    "grain_replay.sources.vault",
)


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
        return 8
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len, default=None)
    return DEFAULT_LAYER if best is None else LAYERS[best]


def _room(name: str) -> str | None:
    return next((r for r in FORMAT_ROOMS if name == r or name.startswith(r + ".")), None)


def test_every_module_is_known_to_the_layering_test() -> None:
    assert len(MODULES) > 40
    assert {"grain_replay.formats", "grain_replay.remote", "grain_replay.sources.base"} <= set(
        GRAPH
    )
    # A parse that found nothing would make the layering tests pass trivially.
    assert "grain_replay.formats" in GRAPH["grain_replay.sources.hdf5.source"]
    assert "grain_replay.sources.reading.readers" in GRAPH["grain_replay.sources.npy"]


def test_imports_run_from_higher_layers_to_lower_ones() -> None:
    upward = [
        f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
        for a, deps in GRAPH.items()
        for b in deps
        if _layer(b) > _layer(a)
    ]
    assert not upward, "\n".join(upward)


def test_format_rooms_never_import_each_other_and_writers_import_no_source() -> None:
    crossing = [
        f"{a} imports {b}"
        for a, deps in GRAPH.items()
        for b in deps
        if (_room(a) and _room(b) and _room(a) != _room(b))
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
import importlib, sys, traceback
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
