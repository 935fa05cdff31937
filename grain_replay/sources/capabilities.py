"""What a source, a sampler or an iterator can do beyond reading batches, one Protocol each.

The package asks an object whether it has a capability with ``isinstance(x, Refreshable)``
and then calls the attribute plainly, so each capability has one name, one signature and
one docstring, and a new source learns from this module what it may offer. Every Protocol
is ``runtime_checkable``: ``isinstance`` only checks that the members exist (a method set
to None counts as absent), not their signatures. It reads each member with ``hasattr``,
so a property runs (and one that raises anything but ``AttributeError`` propagates): the
properties here are cheap reads of state the object holds. ``isinstance`` against a
Protocol costs microseconds, so it is asked once per object or per batch, never per record.

Left as ``getattr``/``hasattr`` on purpose, as they are no capability tests: reads of an
optional value with a default (``path``, ``format``, ``checksums``, ``fps``, ``position``,
a batch's ``index``, a stream's ``sampler`` and its ``options``, a loader's ``plan`` and
``sampling``, options' fields, exception attributes such as ``response``); private
attributes (``_handle``, ``_opens``, ``_layout``, ``_store``, ``_prefetcher``,
``mapped_files``); attributes looked up by a name held in a variable (per-process state,
lazy module exports); other libraries' objects (jax, zarr, h5py, fsspec, numpy, ``os``,
``mmap``, ``crc32c``, PyAV); the override check of ``read_windows`` (which method, not
whether); and ``store/watermark.py``'s ``get_state`` test, which sits below this layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "BindsMaps",
    "Checkpointable",
    "Closeable",
    "HasEpisodeBounds",
    "HasEpisodeEnds",
    "HasEpisodes",
    "HasSpec",
    "HasStoreId",
    "HasTreedef",
    "HasWatermark",
    "HasWriters",
    "HandsOverGroups",
    "LaysOutLanes",
    "ManyWriterStore",
    "OnObjectStorage",
    "Prefetches",
    "PriorityUpdates",
    "ReadsIds",
    "ReadsInto",
    "Refreshable",
    "StateAt",
]

Ids = Sequence[int] | np.ndarray


# -- sources ----------------------------------------------------------------------------


@runtime_checkable
class Refreshable(Protocol):
    """A store that can grow: ``refresh()`` looks for new commits and returns the length.

    Every grain_replay store; an RL view's ``refresh`` also takes the new episodes.
    """

    def refresh(self) -> int: ...


@runtime_checkable
class ReadsIds(Protocol):
    """Reads rows by row id, not position: a bounded many-writer store, whose positions move
    as writers evict (``PartsDataSource``). Replay draws ids from it, and caches keyed by
    position (statistics, episode indexes) are not kept for it."""

    def read_ids(self, ids: Ids, *, evicted: str = "raise") -> Any: ...
    def read_ids_flat(self, ids: Ids, *, evicted: str = "raise") -> dict[str, np.ndarray]: ...
    def read_ids_checked(self, ids: Ids) -> tuple[Any, np.ndarray]: ...


@runtime_checkable
class ReadsInto(Protocol):
    """Reads rows of the leaves named in ``out`` into those arrays (no new arrays)."""

    def read_into(self, indices: Ids, out: Mapping[str, np.ndarray]) -> None: ...


@runtime_checkable
class HasSpec(Protocol):
    """Says its leaves (key -> ``LeafSpec``: dtype and per-row shape) without reading."""

    @property
    def spec(self) -> Mapping[str, Any]: ...


@runtime_checkable
class HasTreedef(Protocol):
    """Says the structure its records' leaves build (a nested dict of leaf keys)."""

    @property
    def treedef(self) -> Any: ...


@runtime_checkable
class Closeable(Protocol):
    """Holds handles that ``close()`` releases."""

    def close(self) -> None: ...


@runtime_checkable
class HasEpisodes(Protocol):
    """Knows its episodes as an ``EpisodeIndex`` (Minari, LeRobot, D4RL)."""

    @property
    def episodes(self) -> Any: ...


@runtime_checkable
class HasEpisodeEnds(Protocol):
    """Knows its episodes as arrays, for a store below ``rl/`` (RLDS): the exclusive end
    step of each episode and whether it terminated."""

    @property
    def episode_ends(self) -> np.ndarray: ...
    @property
    def episode_terminated(self) -> np.ndarray: ...


@runtime_checkable
class HasEpisodeBounds(Protocol):
    """Knows episode bounds its flag leaves alone do not give (a flashbax Vault's rows):
    ``(ends, terminated, open_last)``, or None."""

    def episode_bounds(self) -> tuple[np.ndarray, np.ndarray, bool] | None: ...


@runtime_checkable
class HasWriters(Protocol):
    """Names its writers: each one's manifest (``writer_id``, ``committed``...) in the
    snapshot read. A replay checkpoint's watermark then counts rows per writer."""

    @property
    def writers(self) -> list[Any]: ...


@runtime_checkable
class HasStoreId(Protocol):
    """Knows the id its writers gave the store (None: a foreign store, or one made before
    ids): a replay checkpoint names the store by it, whatever path it is reached by."""

    @property
    def store_id(self) -> str | None: ...


@runtime_checkable
class ManyWriterStore(Protocol):
    """A bounded store many writers append to (``PartsDataSource``): an id, the rows on
    disk now, and positions that restart at each writer's rows."""

    @property
    def store_id(self) -> str | None:
        """The id the store had when opened (None: made before ids)."""
        ...

    def committed_rows(self) -> dict[str, int]:
        """Each writer's committed rows in the store now (the manifests on disk)."""
        ...

    def current_store_id(self) -> str | None:
        """The id of the store at its path now."""
        ...

    def writer_starts(self) -> np.ndarray:
        """The position of each writer's oldest live row in the snapshot."""
        ...


@runtime_checkable
class OnObjectStorage(Protocol):
    """A many-writer store on object storage (``ObjectPartsDataSource``): a rate-limited
    learner publishes its progress into the folder it gives (in the bucket) and counts the
    writers' rows from its manifests, as it does in a local store's folder."""

    def learners_folder(self) -> Any:
        """Where learners publish (``grain_replay.store.object_folder.ObjectFolder``)."""
        ...

    def inserted_count(self) -> Any:
        """The writers' rows (``ObjectInsertedCount``: ``read() -> (inserted, live)``)."""
        ...


@runtime_checkable
class HasWatermark(Protocol):
    """Names each writer's committed rows its draws come from (a replay sampler over a
    many-writer store); None when it has no writers to name."""

    def commit_watermark(self) -> Mapping[str, int] | None: ...


# -- iterators and streams --------------------------------------------------------------


@runtime_checkable
class Checkpointable(Protocol):
    """An iterator whose position can be saved and restored."""

    def get_state(self) -> Any: ...
    def set_state(self, state: Any) -> None: ...


@runtime_checkable
class StateAt(Protocol):
    """An iterator that can give the state of an earlier position (a replay iterator,
    whose state holds the priorities as they were then)."""

    def get_state_at(self, position: int) -> Any: ...


@runtime_checkable
class PriorityUpdates(Protocol):
    """An iterator that samples with priorities and takes new ones for drawn rows (a
    replay iterator also takes ``handed_out=``: the batches its caller received)."""

    def update_priorities(self, index: Any, priorities: Any, **kwargs: Any) -> None: ...


@runtime_checkable
class Prefetches(Protocol):
    """An iterator that can start reading ahead before its first ``next()``."""

    def start_prefetch(self) -> None: ...


@runtime_checkable
class LaysOutLanes(Protocol):
    """A loader iterator that can hand out batches whose leaves lie in one buffer laid out
    as a packed transfer's (``pipeline/lanes.py``), for ``sharded_device_put`` to put as is."""

    def lay_out_lanes(self) -> None: ...


@runtime_checkable
class HandsOverGroups(Protocol):
    """A loader iterator whose workers can hand batches over ``group`` at a time (one
    message and one shared-memory slot a group), for ``sharded_device_put`` moving that
    many batches a transfer: the consumer's cost a batch is then paid once a group."""

    def hand_over(self, group: int) -> None: ...


@runtime_checkable
class BindsMaps(Protocol):
    """A sampling stream whose reader returns more than the maps see: it gives the reader
    that applies the maps itself."""

    def bind_maps(self, maps: Sequence[Any]) -> Any: ...
