"""``.npz`` data source: stored members memory-mapped in place, deflated ones decoded once."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import mmap
import os
import zlib
from collections.abc import Sequence
from typing import IO, Literal

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import InvalidStoreError, StoreNotFoundError
from grain_replay.sources.base import Layout, ReplaySource
from grain_replay.sources.npz.zipdir import DEFLATED, STORED, Member, read_members
from grain_replay.sources.reading.cache import DEFAULT_CACHE_BYTES, ChunkCache
from grain_replay.sources.reading.files import MappedFile
from grain_replay.sources.reading.readers import ArrayReader, Handle, LeafReader
from grain_replay.store import layout as layout_lib
from grain_replay.store.formats import parse_npy_header, require_regular_file, shown_path

__all__ = ["NpzDataSource"]

# Decoded bytes taken to find a deflated member's .npy header (numpy caps headers at 10,000).
_HEADER_BYTES = 1 << 16
_BLOCK = 1 << 20  # compressed bytes inflated at a time


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """Where one member's array lies: the member, its .npy header's length, its order."""

    member: Member
    header: int  # bytes of .npy header before the array data, inside the member
    fortran: bool

    @property
    def nbytes(self) -> int:
        return self.member.size - self.header


def _parse_header(
    raw: IO[bytes], path: str, member: str
) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    """``(shape, dtype, fortran, header length)`` of the .npy bytes ``raw`` starts with."""
    try:
        shape, fortran, dtype = parse_npy_header(raw)
    except Exception as e:  # numpy's header parser raises anything
        raise InvalidStoreError(
            f"{path}: member {member!r} is not a valid .npy array ({e}). Fix: re-create the "
            "archive with np.savez / np.savez_compressed."
        ) from e
    if dtype.hasobject:
        raise InvalidStoreError(
            f"{path}: member {member!r} holds an object array ({dtype}), which only unpickling "
            "could read; grain_replay never unpickles (allow_pickle=False). Fix: save numeric "
            "arrays, or select the other members with keys=[...]."
        )
    return tuple(shape), dtype, bool(fortran), raw.tell()


def _inflate_head(f: IO[bytes], m: Member) -> bytes:
    """The first decoded bytes of a deflated member, enough to hold its .npy header."""
    f.seek(m.data_offset)
    z = zlib.decompressobj(-zlib.MAX_WBITS)
    out = b""
    left = m.compressed_size
    while len(out) < min(_HEADER_BYTES, m.size) and left > 0 and not z.eof:
        block = f.read(min(left, 1 << 16))
        if not block:
            break
        left -= len(block)
        out += z.decompress(block, _HEADER_BYTES - len(out))
        if z.unconsumed_tail:  # the header is in: the rest is array data
            break
    return out


class _ByteRows(LeafReader):
    """Rows of a member whose data is not aligned for its dtype, gathered as raw bytes.

    A zip member's data starts wherever its local header ends, so a float32
    member is usually misaligned in the map; numpy's gather of misaligned
    elements is ~10x slower than of whole rows of bytes (void items), which
    come back as a new, aligned array of the member's dtype.
    """

    def __init__(self, array: np.ndarray):
        self._dtype = array.dtype
        self._shape = array.shape[1:]
        self._void = np.dtype((np.void, math.prod(self._shape) * array.dtype.itemsize))
        self._rows = ArrayReader(array.reshape(len(array), -1).view(self._void).reshape(len(array)))
        # One view turns the gathered void items into the rows: a subarray dtype's items
        # expand into trailing axes of its base dtype.
        self._as_rows = np.dtype((self._dtype, self._shape))
        rows = self._rows.plan
        self.plan = None if rows is None else (rows[0], self._as_rows, rows[2])

    def take(self, indices: np.ndarray) -> np.ndarray:
        return self._rows.take(indices).view(self._as_rows)

    def take_into(self, indices: np.ndarray, out: np.ndarray) -> None:
        if out.dtype != self._dtype or not out.flags.c_contiguous:
            out[...] = self.take(indices)
            return
        rows = out.reshape(len(out), -1).view(self._void).reshape(len(out))
        self._rows.take_into(indices, rows)


def _fits_in_memory(size: int) -> bool:
    """True if ``size`` bytes are at most half the machine's memory (unknown: False)."""
    try:
        return size <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return False


def _advise(mapping: mmap.mmap, size: int) -> None:
    """Random access, and huge pages where the archive fits in memory.

    ``MADV_HUGEPAGE`` lets a page-cache miss in the map read a whole 2 MiB folio
    and map it with one page-table entry (Linux 6.16+ on ext4 and other large-
    folio file systems; the kernel aligns a file map to 2 MiB): random rows then
    cost no TLB miss each, and page-cached gathers run at ~1.0x those over arrays
    in RAM, against ~0.7x on 4 KiB pages. A miss reads 2 MiB, so an archive
    larger than half the memory keeps 4 KiB reads. Refused or unknown advice
    leaves the map as it is: the same bytes, on small pages.
    """
    advice = [getattr(mmap, "MADV_RANDOM", None)]
    if _fits_in_memory(size):
        advice.append(getattr(mmap, "MADV_HUGEPAGE", None))
    for a in advice:
        if a is not None:
            with contextlib.suppress(OSError, ValueError):
                mapping.madvise(a)


class _NpzHandle(Handle):
    def __init__(self, source: NpzDataSource):
        path = source._path
        n = len(source)
        self.readers = {}
        self.mapped_files = {}
        leaves = {k: source._leaves[k] for k in source._keys}
        size = os.path.getsize(path)
        self._mapping: mmap.mmap | None = None
        if size:
            with open(path, "rb") as f:
                self._mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            _advise(self._mapping, size)
        cache = ChunkCache(source._cache_bytes)
        deflated = {k: v for k, v in leaves.items() if v.member.method == DEFLATED}
        for key, leaf in deflated.items():
            cache.register(key, leaf.nbytes)
        for key, leaf in leaves.items():
            spec = source._layout.spec[key]
            shape = (n, *spec.shape)
            order: Literal["C", "F"] = "F" if leaf.fortran else "C"
            if math.prod(shape) * spec.dtype.itemsize == 0 or self._mapping is None:
                array = np.zeros(shape, spec.dtype)
            elif leaf.member.method == STORED:
                start = leaf.member.data_offset + leaf.header
                array = np.ndarray(
                    shape, spec.dtype, buffer=self._mapping, offset=start, order=order
                )
                end = start + leaf.nbytes
                self.mapped_files[key] = [MappedFile(path, end, mapping=self._mapping)]
                if not array.flags.aligned and not leaf.fortran:
                    self.readers[key] = _ByteRows(array)
                    continue
            else:
                raw = cache.dense(key, (leaf.nbytes,), np.dtype(np.uint8), 1)
                if raw is None:
                    raise source._too_big(key, list(deflated), cache.max_bytes)
                buf, done = raw
                if not done[0]:
                    _inflate_into(self._mapping, path, key, leaf, buf)
                    done[0] = True
                array = np.ndarray(shape, spec.dtype, buffer=buf, order=order)
                array.flags.writeable = False
            self.readers[key] = ArrayReader(array)

    def close(self) -> None:
        # Readers may still hold views of the map (another thread's read): the map
        # closes once the last view is gone.
        self._mapping = None


def _inflate_into(mapping: mmap.mmap, path: str, key: str, leaf: _Leaf, out: np.ndarray) -> None:
    """Inflates a deflated member into ``out`` (its array bytes), checking its CRC-32."""
    m = leaf.member
    z = zlib.decompressobj(-zlib.MAX_WBITS)
    dst = memoryview(out.data).cast("B")
    skip = leaf.header  # the .npy header's bytes: checked, not kept
    crc = 0
    at = 0

    def put(chunk: bytes) -> None:
        nonlocal crc, skip, at
        crc = zlib.crc32(chunk, crc)
        if skip:
            drop = min(skip, len(chunk))
            chunk, skip = chunk[drop:], skip - drop
        if at + len(chunk) > len(dst):
            raise ValueError("the member inflates to more bytes than its header says")
        dst[at : at + len(chunk)] = chunk
        at += len(chunk)

    try:
        for pos in range(m.data_offset, m.data_offset + m.compressed_size, _BLOCK):
            # Output is bounded per call: a block of zeros inflates a thousandfold.
            pending = mapping[pos : min(m.data_offset + m.compressed_size, pos + _BLOCK)]
            while pending and not z.eof:
                put(z.decompress(pending, _BLOCK))
                pending = z.unconsumed_tail
        put(z.flush())
    except (zlib.error, ValueError) as e:
        raise InvalidStoreError(
            f"{path}: member {m.name!r} (leaf {key!r}) does not inflate ({e}). The archive is "
            "corrupt. Fix: download or write it again."
        ) from e
    if at != len(dst) or (crc & 0xFFFFFFFF) != m.crc32:
        raise InvalidStoreError(
            f"{path}: member {m.name!r} (leaf {key!r}) inflated to {at:,} of {len(dst):,} "
            f"bytes with CRC-32 {crc & 0xFFFFFFFF:08x}, but the archive says {m.crc32:08x}: "
            "it is corrupt. Fix: download or write it again."
        )


class NpzDataSource(ReplaySource):
    """Random-access grain source over an ``.npz`` archive (``np.savez``, ``np.savez_compressed``).

    Records are rows of the members' leading axis; each ``.npy`` member is a
    leaf (``obs/pixels.npy`` is leaf ``obs/pixels``; keys naturally sorted, as
    for every foreign store). Members stored uncompressed (``np.savez``) are
    memory-mapped in place, as ``.npy`` files are. Deflated members
    (``np.savez_compressed``) are inflated once per process into the decoded
    cache, whose budget is ``cache_bytes`` (default: what fits, up to 1/32 of
    the memory, at most 1 GiB, shared by a loader's workers); one that does not
    fit is refused with the command that converts the archive.

    Members whose leading dimension differs from the others (scalars,
    per-episode metadata) make the archive ambiguous: the error names them, and
    ``keys=[...]`` selects the members of one length. Members that are not
    ``.npy`` arrays are not leaves. Object arrays are refused: nothing is ever
    unpickled.

    OGBench datasets open as they are (``observations``, ``actions``,
    ``terminals``, and ``next_observations``, ``rewards``, ``masks`` where
    present): ``terminals`` is 1 on each trajectory's last step, so episode
    views (``gr.SequenceDataSource`` and the others) find the episodes from it.

    Args:
      path: the ``.npz`` file.
      keys: leaves (or groups) to read; default all.
      cache_bytes: budget of the inflated members of each process.

    Examples:
      >>> src = gr.NpzDataSource("antmaze-large-navigate-v0.npz")
      >>> src.read_batch([0, 5])["observations"].shape
    """

    _leaves: dict[str, _Leaf]

    def __init__(
        self,
        path: str | os.PathLike[str],
        keys: Sequence[str] | None = None,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        allow_external: bool = False,
    ):
        self._cache_bytes = cache_bytes
        ChunkCache(cache_bytes)  # refuses a negative budget now, not in a worker
        super().__init__(path, keys, allow_external=allow_external)
        # Refused here, in the constructing process, rather than at the first read.
        deflated = [k for k in self._keys if self._leaves[k].member.method == DEFLATED]
        cache = ChunkCache(cache_bytes)
        for k in deflated:
            cache.register(k, self._leaves[k].nbytes)
        if sum(self._leaves[k].nbytes for k in deflated) > cache.max_bytes:
            big = max(deflated, key=lambda k: self._leaves[k].nbytes)
            raise self._too_big(big, deflated, cache.max_bytes)

    def _too_big(self, key: str, deflated: list[str], budget: int) -> InvalidStoreError:
        m = self._leaves[key].member
        total = sum(self._leaves[k].nbytes for k in deflated)
        return InvalidStoreError(
            f"{self._path}: member {m.name!r} (leaf {key!r}) is deflated and inflates to "
            f"{self._leaves[key].nbytes:,} bytes; the compressed members read "
            f"({len(deflated)}) need {total:,} bytes together, over the decoded budget of "
            f"{budget:,} bytes (cache_bytes). Fix: convert the archive once, e.g. "
            f"`grain-replay convert {self._path} out.h5` (or re-save it with np.savez, whose "
            "members are mapped in place), raise cache_bytes=, or select fewer members "
            "with keys=[...]."
        )

    def _open(self) -> Handle:
        return _NpzHandle(self)

    def _inspect(self) -> Layout:
        path = self._path
        if not os.path.exists(path):
            raise StoreNotFoundError(
                f"No .npz archive at {shown_path(path)}. Fix: check the path (np.savez writes one)."
            )
        require_regular_file(path)
        members = [m for m in read_members(path) if m.name.endswith(".npy")]
        found = {m.name[: -len(".npy")]: m for m in members}
        if not found:
            raise InvalidStoreError(
                f"{path}: the archive holds no .npy member. Fix: write arrays into it with "
                "np.savez(path, name=array, ...)."
            )
        keys = layout_lib.foreign_keys(found, self._requested_keys)
        spec: dict[str, layout_lib.LeafSpec] = {}
        lengths: dict[str, int] = {}
        self._leaves = {}
        with open(path, "rb") as f:
            for k in keys:
                m = found[k]
                if m.method not in (STORED, DEFLATED):
                    raise InvalidStoreError(
                        f"{path}: member {m.name!r} is compressed with {m.method_name}, which "
                        "grain_replay does not read (only stored and deflated members). Fix: "
                        "re-save the arrays with np.savez or np.savez_compressed, or select "
                        "other members with keys=[...]."
                    )
                if m.method == STORED:
                    f.seek(m.data_offset)
                    head = io.BytesIO(f.read(min(m.size, _HEADER_BYTES)))
                else:
                    head = io.BytesIO(_inflate_head(f, m))
                shape, dtype, fortran, header = _parse_header(head, path, m.name)
                layout_lib.check_dtype(dtype, k, f"{path} (member {m.name!r})")
                if len(shape) == 0:
                    raise InvalidStoreError(
                        f"{path}: member {m.name!r} is a scalar; every leaf needs a records "
                        "axis. Fix: select other members with keys=[...]."
                    )
                leaf = _Leaf(m, header, fortran)
                if leaf.nbytes < math.prod(shape) * dtype.itemsize:
                    raise InvalidStoreError(
                        f"{path}: member {m.name!r} declares {dtype}{list(shape)} but holds "
                        f"{leaf.nbytes:,} bytes of data: it is truncated. Fix: write it again."
                    )
                spec[k] = layout_lib.LeafSpec(dtype, shape[1:])
                lengths[k] = shape[0]
                self._leaves[k] = leaf
        n = layout_lib.common_length(path, lengths)
        treedef = tree_lib.treedef_from_keys(keys)
        ordered = tree_lib.leaf_keys(treedef)
        return Layout(
            n, {k: spec[k] for k in ordered}, treedef, {k: found[k].name for k in ordered}
        )
