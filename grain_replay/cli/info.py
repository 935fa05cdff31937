"""``grain-replay info``: what a store holds (records, leaves, size, writers, episodes)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np

from grain_replay.cli.remote import object_writers, storage_options, writer_row
from grain_replay.sources.capabilities import HasEpisodes, ManyWriterStore

__all__ = ["cmd_info", "fmt_bytes", "size_on_disk"]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def size_on_disk(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for dirpath, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total


def cmd_info(args: argparse.Namespace) -> int:
    import grain_replay as gr

    opts = storage_options(args.path, getattr(args, "storage_option", None))
    src = gr.open_source(args.path, storage_options=opts)
    info: dict[str, Any] = {
        "path": src.path,
        "format": type(src).__name__.replace("DataSource", "").lower(),
        "num_records": len(src),
        "leaves": {k: {"dtype": str(s.dtype), "shape": list(s.shape)} for k, s in src.spec.items()},
    }
    if not src.path.startswith(("s3://", "gs://", "http")):
        info["size_on_disk"] = size_on_disk(src.path)
    if isinstance(src, gr.ObjectPartsDataSource):
        writers: list[dict[str, Any]] | None = object_writers(src, args.path, opts)
    else:
        writers = _writers(src)
    if writers is not None:
        info["format"] = getattr(src, "format", info["format"])
        info["store_id"] = src.store_id if isinstance(src, ManyWriterStore) else None
        info["writers"] = writers
        info["evicted_records"] = sum(w["evicted"] for w in writers)
    info["checksums"] = getattr(src, "checksums", None) is not None
    episodes = _episodes(src, cache=args.cache_episodes)
    if episodes is not None:
        info["episodes"] = episodes
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['path']}")
    print(f"  format:  {info['format']}")
    print(f"  records: {info['num_records']:,}")
    if "size_on_disk" in info:
        print(f"  size:    {fmt_bytes(info['size_on_disk'])}")
    if "episodes" in info:
        e = info["episodes"]
        print(
            f"  episodes: {e['count']:,} (length min/mean/max {e['min_length']}/"
            f"{e['mean_length']:.1f}/{e['max_length']}; flags {', '.join(e['flags'])})"
        )
    if "writers" in info:
        ws = info["writers"]
        if info["store_id"] is not None:  # what checkpoints' watermarks name (None: older store)
            print(f"  store id: {info['store_id']}")
        print(
            f"  writers: {len(ws)} (live records {info['num_records']:,}, evicted "
            f"{info['evicted_records']:,})"
        )
        parts = "pieces" if info["format"] == "npy" and "://" in info["path"] else "segments"
        for w in ws:
            cap = "unbounded" if w["capacity"] is None else f"capacity {w['capacity']:,}"
            held = f", held by pid {w['holder']['pid']}" if w.get("holder") else ""
            print(
                f"    {w['writer_id']}: {w['live']:,} live, {w['evicted']:,} evicted, "
                f"{w['committed']:,} committed, {cap}, {w['segments']} {parts}, "
                f"{fmt_bytes(w['size_on_disk'])}{held}"
            )
    print(f"  checksums: {'recorded' if info['checksums'] else 'none'}")
    width = max(len(k) for k in info["leaves"]) if info["leaves"] else 0
    print("  leaves:")
    for k, v in info["leaves"].items():
        print(f"    {k or '<root>':<{width}}  {v['dtype']:<8} {tuple(v['shape'])}")
    return 0


def _writers(src: Any) -> list[dict[str, Any]] | None:
    """Per-writer rows, segments and disk use of a bounded, many-writer store, else None."""
    from grain_replay.sources import PartsDataSource
    from grain_replay.store import ownership
    from grain_replay.store import parts as parts_lib

    if not isinstance(src, PartsDataSource):
        return None
    out = []
    for m in src.writers:
        wdir = parts_lib.writer_dir(src.path, m.writer_id)
        out.append(writer_row(m, size_on_disk(wdir), ownership.live_holder(wdir)))
    return out


def _episodes(src: Any, cache: bool) -> dict[str, Any] | None:
    """Episode counts, or None for a store without episode flags.

    ``info`` is read-only: the index is built in memory and the cache file that the
    RL views keep beside a store is written only when ``cache`` is true.
    """
    from grain_replay.errors import GrainReplayError
    from grain_replay.rl import build_episode_index
    from grain_replay.rl.episodes import EpisodeFlags

    try:
        flags = EpisodeFlags().resolve(src.spec, src.path)
        own = src.episodes if isinstance(src, HasEpisodes) else None
        index = own or build_episode_index(src, cache=cache)
    except (GrainReplayError, AttributeError, TypeError):
        return None
    lengths = np.asarray(index.lengths)
    if not len(lengths):
        return None
    return {
        "count": int(index.num_episodes),
        "min_length": int(lengths.min()),
        "mean_length": float(lengths.mean()),
        "max_length": int(lengths.max()),
        "flags": list(flags.keys),
    }
