"""Zarr groups at fsspec URLs: metadata fetched concurrently, chunk GETs bounded and retried."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay import remote as remote_lib
from grain_replay.errors import StoreNotFoundError
from grain_replay.formats import import_zarr

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
    errors (network, credentials) are raised for the retry logic.
    """
    zarr = import_zarr()
    from zarr.core.array import AsyncArray
    from zarr.core.sync import sync

    async def fetch_all() -> list[Any]:
        coros = (group._async_group.getitem(loc) for loc in locations)
        return await asyncio.gather(*coros, return_exceptions=True)

    out: dict[str, Any] = {}
    for loc, node in zip(locations, sync(fetch_all())):
        if isinstance(node, KeyError) or (
            isinstance(node, (ValueError, TypeError)) and remote_lib.classify(node) == "other"
        ):
            out[loc] = node
        elif isinstance(node, BaseException):
            raise node
        else:
            out[loc] = zarr.Array(node) if isinstance(node, AsyncArray) else zarr.Group(node)
    return out


def remote_block_reader(
    arr: Any,
    chunk_rows: int,
    n: int,
    remote: remote_lib.Remote,
    limiter: remote_lib.Limiter,
    key: str,
) -> Any:
    """Reads whole row-chunks of a remote array: requests in flight bounded, each retried.

    Each chunk is one ``getitem`` of exactly its rows: one GET of one object,
    decoded once.
    """
    from zarr.core.sync import sync

    async_arr = arr.async_array

    async def one(c: int) -> np.ndarray:
        rows = slice(c * chunk_rows, min((c + 1) * chunk_rows, n))
        async with limiter.get():
            block = await remote.call_async(
                lambda: async_arr.getitem(rows), f"chunk {c} of leaf {key!r}"
            )
        return np.asarray(block)

    async def fetch(chunk_ids: Sequence[int]) -> list[np.ndarray]:
        # Wait for every request before raising, so no task outlives the read.
        results = await asyncio.gather(*(one(c) for c in chunk_ids), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results  # type: ignore[return-value]

    def read_blocks(chunk_ids: Sequence[int]) -> list[np.ndarray]:
        return sync(fetch(chunk_ids))

    return read_blocks
