"""Every error raised on purpose: its class derives from gr.GrainReplayError and the builtin.

Each case provokes one deliberate error through the public API and checks the exact
class, both bases, a phrase of the message, and that nothing was written.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay import errors
from grain_replay.pipeline import spawn_check


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("errors") / "store.h5"
    n = 32
    return gr.write(
        path,
        {
            "obs": np.arange(n * 3, dtype=np.float32).reshape(n, 3),
            "reward": np.ones(n, np.float32),
            "done": np.arange(n) % 8 == 7,
        },
    )


def _open_left_open(path: Path) -> Any:
    """A file its writer had open (libver='latest'), as a writer that died leaves it."""
    import shutil

    import h5py

    writing = path.with_name("writing.h5")
    with h5py.File(writing, "w", libver="latest") as f:
        f["x"] = np.arange(4.0)
        f.flush()
        shutil.copyfile(writing, path)  # the superblock still says "open for write"
    writing.unlink()
    return gr.open_source(path)


def _open_damaged(path: Path) -> Any:
    path.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)  # an HDF5 signature, then nothing
    return gr.open_source(path)


# (name, builtin, expected class, message phrase, provoke(store, tmp_path))
CASES: list[tuple[str, type[BaseException], type[BaseException], str, Callable[..., Any]]] = [
    (
        "missing store",
        FileNotFoundError,
        gr.StoreNotFoundError,
        "check the path",
        lambda s, t: gr.open_source(t / "nothing.h5"),
    ),
    (
        "existing destination",
        FileExistsError,
        gr.StoreExistsError,
        "overwrite=True",
        lambda s, t: gr.write(s, {"x": np.zeros(2)}),
    ),
    (
        "list of lists to write",
        TypeError,
        gr.InvalidTreeError,
        "is an int, not an array",
        lambda s, t: gr.write(t / "out.h5", [[1, 2], [3, 4]]),
    ),
    (
        "damaged file",
        ValueError,
        gr.InvalidStoreError,
        "bad.h5",
        lambda s, t: _open_damaged(t / "bad.h5"),
    ),
    (
        "file left marked open for writing",
        ValueError,
        gr.InvalidStoreError,
        "h5clear -s",
        lambda s, t: _open_left_open(t / "left_open.h5"),
    ),
    (
        "record index out of range",
        IndexError,
        gr.RecordIndexError,
        "32",
        lambda s, t: gr.open_source(s)[32],
    ),
    (
        "float index",
        TypeError,
        gr.ArgumentTypeError,
        "must be integers",
        lambda s, t: gr.open_source(s)[1.5],
    ),
    (
        "float indices to read_batch",
        TypeError,
        gr.ArgumentTypeError,
        "indices must be integers",
        lambda s, t: gr.open_source(s).read_batch([0.0, 1.5]),
    ),
    (
        "unknown keys=",
        ValueError,
        gr.UnknownLeafError,
        "Fix: pick keys from that list",
        lambda s, t: gr.open_source(s, keys=["nope"]),
    ),
    (
        "unknown leaf to read_leaf",
        KeyError,
        gr.UnknownLeafError,
        "no leaf 'nope'",
        lambda s, t: gr.open_source(s).read_leaf("nope", [0]),
    ),
    (
        "bad compression",
        ValueError,
        gr.InvalidArgumentError,
        "compression must be one of",
        lambda s, t: gr.write(t / "out.h5", {"x": np.zeros(4)}, compression="zstdd"),
    ),
    (
        "bad Zarr compression",
        ValueError,
        gr.InvalidArgumentError,
        "compression must be one of",
        lambda s, t: gr.write(t / "out.zarr", {"x": np.zeros(4)}, compression="lzf"),
    ),
    (
        "compressed .npy",
        ValueError,
        gr.InvalidArgumentError,
        "cannot be chunked or compressed",
        lambda s, t: gr.write(t / "out", {"x": np.zeros(4)}, compression="gzip"),
    ),
    (
        "bad chunk_rows",
        ValueError,
        gr.InvalidArgumentError,
        "chunk_rows",
        lambda s, t: gr.write(t / "out.h5", {"x": np.zeros(4)}, chunk_rows=0),
    ),
    (
        "bad format",
        ValueError,
        gr.InvalidArgumentError,
        "format must be one of",
        lambda s, t: gr.write(t / "out.h5", {"x": np.zeros(4)}, format="parquet"),
    ),
    (
        "bad ReplayWriter format",
        ValueError,
        gr.InvalidArgumentError,
        "format must be one of",
        lambda s, t: gr.ReplayWriter(t / "out.h5", format="parquet"),
    ),
    (
        "batch larger than the store",
        ValueError,
        gr.InvalidArgumentError,
        "fewer than one batch of 64",
        lambda s, t: gr.make_data_loader(gr.open_source(s), batch_size=64),
    ),
    (
        "zero batch_size",
        ValueError,
        gr.InvalidArgumentError,
        "batch_size must be positive",
        lambda s, t: gr.make_data_loader(gr.open_source(s), batch_size=0),
    ),
    (
        "float batch_size",
        TypeError,
        gr.ArgumentTypeError,
        "batch_size must be an int",
        lambda s, t: gr.make_data_loader(gr.open_source(s), batch_size=2.5),
    ),
    (
        "zero num_epochs",
        ValueError,
        gr.InvalidArgumentError,
        "num_epochs",
        lambda s, t: gr.make_data_loader(gr.open_source(s), batch_size=4, num_epochs=0),
    ),
    (
        "negative worker_count",
        ValueError,
        gr.InvalidArgumentError,
        "worker_count",
        lambda s, t: gr.make_data_loader(gr.open_source(s), batch_size=4, worker_count=-1),
    ),
    (
        "negative retries",
        ValueError,
        gr.InvalidArgumentError,
        "retries",
        lambda s, t: gr.RetryOptions(retries=-1),
    ),
    (
        "window of length 0",
        ValueError,
        gr.InvalidArgumentError,
        "length must be positive",
        lambda s, t: gr.WindowDataSource(gr.open_source(s), length=0),
    ),
    (
        "gamma above 1",
        ValueError,
        gr.InvalidArgumentError,
        "gamma",
        lambda s, t: gr.NStepDataSource(gr.open_source(s), n=2, gamma=2.0),
    ),
    (
        "unknown flag leaf",
        ValueError,
        gr.UnknownLeafError,
        "names no leaf",
        lambda s, t: gr.build_episode_index(gr.open_source(s), done_key="finished"),
    ),
    (
        "budget_bytes without resident",
        ValueError,
        gr.InvalidArgumentError,
        "budget_bytes applies to resident=True",
        lambda s, t: gr.sharded_device_put(iter([]), budget_bytes=1),
    ),
    (
        "not a source",
        TypeError,
        gr.ArgumentTypeError,
        "is not a replay source",
        lambda s, t: gr.build_episode_index([1, 2, 3]),
    ),
    (
        "capacity not a positive int",
        ValueError,
        gr.InvalidArgumentError,
        "capacity must be a positive int",
        lambda s, t: gr.ReplayWriter(t / "buffer", capacity=0, writer_id="a"),
    ),
    (
        "writer id not a safe file name",
        ValueError,
        gr.InvalidArgumentError,
        "writer_id must be a safe file name",
        lambda s, t: gr.ReplayWriter(t / "buffer", capacity=10, writer_id="../a"),
    ),
]


@pytest.mark.parametrize(
    ("builtin", "cls", "phrase", "provoke"),
    [pytest.param(*c[1:], id=c[0]) for c in CASES],
)
def test_deliberate_error_has_its_class_and_builtin(
    store: str,
    tmp_path: Path,
    builtin: type[BaseException],
    cls: type[BaseException],
    phrase: str,
    provoke: Callable[..., Any],
):
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(cls) as info:
        provoke(store, tmp_path)
    e = info.value
    assert type(e) is cls, f"{type(e).__name__}: {e}"
    assert isinstance(e, gr.GrainReplayError)
    assert isinstance(e, builtin)
    assert phrase in str(e), str(e)
    # Nothing was written (a damaged file the case itself wrote is the only exception).
    assert sorted(os.listdir(tmp_path)) in (before, ["bad.h5"], ["left_open.h5"])


def test_every_error_class_is_exported_and_subclasses_a_builtin():
    classes = [getattr(errors, name) for name in errors.__all__]
    for cls in classes:
        assert getattr(gr, cls.__name__) is cls, f"gr.{cls.__name__} is not exported"
        assert cls.__name__ in gr.__all__
        assert issubclass(cls, gr.GrainReplayError)
        builtins = [
            b
            for b in inspect.getmro(cls)
            if b.__module__ == "builtins" and b not in (Exception, BaseException, object)
        ]
        assert cls is gr.GrainReplayError or builtins, f"{cls.__name__} has no builtin base"
    # Every class exported as an error is in errors.py (one room for them).
    exported = [
        getattr(gr, n)
        for n in gr.__all__
        if n.endswith("Error") and isinstance(getattr(gr, n), type)
    ]
    assert {c for c in exported if c.__module__ == "grain_replay.errors"} == set(classes)


def test_unknown_leaf_error_prints_its_message_not_a_repr(store: str):
    with pytest.raises(gr.UnknownLeafError) as info:
        gr.open_source(store, keys=["nope"])
    assert str(info.value).startswith(str(store))  # KeyError would quote it


def test_list_of_numbers_under_a_key_names_the_list_to_convert(tmp_path: Path):
    with pytest.raises(gr.InvalidTreeError, match=r"Leaf 'obs/0/0' is a float.*'obs'.*np\.asarray"):
        gr.write(tmp_path / "x.h5", {"obs": [[1.0, 2.0], [3.0, 4.0]]})
    with pytest.raises(gr.InvalidTreeError, match=r"Leaf 'flag' is a bool, not an array or"):
        gr.write(tmp_path / "x.h5", {"flag": True})
    assert not os.listdir(tmp_path)


def test_script_without_main_guard_says_the_guard_is_missing(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import numpy as np
            import grain_replay as gr

            path = gr.write("store.h5", {"x": np.arange(64, dtype=np.float32)}, overwrite=True)
            loader = gr.make_data_loader(gr.open_source(path), batch_size=8, worker_count=2)
            print(sum(len(b["x"]) for b in loader))
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("grain_replay.errors.WorkerDiedError:"), proc.stderr
    assert 'no `if __name__ == "__main__":` guard' in last
    assert "out-of-memory" not in proc.stderr
    # One line per worker and one traceback, not a traceback per worker.
    assert proc.stderr.count("Traceback") == 1, proc.stderr
    assert len(proc.stderr.splitlines()) < 40, proc.stderr


@pytest.mark.parametrize(
    ("source", "missing"),
    [
        ("loader = make()\nfor b in loader: pass\n", True),
        ('if __name__ == "__main__":\n    main()\n', False),
        ("if '__main__' == __name__:\n    main()\n", False),
        ('def main():\n    if __name__ == "__main__":\n        pass\n', True),  # not top level
        ('if __name__ != "__main__":\n    pass\n', True),
        ("this is not python (", False),  # unreadable: no claim about the guard
    ],
)
def test_main_guard_detection(tmp_path: Path, monkeypatch, source: str, missing: bool):
    script = tmp_path / "train.py"
    script.write_text(source)
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(script), raising=False)
    assert spawn_check.main_guard_missing() is missing


def test_main_guard_detection_ignores_non_files(monkeypatch):
    monkeypatch.delattr(sys.modules["__main__"], "__file__", raising=False)
    assert spawn_check.main_guard_missing() is False  # python -c, a notebook, a REPL


def test_empty_directory_error_suggests_what_the_readme_shows_and_the_fix_works(tmp_path: Path):
    empty = tmp_path / "replay"
    empty.mkdir()
    with pytest.raises(gr.InvalidStoreError) as info:
        gr.open_source(empty)
    message = str(info.value)
    assert "gr.write(path, tree, overwrite=True)" in message and "write_npy" not in message
    assert "gr.write(" in (Path(__file__).parents[1] / "README.md").read_text()
    gr.write(empty, {"x": np.arange(3)}, overwrite=True)  # the fix, as written
    assert len(gr.open_source(empty)) == 3


def test_missing_npy_directory_error_suggests_gr_write(tmp_path: Path):
    with pytest.raises(gr.StoreNotFoundError, match=r"gr\.write\(path, tree\)"):
        gr.NpyDataSource(tmp_path / "nothing")


def test_import_optional_names_the_fix_for_a_missing_or_blocked_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import email.mime.text  # a submodule already imported, then its package blocked

    from grain_replay.store.formats import import_optional

    assert import_optional("email.mime.text", "unused") is email.mime.text
    with pytest.raises(gr.MissingDependencyError, match="Fix: pip install nothing") as info:
        import_optional("no_such_module_here.sub", "needs it. Fix: pip install nothing")
    assert isinstance(info.value, ImportError) and isinstance(info.value.__cause__, ImportError)
    monkeypatch.setitem(sys.modules, "email", None)
    with pytest.raises(gr.MissingDependencyError, match="blocked"):
        import_optional("email.mime.text", "blocked")


def _closed_writer_append(t: Path) -> None:
    w = gr.ReplayWriter(t / "closed.h5")
    w.append({"x": np.zeros(2)})
    w.close()
    w.append({"x": np.zeros(2)})


@pytest.mark.parametrize(
    ("provoke", "phrases"),
    [
        (
            lambda s, t: gr.make_data_loader(gr.open_source(s), batch_size=0),
            ["batch_size must be positive", "got 0", "Fix: batch_size >= 1"],
        ),
        (
            lambda s, t: gr.make_data_loader(
                gr.open_source(s), batch_size=0, sampling=gr.UniformReplay()
            ),
            ["batch_size must be >= 1, got 0", "Fix: batch_size >= 1"],
        ),
        (
            lambda s, t: _closed_writer_append(t),
            ["the ReplayWriter is closed", "Fix:", "new gr.ReplayWriter on the same path"],
        ),
        (
            lambda s, t: gr.ReplayWriter(t / "z.zarr", compression="gzipp").append(
                {"x": np.zeros(2)}
            ),
            ["compression must be one of", "'gzipp'", "Fix: compression='gzip' (did you mean"],
        ),
        (
            lambda s, t: gr.write(t / "out.h5", {"x": np.zeros(4)}, compression="gzipp"),
            ["got 'gzipp'", "Fix: compression='gzip'"],
        ),
        (
            lambda s, t: gr.write(t / "out", {"x": np.zeros(4)}, format="hdf"),
            ["format must be one of", "Fix: format='hdf5'"],
        ),
        (
            lambda s, t: gr.ReplayWriter(t / "w", flush_every=0),
            ["flush_every must be positive", "Fix:"],
        ),
        (
            lambda s, t: gr.ReplayWriter(t / "w", resume_from=-1),
            ["resume_from must be >= 0", "Fix:"],
        ),
    ],
)
def test_user_reported_messages_say_expected_got_and_fix(
    store: str, tmp_path: Path, provoke: Callable[..., Any], phrases: list[str]
) -> None:
    with pytest.raises(gr.GrainReplayError) as info:
        provoke(store, tmp_path)
    msg = str(info.value)
    for phrase in phrases:
        assert phrase in msg, msg


# Every deliberate error raised by these modules carries its fix (checked in the source:
# a message written in place says "Fix", or is built by a helper that does).
FIX_CHECKED = [
    "grain_replay/pipeline/batches.py",
    "grain_replay/sampling/arguments.py",
    *sorted(
        str(p.relative_to(Path(__file__).parents[1]))
        for p in (Path(__file__).parents[1] / "grain_replay" / "writers").glob("*.py")
    ),
]


@pytest.mark.parametrize("module", FIX_CHECKED)
def test_deliberate_errors_of_the_module_carry_a_fix(module: str) -> None:
    import ast

    text = (Path(__file__).parents[1] / module).read_text()
    missing = []
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
            continue
        func = node.exc.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        if name not in errors.__all__ or not node.exc.args:
            continue
        message = node.exc.args[0]
        if isinstance(message, ast.Call):  # built by a helper (checked where it is)
            continue
        source = ast.get_source_segment(text, message) or ""
        if "Fix" not in source and "choice_fix(" not in source:
            missing.append(f"{module}:{node.lineno}: {source[:80]}")
    assert not missing, "messages without 'Fix': " + "; ".join(missing)
