"""Row ids of a many-writer store: built and split in grain_replay.store.parts alone."""

from __future__ import annotations

import ast
import os
import pathlib

import numpy as np
import pytest

from grain_replay.errors import InvalidStoreError
from grain_replay.store import parts as parts_lib
from grain_replay.store.parts import (
    ID_SHIFT,
    MAX_ORDINAL,
    SEQ_MASK,
    claim_ordinal,
    id_ordinals,
    make_ids,
    split_ids,
)

PACKAGE = pathlib.Path(parts_lib.__file__).resolve().parents[1]
OWNER = PACKAGE / "store" / "parts.py"
# Written out here, not taken from parts.py: the layout is on disk and in checkpoints.
EDGES = [(0, 0), (0, SEQ_MASK), (1, 0), (3, 12345), (MAX_ORDINAL, 0), (MAX_ORDINAL, SEQ_MASK)]


def test_the_layout_is_40_bits_of_seq_under_23_of_ordinal() -> None:
    assert (ID_SHIFT, SEQ_MASK, MAX_ORDINAL) == (40, 2**40 - 1, 2**23 - 1)
    assert make_ids(3, 5) == 3 * 2**40 + 5
    assert make_ids(MAX_ORDINAL, SEQ_MASK) == np.iinfo(np.int64).max


@pytest.mark.parametrize(("ordinal", "seq"), EDGES)
def test_scalar_round_trip(ordinal: int, seq: int) -> None:
    ids = make_ids(ordinal, seq)
    assert type(ids) is int and 0 <= ids <= np.iinfo(np.int64).max
    assert split_ids(ids) == (ordinal, seq)
    assert id_ordinals(ids) == ordinal
    # numpy scalars (an element of an id array) split the same way
    o, s = split_ids(np.int64(ids))
    assert (int(o), int(s)) == (ordinal, seq)


def test_array_round_trip_keeps_int64() -> None:
    ordinals = np.array([o for o, _ in EDGES], dtype=np.int64)
    seqs = np.array([s for _, s in EDGES], dtype=np.int64)
    ids = make_ids(ordinals, seqs)
    assert ids.dtype == np.int64 and ids.shape == (len(EDGES),)
    np.testing.assert_array_equal(ids, [o * 2**40 + s for o, s in EDGES])
    o, s = split_ids(ids)
    assert o.dtype == np.int64 and s.dtype == np.int64
    np.testing.assert_array_equal(o, ordinals)
    np.testing.assert_array_equal(s, seqs)
    np.testing.assert_array_equal(id_ordinals(ids), ordinals)


def test_one_side_an_int_the_other_an_array_broadcasts() -> None:
    seqs = np.arange(5, dtype=np.int64)
    ids = make_ids(7, seqs)
    assert ids.dtype == np.int64
    np.testing.assert_array_equal(ids, 7 * 2**40 + seqs)
    ids = make_ids(np.array([0, 2], dtype=np.int64), 9)
    assert ids.dtype == np.int64
    np.testing.assert_array_equal(ids, [9, 2 * 2**40 + 9])
    assert make_ids(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)).dtype == np.int64


def test_consecutive_seqs_are_consecutive_ids() -> None:
    # The one-writer fast paths add positions to a writer's first id (ids.ids_at,
    # ids.read_mapped, gather.read_mapped): this is what they rely on.
    assert make_ids(4, 100) + 37 == make_ids(4, 137)
    assert make_ids(4, SEQ_MASK) + 1 == make_ids(5, 0)


def test_negative_ids_split_to_a_negative_ordinal() -> None:
    # -1 marks "no row" (empty slots, stand-ins): callers test ordinal >= 0.
    ids = np.array([-1, -(2**40), make_ids(2, 3)], dtype=np.int64)
    o, s = split_ids(ids)
    assert (o[:2] < 0).all() and o[2] == 2 and s[2] == 3
    assert (s >= 0).all() and (s <= SEQ_MASK).all()
    assert id_ordinals(-1) < 0


def test_no_ordinal_past_the_range_is_claimed(tmp_path: pathlib.Path) -> None:
    # The one refusal of a wrong value: claim_ordinal's (make_ids checks nothing, as
    # none of the sites it replaced did: per-batch reads call it).
    store = str(tmp_path)
    os.makedirs(tmp_path / "ordinals")
    (tmp_path / "ordinals" / str(MAX_ORDINAL - 1)).write_text("a")
    assert claim_ordinal(store, "b") == MAX_ORDINAL
    with pytest.raises(InvalidStoreError, match="no row-id ordinal left"):
        claim_ordinal(store, "c")
    assert claim_ordinal(store, "a") == MAX_ORDINAL - 1  # a writer keeps its own


def test_the_compiled_slot_walk_splits_as_split_ids() -> None:
    from grain_replay.sampling import slot_table

    if slot_table._compiled() is None:
        pytest.skip("numba is not installed (or GRAIN_REPLAY_NO_NUMBA is set)")
    for ordinal, seq in [*EDGES, (-1, SEQ_MASK)]:
        x = np.int64(make_ids(ordinal, seq))
        assert tuple(int(v) for v in slot_table._split_ids(x)) == split_ids(int(x))


# -- the rule: no other module of the package does the ids' bit arithmetic ---------------

_MASK_VALUES = {SEQ_MASK, SEQ_MASK + 1}


def _breaks(tree: ast.AST) -> list[str]:
    """Lines of ``tree`` that name ID_SHIFT or SEQ_MASK, shift by 40, or mask with 2**40 - 1."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
        else:
            names = [node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)]
        for name in set(names) & {"ID_SHIFT", "SEQ_MASK"}:
            found.append(f"line {node.lineno}: {name}")  # type: ignore[attr-defined]
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, (ast.LShift, ast.RShift))
            and isinstance(node.right, ast.Constant)
            and node.right.value == ID_SHIFT
        ):
            found.append(f"line {node.lineno}: a shift by {ID_SHIFT}")
        elif isinstance(node, ast.Constant) and node.value in _MASK_VALUES:
            if type(node.value) is int:
                found.append(f"line {node.lineno}: the constant {node.value:#x}")
    return found


def test_only_store_parts_builds_or_splits_row_ids() -> None:
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        if file.resolve() == OWNER:
            continue
        for hit in _breaks(ast.parse(file.read_text(), str(file))):
            found.append(f"{file.relative_to(PACKAGE.parent)} {hit}")
    assert not found, (
        "row ids are built and split by grain_replay.store.parts.make_ids/split_ids/"
        "id_ordinals only:\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "code",
    [
        "x = ids >> parts_lib.ID_SHIFT",
        "from grain_replay.store.parts import SEQ_MASK",
        "seq = ids & SEQ_MASK",
        "o = x >> 40",
        "i = o << 40 | s",
        "seq = x & 0xFFFFFFFFFF",
        "first = p * (1 << 40) + f",
    ],
)
def test_the_rule_sees_a_break(code: str) -> None:
    assert _breaks(ast.parse(code))


def test_the_rule_lets_other_shifts_and_docstrings_be() -> None:
    assert not _breaks(ast.parse('"""ids are ``ordinal << 40 | seq``."""\nx = 1 << 20\ny = a >> 3'))
