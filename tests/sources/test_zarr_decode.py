"""The local Zarr chunk decoder reads exactly what zarr reads, and refuses what it must."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sources.reading.cache import ChunkCache
from grain_replay.sources.reading.chunked import ChunkedLeafReader
from grain_replay.sources.zarr.decode import LocalChunkReader

zarr = pytest.importorskip("zarr")
codecs = pytest.importorskip("zarr.codecs")

N = 203  # not a multiple of any chunk size below: the last chunk is partial


def _codecs() -> dict[str, dict[str, Any]]:
    return {
        "zstd": {"compressors": (codecs.ZstdCodec(level=3),)},
        "gzip": {"compressors": (codecs.GzipCodec(level=5),)},
        "blosc": {"compressors": (codecs.BloscCodec(cname="lz4", shuffle="shuffle"),)},
        "crc32c+zstd": {"compressors": (codecs.ZstdCodec(), codecs.Crc32cCodec())},
        "big-endian": {
            "serializer": codecs.BytesCodec(endian="big"),
            "compressors": (codecs.ZstdCodec(),),
        },
        "uncompressed": {"compressors": None},
    }


def _bits(a: np.ndarray) -> np.ndarray:
    """Bytes of ``a`` in native order, so NaN fill values compare bit-exactly."""
    return np.ascontiguousarray(a.astype(a.dtype.newbyteorder("="))).view(np.uint8)


def _write_group(path: str, codec: dict[str, Any]) -> dict[str, np.ndarray]:
    """Leaves covering multi-dim records, split record axes, unwritten chunks, fill values."""
    rng = np.random.default_rng(0)
    group = zarr.open_group(path, mode="w", zarr_format=3)
    leaves = {
        # (data, chunks, fill_value, rows written)
        "obs": (rng.standard_normal((N, 6, 5)).astype("f4"), (16, 6, 5), np.nan, N - 40),
        "split": (rng.integers(0, 9, (N, 7, 3)).astype("i2"), (10, 3, 2), -3, N),
        "reward": (rng.standard_normal(N).astype("f8"), (32,), 1.5, 100),
        "done": (rng.random(N) < 0.1, (64,), False, N),
        "pixels": (rng.integers(0, 4, (N, 4, 4, 2)).astype("u1"), (7, 4, 4, 2), 0, N),
    }
    for key, (data, chunks, fill, rows) in leaves.items():
        arr = group.create_array(
            key, shape=data.shape, dtype=data.dtype, chunks=chunks, fill_value=fill, **codec
        )
        arr[:rows] = data[:rows]
    return {key: group[key][...] for key in leaves}  # zarr's own reads, fill values included


@pytest.fixture(scope="module", params=list(_codecs()))
def store(request: Any, tmp_path_factory: Any) -> tuple[str, dict[str, np.ndarray]]:
    path = str(tmp_path_factory.mktemp("zd") / f"{request.param}.zarr")
    return path, _write_group(path, _codecs()[request.param])


@pytest.mark.parametrize("cache_bytes", [0, 2000, 1 << 26])
def test_batches_bit_exact_with_zarr_when_codecs_and_fill_values(
    store: tuple[str, dict[str, np.ndarray]], cache_bytes: int
) -> None:
    path, want = store
    rng = np.random.default_rng(cache_bytes)
    with gr.ZarrDataSource(path, cache_bytes=cache_bytes) as src:
        for idx in (rng.integers(0, N, 64), np.arange(N), np.array([N - 1, 0, N - 1])):
            got = src.read_flat(idx)
            for key, full in want.items():
                assert got[key].dtype == full.dtype.newbyteorder("=")
                np.testing.assert_array_equal(_bits(got[key]), _bits(full[idx]), err_msg=key)
        np.testing.assert_array_equal(_bits(src[N - 1]["split"]), _bits(want["split"][N - 1]))


def test_fast_path_taken_for_plain_codecs(store: tuple[str, dict[str, np.ndarray]]) -> None:
    path, _ = store
    with gr.ZarrDataSource(path) as src:
        src[0]
        for key, reader in src._get_handle().readers.items():
            if isinstance(reader, ChunkedLeafReader):
                assert isinstance(reader._read_blocks.__self__, LocalChunkReader), key


def test_sharded_array_falls_back_to_zarr_and_matches(tmp_path: Any) -> None:
    data = np.arange(N * 4, dtype="i4").reshape(N, 4)
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="w", zarr_format=3)
    arr = group.create_array("x", shape=data.shape, dtype=data.dtype, chunks=(8, 4), shards=(32, 4))
    arr[...] = data
    with gr.ZarrDataSource(str(tmp_path / "s.zarr")) as src:
        idx = np.array([5, 200, 31, 32, 5])
        np.testing.assert_array_equal(src.read_flat(idx)["x"], data[idx])
        reader = src._get_handle().readers["x"]
        assert not isinstance(getattr(reader._read_blocks, "__self__", None), LocalChunkReader)


def _zstd_store(tmp_path: Any) -> tuple[str, str]:
    path = str(tmp_path / "z.zarr")
    _write_group(path, _codecs()["zstd"])
    return path, os.path.join(path, "split", "c", "1", "0", "0")


@pytest.fixture(params=["fast", "zarr"])
def read_path(request: Any, monkeypatch: Any) -> str:
    """Which reader decodes the chunks: ours (the fast path), or zarr (the fast path turned off).

    The refusals must hold on both: zarr opens a FIFO and follows a symlink as
    readily as any file.
    """
    if request.param == "zarr":
        from grain_replay.sources.zarr import decode

        monkeypatch.setattr(decode, "local_chunk_reader", lambda *args, **kwargs: None)
    return str(request.param)


def _assert_read_path(src: gr.ZarrDataSource, key: str, read_path: str) -> None:
    reader = src._get_handle().readers[key]
    fast = isinstance(getattr(reader._read_blocks, "__self__", None), LocalChunkReader)
    assert fast == (read_path == "fast"), (key, read_path)


def test_corrupt_chunk_raises_invalid_store_error_naming_file_and_leaf(
    tmp_path: Any, read_path: str
) -> None:
    path, chunk = _zstd_store(tmp_path)
    with open(chunk, "r+b") as f:
        f.seek(8)
        f.write(b"\xff" * 16)
    with gr.ZarrDataSource(path) as src:
        _assert_read_path(src, "split", read_path)
        with pytest.raises(gr.InvalidStoreError) as e:
            src.read_batch([12])
    assert chunk in str(e.value) and "'split'" in str(e.value)


def test_truncated_chunk_raises_invalid_store_error(tmp_path: Any, read_path: str) -> None:
    path, chunk = _zstd_store(tmp_path)
    with open(chunk, "r+b") as f:
        f.truncate(os.path.getsize(chunk) // 2)
    with gr.ZarrDataSource(path) as src:
        _assert_read_path(src, "split", read_path)
        with pytest.raises(gr.InvalidStoreError) as e:
            src.read_batch([12])
    assert chunk in str(e.value) and "'split'" in str(e.value)


@pytest.mark.timeout(60)
def test_fifo_chunk_refused_without_blocking(tmp_path: Any, read_path: str) -> None:
    path, chunk = _zstd_store(tmp_path)
    os.remove(chunk)
    os.mkfifo(chunk)
    with gr.ZarrDataSource(path) as src:
        _assert_read_path(src, "split", read_path)
        with pytest.raises(gr.InvalidStoreError, match="regular"):
            src.read_batch([12])


def test_symlinked_chunk_outside_store_refused(tmp_path: Any, read_path: str) -> None:
    path, chunk = _zstd_store(tmp_path)
    _, other_chunk = _zstd_store(tmp_path / "elsewhere")
    os.remove(chunk)
    os.symlink(other_chunk, chunk)
    with gr.ZarrDataSource(path) as src:
        _assert_read_path(src, "split", read_path)
        with pytest.raises(gr.InvalidStoreError, match="outside"):
            src.read_batch([12])


def test_symlinked_chunk_folder_outside_store_refused(tmp_path: Any, read_path: str) -> None:
    path, chunk = _zstd_store(tmp_path)
    _, other_chunk = _zstd_store(tmp_path / "elsewhere")
    folder = os.path.dirname(os.path.dirname(chunk))  # split/c/1
    shutil.rmtree(folder)
    os.symlink(os.path.dirname(os.path.dirname(other_chunk)), folder)
    with gr.ZarrDataSource(path) as src:
        _assert_read_path(src, "split", read_path)
        with pytest.raises(gr.InvalidStoreError, match="outside"):
            src.read_batch([12])


def test_symlinked_chunk_outside_store_reads_with_allow_external(
    tmp_path: Any, read_path: str
) -> None:
    path, chunk = _zstd_store(tmp_path)
    _, other_chunk = _zstd_store(tmp_path / "elsewhere")
    os.remove(chunk)
    os.symlink(other_chunk, chunk)
    with gr.ZarrDataSource(path, allow_external=True) as src:
        _assert_read_path(src, "split", read_path)
        got = src.read_flat([12])["split"]
    np.testing.assert_array_equal(got, zarr.open_group(path, mode="r")["split"][12:13])


def test_symlinked_chunk_inside_store_reads(tmp_path: Any, read_path: str) -> None:
    path, chunk = _zstd_store(tmp_path)
    twin = os.path.join(path, "split", "c", "0", "0", "0")
    os.remove(chunk)
    os.symlink(twin, chunk)
    with gr.ZarrDataSource(path) as src:
        _assert_read_path(src, "split", read_path)
        got = src.read_flat([12])["split"]
    want = zarr.open_group(path, mode="r")["split"][12:13]
    np.testing.assert_array_equal(got, want)


# -- arrays only zarr decodes: sharded (the files are shards) -----------------------------


def _sharded_store(tmp_path: Any) -> tuple[str, str, np.ndarray]:
    path = str(tmp_path / "s.zarr")
    data = np.arange(N * 4, dtype="i4").reshape(N, 4)
    group = zarr.open_group(path, mode="w", zarr_format=3)
    arr = group.create_array(
        "x", shape=data.shape, dtype=data.dtype, chunks=(8, 4), shards=(32, 4),
        compressors=(codecs.ZstdCodec(),),
    )  # fmt: skip
    arr[...] = data
    return path, os.path.join(path, "x", "c", "1", "0"), data  # rows 32..63


def test_sharded_corrupt_shard_named_by_file(tmp_path: Any) -> None:
    path, shard, _ = _sharded_store(tmp_path)
    index = 4 * 16 + 4  # at the end: (offset, length) per inner chunk, then its crc32c
    with open(shard, "r+b") as f:
        f.write(b"\xff" * (os.path.getsize(shard) - index))
    with gr.ZarrDataSource(path) as src, pytest.raises(gr.InvalidStoreError) as e:
        src.read_batch([40])
    assert shard in str(e.value) and "'x'" in str(e.value)


@pytest.mark.timeout(60)
def test_sharded_fifo_shard_refused_without_blocking(tmp_path: Any) -> None:
    path, shard, data = _sharded_store(tmp_path)
    os.remove(shard)
    os.mkfifo(shard)
    with gr.ZarrDataSource(path) as src:
        np.testing.assert_array_equal(src.read_flat([5])["x"], data[[5]])  # another shard
        with pytest.raises(gr.InvalidStoreError, match="regular") as e:
            src.read_batch([40])
    assert shard in str(e.value)


def test_sharded_symlinked_shard_outside_store_refused(tmp_path: Any) -> None:
    path, shard, _ = _sharded_store(tmp_path)
    _, other, _ = _sharded_store(tmp_path / "elsewhere")
    os.remove(shard)
    os.symlink(other, shard)
    with gr.ZarrDataSource(path) as src, pytest.raises(gr.InvalidStoreError, match="outside"):
        src.read_batch([40])


# -- codecs our decoder covers beyond the group above ---------------------------------------


def test_transposed_chunks_take_the_fast_path_bit_exact(tmp_path: Any) -> None:
    path = str(tmp_path / "t.zarr")
    data = np.random.default_rng(1).standard_normal((N, 6, 5)).astype("f4")
    group = zarr.open_group(path, mode="w", zarr_format=3)
    arr = group.create_array(
        "obs", shape=data.shape, dtype=data.dtype, chunks=(16, 3, 5),
        filters=(codecs.TransposeCodec(order=(2, 0, 1)),), compressors=(codecs.ZstdCodec(),),
    )  # fmt: skip
    arr[: N - 30] = data[: N - 30]
    want = group["obs"][...]
    with gr.ZarrDataSource(path) as src:
        _assert_read_path(src, "obs", "fast")
        idx = np.array([0, 17, N - 31, N - 1, 100])
        np.testing.assert_array_equal(_bits(src.read_flat(idx)["obs"]), _bits(want[idx]))


# -- ChunkedLeafReader: what a batch holds -----------------------------------------------------


def _recording_reader(
    cache_bytes: int, *, with_rows: bool
) -> tuple[ChunkedLeafReader, list[list[int]], np.ndarray]:
    data = np.arange(1000 * 10, dtype="f8").reshape(1000, 10)  # 10 rows = 800 B per block
    calls: list[list[int]] = []

    def read_blocks(ids: Sequence[int]) -> list[np.ndarray]:
        calls.append(list(ids))
        return [data[c * 10 : (c + 1) * 10].copy() for c in ids]

    read_rows: Callable[..., list[np.ndarray]] | None = None
    if with_rows:

        def read_rows(ids: Sequence[int], rows: Sequence[np.ndarray]) -> list[np.ndarray]:
            calls.append([-1, *ids])
            return [data[c * 10 + r] for c, r in zip(ids, rows)]

    reader = ChunkedLeafReader(
        "x", 1000, 10, (10,), data.dtype, read_blocks, ChunkCache(cache_bytes), read_rows
    )
    return reader, calls, data


def test_blocks_fetched_in_groups_bounded_by_cache_bytes(monkeypatch: Any) -> None:
    from grain_replay.sources.reading import chunked

    monkeypatch.setattr(chunked, "_MIN_GROUP_BYTES", 0)
    reader, calls, data = _recording_reader(2400, with_rows=False)  # 3 blocks
    idx = np.arange(0, 1000, 37)
    np.testing.assert_array_equal(reader.take(idx), data[idx])
    assert calls and max(len(c) for c in calls) == 3
    assert reader._cache.nbytes <= 2400


def test_blocks_bigger_than_cache_read_for_their_rows_only() -> None:
    reader, calls, data = _recording_reader(100, with_rows=True)
    idx = np.array([999, 5, 5, 512, 0])
    np.testing.assert_array_equal(reader.take(idx), data[idx])
    assert calls == [[-1, 0, 51, 99]]
    assert reader._cache.nbytes == 0


def test_batch_missing_more_than_half_the_cache_reads_rows_only() -> None:
    reader, calls, data = _recording_reader(2000, with_rows=True)  # blocks fit, 3 of them don't
    idx = np.array([5, 15, 25, 35])
    np.testing.assert_array_equal(reader.take(idx), data[idx])
    assert calls == [[-1, 0, 1, 2, 3]]
    idx = np.array([5, 7])  # one block: cached for the next batch
    np.testing.assert_array_equal(reader.take(idx), data[idx])
    assert calls[-1] == [0] and reader._cache.nbytes == 800
