"""The source contract, once: every store and every RL view subclasses SourceTests.

``SourceTests`` is the contract of anything grain_replay hands to grain (stores
and views alike); ``DataSourceTests`` adds what only a store on disk has (a path
to open, ``keys=`` selection, a missing-store error) and builds ``src`` and
``expect`` from a tree written by ``write``.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import pickle
import re
import threading
from collections.abc import Callable
from typing import Any

import cloudpickle
import grain
import numpy as np
import pytest

import grain_replay as gr
from grain_replay import tree as tree_lib
from grain_replay.sources import BatchSource

N = 97


def make_tree(n: int = N, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "obs": {
            "vec": rng.standard_normal((n, 5)).astype(np.float32),
            "pixels": rng.integers(0, 255, (n, 3, 4), dtype=np.uint8),
        },
        "action": rng.integers(0, 6, n).astype(np.int64),
        "reward": rng.standard_normal(n).astype(np.float32),
        "done": rng.random(n) < 0.1,
    }


def take(tree: Any, idx: Any) -> Any:
    if isinstance(tree, dict):
        return {k: take(v, idx) for k, v in tree.items()}
    return np.asarray(tree)[idx]


def assert_tree_equal(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict), type(got)
        assert list(got) == list(want)
        for k in want:
            assert_tree_equal(got[k], want[k])
        return
    got = np.asarray(got)
    assert got.dtype == np.asarray(want).dtype
    np.testing.assert_array_equal(got, want)


def flat(tree: Any) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree_lib.flatten(tree)[0].items()}


def assert_same_tree(got: Any, want: Any, *, numpy_scalars: bool = False) -> None:
    """``got`` has ``want``'s structure and leaves: numpy arrays (or, with ``numpy_scalars``,
    numpy scalars) of the same dtype and values."""
    got_leaves, got_def = tree_lib.flatten(got)
    want_leaves, want_def = tree_lib.flatten(want)
    assert got_def == want_def
    assert list(got_leaves) == list(want_leaves)
    kinds = (np.ndarray, np.generic) if numpy_scalars else np.ndarray
    for key, w in want_leaves.items():
        g = got_leaves[key]
        w = np.asarray(w)
        assert isinstance(g, kinds), (key, type(g))
        assert g.dtype == w.dtype, key
        np.testing.assert_array_equal(g, w, err_msg=key)


def assert_flat_equal(got: dict[str, Any], want: dict[str, Any], rtol: float = 0.0) -> None:
    """Same keys in the same order, dtypes and values (floats within ``rtol`` when given)."""
    assert list(got) == list(want), (list(got), list(want))
    for k in want:
        g, w = np.asarray(got[k]), np.asarray(want[k])
        assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
        if rtol and g.dtype.kind == "f":
            np.testing.assert_allclose(g, w, rtol=rtol, err_msg=k)
        else:
            np.testing.assert_array_equal(g, w, err_msg=k)


def grain_loader(src: Any, batch: int = 8, workers: int = 2) -> grain.DataLoader:
    return grain.DataLoader(
        data_source=src,
        sampler=grain.samplers.IndexSampler(
            len(src), shuffle=True, seed=3, num_epochs=1,
            shard_options=grain.sharding.NoSharding(),
        ),
        operations=[grain.transforms.Batch(batch, drop_remainder=False)],
        worker_count=workers,
        shard_options=grain.sharding.NoSharding(),
    )  # fmt: skip


def _record_bytes(leaves: dict[str, np.ndarray]) -> list[bytes]:
    n = len(next(iter(leaves.values())))
    return sorted(
        b"".join(np.ascontiguousarray(v[j]).tobytes() for v in leaves.values()) for j in range(n)
    )


Expect = Callable[[np.ndarray], dict[str, Any]]


def slow_in_this_class(test: Callable[..., None]) -> Callable[..., None]:
    """An inherited contract test, marked ``slow`` for one subclass only.

    For a variant of a source class (another compression, chunking, padding) whose
    code path for that test another subclass of the same source class runs in
    ``make test``: ``make test-slow`` still runs it here. Marking the inherited
    function itself would mark it in every subclass, hence the copy.
    """

    @functools.wraps(test)
    def copy(self: Any, *args: Any, **kwargs: Any) -> None:
        test(self, *args, **kwargs)

    return pytest.mark.slow(copy)


class SourceTests:
    """The contract of every source and view.

    Subclasses provide the fixtures ``src`` (a source) and ``expect`` (record ids
    -> the expected ``{key: array}``), and ``make(tmp_path, scale)`` building a
    source whose store grows with ``scale``.
    """

    # Float leaves computed by the source (n-step returns) are compared within this.
    rtol = 0.0

    def make(self, tmp_path: Any, scale: int) -> Any:
        raise NotImplementedError

    def _row(self, expect: Expect, i: int) -> dict[str, Any]:
        return {k: v[0] for k, v in expect(np.array([i])).items()}

    # -- values ---------------------------------------------------------------

    def test_read_batch_matches_reference_with_duplicates_and_negatives(
        self, src: Any, expect: Expect
    ) -> None:
        n = len(src)
        rng = np.random.default_rng(1)
        idx = np.concatenate([[0, n - 1, -1, -n, 5 % n, 5 % n, 5 % n], rng.integers(-n, n, 200)])
        want = expect(np.where(idx < 0, idx + n, idx))
        assert_flat_equal(flat(src.read_batch(idx)), want, self.rtol)
        assert_flat_equal(flat(src.read_batch(list(idx))), want, self.rtol)
        assert_flat_equal(src.read_flat(list(idx)), want, self.rtol)

    def test_read_into_writes_the_named_leaves_into_slices_of_one_batch(
        self, src: Any, expect: Expect
    ) -> None:
        n = len(src)
        idx = np.array([n - 1, 0, 2 % n, 2 % n, -1])
        want = expect(np.where(idx < 0, idx + n, idx))
        keys = src.keys[::2]  # every other leaf: the rest are not read
        batch = {k: np.full((len(idx) + 3, *src.spec[k].shape), 7, src.spec[k].dtype) for k in keys}
        src.read_into(idx, {k: v[2:-1] for k, v in batch.items()})
        assert_flat_equal(
            {k: v[2:-1] for k, v in batch.items()}, {k: want[k] for k in keys}, self.rtol
        )
        pristine = {k: np.full_like(v, 7) for k, v in batch.items()}
        for k, v in batch.items():  # nothing written outside the slices
            np.testing.assert_array_equal(v[:2], pristine[k][:2], err_msg=k)
            np.testing.assert_array_equal(v[-1:], pristine[k][-1:], err_msg=k)
        checked = {k: np.zeros_like(v[2:-1]) for k, v in batch.items()}
        src.read_into(np.where(idx < 0, idx + n, idx), checked, check=False)
        assert_flat_equal(checked, {k: want[k] for k in keys}, self.rtol)

    def test_read_into_refuses_arrays_that_cannot_take_the_rows(self, src: Any) -> None:
        key = src.keys[0]
        spec = src.spec[key]
        good = np.zeros((2, *spec.shape), spec.dtype)
        other = np.dtype(np.int8 if spec.dtype != np.int8 else np.int16)
        readonly = good.copy()
        readonly.flags.writeable = False
        for bad in (np.zeros((3, *spec.shape), spec.dtype), good.astype(other), readonly):
            with pytest.raises(gr.InvalidArgumentError, match=re.escape(repr(key))):
                src.read_into([0, 1], {key: bad})
        with pytest.raises(gr.UnknownLeafError, match="no_such_leaf"):
            src.read_into([0, 1], {"no_such_leaf": good})
        with pytest.raises(IndexError):
            src.read_into([0, len(src)], {key: good})

    def test_read_batch_preserves_order(self, src: Any, expect: Expect) -> None:
        idx = np.arange(len(src))[::-1]
        assert_flat_equal(flat(src.read_batch(idx)), expect(idx), self.rtol)

    def test_getitem_and_getitems_match_read_batch(self, src: Any, expect: Expect) -> None:
        n = len(src)
        for i in [0, 1, n // 2, n - 1, -1, -n]:
            assert_flat_equal(flat(src[i]), self._row(expect, i % n), self.rtol)
        idx = [3, 1, 3, n - 1]
        records = src._getitems(idx)
        assert len(records) == len(idx)
        want = expect(np.array(idx))
        for j, r in enumerate(records):
            assert_flat_equal(flat(r), {k: v[j] for k, v in want.items()}, self.rtol)

    def test_spec_matches_records(self, src: Any) -> None:
        got = flat(src.read_batch([0, 1]))
        assert list(got) == list(src.spec) == src.keys
        for k, s in src.spec.items():
            assert got[k].dtype == s.dtype and got[k].shape[1:] == s.shape, k
            assert type(got[k]) is np.ndarray
        assert all(isinstance(v, np.ndarray) for v in flat(src[0]).values())

    def test_empty_batch_has_spec_shapes(self, src: Any) -> None:
        got = flat(src.read_batch([]))
        for k, s in src.spec.items():
            assert got[k].shape == (0, *s.shape), k

    # -- errors ---------------------------------------------------------------

    def test_out_of_range_raises_index_error_naming_index_and_length(self, src: Any) -> None:
        n = len(src)
        for bad in (n, n + 5, -n - 1):
            with pytest.raises(IndexError, match=rf"{bad}.*{n}"):
                src[bad]
            with pytest.raises(gr.RecordIndexError, match=rf"{bad}.*{n}"):
                src.read_batch([0, bad])

    def test_non_integer_index_raises_type_error(self, src: Any) -> None:
        with pytest.raises(TypeError):
            src[1.5]
        with pytest.raises(TypeError):
            src.read_batch([0.5, 1.0])

    # -- protocol, repr, pickling ---------------------------------------------

    def test_is_a_grain_random_access_source(self, src: Any) -> None:
        assert isinstance(src, grain.sources.RandomAccessDataSource)
        assert isinstance(src, BatchSource)  # what make_data_loader reads
        assert isinstance(src, gr.sources.SourceSurface)

    def test_repr_is_deterministic(self, src: Any) -> None:
        before = repr(src)
        src[0]
        assert repr(src) == before == repr(pickle.loads(pickle.dumps(src)))
        assert src.path in before and str(len(src)) in before

    def test_pickle_round_trip_has_no_handle(self, src: Any, expect: Expect) -> None:
        src.read_batch([1, 2])
        assert src._handle is not None
        for dumps in (pickle.dumps, cloudpickle.dumps):
            clone = pickle.loads(dumps(src))
            assert repr(clone) == repr(src)
            assert clone._handle is None
            assert getattr(clone, "_state", None) is None  # no episode index travels
            assert_flat_equal(flat(clone[7]), self._row(expect, 7), self.rtol)
            assert_flat_equal(flat(clone.read_batch([3, 1])), expect(np.array([3, 1])), self.rtol)

    def test_pickle_size_independent_of_records(self, tmp_path: Any) -> None:
        small, big = self.make(tmp_path / "small", 1), self.make(tmp_path / "big", 50)
        assert len(big) > 20 * len(small)
        small[0], big[0]
        size_small, size_big = len(pickle.dumps(small)), len(pickle.dumps(big))
        assert abs(size_big - size_small) < 64, (size_small, size_big)
        assert size_big < 8192

    def test_close_and_context_manager_release_and_reopen(self, src: Any, expect: Expect) -> None:
        with src as s:
            s[0]
            assert s._handle is not None
        assert src._handle is None
        assert_flat_equal(flat(src[3]), self._row(expect, 3), self.rtol)
        assert src._handle is not None
        src.close()
        src.close()  # idempotent

    def test_one_handle_per_process_reused_across_reads(self, src: Any) -> None:
        for i in range(5):
            src[i]
            src.read_batch([i, i + 1])
        assert src._opens == 1

    @pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
    def test_reopens_after_fork(self, src: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        import worker_fns

        # The fork happens in a freshly spawned process (this one runs JAX and
        # reader threads, and forking it could deadlock the child); one BLAS
        # thread there, so the threads alive at the fork are those reading left.
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1) as pool:
            res = pool.apply(worker_fns.read_across_fork, (src, [5, 6]))
        assert res["child_ok"], res
        assert res["parent_kept_handle"]
        if res["os_threads_at_fork"] == 1:  # else reading left threads (zarr's, arrow's, ours)
            assert not res["fork_warnings"], res["fork_warnings"]

    # -- concurrency ------------------------------------------------------------

    def test_sixteen_threads_read_correct_data(self, src: Any, expect: Expect) -> None:
        errors: list[BaseException] = []
        barrier = threading.Barrier(16)
        n = len(src)

        def work(seed: int) -> None:
            try:
                rng = np.random.default_rng(seed)
                barrier.wait()
                for _ in range(20):
                    idx = rng.integers(0, n, 17)
                    assert_flat_equal(flat(src.read_batch(idx)), expect(idx), self.rtol)
                    i = int(rng.integers(0, n))
                    assert_flat_equal(flat(src[i]), self._row(expect, i), self.rtol)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert src._opens == 1

    def test_spawned_workers_open_one_handle_each(self, src: Any, expect: Expect) -> None:
        import worker_fns

        src[0]  # the parent's handle must not travel
        idx = [4, 0, len(src) - 1, 4]
        want = expect(np.array(idx))
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(2) as pool:
            results = pool.starmap(worker_fns.read_in_worker, [(src, idx)] * 4)
        for res in results:
            assert res["pid"] != os.getpid()
            assert res["opens"] == 1
            assert_flat_equal(flat(res["batch"]), want, self.rtol)
            assert_flat_equal(flat(res["again"]), expect(np.array(idx[::-1])), self.rtol)
            for j, r in enumerate(res["records"]):
                assert_flat_equal(flat(r), {k: v[j] for k, v in want.items()}, self.rtol)

    def test_grain_dataloader_with_workers_reads_every_record_once(
        self, src: Any, expect: Expect
    ) -> None:
        # One grain worker process: the source pickled into grain's worker and read there
        # (each grain worker imports jax, ~2 s of CPU: two readers in two processes at once
        # are test_spawned_workers_open_one_handle_each's). Compare the records as a
        # multiset: grain's worker path batches them in its own order.
        batches = list(grain_loader(src, batch=8, workers=1))
        got = {k: np.concatenate([flat(b)[k] for b in batches]) for k in src.spec}
        want = expect(np.arange(len(src)))
        assert {k: (v.dtype, v.shape) for k, v in got.items()} == {
            k: (v.dtype, v.shape) for k, v in want.items()
        }
        assert _record_bytes(got) == _record_bytes(want)

    def test_grain_checkpoint_round_trip(self, src: Any) -> None:
        def make() -> grain.DataLoader:
            return grain.DataLoader(
                data_source=pickle.loads(pickle.dumps(src)),  # a fresh source, as on restart
                sampler=grain.samplers.IndexSampler(
                    len(src), shuffle=True, seed=5, num_epochs=1,
                    shard_options=grain.sharding.NoSharding(),
                ),
                operations=[grain.transforms.Batch(4)],
                shard_options=grain.sharding.NoSharding(),
            )  # fmt: skip

        it = iter(make())
        for _ in range(3):
            next(it)
        state = it.get_state()
        rest = [flat(b) for b in it]
        resumed = iter(make())
        resumed.set_state(state)
        rest2 = [flat(b) for b in resumed]
        assert len(rest) == len(rest2) > 0
        for a, b in zip(rest, rest2):
            assert_flat_equal(a, b)


class DataSourceTests(SourceTests):
    """The contract of a store format. Subclasses set ``cls`` and implement ``write``."""

    cls: type[gr.ReplaySource]
    suffix = ""

    def write(self, path: str, tree: Any) -> str:
        raise NotImplementedError

    def make(self, tmp_path: Any, scale: int) -> Any:
        os.makedirs(tmp_path, exist_ok=True)
        return self.cls(self.write(str(tmp_path / f"store{self.suffix}"), make_tree(60 * scale)))

    @pytest.fixture
    def tree(self) -> dict[str, Any]:
        return make_tree()

    @pytest.fixture
    def src(self, tmp_path: Any, tree: Any) -> gr.ReplaySource:
        path = self.write(str(tmp_path / f"store{self.suffix}"), tree)
        return self.cls(path)

    @pytest.fixture
    def expect(self, tree: Any) -> Expect:
        leaves = flat(tree)
        return lambda ids: {k: v[ids] for k, v in leaves.items()}

    # -- what only a store has ------------------------------------------------------

    def test_len_is_number_of_records(self, src: gr.ReplaySource) -> None:
        assert len(src) == N

    def test_unchecked_reads_of_drawn_rows_match_and_never_leave_the_store(
        self, src: gr.ReplaySource, tree: Any
    ) -> None:
        idx = np.random.default_rng(3).integers(0, N, 40)
        assert_tree_equal(src.read_batch(idx, check=False), take(tree, idx))
        assert_flat_equal(src.read_flat(idx, check=False), flat(take(tree, idx)))
        with pytest.raises(IndexError):  # numpy's, not ours: but no read past the store
            src.read_batch(np.array([0, N + 5]), check=False)

    def test_getitem_matches_memory(self, src: gr.ReplaySource, tree: Any) -> None:
        for i in [0, 1, N // 2, N - 1, -1, -N]:
            assert_tree_equal(src[i], take(tree, i))
        idx = np.array([0, N - 1, -1, -N, 5, 5])
        assert_tree_equal(src.read_batch(idx), take(tree, idx))

    def test_spec_gives_per_record_dtype_and_shape(self, src: gr.ReplaySource) -> None:
        assert src.spec["obs/pixels"].shape == (3, 4)
        assert src.spec["obs/pixels"].dtype == np.uint8
        assert src.spec["action"].shape == ()
        assert list(src.spec) == ["obs/vec", "obs/pixels", "action", "reward", "done"]

    def test_keys_select_leaves_and_groups(self, tmp_path: Any, tree: Any) -> None:
        path = self.write(str(tmp_path / f"k{self.suffix}"), tree)
        src = self.cls(path, keys=["obs", "reward"])
        r = src[4]
        assert set(r) == {"obs", "reward"}
        assert_tree_equal(r["obs"], take(tree["obs"], 4))
        only = self.cls(path, keys=["obs/vec"])
        assert list(only.spec) == ["obs/vec"]
        with pytest.raises(gr.UnknownLeafError, match="nope"):
            self.cls(path, keys=["nope"])

    def test_missing_store_raises_file_not_found(self, tmp_path: Any) -> None:
        with pytest.raises(FileNotFoundError):
            self.cls(str(tmp_path / f"missing{self.suffix}"))

    def test_repr_names_class_path_keys_and_length(self, src: gr.ReplaySource) -> None:
        assert repr(src) == repr(self.cls(src.path))
        assert repr(src).startswith(type(src).__name__ + "(")
        assert src.path in repr(src) and str(src.keys) in repr(src) and str(N) in repr(src)
