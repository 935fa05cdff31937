"""A tree's containers remembered, so a like tree's leaves are taken without a walk.

The device and host appends check each tree against the last (``writers/device/leaves.py``,
``writers/row_stage.py``): a tree whose containers match the last one's (exact types, dict
keys in order, lengths) has its leaves under the same names, in the same order, as
:func:`grain_replay.tree.flatten` gave them, and skips the naming rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["TreeLayout"]


# A compiled container of a remembered tree: ``take(node, out)`` appends the leaves of a
# node like it to ``out`` in flatten order and says whether the node was like it.
_Take = Callable[[Any, list[Any]], bool]


class TreeLayout:
    """The containers of a tree that :func:`flatten` took, remembered: a later tree with
    containers of the same exact types, dict keys in the same order and the same lengths
    has its leaves under the same names, in the same order, so :meth:`leaves` hands them
    over without walking the naming rules again (a few operations a container, none a
    leaf). What a leaf is, is the caller's to check (its type, dtype, shape)."""

    def __init__(self, take: _Take, keys: tuple[str, ...], flat_dict: bool) -> None:
        self._take = take
        self.keys = keys  # the leaves' names, in flatten order
        # The tree is a dict of leaves: its leaves are dict(tree).
        self.flat_dict = flat_dict

    @classmethod
    def of(cls, tree: Any, leaves: Mapping[str, Any]) -> TreeLayout | None:
        """The layout of ``tree``, which :func:`flatten` split into ``leaves`` (these very
        objects, in order); None when the walk does not give them back."""
        found: list[Any] = []
        take = _layout_of(tree, found)
        if take is None or len(found) != len(leaves):
            return None
        if any(a is not b for a, b in zip(found, leaves.values())):
            return None
        keys = tuple(leaves)
        return cls(take, keys, type(tree) is dict and tuple(tree) == keys)

    def leaves(self, tree: Any) -> list[Any] | None:
        """The leaves of a tree with this layout, in flatten order; None for any other."""
        out: list[Any] = []
        return out if self._take(tree, out) else None


def _layout_of(node: Any, found: list[Any]) -> _Take | None:
    """``take`` of ``node``'s containers (:class:`TreeLayout`), mirroring :func:`flatten`'s
    order of kinds: Mapping, NamedTuple, list/tuple, leaf; its leaves appended to
    ``found``. None where flatten would refuse the node (its error is the full path's)."""
    cls = type(node)
    if isinstance(node, Mapping):
        keys = tuple(node.keys())
        if not all(isinstance(k, str) for k in keys):
            return None
        children = _children_of([node[k] for k in keys], found)
        return None if children is None else _take_mapping(cls, keys, children)
    if isinstance(node, (list, tuple)):
        children = _children_of(node, found)
        return None if children is None else _take_sequence(cls, children)
    found.append(node)
    return _take_leaf


def _children_of(nodes: Any, found: list[Any]) -> tuple[_Take | None, ...] | None:
    """Each child's ``take`` (None for a leaf, appended to ``found``), in order; None where
    flatten would refuse one of them."""
    children: list[_Take | None] = []
    for child in nodes:
        if _is_container(child):
            take = _layout_of(child, found)
            if take is None:
                return None
            children.append(take)
        else:
            found.append(child)
            children.append(None)
    return tuple(children)


def _is_container(node: Any) -> bool:
    return isinstance(node, (Mapping, list, tuple))


def _take_leaf(node: Any, out: list[Any]) -> bool:
    out.append(node)
    return True


def _take_mapping(
    cls: type[Any], keys: tuple[str, ...], children: tuple[_Take | None, ...]
) -> _Take:
    pairs = tuple(zip(keys, children))
    if cls is dict and all(c is None for c in children):

        def take_leaves(node: Any, out: list[Any]) -> bool:
            # A dict's iteration and values() follow its keys(): flatten's order.
            if type(node) is not dict or tuple(node) != keys:
                return False
            out.extend(node.values())
            return True

        return take_leaves

    def take(node: Any, out: list[Any]) -> bool:
        if type(node) is not cls or tuple(node.keys()) != keys:
            return False
        for k, child in pairs:
            if child is None:
                out.append(node[k])
            elif not child(node[k], out):
                return False
        return True

    return take


def _take_sequence(cls: type[Any], children: tuple[_Take | None, ...]) -> _Take:
    n = len(children)
    if all(c is None for c in children):

        def take_leaves(node: Any, out: list[Any]) -> bool:
            if type(node) is not cls or len(node) != n:
                return False
            out.extend(node)
            return True

        return take_leaves

    def take(node: Any, out: list[Any]) -> bool:
        if type(node) is not cls or len(node) != n:
            return False
        for child, value in zip(children, node):
            if child is None:
                out.append(value)
            elif not child(value, out):
                return False
        return True

    return take
