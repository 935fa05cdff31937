"""The checkpoint of a sampling iterator: one JSON document, priorities included.

``get_state()`` of a mixture or replay loader's iterator is JSON bytes holding
``version``, ``sampling`` (the stream's description), ``position`` (batches
handed out), ``sampler`` (its state before the next batch), the store's commit
``watermark`` (a replay mixture: ``watermarks``, one per source), a rate limit's
counters (``rate_limit``) and, with prioritized replay, the ``priorities`` (numpy
arrays as base64; the draws ahead only when one of them looked at the store).
Version 1 has none of watermark, rate limit and priorities; version 2 lacks the
rate limit (its rows handed out are the position's batches).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from grain_replay.errors import ReplayCheckpointError
from grain_replay.sampling.encoded import decode_arrays, json_pieces
from grain_replay.sampling.replay import reaches
from grain_replay.sources.capabilities import (
    HasStoreId,
    HasWatermark,
    HasWriters,
    ManyWriterStore,
)
from grain_replay.store.watermark import Watermark, identity_mismatch, same_path, same_store

__all__ = [
    "STATE_VERSION",
    "Decoded",
    "check_store",
    "decode_state",
    "drawn_arrays",
    "encode_state",
    "parse_drawn",
    "store_watermark",
]

# 2: the state also holds the store's watermark and, with priorities, the priority state.
# 3: and, with a rate limit, its counters (a state without them: rows handed out are
# the position's batches).
STATE_VERSION = 3
_READS_VERSIONS = (1, 2, 3)


class Decoded(NamedTuple):
    """A decoded iterator state (checked against the iterator's description)."""

    position: int
    sampler: Any
    watermark: Watermark | None
    rate_limit: Any
    priorities: dict[str, np.ndarray] | None
    watermarks: dict[str, Watermark] | None = None  # a replay mixture's, by source name


def encode_state(
    *,
    sampling: dict[str, Any],
    position: int,
    sampler: Any,
    watermark: Watermark | None,
    rate_limit: Any,
    priorities: Mapping[str, np.ndarray] | None,
    watermarks: Mapping[str, Watermark] | None = None,
) -> bytes:
    """The JSON bytes of a state (``priorities`` encoded at once, without a copy)."""
    out: dict[str, Any] = {
        "version": STATE_VERSION,
        "sampling": sampling,
        "position": position,
        "sampler": sampler,
    }
    if watermark is not None:
        out["watermark"] = watermark.to_json()
    if watermarks is not None:
        out["watermarks"] = {name: mark.to_json() for name, mark in watermarks.items()}
    if rate_limit is not None:
        out["rate_limit"] = rate_limit
    text = json.dumps(out).encode()
    if priorities is None:
        return text
    return b"".join([text[:-1], b', "priorities": ', *json_pieces(priorities), b"}"])


def decode_state(state: bytes, sampling: dict[str, Any]) -> Decoded:
    """:func:`encode_state`'s bytes, for an iterator described by ``sampling``.

    Raises:
      ReplayCheckpointError: not such a state, or one of another mode, store, batch
        size or seed.
    """
    try:
        decoded = json.loads(bytes(state).decode())
        version, described = decoded["version"], decoded["sampling"]
        position, sampler = int(decoded["position"]), decoded["sampler"]
        priorities = decoded.get("priorities")
        if priorities is not None:
            priorities = decode_arrays(priorities)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ReplayCheckpointError(
            f"Not a state of a mixture or replay loader ({type(e).__name__}: {e}). "
            "Fix: pass bytes from get_state() of a loader made with the same arguments."
        ) from e
    if version not in _READS_VERSIONS or described != sampling:
        raise ReplayCheckpointError(
            f"The state was saved by a loader with {described}; this one has "
            f"{sampling}. Fix: resume with the same sources, sampling, "
            "batch_size and seed."
        )
    mark, marks = decoded.get("watermark"), decoded.get("watermarks")
    watermark = None if mark is None else Watermark.from_json(mark)
    watermarks = None
    if isinstance(marks, Mapping):
        watermarks = {str(k): Watermark.from_json(v) for k, v in marks.items()}
    return Decoded(position, sampler, watermark, decoded.get("rate_limit"), priorities, watermarks)


def store_watermark(sampler: Any, source: Any) -> Watermark:
    """The rows ``sampler`` draws from ``source``, as the store's writers count them."""
    store = str(getattr(source, "path", None) or repr(source))
    sid = source.store_id if isinstance(source, HasStoreId) else None
    sid = sid if isinstance(sid, str) else None
    # A bounded many-writer store names each writer's committed rows in the view:
    # through commit_watermark(), or the writers' manifests of its snapshot.
    if isinstance(sampler, HasWatermark):  # the writers' rows the draws come from
        writers = sampler.commit_watermark()
        if writers is not None:
            return Watermark(store, writers=dict(writers), store_id=sid)
    if isinstance(source, HasWatermark):
        writers = source.commit_watermark()
        if writers is not None:
            return Watermark(store, writers=dict(writers), store_id=sid)
    manifests = source.writers if isinstance(source, HasWriters) else None
    if isinstance(manifests, list) and all(
        hasattr(m, "writer_id") and hasattr(m, "committed") for m in manifests
    ):
        writers = {m.writer_id: int(m.committed) for m in manifests}
        return Watermark(store, writers=writers, store_id=sid)
    return Watermark(store, rows=int(sampler.bound), store_id=sid)


def check_store(saved: Watermark, ours: Watermark | None, source: Any) -> None:
    """The checkpoint's store is this iterator's (``ours``), and holds the rows it covers.

    A many-writer store must hold, for every writer the saved watermark names, at
    least its marked committed rows (evicted ones count: eviction since the
    checkpoint is expected; rows committed after the mark are allowed too).

    The store is matched by its id (a symlink, a relative path, a moved folder or a
    copy restore), by its real path where the store or the checkpoint has none.

    Raises:
      ReplayCheckpointError: another store, another kind of store (plain vs
        many-writer), or rows the checkpoint replayed are gone.
    """
    if ours is None:
        return
    replaced = same_path(saved.store, ours.store) and (
        (saved.writers is None) != (ours.writers is None)
    )  # worded below: the other kind of store is there now
    if not replaced and not same_store(saved, ours.store, ours.store_id):
        raise ReplayCheckpointError(
            f"The checkpoint was saved replaying another store than this iterator replays: "
            f"{identity_mismatch(saved, ours.store, ours.store_id)}. Fix: restore into a "
            "loader over the store it was saved with (by any path), or start the learner "
            "afresh."
        )
    if saved.writers is not None:
        _check_writers(saved, ours, source)
        return
    if ours.writers is not None:
        raise ReplayCheckpointError(
            f"The checkpoint drew from the plain store {saved.store} ({saved.rows} rows); "
            "a bounded many-writer store is there now: the store was replaced. Fix: "
            "restore with the store as it was saved, or start the learner afresh."
        )
    if saved.rows is not None and not reaches(source, saved.rows):
        raise ReplayCheckpointError(
            f"The checkpoint drew from the first {saved.rows} rows of {saved.store}, which "
            f"holds {len(source)} committed rows now: rows it replayed are gone. Fix: "
            "restore with the store as it was saved (a writer reopened with resume_from= "
            "drops only rows after the checkpoint)."
        )


def _held_rows(source: Any) -> dict[str, int] | None:
    """Each writer's committed rows in ``source``'s store now (None: not a many-writer one)."""
    if isinstance(source, ManyWriterStore):  # the manifests on disk, not a snapshot
        return {str(k): int(v) for k, v in dict(source.committed_rows()).items()}
    view = source.commit_watermark() if isinstance(source, HasWatermark) else None
    if view is not None:
        return {str(k): int(v) for k, v in dict(view).items()}
    manifests = source.writers if isinstance(source, HasWriters) else None
    if isinstance(manifests, list) and all(
        hasattr(m, "writer_id") and hasattr(m, "committed") for m in manifests
    ):
        return {m.writer_id: int(m.committed) for m in manifests}
    return None


def _check_writers(saved: Watermark, ours: Watermark, source: Any) -> None:
    """Every writer ``saved`` names still holds its marked rows (see :func:`check_store`)."""
    assert saved.writers is not None
    held = _held_rows(source) if ours.writers is not None else None
    if held is None:
        raise ReplayCheckpointError(
            f"The checkpoint drew from the bounded many-writer store {saved.store} (writers "
            f"{sorted(saved.writers)}); a plain store is there now: the store was replaced. "
            "Fix: restore with the store as it was saved, or start the learner afresh."
        )
    sid = source.current_store_id() if isinstance(source, ManyWriterStore) else None
    if None not in (saved.store_id, sid) and saved.store_id != sid:
        raise ReplayCheckpointError(
            f"The checkpoint drew from the store {saved.store_id} at {saved.store}; the store "
            f"there now is another ({sid}): it was deleted and made again, with the same "
            "writer ids. Its rows are not the ones the checkpoint replayed. Fix: restore "
            "with the store as it was saved, or start the learner afresh."
        )
    for wid, rows in sorted(saved.writers.items()):
        if rows <= 0:
            continue
        has = held.get(wid)
        if has is None:
            raise ReplayCheckpointError(
                f"{saved.store}: writer {wid!r} committed {rows} rows the checkpoint drew "
                "from, but its part is gone (the writer's folder or manifest was deleted, "
                "or the store was replaced). Fix: restore with the store as it was saved "
                "(rows evicted by capacity are fine, a deleted part is not), or resume "
                "from a checkpoint taken after the part was removed."
            )
        if has < rows:
            raise ReplayCheckpointError(
                f"{saved.store}: writer {wid!r} holds {has} committed rows (evicted ones "
                f"included), but the checkpoint drew from its first {rows}: its part was "
                "cut back below the checkpoint (truncate_to_watermark or resume_from= an "
                "older checkpoint) or replaced. Fix: restore a checkpoint the store still "
                f"holds (an older one, with gr.read_watermark(ckpt).rows_for({wid!r}) <= "
                f"{has}), or restore with the store as it was saved."
            )


def drawn_arrays(drawn: Mapping[int, Any], next_draw: int) -> dict[str, np.ndarray]:
    """The draws ahead of a prioritized iterator (``step -> (task, (index, weight), _)``)
    as arrays: they were drawn with the priorities of their time, so they travel too."""
    steps = sorted(drawn)
    b = len(drawn[steps[0]][1][0]) if steps else 0
    return {
        "next_draw": np.array(next_draw, dtype=np.int64),
        "drawn_step": np.array(steps, dtype=np.int64),
        "drawn_index": np.array([drawn[s][1][0] for s in steps], dtype=np.int64).reshape(
            len(steps), b
        ),
        "drawn_weight": np.array([drawn[s][1][1] for s in steps], dtype=np.float32).reshape(
            len(steps), b
        ),
    }


def parse_drawn(state: Mapping[str, Any]) -> tuple[int, dict[int, Any]]:
    """:func:`drawn_arrays`' arrays back: the next draw and the draws ahead.

    Raises:
      ReplayCheckpointError: they are missing or do not convert.
    """
    try:
        next_draw = int(state["next_draw"])
        steps = np.asarray(state["drawn_step"], dtype=np.int64)
        index = np.asarray(state["drawn_index"], dtype=np.int64)
        weight = np.asarray(state["drawn_weight"], dtype=np.float32)
    except (KeyError, TypeError, ValueError) as e:
        raise ReplayCheckpointError(
            f"Not a prioritized-replay state ({type(e).__name__}: {e}). Fix: pass what "
            "priority_state() returned."
        ) from e
    return next_draw, {int(s): (i, (i, w), {}) for s, i, w in zip(steps, index, weight)}
