"""Sequence offsets validated (in steps, or seconds at a frame rate) and the output tree."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import ArgumentTypeError, InvalidArgumentError, InvalidStoreError
from grain_replay.sources.access import LeafAccess

__all__ = [
    "PAD_MODES",
    "PAD_SUFFIX",
    "TOLERANCE_S",
    "offsets_in_steps",
    "frame_offset",
    "offsets_from_seconds",
    "leaf_lists",
    "resolve_fps",
    "check_leaves",
    "sequence_treedef",
    "sequence_offsets",
]

PAD_MODES = ("edge", "zero", "drop")

# The mask of leaf "obs/pixels" is "obs/pixels_is_pad" (LeRobot's convention).
PAD_SUFFIX = "_is_pad"
# How far (seconds) a delta timestamp may lie from a frame: LeRobot's default tolerance_s.
TOLERANCE_S = 1e-4
_LEAF = {"type": "leaf"}


def sequence_offsets(
    offsets: Any, delta_timestamps: Any, fps: Any, pad: str, where: str
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[float, ...]] | None, float | None]:
    """A sequence view's offset arguments checked: ``(steps, seconds, fps)``, the offsets in
    steps a leaf, those in seconds as given (None when given in steps) and the frame rate."""
    if pad not in PAD_MODES:
        raise InvalidArgumentError(
            f"{where}: pad={pad!r} is not a padding mode. Fix: pass one of {list(PAD_MODES)}."
        )
    if (offsets is None) == (delta_timestamps is None):
        raise InvalidArgumentError(
            f"{where}: pass exactly one of offsets= (steps) and delta_timestamps= (seconds), "
            f"got {'both' if offsets is not None else 'neither'}."
        )
    rate = None if fps is None else resolve_fps(fps, where)
    if delta_timestamps is None:
        return offsets_in_steps(offsets, where), None, rate
    if rate is None:
        raise InvalidArgumentError(
            f"{where}: delta_timestamps= gives offsets in seconds, but the step source "
            "has no frame rate (no `fps` attribute) and fps= was not given. Fix: pass "
            "fps=<frames per second>, or offsets= in steps."
        )
    steps = offsets_from_seconds(delta_timestamps, rate, where)
    seconds = {
        k: tuple(float(v) for v in vs)
        for k, vs in leaf_lists(delta_timestamps, "delta_timestamps", where).items()
    }
    return steps, seconds, rate


def offsets_in_steps(offsets: Any, where: str) -> dict[str, tuple[int, ...]]:
    """``offsets`` validated: leaf key -> tuple of int steps."""
    out: dict[str, tuple[int, ...]] = {}
    for key, values in leaf_lists(offsets, "offsets", where).items():
        steps = []
        for v in values:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
                raise ArgumentTypeError(
                    f"{where}: offsets[{key!r}] holds {v!r}, which is not a whole number of "
                    "steps. Fix: give offsets in steps as ints (e.g. range(-3, 1)), or offsets "
                    "in seconds as delta_timestamps= with fps=."
                )
            steps.append(int(v))
        out[key] = tuple(steps)
    return out


def frame_offset(seconds: float, fps: float) -> tuple[int, float]:
    """``(k, miss)``: the nearest whole frame ``k = round(seconds * fps)`` (LeRobot's rule) and
    how far it is from ``seconds``, in seconds (a caller refuses a miss over its tolerance)."""
    frames = seconds * fps
    k = round(frames)
    return int(k), abs(frames - k) / fps


def offsets_from_seconds(
    delta_timestamps: Any, fps: float, where: str
) -> dict[str, tuple[int, ...]]:
    """LeRobot's rule: offset = round(dt * fps); a dt over TOLERANCE_S off a frame is refused."""
    out: dict[str, tuple[int, ...]] = {}
    for key, values in leaf_lists(delta_timestamps, "delta_timestamps", where).items():
        steps = []
        for dt in values:
            if isinstance(dt, (bool, np.bool_)) or not isinstance(dt, numbers.Real):
                raise ArgumentTypeError(
                    f"{where}: delta_timestamps[{key!r}] holds {dt!r}, which is not a number of "
                    "seconds. Fix: give a list of floats, e.g. [-0.1, 0.0]."
                )
            if not math.isfinite(float(dt)):
                raise InvalidArgumentError(
                    f"{where}: delta_timestamps[{key!r}] holds {dt!r}. Fix: give finite seconds."
                )
            k, miss = frame_offset(float(dt), fps)
            if miss > TOLERANCE_S:
                raise InvalidArgumentError(
                    f"{where}: delta_timestamps[{key!r}] holds {dt!r} s, which is not a frame at "
                    f"fps={fps!r} (nearest: {k} steps = {k / fps!r} s; tolerance "
                    f"{TOLERANCE_S} s). Fix: use multiples of 1/fps = {1 / fps!r} s, or the "
                    "right fps=."
                )
            steps.append(k)
        out[key] = tuple(steps)
    return out


def leaf_lists(mapping: Any, name: str, where: str) -> dict[str, list[Any]]:
    if not isinstance(mapping, Mapping):
        raise ArgumentTypeError(
            f"{where}: {name}= must be a mapping from leaf key to a list, got "
            f"{type(mapping).__name__}. Fix: e.g. {name}={{'obs': [-1, 0], 'action': [0, 1]}}."
        )
    if not mapping:
        raise InvalidArgumentError(
            f"{where}: {name}= is empty, so nothing would be read. Fix: name at least one leaf, "
            f"e.g. {name}={{'obs': [0]}}."
        )
    out: dict[str, list[Any]] = {}
    for key, values in mapping.items():
        if not isinstance(key, str):
            raise ArgumentTypeError(
                f"{where}: {name}= has the key {key!r}; keys are leaf keys (str) such as "
                "'obs/pixels'."
            )
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise ArgumentTypeError(
                f"{where}: {name}[{key!r}] is {values!r}, not a list. Fix: give a list, even "
                "for one value: [0]."
            )
        values = list(values)
        if not values:
            raise InvalidArgumentError(
                f"{where}: {name}[{key!r}] is empty; a named leaf needs at least one offset. "
                "Fix: give e.g. [0], or leave the key out (it is then not read)."
            )
        out[key] = values
    return out


def resolve_fps(fps: Any, where: str) -> float:
    if isinstance(fps, (bool, np.bool_)) or not isinstance(fps, numbers.Real):
        raise ArgumentTypeError(f"{where}: fps must be a number of frames per second, got {fps!r}")
    value = float(fps)
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgumentError(f"{where}: fps must be positive and finite, got {fps!r}")
    return value


def check_leaves(access: LeafAccess, keys: Iterable[str]) -> None:
    leaves = list(access.spec)
    for key in keys:
        if key in access.spec:
            continue
        under = access.leaves_under(key)
        if under:
            raise InvalidArgumentError(
                f"{access.where}: the offset key {key!r} is a group, not a leaf; offsets apply "
                f"to leaves, each with its own mask. Fix: name its leaves: {under}."
            )
        raise InvalidArgumentError(
            f"{access.where}: the offset key {key!r} names no leaf of the store; the leaves are "
            f"{leaves}. Fix: pick keys from that list."
        )


def sequence_treedef(treedef: Mapping[str, Any], named: set[str], where: str) -> dict[str, Any]:
    """The step tree pruned to ``named`` leaves, each followed by its ``<leaf>_is_pad`` mask.

    Containers become dicts (lists and tuples keyed by index), so every leaf
    keeps its key and its mask sits beside it.
    """
    if treedef["type"] == "leaf":
        raise InvalidStoreError(
            f"{where}: the steps are a single unnamed array; a sequence names its leaves and "
            "puts a mask beside each. Fix: store the steps as a dict, e.g. {'obs': ...}."
        )

    def visit(node: Mapping[str, Any], path: str) -> dict[str, Any] | None:
        names = tree_lib.child_names(node)
        entries: list[tuple[str, dict[str, Any]]] = []
        for name, child in zip(names, node["children"]):
            key = f"{path}/{name}" if path else name
            if child["type"] == "leaf":
                if key in named:
                    entries += [(name, dict(_LEAF)), (name + PAD_SUFFIX, dict(_LEAF))]
                continue
            sub = visit(child, key)
            if sub is not None:
                entries.append((name, sub))
        if not entries:
            return None
        seen: set[str] = set()
        for name, _ in entries:
            if name in seen:
                clash = f"{path}/{name}" if path else name
                raise InvalidArgumentError(
                    f"{where}: the output would hold {clash!r} twice: a leaf of that name and "
                    f"the mask of {clash[: -len(PAD_SUFFIX)]!r}. Fix: leave one of them out of "
                    "the offsets."
                )
            seen.add(name)
        return {
            "type": "dict",
            "keys": [n for n, _ in entries],
            "children": [c for _, c in entries],
        }

    return visit(treedef, tree_lib.ROOT_KEY) or {"type": "dict", "keys": [], "children": []}
