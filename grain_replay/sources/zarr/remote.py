"""Zarr groups at fsspec URLs: metadata fetched concurrently, chunk GETs bounded and retried."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay import remote as remote_lib
from grain_replay.errors import StoreNotFoundError
from grain_replay.pipeline import shutdown
from grain_replay.store.optional import import_zarr

__all__ = ["fetch_arrays", "open_remote_group", "remote_block_reader"]


def open_remote_group(
    url: str, storage_options: Mapping[str, Any], remote: remote_lib.Remote, concurrency: int
) -> Any:
    """The ``zarr.Group`` at ``url``, its metadata fetch retried.

    Raises:
      StoreNotFoundError: saying whether the bucket or the key is missing.
    """
    zarr = import_zarr()
    opts = remote_lib.effective_storage_options(url, storage_options, concurrency=concurrency)

    def open_group() -> Any:
        # Zarr v3 first: one GET of zarr.json instead of probing every v2 key too.
        try:
            return zarr.open_group(url, mode="r", storage_options=opts, zarr_format=3)
        except FileNotFoundError:
            return zarr.open_group(url, mode="r", storage_options=opts)

    try:
        return remote.call(open_group, "the Zarr group metadata")
    except StoreNotFoundError as e:
        cause = e.__cause__ or e
        raise remote.not_found(opts, cause) from cause


def fetch_arrays(group: Any, locations: Sequence[str]) -> dict[str, Any]:
    """``{location: zarr.Array, or the error}``, the array metadata fetched concurrently.

    A missing array (KeyError) or metadata zarr cannot parse (ValueError,
    TypeError) is kept per location, so that the caller names the leaf; other
    errors (network, credentials) are raised for the retry logic. zarr's public
    synchronous API runs each fetch on zarr's own event loop; our threads keep
    several in flight.
    """

    def fetch(loc: str) -> Any:
        try:
            return group[loc]
        except Exception as e:
            return e

    if not locations:
        return {}
    with shutdown.thread_pool(min(len(locations), 16), "grain_replay_zarr_meta") as pool:
        nodes = [f.result() for f in [shutdown.submit(pool, fetch, loc) for loc in locations]]
    out: dict[str, Any] = {}
    for loc, node in zip(locations, nodes):
        if isinstance(node, KeyError) or (
            isinstance(node, (ValueError, TypeError)) and remote_lib.classify(node) == "other"
        ):
            out[loc] = node
        elif isinstance(node, BaseException):
            raise node
        else:
            out[loc] = node
    return out


def remote_block_reader(
    arr: Any,
    chunk_rows: int,
    n: int,
    remote: remote_lib.Remote,
    fetch_pool: concurrent.futures.Executor,
    key: str,
) -> Any:
    """Reads whole row-chunks of a remote array: requests in flight bounded, each retried.

    Each chunk is one read of exactly its rows (one GET of one object, decoded
    once) through zarr's public API, on ``fetch_pool``, whose threads bound the
    requests in flight of every leaf of the source together.
    """

    def one(c: int) -> np.ndarray:
        rows = slice(c * chunk_rows, min((c + 1) * chunk_rows, n))
        return remote.call(lambda: np.asarray(arr[rows]), f"chunk {c} of leaf {key!r}")

    def read_blocks(chunk_ids: Sequence[int]) -> list[np.ndarray]:
        # A chunk the pool refuses (at interpreter exit, or shut by the handle's close()
        # in another thread) is fetched here.
        futures = [shutdown.submit(fetch_pool, one, c) for c in chunk_ids]
        # Wait for every request before raising, so no fetch outlives the read.
        concurrent.futures.wait(futures)
        return [f.result() for f in futures]

    return read_blocks
