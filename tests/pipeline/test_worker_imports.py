"""A spawned loader worker imports neither jax nor grain; ``import grain_replay`` neither.

Each worker reports, from inside, which heavy modules it holds when it reads a
batch (``import_probe.ImportProbe``, a source wrapper importing only numpy), for
every store format and for the sampling modes that read in the same workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from import_probe import HEAVY, ImportProbe

import grain_replay as gr

pytestmark = pytest.mark.timeout(300)

_NO_HEAVY = dict.fromkeys(HEAVY, False)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("imports")
    tree = {
        "x": np.arange(400, dtype=np.float32),
        "y": np.arange(800, dtype=np.int64).reshape(400, 2),
    }
    out = {}
    for fmt, name in (("npy", "s_npy"), ("hdf5", "s.h5"), ("zarr", "s.zarr")):
        out[fmt] = str(root / name)
        gr.write(out[fmt], tree, format=fmt, chunk_rows=None if fmt == "npy" else 64)
    return out


def _held(batch: Any) -> dict[int, dict[str, bool]]:
    """pid -> {heavy module: held} of the processes that read ``batch``'s rows."""
    batch = getattr(batch, "data", batch)  # prioritized replay: gr.Sampled
    out: dict[int, dict[str, bool]] = {}
    for pid, row in zip(batch["pid"].tolist(), batch["heavy"]):
        out.setdefault(int(pid), {}).update(
            {name: bool(v) or out.get(int(pid), {}).get(name, False) for name, v in zip(HEAVY, row)}
        )
    return out


def _worker_modules(source: Any, **kw: Any) -> dict[int, dict[str, bool]]:
    """Reads one batch from each of two workers and returns what each one held."""
    it = iter(gr.make_data_loader(source, batch_size=8, worker_count=2, num_epochs=None, **kw))
    try:
        held: dict[int, dict[str, bool]] = {}
        for _ in range(2):  # batch j is worker j % 2's
            held.update(_held(next(it)))
    finally:
        it.close()
    return held


def test_the_probe_sees_heavy_modules_of_the_consuming_process(stores: dict[str, str]) -> None:
    jax.devices()
    held = _held(ImportProbe(gr.open_source(stores["npy"])).read_batch(np.arange(3)))
    assert held == {os.getpid(): {**_NO_HEAVY, **held[os.getpid()]}}
    assert held[os.getpid()]["jax"] and held[os.getpid()]["jaxlib"]


# Every format with epochs; uniform sampling's workers (the sampling modules) on npy in make
# test, on hdf5 and zarr under -m slow (the format rooms' imports are those of epochs).
@pytest.mark.parametrize(
    ("sampling", "fmt"),
    [
        ("epochs", "npy"),
        ("epochs", "hdf5"),
        ("epochs", "zarr"),
        ("uniform", "npy"),
        pytest.param("uniform", "hdf5", marks=pytest.mark.slow),
        pytest.param("uniform", "zarr", marks=pytest.mark.slow),
    ],
)
def test_loader_workers_import_neither_jax_nor_grain(
    stores: dict[str, str], fmt: str, sampling: str
) -> None:
    jax.devices()  # the consuming process holds jax and a backend; the workers must not
    kw = {"sampling": gr.UniformReplay()} if sampling == "uniform" else {}
    held = _worker_modules(ImportProbe(gr.open_source(stores[fmt])), **kw)
    assert os.getpid() not in held
    assert len(held) == 2, held
    assert all(modules == _NO_HEAVY for modules in held.values()), held


def test_mixture_and_prioritized_workers_import_neither_jax_nor_grain(
    stores: dict[str, str],
) -> None:
    jax.devices()
    sources = {fmt: ImportProbe(gr.open_source(path)) for fmt, path in stores.items()}
    mixed = _worker_modules(sources, weights={"npy": 1, "hdf5": 1, "zarr": 2})
    prioritized = _worker_modules(sources["zarr"], sampling=gr.PrioritizedReplay())
    for held in (mixed, prioritized):
        assert os.getpid() not in held and len(held) == 2, held
        assert all(modules == _NO_HEAVY for modules in held.values()), held


_IMPORTS = textwrap.dedent(
    """
    import sys

    import grain_replay as gr

    def heavy():
        return sorted(m for m in ("jax", "jaxlib", "grain", "orbax") if m in sys.modules)

    from absl import flags

    print("import", heavy(), flags.FLAGS.is_parsed())
    src = gr.open_source(sys.argv[1])
    src.read_batch([0, 1])
    gr.UniformReplay(), gr.LeafSpec, gr.write, gr.ReplayWriter, gr.tree.flatten
    print("sources", heavy())
    gr.make_data_loader
    print("loader", heavy())
    """
)


def test_import_grain_replay_imports_neither_jax_nor_grain(
    stores: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / "imports.py"
    script.write_text(_IMPORTS)
    proc = subprocess.run(
        [sys.executable, str(script), stores["zarr"]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    # absl flags are marked parsed at import (DESIGN.md: workers from a plain script).
    assert lines[0] == "import [] True"
    assert lines[1] == "sources []"
    assert lines[2].startswith("loader [") and "'grain'" in lines[2]


def test_public_names_resolve_lazily_and_unknown_ones_raise() -> None:
    for name in gr.__all__:
        assert getattr(gr, name) is not None, name
    assert set(gr.__all__) <= set(dir(gr))
    assert gr.make_data_loader.__module__ == "grain_replay.loading"
    assert gr.tree.flatten is not None and gr.sources.NpyDataSource is gr.NpyDataSource
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        _ = gr.not_a_name
    with pytest.raises(AttributeError, match="no attribute '_private'"):
        _ = gr._private
