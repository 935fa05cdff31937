"""Zarr and HDF5 sources over S3: a real moto server on 127.0.0.1, faults injected at the wire."""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conformance import DataSourceTests, N, assert_tree_equal, make_tree, take
from s3_server import (
    SECRET_KEY,
    HTTPProxy,
    S3Server,
    free_port,
    moto_unavailable_reason,
    serve_bucket,
)

import grain_replay as gr
from grain_replay import remote as remote_lib

_reason = moto_unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

BUCKET = "replay-tests"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    yield from serve_bucket(BUCKET)


@pytest.fixture(scope="module")
def proxy(s3: S3Server) -> Iterator[HTTPProxy]:
    with HTTPProxy(s3.port, stall_s=1.0) as p:
        yield p


def upload(server: S3Server, local: str) -> str:
    return server.upload(local, BUCKET, f"{uuid.uuid4().hex[:12]}/{os.path.basename(local)}")


def via(proxy: HTTPProxy, server: S3Server, **extra: Any) -> dict[str, Any]:
    """Storage options that reach ``server`` through ``proxy``."""
    opts = server.storage_options(**extra)
    opts["client_kwargs"] = dict(opts["client_kwargs"], endpoint_url=proxy.endpoint_url)
    return opts


@pytest.fixture(scope="module")
def store(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """A compressed Zarr store of N records in chunks of 10 rows, uploaded once: (url, tree)."""
    tree = make_tree()
    local = gr.write_zarr(
        str(tmp_path_factory.mktemp("s3") / "s.zarr"), tree, compression="zstd", chunk_rows=10
    )
    return upload(s3, local), tree


def _digest(tree: dict[str, Any]) -> str:
    h = hashlib.sha1()
    for key in sorted(tree):
        leaf = tree[key]
        h.update(key.encode())
        if isinstance(leaf, dict):
            h.update(_digest(leaf).encode())
        else:
            h.update(str((leaf.dtype, leaf.shape)).encode() + np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


# Stores the conformance tests upload, by (server port, writer, content): tests only read.
_UPLOADED: dict[tuple[int, str, str], str] = {}


# -- the source contract, over S3 ------------------------------------------------------


class _S3Tests(DataSourceTests):
    """The conformance suite with stores uploaded to the server and read by URL."""

    source_cls: Any
    _server: S3Server

    @pytest.fixture(autouse=True)
    def _bind_server(self, s3: S3Server) -> None:
        self._server = s3

    @property
    def cls(self) -> Any:  # type: ignore[override]
        return functools.partial(self.source_cls, storage_options=self._server.storage_options())

    def write_local(self, path: str, tree: Any) -> str:
        raise NotImplementedError

    def write(self, path: str, tree: Any) -> str:
        key = (self._server.port, type(self).__name__, _digest(tree))
        if key not in _UPLOADED:
            _UPLOADED[key] = upload(self._server, self.write_local(path, tree))
        return _UPLOADED[key]


def _chunk_rows(tree: Any) -> int:
    """10 rows for the small trees; 4 chunks a leaf for the 20k-record one (fewer uploads)."""
    n = len(tree["reward"])
    return 10 if n < 1000 else -(-n // 4)


class TestZarrS3Compressed(_S3Tests):
    source_cls = gr.ZarrDataSource
    suffix = ".zarr"

    # Spawned workers are covered by the grain DataLoader test (worker_count=2),
    # which unpickles the source in each worker and reads the server from there.
    test_spawned_workers_open_one_handle_each = None  # type: ignore[assignment]

    def write_local(self, path: str, tree: Any) -> str:
        return gr.write_zarr(path, tree, compression="zstd", chunk_rows=_chunk_rows(tree))


class TestHDF5S3Chunked(_S3Tests):
    source_cls = gr.HDF5DataSource
    suffix = ".h5"

    # The spawned-worker test reads from the server in fresh processes; the grain
    # DataLoader test adds nothing S3-specific to it and the Zarr class runs it.
    test_grain_dataloader_with_workers_reads_every_record_once = None  # type: ignore[assignment]

    def write_local(self, path: str, tree: Any) -> str:
        return gr.write_hdf5(path, tree, compression="gzip", chunk_rows=_chunk_rows(tree))


def test_hdf5_contiguous_over_s3(s3: S3Server, tmp_path: Any) -> None:
    tree = make_tree()
    url = upload(s3, gr.write_hdf5(str(tmp_path / "c.h5"), tree))
    src = gr.HDF5DataSource(url, storage_options=s3.storage_options())
    idx = np.array([5, 0, N - 1, 5])
    assert_tree_equal(src.read_batch(idx), take(tree, idx))
    assert_tree_equal(src[-1], take(tree, N - 1))


def test_open_source_picks_the_class_from_the_url_suffix(s3: S3Server, tmp_path: Any) -> None:
    tree = make_tree()
    opts = s3.storage_options()
    z = gr.open_source(
        upload(s3, gr.write_zarr(str(tmp_path / "o.zarr"), tree)), storage_options=opts
    )
    h = gr.open_source(
        upload(s3, gr.write_hdf5(str(tmp_path / "o.h5"), tree)), storage_options=opts
    )
    assert isinstance(z, gr.ZarrDataSource) and isinstance(h, gr.HDF5DataSource)
    assert_tree_equal(z.read_batch([1, 2]), h.read_batch([1, 2]))


# -- requests: one GET per chunk, concurrent, cached ------------------------------------


def test_read_batch_sends_one_get_per_needed_chunk_concurrently(
    s3: S3Server, proxy: HTTPProxy, store: Any
) -> None:
    url, tree = store
    src = gr.ZarrDataSource(url, storage_options=via(proxy, s3))
    src._get_handle()
    idx = np.random.default_rng(0).integers(0, N, 24)
    needed = len(np.unique(idx // 10)) * len(src.keys)
    proxy.reset_counts()
    with proxy.counting() as cold:
        assert_tree_equal(src.read_batch(idx), take(tree, idx))
    assert cold["GET"] == needed, (dict(cold), needed)
    assert cold["HEAD"] == 0, dict(cold)  # no HEAD before each GET (s3fs max_concurrency=1)
    assert proxy.max_in_flight > 1, "chunk GETs were sent one at a time"
    with proxy.counting() as warm:
        assert_tree_equal(src.read_batch(idx[::-1]), take(tree, idx[::-1]))
    assert sum(warm.values()) == 0, dict(warm)  # served by the decoded-chunk cache


def test_max_concurrency_bounds_requests_in_flight(
    s3: S3Server, proxy: HTTPProxy, store: Any
) -> None:
    url, tree = store
    keys = ["reward", "done"]
    src = gr.ZarrDataSource(url, keys=keys, storage_options=via(proxy, s3), max_concurrency=2)
    src._get_handle()
    proxy.reset_counts()
    idx = np.arange(N)
    got = src.read_batch(idx)
    assert_tree_equal(got, {k: tree[k] for k in keys})
    assert 1 <= proxy.max_in_flight <= 2


# -- transient failures are retried -------------------------------------------------------


@pytest.mark.parametrize("mode", ["503", "reset", "stall"])
def test_transient_failures_are_retried(
    s3: S3Server, proxy: HTTPProxy, store: Any, mode: str
) -> None:
    url, tree = store
    opts = via(proxy, s3, config_kwargs={"read_timeout": 0.3, "connect_timeout": 1})
    src = gr.ZarrDataSource(url, storage_options=opts, retries=gr_retry(4))
    src._get_handle()
    proxy.fail_next(2, mode)
    assert_tree_equal(src.read_batch([0, 50, 96]), take(tree, [0, 50, 96]))
    proxy.clear_faults()
    if mode == "503":  # s3fs retries resets and timeouts itself; 503s are ours to retry
        assert src._handle.remote.retried == 2


def gr_retry(retries: int) -> gr.RetryOptions:
    return gr.RetryOptions(retries=retries, backoff_s=0.01, max_backoff_s=0.05)


def test_transient_failures_at_open_are_retried(s3: S3Server, proxy: HTTPProxy, store: Any) -> None:
    url, tree = store
    proxy.fail_next(2, "503")
    src = gr.ZarrDataSource(url, storage_options=via(proxy, s3), retries=gr_retry(3))
    assert_tree_equal(src[3], take(tree, 3))


def test_retries_exhausted_raise_clear_error(s3: S3Server, proxy: HTTPProxy, store: Any) -> None:
    url, _ = store
    # One leaf, one chunk: one request takes every injected fault.
    opts = via(proxy, s3)
    src = gr.ZarrDataSource(url, keys=["reward"], storage_options=opts, retries=gr_retry(1))
    src._get_handle()
    proxy.fail_next(2, "503")
    with pytest.raises(gr.StoreUnreachableError, match=r"after 2 attempt.*retries=") as info:
        src.read_batch([0])
    assert url in str(info.value) and "ServiceUnavailable" in str(info.value)
    proxy.clear_faults()
    src.read_batch([0])  # the source stays usable


def test_retries_zero_fails_at_first_error(s3: S3Server, proxy: HTTPProxy, store: Any) -> None:
    url, _ = store
    src = gr.ZarrDataSource(url, keys=["reward"], storage_options=via(proxy, s3), retries=0)
    src._get_handle()
    proxy.fail_next(1, "503")
    with pytest.raises(gr.GrainReplayError, match="after 1 attempt"):
        src.read_batch([10])


def test_hdf5_remote_reads_are_retried_and_failures_named(
    s3: S3Server, proxy: HTTPProxy, tmp_path: Any
) -> None:
    # Large enough that chunk reads after the open still go to the server.
    tree = {"obs": np.random.default_rng(0).standard_normal((4000, 64)).astype(np.float32)}
    url = upload(s3, gr.write_hdf5(str(tmp_path / "r.h5"), tree, compression="gzip"))
    src = gr.HDF5DataSource(url, storage_options=via(proxy, s3))
    src[0]
    proxy.fail_next(2, "503")
    assert_tree_equal(src.read_batch([3999, 2000]), take(tree, [3999, 2000]))
    proxy.fail_next(50, "503")
    with pytest.raises(gr.StoreUnreachableError, match=r"s3://.*r\.h5.*after \d attempt"):
        src.read_batch([1000, 3000])
    proxy.clear_faults()


# -- clear errors ------------------------------------------------------------------------


def test_missing_bucket_raises_store_not_found_naming_it(s3: S3Server) -> None:
    for cls, name in [(gr.ZarrDataSource, "x.zarr"), (gr.HDF5DataSource, "x.h5")]:
        with pytest.raises(gr.StoreNotFoundError, match=r"bucket 'no-such-bucket' does not exist"):
            cls(f"s3://no-such-bucket/{name}", storage_options=s3.storage_options())


def test_missing_key_raises_store_not_found(s3: S3Server) -> None:
    with pytest.raises(FileNotFoundError, match=rf"No Zarr group at s3://{BUCKET}/nope\.zarr"):
        gr.ZarrDataSource(f"s3://{BUCKET}/nope.zarr", storage_options=s3.storage_options())
    with pytest.raises(gr.StoreNotFoundError, match=rf"No HDF5 file at s3://{BUCKET}/nope\.h5"):
        gr.HDF5DataSource(f"s3://{BUCKET}/nope.h5", storage_options=s3.storage_options())


def test_missing_credentials_name_the_options_to_set(
    s3: S3Server, store: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = store
    for var in list(os.environ):
        if var.startswith("AWS_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    opts = {"client_kwargs": {"endpoint_url": s3.endpoint_url, "region_name": "us-east-1"}}
    for cls, u in [(gr.ZarrDataSource, url), (gr.HDF5DataSource, url.replace(".zarr", ".h5"))]:
        with pytest.raises(gr.StoreAccessError, match=r"no credentials.*'key'.*'secret'") as info:
            cls(u, storage_options=opts)
        assert u in str(info.value)


def test_unreachable_endpoint_fails_fast_naming_endpoint_url(s3: S3Server) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    opts = s3.storage_options()
    opts["client_kwargs"] = dict(opts["client_kwargs"], endpoint_url=dead)
    for cls, name in [(gr.ZarrDataSource, "x.zarr"), (gr.HDF5DataSource, "x.h5")]:
        start = time.monotonic()
        with pytest.raises(ConnectionError, match=r"cannot connect.*endpoint_url") as info:
            cls(f"s3://{BUCKET}/{name}", storage_options=opts)
        assert dead in str(info.value)
        assert time.monotonic() - start < 5, "a refused connection must not be retried for long"


def test_server_going_down_mid_run_raises_clear_error(s3: S3Server, store: Any) -> None:
    url, tree = store
    with HTTPProxy(s3.port) as doomed:
        src = gr.ZarrDataSource(url, storage_options=via(doomed, s3), retries=gr_retry(1))
        assert_tree_equal(src[0], take(tree, 0))
    with pytest.raises(gr.StoreUnreachableError, match=r"s3://.*(cannot connect|kept failing)"):
        src.read_batch(np.arange(N))


def test_errors_repr_and_pickle_keep_secrets_out_of_sight(s3: S3Server, store: Any) -> None:
    url, _ = store
    src = gr.ZarrDataSource(url, storage_options=s3.storage_options())
    assert SECRET_KEY not in repr(src)
    assert repr(src) == f"ZarrDataSource(path={url!r}, keys={src.keys!r}, num_records={N})"
    clone = pickle.loads(pickle.dumps(src))  # workers need the options to connect
    assert clone._storage_options == src._storage_options and repr(clone) == repr(src)
    bad = s3.storage_options()
    bad["client_kwargs"] = dict(
        bad["client_kwargs"], endpoint_url=f"http://127.0.0.1:{free_port()}"
    )
    with pytest.raises(gr.GrainReplayError) as info:
        gr.ZarrDataSource(url, storage_options=bad)
    assert SECRET_KEY not in str(info.value)


def test_redact_url_hides_passwords_and_signatures() -> None:
    url = "https://user:pw@host/r.zarr?X-Amz-Signature=abc&X-Amz-Credential=def&part=1"
    shown = remote_lib.redact_url(url)
    assert "pw" not in shown and "abc" not in shown and "def" not in shown
    assert "user" in shown and "part=1" in shown
    assert remote_lib.redact_url("s3://bucket/r.zarr") == "s3://bucket/r.zarr"


def test_retry_options_are_validated() -> None:
    with pytest.raises(ValueError, match="retries must be an int >= 0, got -1"):
        remote_lib.RetryOptions(retries=-1)
    with pytest.raises(ValueError, match="max_backoff_s"):
        remote_lib.RetryOptions(backoff_s=2.0, max_backoff_s=1.0)
    with pytest.raises(TypeError, match="retries must be an int or a RetryOptions"):
        remote_lib.retry_options(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        gr.ZarrDataSource("s3://b/x.zarr", max_concurrency=0)
    opts = remote_lib.RetryOptions(retries=5, backoff_s=0.1, max_backoff_s=0.4)
    assert all(0.05 <= opts.delay(0) <= 0.1 and opts.delay(k) <= 0.4 for k in range(10))


def test_storage_options_defaults_keep_what_the_user_set() -> None:
    user = {"config_kwargs": {"retries": {"max_attempts": 7}}, "max_concurrency": 4}
    got = remote_lib.effective_storage_options("s3://b/x.zarr", user)
    assert got["config_kwargs"]["retries"] == {"max_attempts": 7}
    assert got["max_concurrency"] == 4 and got["config_kwargs"]["max_pool_connections"] >= 64
    assert user == {"config_kwargs": {"retries": {"max_attempts": 7}}, "max_concurrency": 4}
    assert remote_lib.effective_storage_options("gs://b/x.zarr", {"token": "t"}) == {"token": "t"}


def test_remote_errors_are_catchable_as_builtins_and_as_invalid_store() -> None:
    # Code written against InvalidStoreError keeps working; code that knows only
    # the builtins catches access and network failures by their meaning.
    assert issubclass(gr.StoreAccessError, PermissionError)
    assert issubclass(gr.StoreUnreachableError, ConnectionError)
    for cls in (gr.StoreAccessError, gr.StoreUnreachableError):
        assert issubclass(cls, gr.InvalidStoreError) and issubclass(cls, gr.GrainReplayError)


def test_hdf5_retries_argument_is_validated_and_kept_in_pickles(tmp_path: Any) -> None:
    path = gr.write_hdf5(str(tmp_path / "l.h5"), {"x": np.arange(4)})
    with pytest.raises(TypeError, match="retries must be an int or a RetryOptions"):
        gr.HDF5DataSource(path, retries="3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="retries must be an int >= 0"):
        gr.HDF5DataSource(path, retries=-1)
    src = pickle.loads(pickle.dumps(gr.HDF5DataSource(path, retries=gr_retry(7))))
    assert src._retry.retries == 7 and src[3]["x"] == 3
