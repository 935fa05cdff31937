"""A many-writer store's schema: the leaves its writers agree on, and those a reader returns."""

from __future__ import annotations

from typing import Any

import numpy as np

from grain_replay.errors import InvalidStoreError, UnknownLeafError
from grain_replay.sources.base import Layout, select_keys
from grain_replay.store import layout as layout_lib
from grain_replay.store import parts as parts_lib
from grain_replay.store.layout import LeafSpec

__all__ = ["WRITER_KEY", "read_schema", "select_leaves"]

# The leaf that names each row's writer (its ordinal); not stored in any segment.
WRITER_KEY = "_writer"


def read_schema(
    store: str, manifests: list[parts_lib.Manifest]
) -> tuple[str, layout_lib.StoreMetadata] | None:
    """The store's leaves and tree, from its writers' schemas (which must agree), with
    the first schema's text; None while no writer has committed a row.

    Raises:
      InvalidStoreError: two writers wrote different leaves.
    """
    first: tuple[str, layout_lib.StoreMetadata] | None = None
    first_text = None
    for m in manifests:
        if m.schema is None or m.schema == first_text:
            continue  # the same text as the first: parsed once
        meta = layout_lib.StoreMetadata.from_json(m.schema, where=store)
        first_text = m.schema if first is None else first_text
        if first is None:
            first = (m.writer_id, meta)
        elif meta.leaves != first[1].leaves or meta.treedef != first[1].treedef:
            raise InvalidStoreError(
                f"{store}: writer {m.writer_id!r} wrote leaves {list(meta.leaves)} "
                f"that do not match writer {first[0]!r}'s {list(first[1].leaves)} (or "
                "their dtypes/shapes). Fix: remove one writer's folder under writers/, or "
                "read it alone."
            )
    if first is None or first_text is None:
        return None
    return first_text, first[1]


def select_leaves(
    store: str,
    meta: layout_lib.StoreMetadata,
    requested: list[str] | None,
    *,
    with_writer: bool,
    only_writer: bool,
) -> tuple[dict[str, LeafSpec], dict[str, Any]]:
    """The spec and treedef a reader of leaves ``requested`` (plus :data:`WRITER_KEY`
    with ``with_writer``; only it with ``only_writer``) returns."""
    full = Layout(0, dict(meta.leaves), meta.treedef, {k: k for k in meta.leaves})
    if only_writer:
        chosen = Layout(0, {}, {"type": "dict", "keys": [], "children": []}, {})
    else:
        chosen = select_keys(full, requested, store)
    spec, treedef = dict(chosen.spec), chosen.treedef
    if with_writer:
        if treedef.get("type") != "dict" or WRITER_KEY in treedef["keys"]:
            raise UnknownLeafError(
                f"{store}: keys= names {WRITER_KEY!r}, which needs records that are "
                "dicts without a leaf of that name. Fix: drop it from keys."
            )
        treedef = {
            "type": "dict",
            "keys": [*treedef["keys"], WRITER_KEY],
            "children": [*treedef["children"], {"type": "leaf"}],
        }
        spec[WRITER_KEY] = LeafSpec(np.dtype(np.int64), ())
    return spec, treedef
