"""Tests of the pytree <-> {"obs/pixels": leaf} mapping and NamedTuple rebuilding."""

from __future__ import annotations

import collections
import copy
import json
import multiprocessing
import os
import pickle
import types
from typing import NamedTuple

import numpy as np
import pytest

import grain_replay as gr
from grain_replay import tree as tree_lib
from grain_replay.tree_layout import TreeLayout


class Step(NamedTuple):
    obs: np.ndarray
    reward: np.ndarray


def _assert_same_tree(got, want) -> None:
    got_leaves, got_def = tree_lib.flatten(got)
    want_leaves, want_def = tree_lib.flatten(want)
    assert got_def == want_def
    assert list(got_leaves) == list(want_leaves)
    for key in want_leaves:
        np.testing.assert_array_equal(got_leaves[key], want_leaves[key], err_msg=key)


def _nested():
    return {
        "obs": {"pixels": np.zeros((2, 4, 4)), "vel": np.ones((2, 3))},
        "step": Step(np.arange(2), np.arange(2.0)),
        "extras": (np.arange(2), [np.arange(2), {"z": np.arange(2)}]),
    }


# -- flatten / unflatten ---------------------------------------------------------


@pytest.mark.parametrize(
    "tree",
    [
        {"a": np.arange(3)},
        (np.arange(3), np.arange(3.0)),
        [np.arange(3), np.arange(3.0)],
        Step(np.arange(3), np.arange(3.0)),
        _nested(),
        np.arange(3),
        {"a": np.arange(3), "empty": {}, "none": [], "t": ()},
    ],
    ids=["dict", "tuple", "list", "namedtuple", "nested", "bare", "empty-containers"],
)
def test_flatten_unflatten_round_trip(tree):
    leaves, treedef = tree_lib.flatten(tree)
    rebuilt = tree_lib.unflatten(treedef, leaves)
    _assert_same_tree(rebuilt, tree)
    assert type(rebuilt) is type(tree)


def test_flatten_unflatten_round_trip_through_json():
    tree = _nested()
    leaves, treedef = tree_lib.flatten(tree)
    stored = json.loads(json.dumps(treedef))
    rebuilt = tree_lib.unflatten(stored, leaves)
    _assert_same_tree(rebuilt, tree)
    assert type(rebuilt["step"]) is Step


def test_flatten_keys_joined_with_slash():
    leaves, _ = tree_lib.flatten(_nested())
    assert list(leaves) == [
        "obs/pixels",
        "obs/vel",
        "step/obs",
        "step/reward",
        "extras/0",
        "extras/1/0",
        "extras/1/1/z",
    ]


def test_flatten_keys_tuple_and_list_indices():
    leaves, _ = tree_lib.flatten((np.arange(2), [np.arange(2), np.arange(2)]))
    assert list(leaves) == ["0", "1/0", "1/1"]


def test_flatten_keys_keep_dict_insertion_order():
    leaves, treedef = tree_lib.flatten({"b": np.arange(1), "a": np.arange(1), "c": np.arange(1)})
    assert list(leaves) == ["b", "a", "c"]
    assert tree_lib.leaf_keys(treedef) == ["b", "a", "c"]


def test_flatten_bare_array_has_root_key():
    leaves, treedef = tree_lib.flatten(np.arange(3))
    assert list(leaves) == [tree_lib.ROOT_KEY]
    assert treedef == {"type": "leaf"}


def test_flatten_keeps_leaf_objects():
    a = np.arange(3)
    leaves, _ = tree_lib.flatten({"a": a})
    assert leaves["a"] is a


def test_leaf_keys_match_flatten_order():
    leaves, treedef = tree_lib.flatten(_nested())
    assert tree_lib.leaf_keys(treedef) == list(leaves)


def test_treedef_of_is_json_serializable_and_stable():
    treedef = tree_lib.treedef_of(_nested())
    assert json.loads(json.dumps(treedef)) == treedef
    assert tree_lib.treedef_of(_nested()) == treedef


def test_map_leaves_keeps_structure_and_passes_keys():
    seen = []

    def fn(key, leaf):
        seen.append(key)
        return np.asarray(leaf) * 2

    out = tree_lib.map_leaves(fn, {"a": np.arange(3), "b": (np.ones(2),)})
    assert seen == ["a", "b/0"]
    np.testing.assert_array_equal(out["a"], [0, 2, 4])
    assert isinstance(out["b"], tuple)


@pytest.mark.parametrize(
    ("tree", "needle"),
    [({1: np.arange(2)}, "1"), ({"a/b": np.arange(2)}, "'a/b'"), ({"a": object()}, "'a'")],
    ids=["int-key", "slash-key", "object-leaf"],
)
def test_flatten_raises_invalid_tree_error_bad_tree(tree, needle):
    with pytest.raises(gr.InvalidTreeError, match="Fix") as info:
        tree_lib.flatten(tree)
    assert isinstance(info.value, TypeError)
    assert needle in str(info.value)


# -- natural_key / treedef_from_keys ------------------------------------------------


def test_natural_key_sorts_numbers_numerically():
    keys = ["arr_10", "arr_2", "arr_1", "arr_0", "arr_11", "arr_9"]
    assert sorted(keys, key=tree_lib.natural_key) == [
        "arr_0",
        "arr_1",
        "arr_2",
        "arr_9",
        "arr_10",
        "arr_11",
    ]
    assert tree_lib.natural_key("episode_9") < tree_lib.natural_key("episode_10")
    assert tree_lib.natural_key("arr_2") < tree_lib.natural_key("arr_10")


def test_natural_key_orders_mixed_keys_totally():
    keys = ["b", "a10", "a2", "10", "9", "a", "a2b", "a2a", "obs/x1", "obs/x01"]
    once = sorted(keys, key=tree_lib.natural_key)
    assert sorted(reversed(keys), key=tree_lib.natural_key)[:3] == once[:3]
    assert once.index("9") < once.index("10")
    assert once.index("a2") < once.index("a10")


def test_treedef_from_keys_nested_dicts_naturally_sorted():
    treedef = tree_lib.treedef_from_keys(["obs/b", "arr_10", "obs/a", "arr_2", "x/y/z"])
    assert tree_lib.leaf_keys(treedef) == ["arr_2", "arr_10", "obs/a", "obs/b", "x/y/z"]
    rec = tree_lib.unflatten(treedef, {k: k for k in tree_lib.leaf_keys(treedef)})
    assert rec == {
        "arr_2": "arr_2",
        "arr_10": "arr_10",
        "obs": {"a": "obs/a", "b": "obs/b"},
        "x": {"y": {"z": "x/y/z"}},
    }


def test_treedef_from_keys_root_key_is_bare_leaf():
    assert tree_lib.treedef_from_keys([tree_lib.ROOT_KEY]) == {"type": "leaf"}


def test_treedef_from_keys_raises_key_under_leaf():
    with pytest.raises(gr.InvalidStoreError, match="a/b"):
        tree_lib.treedef_from_keys(["a", "a/b"])


def test_treedef_from_keys_raises_leaf_over_group_any_order():
    with pytest.raises(gr.InvalidStoreError):
        tree_lib.treedef_from_keys(["a/b", "a"])


# -- NamedTuples ------------------------------------------------------------------


def test_unflatten_importable_namedtuple_is_same_class():
    leaves, treedef = tree_lib.flatten({"s": Step(np.arange(2), np.arange(2))})
    assert type(tree_lib.unflatten(treedef, leaves)["s"]) is Step


def _local_record(n: int = 3):
    class Local(NamedTuple):
        obs: np.ndarray
        reward: np.ndarray

    return Local(np.arange(n * 2).reshape(n, 2), np.arange(n, dtype=np.float32))


def _check_local_like(rec, want) -> None:
    assert isinstance(rec, tuple)
    assert type(rec) is not type(want)
    assert type(rec).__name__ == "Local"
    assert rec._fields == ("obs", "reward")
    for got_leaf, want_leaf in zip(rec, want):
        np.testing.assert_array_equal(got_leaf, want_leaf)


def test_unflatten_local_namedtuple_rebuilt_with_same_fields():
    want = _local_record()
    leaves, treedef = tree_lib.flatten(want)
    rebuilt = tree_lib.unflatten(json.loads(json.dumps(treedef)), leaves)
    _check_local_like(rebuilt, want)
    assert rebuilt.obs is leaves["obs"]


def test_unflatten_main_module_namedtuple_rebuilt_with_same_fields():
    leaves, treedef = tree_lib.flatten(Step(np.arange(2), np.arange(2)))
    treedef = {**treedef, "module": "__main__", "qualname": "Step"}
    rebuilt = tree_lib.unflatten(treedef, leaves)
    assert type(rebuilt) is not Step
    assert rebuilt._fields == Step._fields


def test_unflatten_namedtuple_fields_changed_gets_stand_in():
    leaves = {"obs": np.arange(2), "other": np.arange(2)}
    treedef = {
        "type": "namedtuple",
        "name": "Step",
        "module": __name__,
        "qualname": "Step",
        "fields": ["obs", "other"],
        "children": [{"type": "leaf"}, {"type": "leaf"}],
    }
    rebuilt = tree_lib.unflatten(treedef, leaves)
    assert type(rebuilt) is not Step
    assert rebuilt._fields == ("obs", "other")


def test_local_namedtuple_records_from_store_rebuilt_and_pickle(tmp_path):
    want = _local_record(4)
    path = gr.write(tmp_path / "x.h5", want)
    with gr.open_source(path) as src:
        rec = src[1]
        batch = src.read_batch([0, 1, 2, 3])
    _check_local_like(rec, type(want)(want.obs[1], want.reward[1]))
    _check_local_like(batch, want)
    for obj in (rec, batch):
        back = pickle.loads(pickle.dumps(obj))
        assert type(back) is type(obj)
        for got_leaf, want_leaf in zip(back, obj):
            np.testing.assert_array_equal(got_leaf, want_leaf)
    assert copy.deepcopy(rec)._fields == rec._fields


def test_local_namedtuple_record_survives_spawned_process(tmp_path):
    want = _local_record(4)
    with gr.open_source(gr.write(tmp_path / "x.h5", want)) as src:
        rec = src[2]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        # copy.copy lives in the stdlib: the child need not import this test module.
        back = pool.apply(copy.copy, (rec,))
        assert pool.apply(os.getpid) != os.getpid()
    assert type(back) is type(rec)
    assert back._fields == ("obs", "reward")
    np.testing.assert_array_equal(back.obs, want.obs[2])
    np.testing.assert_array_equal(back.reward, want.reward[2])


class Other(NamedTuple):
    obs: np.ndarray
    reward: np.ndarray


def _layout_tree(i: int = 0) -> dict:
    a = np.full((2, 1), i)
    return {
        "obs": {"pos": a + 1, "vel": a + 2},
        "step": Step(a + 3, a + 4),
        "pair": (a + 5, [a + 6, {"x": a + 7}]),
        "done": a + 8,
    }


@pytest.mark.parametrize(
    "make",
    [
        _layout_tree,
        lambda i: {"a": np.zeros(2) + i, "b": np.ones(2)},
        lambda i: np.zeros(3) + i,
        lambda i: [np.zeros(1) + i],
        lambda i: {},
        lambda i: collections.OrderedDict(b=np.zeros(2) + i, a=np.ones(2)),
        lambda i: {"m": types.MappingProxyType({"b": np.zeros(2) + i, "a": {"c": np.ones(2)}})},
    ],
    ids=["nested", "flat-dict", "bare-array", "list", "empty", "ordered-dict", "other-mapping"],
)
def test_tree_layout_gives_a_like_trees_leaves_in_flatten_order(make):
    tree = make(0)
    leaves, treedef = tree_lib.flatten(tree)
    layout = TreeLayout.of(tree, leaves)
    assert layout is not None
    assert layout.keys == tuple(leaves)
    flat = type(tree) is dict and treedef["children"] == [{"type": "leaf"}] * len(tree)
    assert layout.flat_dict == flat
    # A new tree of the same containers: its leaves, as flatten names and orders them.
    like = make(1)
    got = layout.leaves(like)
    want, _ = tree_lib.flatten(like)
    assert got is not None and len(got) == len(want)
    assert all(g is w for g, w in zip(got, want.values()))


@pytest.mark.parametrize(
    "change",
    [
        lambda t: {k: t[k] for k in reversed(t)},  # dict keys in another order
        lambda t: {**t, "extra": t["done"]},
        lambda t: {**t, "obs": {"vel": t["obs"]["vel"], "pos": t["obs"]["pos"]}},
        lambda t: {**t, "obs": {"pos": t["obs"]["pos"]}},
        lambda t: {**t, "step": Other(*t["step"])},  # another NamedTuple of the same fields
        lambda t: {**t, "step": tuple(t["step"])},
        lambda t: {**t, "pair": list(t["pair"])},  # a list where a tuple was
        lambda t: {**t, "pair": (t["pair"][0], [t["pair"][1][0]])},
        lambda t: {**t, "obs": t["done"]},  # a leaf where a container was
        lambda t: collections.OrderedDict(t),
        lambda t: list(t.values()),
    ],
)
def test_tree_layout_refuses_any_other_container(change):
    tree = _layout_tree()
    leaves, _ = tree_lib.flatten(tree)
    layout = TreeLayout.of(tree, leaves)
    assert layout is not None
    assert layout.leaves(change(_layout_tree(1))) is None


def test_tree_layout_of_needs_flattens_own_leaves():
    tree = _layout_tree()
    leaves, _ = tree_lib.flatten(tree)
    copies = {k: v.copy() for k, v in leaves.items()}
    assert TreeLayout.of(tree, copies) is None
    assert TreeLayout.of(tree, dict(list(leaves.items())[:-1])) is None
    twice = {"a": leaves["done"], "b": leaves["done"]}  # one array under two names
    layout = TreeLayout.of(twice, tree_lib.flatten(twice)[0])
    assert layout is not None and layout.leaves({"a": 1, "b": 2}) == [1, 2]


def test_tree_layout_leaves_whatever_sits_at_a_leaf_to_the_caller():
    """What a leaf is (an array of the right type) is the caller's check: a container where
    a leaf was comes back as that leaf, for the caller's type check to refuse."""
    tree = _layout_tree()
    layout = TreeLayout.of(tree, tree_lib.flatten(tree)[0])
    assert layout is not None
    got = layout.leaves({**tree, "done": {"x": tree["done"]}})
    assert got is not None and got[-1] == {"x": tree["done"]}


def test_tree_layout_of_another_mapping_follows_its_keys():
    proxy = types.MappingProxyType
    tree = {"m": proxy({"b": np.zeros(2), "a": np.ones(2)})}
    layout = TreeLayout.of(tree, tree_lib.flatten(tree)[0])
    assert layout is not None and layout.keys == ("m/b", "m/a")
    assert layout.leaves({"m": proxy({"b": 1, "a": 2})}) == [1, 2]
    assert layout.leaves({"m": proxy({"a": 2, "b": 1})}) is None
    assert layout.leaves({"m": {"b": 1, "a": 2}}) is None  # a dict where a proxy was
