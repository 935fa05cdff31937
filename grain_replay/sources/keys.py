"""What a source learns from its store when it opens it (:class:`Layout`), and ``keys=``:
the layout cut down to the leaves or groups a reader asks for (:func:`select_keys`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from grain_replay import tree as tree_lib
from grain_replay.errors import UnknownLeafError
from grain_replay.store.layout import LeafSpec, StoreMetadata

__all__ = ["Layout", "select_keys"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a source learns from the store when it is constructed."""

    num_records: int
    spec: dict[str, LeafSpec]
    treedef: dict[str, Any]
    # Leaf key -> location inside the store (dataset path, array path, file).
    locations: dict[str, str]
    # Per-leaf block checksums recorded by the writer, if any.
    checksums: dict[str, Any] | None = None
    # The store's id in its metadata (None: a foreign store, or one made before ids).
    store_id: str | None = None

    @classmethod
    def of_store(cls, meta: StoreMetadata, locations: dict[str, str]) -> Layout:
        """The layout a writer's committed metadata describes, its leaves at ``locations``."""
        return cls(
            meta.num_records,
            dict(meta.leaves),
            meta.treedef,
            locations,
            meta.checksums,
            meta.store_id,
        )


def select_keys(layout: Layout, keys: Sequence[str] | None, where: str) -> Layout:
    """Restricts ``layout`` to ``keys`` (leaf keys or group prefixes such as ``"obs"``)."""
    if keys is None:
        return layout
    if isinstance(keys, str):
        keys = [keys]
    all_keys = list(layout.spec)
    chosen: list[str] = []
    for want in keys:
        hits = [k for k in all_keys if k == want or k.startswith(want.rstrip("/") + "/")]
        if not hits:
            raise UnknownLeafError(
                f"{where}: keys= names {want!r}, which is not a leaf or group of the store. "
                f"Leaves: {all_keys}. Fix: pick keys from that list."
            )
        chosen.extend(k for k in hits if k not in chosen)
    if len(chosen) == len(all_keys):
        return layout
    treedef = tree_lib.prune_treedef(layout.treedef, chosen)
    ordered = tree_lib.leaf_keys(treedef)
    return Layout(
        layout.num_records,
        {k: layout.spec[k] for k in ordered},
        treedef,
        {k: layout.locations[k] for k in ordered},
        None if layout.checksums is None else {k: layout.checksums[k] for k in ordered},
        layout.store_id,
    )
