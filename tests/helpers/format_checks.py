"""Checks every foreign-format source runs: the loader with workers and sharded_device_put."""

from __future__ import annotations

from typing import Any

import numpy as np

import grain_replay as gr


def assert_loader_delivers_every_record(
    src: Any, index_key: str, *, workers: int, batch_size: int = 8, offset: int = 0
) -> None:
    """Every record once, through make_data_loader (``workers``) and sharded_device_put.

    ``index_key`` is a leaf holding each record's own position plus ``offset``, so a
    batch says which records it holds; every leaf of the batch is compared with a
    direct read of those records.
    """
    loader = gr.make_data_loader(
        src, batch_size=batch_size, shuffle=True, seed=3, worker_count=workers
    )
    seen: list[int] = []
    with gr.sharded_device_put(loader) as batches:
        for batch in batches:
            flat = dict(zip(src.keys, _leaves(batch, src.keys)))
            idx = np.asarray(flat[index_key]).reshape(-1).astype(np.int64) - offset
            want = src.read_flat(idx)
            for k in src.keys:
                np.testing.assert_array_equal(np.asarray(flat[k]), want[k], err_msg=k)
            seen.extend(idx.tolist())
    assert len(seen) == (len(src) // batch_size) * batch_size
    assert len(set(seen)) == len(seen)


def _leaves(batch: Any, keys: list[str]) -> list[Any]:
    out = []
    for k in keys:
        node = batch
        for part in k.split("/") if k else []:
            node = node[part]
        out.append(node)
    return out


def sorted_tree(tree: Any) -> Any:
    """``tree`` with every dict's keys sorted: the order a foreign store's leaves come back in."""
    if isinstance(tree, dict):
        return {k: sorted_tree(tree[k]) for k in sorted(tree)}
    return tree
