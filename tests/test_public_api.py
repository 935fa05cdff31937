"""``gr.__all__`` pinned: a public name appears or goes only with this list (and CHANGELOG).

Users and acceptance checks rely on every ``gr.*`` name, and on every import path the README,
docs and examples show; module paths behind them may move freely.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

import grain_replay as gr

ROOT = pathlib.Path(gr.__file__).parent.parent

SOURCES = [
    "HDF5DataSource",
    "NpyDataSource",
    "NpzDataSource",
    "ObjectPartsDataSource",
    "PartsDataSource",
    "ReplaySource",
    "ZarrDataSource",
]
DATASETS = [
    "D4RLDataSource",
    "LeRobotDataSource",
    "MinariDataSource",
    "RLDSDataSource",
    "TorchRLDataSource",
    "VaultDataSource",
]
VIEWS = [
    "EpisodeIndex",
    "NStepDataSource",
    "SequenceDataSource",
    "TransitionDataSource",
    "WindowDataSource",
    "build_episode_index",
]
FUNCTIONS_AND_OPTIONS = [
    "DeviceReplay",
    "LeafSpec",
    "LoaderOptions",
    "PrioritizedReplay",
    "RateLimit",
    "ReplayWriter",
    "RetryOptions",
    "Sampled",
    "UniformReplay",
    "Watermark",
    "compute_stats",
    "make_data_loader",
    "open_source",
    "read_watermark",
    "replay_dataset",
    "sharded_device_put",
    "shutdown_distributed",
    "truncate_to_watermark",
    "write",
    "write_hdf5",
    "write_npy",
    "write_zarr",
]
ERRORS = [
    "ArgumentTypeError",
    "BackgroundWriteError",
    "BatchShardingError",
    "CheckpointMismatchError",
    "EvictedRowError",
    "FrameTimestampError",
    "GrainReplayError",
    "InvalidArgumentError",
    "InvalidPrefetchError",
    "InvalidPriorityError",
    "InvalidSamplingError",
    "InvalidShardingError",
    "InvalidStoreError",
    "InvalidTreeError",
    "LeafMismatchError",
    "MissingDependencyError",
    "PriorityIndexError",
    "RateLimitTimeoutError",
    "RecordIndexError",
    "ReferenceRefusedError",
    "ReplayCheckpointError",
    "ResidentBudgetError",
    "ResidentUnsupportedError",
    "StoreAccessError",
    "StoreExistsError",
    "StoreNotFoundError",
    "StoreUnreachableError",
    "UnfinishedWriteError",
    "UnknownLeafError",
    "UnsupportedStateError",
    "WorkerDiedError",
    "WriterBusyError",
]
PUBLIC = ["__version__", *SOURCES, *DATASETS, *VIEWS, *FUNCTIONS_AND_OPTIONS, *ERRORS]


def test_all_is_exactly_the_pinned_names() -> None:
    assert len(PUBLIC) == len(set(PUBLIC))
    added = sorted(set(gr.__all__) - set(PUBLIC))
    removed = sorted(set(PUBLIC) - set(gr.__all__))
    assert not added and not removed, (
        f"gr.__all__ added {added} and removed {removed}. Fix: a public name changes with "
        "tests/test_public_api.py and a CHANGELOG entry (Breaking changes for a removal)."
    )
    assert len(gr.__all__) == len(set(gr.__all__))


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_resolves_and_is_listed_by_dir(name: str) -> None:
    assert getattr(gr, name) is not None
    assert name in dir(gr)


@pytest.mark.parametrize("name", ERRORS)
def test_every_public_error_is_a_grain_replay_error_and_a_builtin_one(name: str) -> None:
    cls = getattr(gr, name)
    assert issubclass(cls, gr.GrainReplayError)
    builtins = [c for c in cls.__mro__ if c.__module__ == "builtins" and c is not object]
    assert any(c not in (BaseException, Exception) for c in builtins) or cls is gr.GrainReplayError


@pytest.mark.parametrize("name", [*SOURCES, *DATASETS])
def test_sources_and_datasets_are_classes_named_like_grain_sources(name: str) -> None:
    cls = getattr(gr, name)
    assert isinstance(cls, type)
    assert name.endswith(("DataSource", "Source"))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        gr.NoSuchThing  # noqa: B018


_IMPORT = re.compile(
    r"^\s*(?:from (grain_replay[\w.]*) import ([\w, ()]+)|import (grain_replay[\w.]*))", re.M
)


def _shown_imports() -> set[tuple[str, str | None]]:
    """Every ``grain_replay`` import in the README, docs/ and examples/."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += sorted((ROOT / "examples").glob("*.py"))
    out: set[tuple[str, str | None]] = set()
    for f in files:
        for m in _IMPORT.finditer(f.read_text()):
            if m.group(3):
                out.add((m.group(3), None))
            else:
                for item in m.group(2).strip("()").split(","):
                    if item.split():
                        out.add((m.group(1), item.split()[0]))  # `x as y` imports x
    return out


def test_every_import_the_docs_and_examples_show_works() -> None:
    shown = _shown_imports()
    assert ("grain_replay", None) in shown  # the scan found the README's imports
    code = "\n".join(
        f"import {mod}" if name is None else f"from {mod} import {name}"
        for mod, name in sorted(shown)
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{code}\n{proc.stderr}"
