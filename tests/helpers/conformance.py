"""The source contract, once: every backend's test module subclasses DataSourceTests."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
from typing import Any

import cloudpickle
import grain
import numpy as np
import pytest

import grain_replay as gr

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


class DataSourceTests:
    """Contract tests. Subclasses implement ``write(path, tree) -> store path`` and ``cls``."""

    cls: type[gr.ReplaySource]
    suffix = ""

    def write(self, path: str, tree: Any) -> str:
        raise NotImplementedError

    @pytest.fixture
    def tree(self) -> dict[str, Any]:
        return make_tree()

    @pytest.fixture
    def src(self, tmp_path: Any, tree: Any) -> gr.ReplaySource:
        path = self.write(str(tmp_path / f"store{self.suffix}"), tree)
        return self.cls(path)

    # -- values ---------------------------------------------------------------

    def test_len_is_number_of_records(self, src: gr.ReplaySource) -> None:
        assert len(src) == N

    def test_getitem_matches_memory(self, src: gr.ReplaySource, tree: Any) -> None:
        for i in [0, 1, N // 2, N - 1, -1, -N]:
            assert_tree_equal(src[i], take(tree, i))

    def test_read_batch_matches_memory_with_duplicates_and_negatives(
        self, src: gr.ReplaySource, tree: Any
    ) -> None:
        rng = np.random.default_rng(1)
        idx = np.concatenate([[0, N - 1, -1, -N, 5, 5, 5], rng.integers(-N, N, 200)])
        assert_tree_equal(src.read_batch(idx), take(tree, idx))
        assert_tree_equal(src.read_batch(list(idx)), take(tree, idx))

    def test_read_batch_preserves_order(self, src: gr.ReplaySource, tree: Any) -> None:
        idx = np.arange(N)[::-1]
        assert_tree_equal(src.read_batch(idx), take(tree, idx))

    def test_read_batch_empty(self, src: gr.ReplaySource, tree: Any) -> None:
        out = src.read_batch([])
        assert out["obs"]["pixels"].shape == (0, 3, 4)

    def test_getitems_returns_records(self, src: gr.ReplaySource, tree: Any) -> None:
        idx = [3, 1, 3, N - 1]
        records = src._getitems(idx)
        assert len(records) == len(idx)
        for r, i in zip(records, idx):
            assert_tree_equal(r, take(tree, i))

    def test_records_are_numpy(self, src: gr.ReplaySource) -> None:
        r = src[0]
        assert isinstance(r["obs"]["vec"], np.ndarray)
        assert type(src.read_batch([0, 1])["obs"]["vec"]) is np.ndarray

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

    # -- errors ---------------------------------------------------------------

    @pytest.mark.parametrize("bad", [N, N + 5, -N - 1])
    def test_out_of_range_raises_index_error_naming_index_and_length(
        self, src: gr.ReplaySource, bad: int
    ) -> None:
        with pytest.raises(IndexError, match=rf"{bad}.*{N}"):
            src[bad]
        with pytest.raises(gr.RecordIndexError, match=rf"{bad}.*{N}"):
            src.read_batch([0, bad])

    def test_non_integer_index_raises_type_error(self, src: gr.ReplaySource) -> None:
        with pytest.raises(TypeError):
            src[1.5]  # type: ignore[index]
        with pytest.raises(TypeError):
            src.read_batch([0.5, 1.0])

    def test_missing_store_raises_file_not_found(self, tmp_path: Any) -> None:
        with pytest.raises(FileNotFoundError):
            self.cls(str(tmp_path / f"missing{self.suffix}"))

    # -- protocol, repr, pickling ---------------------------------------------

    def test_is_a_grain_random_access_source(self, src: gr.ReplaySource) -> None:
        assert isinstance(src, grain.sources.RandomAccessDataSource)

    def test_repr_is_deterministic(self, src: gr.ReplaySource) -> None:
        again = self.cls(src.path)
        assert repr(src) == repr(again)
        assert src.path in repr(src) and str(N) in repr(src)
        src[0]
        assert repr(src) == repr(again)

    def test_pickle_round_trip_has_no_handle(self, src: gr.ReplaySource, tree: Any) -> None:
        src.read_batch([1, 2])
        assert src._handle is not None
        for dumps in (pickle.dumps, cloudpickle.dumps):
            clone = pickle.loads(dumps(src))
            assert repr(clone) == repr(src)
            assert clone._handle is None
            assert_tree_equal(clone[7], take(tree, 7))

    def test_pickle_size_independent_of_records(self, tmp_path: Any) -> None:
        small = self.cls(self.write(str(tmp_path / f"s{self.suffix}"), make_tree(10)))
        big = self.cls(self.write(str(tmp_path / f"b{self.suffix}"), make_tree(3_000)))
        small[0], big[0]
        size_small, size_big = len(pickle.dumps(small)), len(pickle.dumps(big))
        assert abs(size_big - size_small) < 64, (size_small, size_big)
        assert size_big < 8192

    def test_close_and_context_manager_release_and_reopen(
        self, src: gr.ReplaySource, tree: Any
    ) -> None:
        with src as s:
            s[0]
            assert s._handle is not None
        assert src._handle is None
        assert_tree_equal(src[3], take(tree, 3))
        assert src._handle is not None
        src.close()
        src.close()  # idempotent

    def test_one_handle_per_process_reused_across_reads(self, src: gr.ReplaySource) -> None:
        for i in range(5):
            src[i]
            src.read_batch([i, i + 1])
        assert src._opens == 1

    @pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
    @pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the child runs no JAX
    def test_reopens_after_fork(self, src: gr.ReplaySource, tree: Any) -> None:
        src[0]
        parent_handle = src._handle
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: must not reuse the parent's handle
            ok = 1
            try:
                got = src.read_batch([5, 6])
                ok = int(
                    src._handle is not parent_handle
                    and np.array_equal(got["reward"], tree["reward"][[5, 6]])
                )
            finally:
                os.write(w, bytes([ok]))
                os._exit(0)
        os.close(w)
        result = os.read(r, 1)
        os.waitpid(pid, 0)
        assert result == b"\x01"
        assert src._handle is parent_handle

    # -- concurrency ------------------------------------------------------------

    def test_sixteen_threads_read_correct_data(self, src: gr.ReplaySource, tree: Any) -> None:
        errors: list[BaseException] = []
        barrier = threading.Barrier(16)

        def work(seed: int) -> None:
            try:
                rng = np.random.default_rng(seed)
                barrier.wait()
                for _ in range(20):
                    idx = rng.integers(0, N, 17)
                    assert_tree_equal(src.read_batch(idx), take(tree, idx))
                    i = int(rng.integers(0, N))
                    assert_tree_equal(src[i], take(tree, i))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert src._opens == 1

    def test_spawned_workers_open_one_handle_each(self, src: gr.ReplaySource, tree: Any) -> None:
        import worker_fns

        src[0]  # the parent's handle must not travel
        idx = [4, 0, N - 1, 4]
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(2) as pool:
            results = pool.starmap(worker_fns.read_in_worker, [(src, idx)] * 4)
        for res in results:
            assert res["pid"] != os.getpid()
            assert res["opens"] == 1
            assert_tree_equal(res["batch"], take(tree, idx))
            assert_tree_equal(res["again"], take(tree, idx[::-1]))
            for r, i in zip(res["records"], idx):
                assert_tree_equal(r, take(tree, i))

    def test_grain_dataloader_with_workers_reads_every_record_once(
        self, src: gr.ReplaySource, tree: Any
    ) -> None:
        loader = grain.DataLoader(
            data_source=src,
            sampler=grain.samplers.IndexSampler(
                len(src), shuffle=True, seed=3, num_epochs=1,
                shard_options=grain.sharding.NoSharding(),
            ),
            operations=[grain.transforms.Batch(8, drop_remainder=False)],
            worker_count=2,
            shard_options=grain.sharding.NoSharding(),
        )  # fmt: skip
        rewards = np.concatenate([b["reward"] for b in loader])
        np.testing.assert_array_equal(np.sort(rewards), np.sort(tree["reward"]))

    def test_grain_checkpoint_round_trip(self, src: gr.ReplaySource) -> None:
        def make() -> grain.DataLoader:
            return grain.DataLoader(
                data_source=self.cls(src.path),
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
        rest = [b["action"] for b in it]
        resumed = iter(make())
        resumed.set_state(state)
        rest2 = [b["action"] for b in resumed]
        assert len(rest) == len(rest2) > 0
        for a, b in zip(rest, rest2):
            np.testing.assert_array_equal(a, b)
