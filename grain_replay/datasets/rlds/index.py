"""The step index of an RLDS dataset: where each episode and each step's values sit in the shards.

Built once per shard (in threads, with a progress bar) and cached (:mod:`index_cache`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_replay.datasets.rlds import example_scan
from grain_replay.datasets.rlds.arrayrecord import RECORD_SHIFT, iter_array_records
from grain_replay.datasets.rlds.example import FeatureValues, WireError, parse_example
from grain_replay.datasets.rlds.features import STEPS, Feature
from grain_replay.datasets.rlds.index_cache import (
    CACHE_FOLDER,
    cache_dirs,
    load_cached,
    save_cached,
    shard_signature,
)
from grain_replay.datasets.rlds.tfrecord import frame_records, map_shard
from grain_replay.errors import InvalidStoreError
from grain_replay.pipeline import shutdown

__all__ = ["CACHE_FOLDER", "Index", "ShardIndex", "build_index", "cache_dirs", "index_shard"]

logger = logging.getLogger(__name__)


def _per_record(f: Feature) -> int:
    """Values of ``f`` per record (step or episode) in the Example."""
    return 1 if f.kind in ("image", "raw") else f.size


def _as_dtype(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype == np.bool_:
        return values != 0
    if dtype == np.uint64:
        return values.view(np.uint64)
    return values.astype(dtype)


@dataclasses.dataclass
class ShardIndex:
    """One shard's index: ``arrays`` keyed ``"n_steps"`` and ``"<leaf>#<what>"``."""

    arrays: dict[str, np.ndarray]


def index_shard(
    path: str,
    features: Sequence[Feature],
    *,
    check_crc: bool = True,
    fmt: str = "tfrecord",
    compiled_scan: bool | None = None,
) -> ShardIndex:
    """Reads the shard ``path`` once and records where every value sits.

    Per episode: the step count, and for each float leaf the file offset of its
    first value and the stride (4 packed, 5 unpacked); for each bytes leaf
    (images, text, encoded tensors) the offset and length of every element;
    int64 leaves (flags, ids) are decoded here, in their declared dtype.

    ``compiled_scan``: how records are parsed (:func:`example_scan.scanner`): None, the
    compiled scan once this process has loaded it; True, wait for it; False, in Python.
    With the compiled scan a TFRecord shard is framed (CRCs checked), then all its records
    are scanned in one call and checked at once; a shard where a CRC, a record or a check
    fails is then indexed record by record, as in Python. Each gives the same index and
    the same errors, in record order.

    Raises:
      InvalidStoreError: a bad CRC, a truncated record, a record that is not a
        ``tf.train.Example``, or a feature missing or of the wrong size, naming
        the file, the record's offset and the feature.
    """
    scan = example_scan.scanner(compiled_scan)
    if scan is not None and fmt == "tfrecord":
        done = _index_at_once(path, features, check_crc, scan)
        if done is not None:
            return done
    return _index_by_record(path, features, check_crc, fmt, compiled_scan, scan)


def _rows(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The rows ``starts[i]:starts[i] + counts[i]`` of every i, in order."""
    ends = np.cumsum(counts)
    if not ends.size or ends[-1] == 0:
        return np.zeros(0, np.int64)
    return np.arange(ends[-1]) + np.repeat(starts - (ends - counts), counts)


def _index_at_once(
    path: str, features: Sequence[Feature], check_crc: bool, scan: example_scan.ExampleScanner
) -> ShardIndex | None:
    """The shard's index from one compiled scan of all its records, checked at once; None
    where a record, a check or a CRC fails (or it is empty): then the shard is indexed
    record by record, which gives the same index and the errors in record order."""
    mapping, address = map_shard(path)
    if mapping is None:
        return None
    try:
        framed = list(frame_records(path, mapping, address, check_crc=check_crc))
    except InvalidStoreError:
        return None
    bounds = np.array(framed, np.int64).reshape(-1, 2)
    bounds[:, 1] += bounds[:, 0]
    cols = {name: j for j, name in enumerate(dict.fromkeys(f.name for f in features))}
    view = np.frombuffer(mapping, np.uint8)
    got = scan.scan_records(view, bounds, list(cols))
    del view  # no export of the map left: it closes when its last user drops it
    if got is None:
        return None
    slots, values, lengths = got
    kind, count, at, stride = (slots[:, :, c] for c in range(4))
    n = np.full(len(bounds), -1, np.int64)  # as _episode_length: its first step feature there
    for f in features:
        per = _per_record(f)
        if f.level != STEPS or per <= 0:
            continue
        j = cols[f.name]
        take = (n < 0) & (kind[:, j] >= 0)
        if np.any(count[take, j] % per):
            return None
        n[take] = count[take, j] // per
    if np.any(n < 0):
        return None
    keep = n > 0  # an empty episode holds no step; its metadata has no record to ride on
    steps = n[keep]
    arrays = {"n_steps": steps}
    for f in features:
        j, per = cols[f.name], _per_record(f)
        want = steps * per if f.level == STEPS else np.full(len(steps), per, np.int64)
        if not np.all((kind[keep, j] == example_scan.KINDS[f.wire]) & (count[keep, j] == want)):
            return None  # as _check: missing, or another kind or size
        if f.wire == "float":
            arrays[f.key + "#off"] = at[keep, j]
            arrays[f.key + "#stride"] = stride[keep, j].astype(np.uint8)
            continue
        rows = _rows(at[keep, j], want)
        if f.wire == "int64":
            arrays[f.key + "#val"] = _as_dtype(values[rows], f.dtype)
        else:
            arrays[f.key + "#off"] = values[rows]
            arrays[f.key + "#len"] = lengths[rows].astype(np.uint32)
    return ShardIndex(arrays)


def _index_by_record(
    path: str,
    features: Sequence[Feature],
    check_crc: bool,
    fmt: str,
    compiled_scan: bool | None,
    scan: example_scan.ExampleScanner | None,
) -> ShardIndex:
    """:func:`index_shard` one record after the other (``scan``: the compiled scan of each
    record, else the Python parser; with ``compiled_scan=None`` taken once it has loaded)."""
    wanted = {f.name for f in features}
    step_feats = [f for f in features if f.level == STEPS]
    # Per feature, once: (feature, values per record, whether per step, key names).
    plan = [
        (f, _per_record(f), f.level == STEPS, f.wire, f"{f.key}#off", f"{f.key}#stride",
         f"{f.key}#val", f"{f.key}#len")
        for f in features
    ]  # fmt: skip
    n_steps: list[int] = []
    parts: dict[str, list[Any]] = collections.defaultdict(list)

    # (where offsets in buf are addressed from, buf, the record's bounds in buf)
    if fmt == "array_record":
        records: Any = ((a, d, 0, len(d)) for a, d in iter_array_records(path))
    else:  # parsed in place in a map of the shard: offsets in it are file offsets
        mapping, address = map_shard(path)
        records = (
            (0, mapping, a, a + n)
            for a, n in frame_records(path, mapping, address, check_crc=check_crc)
        )
    names = {w.encode("utf-8"): w for w in wanted}
    view: np.ndarray | None = None  # buf as uint8, for the compiled scan
    for data_off, buf, lo, hi in records:
        where = (
            f"{path}: record {data_off >> RECORD_SHIFT}"
            if fmt == "array_record"
            else f"{path}: the episode at byte offset {data_off + lo - 12}"
        )
        if scan is None and compiled_scan is None:
            scan = example_scan.scanner(None)  # loaded meanwhile?
        try:
            if scan is None:
                parsed = parse_example(buf, wanted, lo, hi)
            else:
                if view is None or fmt == "array_record":
                    view = np.frombuffer(buf, np.uint8)
                parsed = scan.parse(view, buf, names, lo, hi)
        except WireError as e:
            raise InvalidStoreError(
                f"{where} is not a tf.train.Example ({e}). Fix: the shard is corrupt; copy it "
                "again or rebuild the dataset with TFDS."
            ) from e
        n = _episode_length(parsed, step_feats, where)
        if n == 0:
            continue  # an empty episode holds no step; its metadata has no record to ride on
        n_steps.append(n)
        for f, per, per_step, wire, k_off, k_stride, k_val, k_len in plan:
            count = n * per if per_step else per
            v = parsed.get(f.name)
            _check(v, f, count, where)
            assert v is not None
            if wire == "float":
                parts[k_off].append(data_off + v.offset)
                parts[k_stride].append(v.stride)
            elif wire == "int64":
                assert v.values is not None
                parts[k_val].append(v.values)
            else:
                assert v.offsets is not None and v.lengths is not None
                parts[k_off].append(v.offsets + data_off if data_off else v.offsets)
                parts[k_len].append(v.lengths)
    del view  # no export of the map left: it closes when its last user drops it
    arrays = {"n_steps": np.asarray(n_steps, np.int64)}
    for f in features:
        k = f.key
        if f.wire == "float":  # one offset and stride an episode
            arrays[k + "#off"] = np.asarray(parts[k + "#off"], np.int64)
            arrays[k + "#stride"] = np.asarray(parts[k + "#stride"], np.uint8)
        elif f.wire == "int64":
            got = parts[k + "#val"]
            arrays[k + "#val"] = _as_dtype(
                np.concatenate(got) if got else np.zeros(0, np.int64), f.dtype
            )
        else:
            for s, dtype in (("#off", np.int64), ("#len", np.uint32)):
                got = parts[k + s]
                arrays[k + s] = (np.concatenate(got) if got else np.zeros(0)).astype(dtype)
    return ShardIndex(arrays)


def _episode_length(parsed: dict[str, FeatureValues], steps: Sequence[Feature], where: str) -> int:
    for f in steps:
        v = parsed.get(f.name)
        per = _per_record(f)
        if v is not None and per > 0:
            if v.count % per:
                raise InvalidStoreError(
                    f"{where}: feature {f.name!r} holds {v.count} values, not a whole number of "
                    f"steps of {per}. Fix: the dataset does not match its features.json; "
                    "rebuild it with TFDS."
                )
            return v.count // per
    raise InvalidStoreError(
        f"{where}: none of the step features {[f.name for f in steps]} is in the record. Fix: "
        "the dataset does not match its features.json; rebuild it with TFDS."
    )


def _check(v: FeatureValues | None, f: Feature, count: int, where: str) -> None:
    if v is None or (v.kind == "none" and count == 0):
        if count == 0:
            return
        raise InvalidStoreError(
            f"{where}: feature {f.name!r} is missing from the record. Fix: leave it out with "
            f"keys=[...] (the other features), or rebuild the dataset with TFDS."
        )
    if v.kind not in (f.wire, "none") or v.count != count:
        raise InvalidStoreError(
            f"{where}: feature {f.name!r} holds {v.count} {v.kind} values, but features.json "
            f"declares {count} {f.wire} values ({f.kind} {f.dtype}{list(f.shape)}). Fix: the "
            "dataset does not match its features.json; rebuild it with TFDS."
        )


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="indexing RLDS shards", unit="shard", leave=False)


@dataclasses.dataclass
class Index:
    """The whole dataset's index: the shards' indexes, concatenated.

    Memory: per episode 8 bytes for the step count plus 9 bytes per float leaf;
    per step 12 bytes per element of an image, text or encoded leaf, and the
    decoded int64 leaves (flags) in their own dtype. Float values and encoded
    bytes stay on disk.
    """

    shards: list[str]
    arrays: dict[str, np.ndarray]
    # Episode e's shard, and its first step; ends[e] its exclusive end.
    episode_shard: np.ndarray
    ends: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.ends[-1]) if self.ends.size else 0

    @property
    def starts(self) -> np.ndarray:
        return self.ends - self.arrays["n_steps"]


def build_index(
    root: str,
    shards: Sequence[str],
    features: Sequence[Feature],
    *,
    use_cache: bool = True,
    check_crc: bool = True,
    progress: bool = True,
    threads: int | None = None,
    fmt: str = "tfrecord",
    compiled_scan: bool | None = None,
) -> Index:
    """The index of ``shards`` (paths, in read order), from the cache or built in threads
    (``compiled_scan``: as :func:`index_shard`'s)."""
    dirs = cache_dirs(root)
    workers = threads or max(1, min(8, len(os.sched_getaffinity(0)), len(shards)))
    signatures = [shard_signature(p, features) for p in shards]
    cached = [
        load_cached(dirs, os.path.basename(p), sig) if use_cache else None
        for p, sig in zip(shards, signatures)
    ]
    results = [None if a is None else ShardIndex(a) for a in cached]
    missing = [i for i, r in enumerate(results) if r is None]
    bar = _progress(len(missing), progress and len(missing) > 1)

    def build(i: int) -> ShardIndex:
        index = index_shard(
            shards[i], features, check_crc=check_crc, fmt=fmt, compiled_scan=compiled_scan
        )
        if use_cache:
            save_cached(dirs, os.path.basename(shards[i]), index.arrays, signatures[i])
        return index

    try:
        with shutdown.thread_pool(workers, "grain_replay-rlds-index") as pool:
            # A shard the pool refuses (at interpreter exit) is indexed in this thread.
            futures = {shutdown.submit(pool, build, i): i for i in missing}
            for fut in concurrent.futures.as_completed(futures):
                results[futures[fut]] = fut.result()
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    done = [r for r in results if r is not None]
    keys = list(done[0].arrays) if done else ["n_steps"]
    arrays = {k: np.concatenate([r.arrays[k] for r in done]) for k in keys} if done else {
        "n_steps": np.zeros(0, np.int64)
    }  # fmt: skip
    shard_of = np.concatenate(
        [np.full(len(r.arrays["n_steps"]), i, np.int32) for i, r in enumerate(done)]
    ) if done else np.zeros(0, np.int32)  # fmt: skip
    return Index(list(shards), arrays, shard_of, np.cumsum(arrays["n_steps"]))
