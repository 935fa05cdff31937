"""D4RL-layout HDF5 files as transition sources, episodes from ``terminals | timeouts``."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from grain_replay.errors import InvalidStoreError, StoreNotFoundError
from grain_replay.rl.transitions import TransitionDataSource
from grain_replay.sources.hdf5 import HDF5DataSource
from grain_replay.sources.reading.cache import DEFAULT_CACHE_BYTES
from grain_replay.store.formats import HDF5_SIGNATURE, import_h5py, shown_path

__all__ = ["D4RLDataSource"]

logger = logging.getLogger(__name__)

_REQUIRED = ("observations", "actions", "rewards")


def _step_datasets(path: str) -> tuple[list[str], list[str], int]:
    """Datasets with one row per step, datasets skipped, and the number of steps."""
    h5py = import_h5py()
    if not os.path.exists(path):
        raise StoreNotFoundError(
            f"No D4RL file at {shown_path(path)}. Fix: check the path (D4RL keeps its files under "
            "~/.d4rl/datasets)."
        )
    with open(path, "rb") as f:
        if f.read(8) != HDF5_SIGNATURE:
            raise InvalidStoreError(f"{path} is not an HDF5 file (no HDF5 signature).")
    found: dict[str, tuple[tuple[int, ...], Any]] = {}
    try:
        with h5py.File(path, "r") as f:

            def visit(name: str, obj: Any) -> None:
                if isinstance(obj, h5py.Dataset):
                    found[name] = (tuple(obj.shape or ()), obj.dtype)

            f.visititems(visit)
    except OSError as e:
        raise InvalidStoreError(
            f"{path}: h5py cannot open the file ({e}). It may be truncated or corrupt. "
            "Fix: download or write it again."
        ) from e
    missing = [k for k in _REQUIRED if k not in found]
    if missing:
        raise InvalidStoreError(
            f"{path}: not a D4RL-layout file: datasets {missing} are missing (it has "
            f"{sorted(found)}). Fix: pass a D4RL file, or open it with gr.HDF5DataSource and "
            "wrap it in gr.TransitionDataSource with obs_key=/done_key=."
        )
    n = found["observations"][0][0] if found["observations"][0] else 0
    keep, skipped = [], []
    for name, (shape, dtype) in found.items():
        if shape[:1] == (n,) and not (dtype.hasobject or dtype.kind in "OUSV"):
            keep.append(name)
        else:
            skipped.append(name)
    if skipped:
        logger.info(
            "%s: skipping datasets without one numeric row per step (%d steps): %s",
            path, n, ", ".join(sorted(skipped)),
        )  # fmt: skip
    return keep, skipped, n


class D4RLDataSource(TransitionDataSource):
    """A D4RL-layout HDF5 file as a random-access source of transitions.

    The file holds ``observations``, ``actions``, ``rewards``, ``terminals``,
    ``timeouts``, optionally ``next_observations`` and ``infos/...``, all with
    one row per step; datasets of other lengths (``metadata/...``, scalars)
    are skipped with a log line. Episodes end where ``terminals | timeouts``;
    ``terminals`` marks terminations. Records keep D4RL's names; each has
    ``next_observations``: read from the file when it has them (every step is
    a record), else derived as ``observations[t+1]`` within the episode, in
    which case the last step of a timed-out (or unfinished) episode is not a
    record and a terminal step's ``next_observations`` repeats its own
    observation (see :class:`TransitionDataSource`).

    Args:
      path: the ``.hdf5`` file.
      keys: leaves (or groups) to include; default every per-step dataset.
      cache: read/write the episode index cache (``<path>.episodes.npz``).
      cache_bytes: bound of the decoded-chunk cache per process.

    Attributes:
      episodes: the :class:`EpisodeIndex` of the records;
        ``step_episodes`` that of the file's steps.

    Raises:
      StoreNotFoundError: no file at ``path``.
      InvalidStoreError: not HDF5, or ``observations``/``actions``/``rewards``
        or both ``terminals`` and ``timeouts`` missing.

    Examples:
      >>> src = gr.D4RLDataSource("~/.d4rl/datasets/hopper_medium-v2.hdf5")
      >>> src.episodes.num_episodes, src[0]["next_observations"].shape
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        keys: Sequence[str] | str | None = None,
        *,
        cache: bool = True,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ):
        path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        steps, _, _ = _step_datasets(path)
        term = "terminals" if "terminals" in steps else None
        trunc = "timeouts" if "timeouts" in steps else None
        if term is None and trunc is None:
            raise InvalidStoreError(
                f"{path}: neither 'terminals' nor 'timeouts' has one row per step, so episodes "
                f"cannot be found (datasets: {sorted(steps)}). Fix: open it with "
                "gr.HDF5DataSource and pass done_key= to gr.TransitionDataSource."
            )
        if trunc is None:
            logger.warning(
                "%s: no 'timeouts' dataset: time-limit episode ends are invisible and such "
                "episodes merge with the next one",
                path,
            )
        self._d4rl_path = path
        source = HDF5DataSource(path, keys=steps, cache_bytes=cache_bytes)
        super().__init__(
            source, keys, obs_key="observations", next_obs_key="next_observations",
            terminated_key=term, truncated_key=trunc, cache=cache,
        )  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"D4RLDataSource(path={self._d4rl_path!r}, keys={self.keys!r}, num_records={len(self)})"
        )
