"""Pytree <-> flat ``{"obs/pixels": leaf}`` mapping; the one leaf-naming rule.

Supports dicts (string keys), lists, tuples and NamedTuples, nested, with array
leaves. jax is not imported: jax arrays are leaves like any other array.
"""

from __future__ import annotations

import collections
import numbers
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from grain_replay.errors import InvalidStoreError, InvalidTreeError

__all__ = [
    "ROOT_KEY",
    "flatten",
    "unflatten",
    "treedef_of",
    "treedef_from_keys",
    "prune_treedef",
    "compile_unflatten",
    "leaf_keys",
    "natural_key",
    "map_leaves",
]

# The key of a tree that is a single array. On disk it is stored as "data".
ROOT_KEY = ""

_LEAF = {"type": "leaf"}


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _is_leaf(x: Any) -> bool:
    return (hasattr(x, "shape") and hasattr(x, "dtype")) or hasattr(x, "__array__")


# Names that would step outside or alias a path on disk, or clash with the
# metadata files of the formats.
RESERVED_KEYS = frozenset({".", "..", "zarr.json", ".zgroup", ".zarray", ".zattrs"})


def flatten(tree: Any, *, where: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """Splits a pytree into ``({key: leaf}, treedef)``.

    Args:
      tree: a dict / list / tuple / NamedTuple tree whose leaves are arrays
        (numpy, jax, or anything with ``__array__``).

    Returns:
      The leaves keyed by their ``/``-joined path, in tree order, and a
      JSON-serializable description of the structure.

    Raises:
      InvalidTreeError: a node is neither a container nor an array, a dict key
        is not a string, contains ``/`` or is reserved (``.``, ``..``,
        ``zarr.json``); the message starts with ``where``.
    """
    leaves: dict[str, Any] = {}
    prefix = f"{where}: " if where else ""

    def visit(node: Any, path: str, in_list: str | None = None) -> dict[str, Any]:
        # in_list: the path of the outermost list/tuple this node is nested in, through
        # lists and tuples only (the list to hand to np.asarray when a leaf is a number).
        if isinstance(node, Mapping):
            keys = list(node.keys())
            for k in keys:
                if not isinstance(k, str):
                    raise InvalidTreeError(
                        f"{prefix}Dict keys must be strings; got {k!r} ({type(k).__name__}) at "
                        f"{path or '<root>'!r}. Fix: convert the key with str()."
                    )
                if "/" in k or k == "" or k in RESERVED_KEYS:
                    raise InvalidTreeError(
                        f"{prefix}Dict key {k!r} at {path or '<root>'!r} is empty, contains "
                        "'/' (the leaf path separator) or is a reserved name "
                        f"{sorted(RESERVED_KEYS)}. Fix: rename the key."
                    )
            return {
                "type": "dict",
                "keys": keys,
                "children": [visit(node[k], _join(path, k)) for k in keys],
            }
        if _is_namedtuple(node):
            cls = type(node)
            return {
                "type": "namedtuple",
                "name": cls.__name__,
                "module": cls.__module__,
                "qualname": cls.__qualname__,
                "fields": list(cls._fields),
                "children": [visit(v, _join(path, f)) for f, v in zip(cls._fields, node)],
            }
        if isinstance(node, (list, tuple)):
            return {
                "type": "list" if isinstance(node, list) else "tuple",
                "children": [
                    visit(v, _join(path, str(i)), path if in_list is None else in_list)
                    for i, v in enumerate(node)
                ],
            }
        if _is_leaf(node):
            leaves[path] = node
            return dict(_LEAF)
        what = type(node).__name__
        article = "an" if what[:1].lower() in "aeiou" else "a"
        if isinstance(node, numbers.Number) and in_list is not None:
            raise InvalidTreeError(
                f"{prefix}Leaf {path!r} is {article} {what}, not an array: to a writer a list "
                "of numbers is a list of separate leaves. Fix: convert the list at "
                f"{in_list or '<root>'!r} with np.asarray(...) first."
            )
        raise InvalidTreeError(
            f"{prefix}Leaf {path or '<root>'!r} is {article} {what}, not an array or a "
            "dict/list/tuple/NamedTuple. Fix: pass a pytree of numpy or jax arrays."
        )

    treedef = visit(tree, ROOT_KEY)
    return leaves, treedef


def child_names(node: Mapping[str, Any]) -> list[str]:
    """The key part of each child of a treedef node: dict keys, NamedTuple fields,
    list/tuple indices; none for a leaf.

    Raises:
      InvalidStoreError: the node's type is none of these.
    """
    kind = node["type"]
    if kind == "leaf":
        return []
    if kind == "dict":
        return list(node["keys"])
    if kind == "namedtuple":
        return list(node["fields"])
    if kind in ("list", "tuple"):
        return [str(i) for i in range(len(node["children"]))]
    raise InvalidStoreError(f"Unknown tree node type {kind!r} in stored tree structure.")


def leaf_keys(treedef: Mapping[str, Any]) -> list[str]:
    """Returns the leaf keys of ``treedef`` in tree order."""
    out: list[str] = []

    def visit(node: Mapping[str, Any], path: str) -> None:
        if node["type"] == "leaf":
            out.append(path)
            return
        for name, child in zip(child_names(node), node["children"]):
            visit(child, _join(path, name))

    visit(treedef, ROOT_KEY)
    return out


_NAMEDTUPLES: dict[tuple[str, tuple[str, ...]], type] = {}


def _rebuild_namedtuple(name: str, fields: tuple[str, ...], values: tuple[Any, ...]) -> Any:
    return _namedtuple_class(name, fields, "", "")(*values)


def _namedtuple_class(name: str, fields: tuple[str, ...], module: str, qualname: str) -> type:
    """The user's NamedTuple class if its module is already imported, else a stand-in.

    The module named in a store's metadata is never imported: that would run
    code chosen by whoever wrote the file.
    """
    if module and module != "__main__" and "<" not in qualname:
        obj: Any = sys.modules.get(module)
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if (
            isinstance(obj, type)
            and issubclass(obj, tuple)
            and tuple(getattr(obj, "_fields", ())) == fields
        ):
            return obj
    key = (name, fields)
    cached = _NAMEDTUPLES.get(key)
    if cached is not None:
        return cached
    made: Any = collections.namedtuple(name, fields)  # type: ignore[misc]
    # Records cross process boundaries (grain workers): pickle by value of
    # name and fields so the receiving process can rebuild the class.
    made.__reduce__ = lambda self: (_rebuild_namedtuple, (name, fields, tuple(self)))  # type: ignore[method-assign,arg-type]
    _NAMEDTUPLES[key] = made
    return made


def unflatten(treedef: Mapping[str, Any], leaves: Mapping[str, Any]) -> Any:
    """Inverse of :func:`flatten`: builds the tree from ``{key: leaf}``."""
    builders = _compile(treedef)
    return builders(leaves)


def _compile(treedef: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], Any]:
    """Compiles ``treedef`` into a function from ``{key: leaf}`` to the tree.

    Building a record is on the read path (once per record for ``src[i]``), so
    the structure is walked once here instead of per call.
    """

    def build(node: Mapping[str, Any], path: str) -> Callable[[Mapping[str, Any]], Any]:
        kind = node["type"]
        if kind == "leaf":
            return lambda leaves: leaves[path]
        if kind == "dict":
            keys = list(node["keys"])
            subs = [build(c, _join(path, k)) for k, c in zip(keys, node["children"])]
            return lambda leaves: {k: f(leaves) for k, f in zip(keys, subs)}
        if kind == "namedtuple":
            fields = tuple(node["fields"])
            cls = _namedtuple_class(
                node.get("name", "Record"), fields, node.get("module", ""), node.get("qualname", "")
            )
            subs = [build(c, _join(path, k)) for k, c in zip(fields, node["children"])]
            return lambda leaves: cls(*(f(leaves) for f in subs))
        if kind in ("list", "tuple"):
            subs = [build(c, _join(path, str(i))) for i, c in enumerate(node["children"])]
            if kind == "list":
                return lambda leaves: [f(leaves) for f in subs]
            return lambda leaves: tuple(f(leaves) for f in subs)
        raise InvalidStoreError(f"Unknown tree node type {kind!r} in stored tree structure.")

    return build(treedef, ROOT_KEY)


def compile_unflatten(treedef: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], Any]:
    """Returns a fast ``{key: leaf} -> tree`` function for a fixed structure."""
    return _compile(treedef)


def is_flat_dict(treedef: Mapping[str, Any], keys: Sequence[str]) -> bool:
    """Whether ``treedef`` is one dict whose children are the leaves ``keys``, in order: its
    tree is the ``{key: leaf}`` dict itself."""
    return (
        treedef.get("type") == "dict"
        and list(treedef.get("keys", ())) == list(keys)
        and all(c.get("type") == "leaf" for c in treedef.get("children", ()))
    )


def treedef_of(tree: Any) -> dict[str, Any]:
    """Returns the structure of ``tree`` (see :func:`flatten`)."""
    return flatten(tree)[1]


def natural_key(key: str) -> list[Any]:
    """Sort key that orders ``arr_10`` after ``arr_9`` and ``episode_10`` after ``episode_9``."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", key) if t]


def treedef_from_keys(keys: Iterable[str]) -> dict[str, Any]:
    """Nested-dict structure for ``/``-joined keys, each level naturally sorted.

    A single key equal to :data:`ROOT_KEY` gives a bare-leaf tree.
    """
    keys = list(keys)
    if keys == [ROOT_KEY]:
        return dict(_LEAF)
    nested: dict[str, Any] = {}
    for key in keys:
        node = nested
        parts = key.split("/")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise InvalidStoreError(f"Key {key!r} nests under the leaf {part!r}.")
            node = child
        if isinstance(node.get(parts[-1]), dict):
            raise InvalidStoreError(f"Leaf {key!r} is also a group of other leaves.")
        node[parts[-1]] = None

    def to_def(node: dict[str, Any]) -> dict[str, Any]:
        names = sorted(node, key=natural_key)
        return {
            "type": "dict",
            "keys": names,
            "children": [_LEAF if node[n] is None else to_def(node[n]) for n in names],
        }

    return to_def(nested)


def prune_treedef(treedef: Mapping[str, Any], keep: Iterable[str]) -> dict[str, Any]:
    """The part of ``treedef`` holding the leaves ``keep``, order preserved.

    A tuple, list or NamedTuple that loses children becomes a dict keyed by the
    remaining indices or field names, so every kept leaf keeps its key.
    """
    wanted = set(keep)

    def visit(node: Mapping[str, Any], path: str) -> dict[str, Any] | None:
        if node["type"] == "leaf":
            return dict(_LEAF) if path in wanted else None
        names = child_names(node)
        kept = [(n, visit(c, _join(path, n))) for n, c in zip(names, node["children"])]
        kept = [(n, c) for n, c in kept if c is not None]
        if not kept:
            return None
        if len(kept) == len(names):
            return {**node, "children": [c for _, c in kept]}
        return {"type": "dict", "keys": [n for n, _ in kept], "children": [c for _, c in kept]}

    return visit(treedef, ROOT_KEY) or {"type": "dict", "keys": [], "children": []}


def map_leaves(fn: Callable[[str, Any], Any], tree: Any) -> Any:
    """Applies ``fn(key, leaf)`` to every leaf, keeping the structure."""
    leaves, treedef = flatten(tree)
    return unflatten(treedef, {k: fn(k, v) for k, v in leaves.items()})
