"""The files of a LeRobot dataset's meta/ folder read: JSON, JSON lines and parquet tables."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from grain_replay.errors import InvalidStoreError, StoreNotFoundError
from grain_replay.store.formats import shown_path
from grain_replay.store.optional import import_optional

__all__ = ["load_json", "load_jsonl", "parquet_files", "pyarrow_parquet", "table_columns"]


def pyarrow_parquet() -> Any:
    """``pyarrow.parquet``, or MissingDependencyError with the install hint."""
    return import_optional(
        "pyarrow.parquet",
        "Reading LeRobot datasets needs pyarrow. Fix: pip install pyarrow av "
        "(or grain_replay[rl]).",
    )


def load_json(path: str) -> Any:
    """The JSON file ``path`` (FileNotFoundError when missing; InvalidStoreError when bad)."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise InvalidStoreError(
            f"{path}: cannot read it as JSON ({e}). Fix: restore the file from the dataset's "
            "source (e.g. download the dataset again)."
        ) from e


def load_jsonl(path: str) -> list[dict[str, Any]]:
    """The JSON objects of the JSON-lines file ``path``, one a non-empty line."""
    if not os.path.isfile(path):
        raise StoreNotFoundError(
            f"{shown_path(path)}: missing. A LeRobot v2.1 dataset lists its rows there."
        )
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise InvalidStoreError(
                        f"{path}, line {number}: not JSON ({e}). Fix: restore the file from the "
                        "dataset's source."
                    ) from e
                if not isinstance(row, dict):
                    raise InvalidStoreError(f"{path}, line {number}: expected a JSON object.")
                out.append(row)
    return out


def parquet_files(root: str, pattern: str) -> list[str]:
    """The files under ``root`` matching ``pattern``, relative to ``root``, sorted."""
    return sorted(
        os.path.relpath(p, root) for p in glob.glob(os.path.join(root, pattern), recursive=False)
    )


def table_columns(paths: list[str], columns: list[str] | None) -> dict[str, list[Any]]:
    """Columns of parquet files, concatenated, as Python lists (small metadata tables)."""
    pq = pyarrow_parquet()
    out: dict[str, list[Any]] = {}
    for path in paths:
        try:
            table = pq.read_table(path, columns=columns)
        except (OSError, ValueError) as e:
            raise InvalidStoreError(
                f"{path}: cannot read it ({e}). Fix: download or re-create the dataset's "
                "meta/ folder."
            ) from e
        for name in table.column_names:
            out.setdefault(name, []).extend(table.column(name).to_pylist())
    return out
