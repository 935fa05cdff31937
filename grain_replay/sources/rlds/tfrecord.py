"""TFRecord framing: records located and CRC32C-checked without TensorFlow."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

from grain_replay.errors import InvalidStoreError

__all__ = ["HEADER", "FOOTER", "masked_crc", "iter_records", "read_exact"]

# uint64 length, uint32 masked CRC of the length; the data; uint32 masked CRC of the data.
HEADER = 12
FOOTER = 4
_MASK_DELTA = 0xA282EAD8


def _crc32c(data: bytes | bytearray | memoryview) -> int:
    import google_crc32c  # a dependency of zarr, so of grain-replay

    return int(google_crc32c.value(data if isinstance(data, bytes) else bytes(data)))


def masked_crc(data: bytes | bytearray | memoryview) -> int:
    """TFRecord's masked CRC32C of ``data``."""
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _fix(path: str) -> str:
    return (
        "Fix: the shard is truncated or corrupt; copy it again from the dataset's source "
        f"(or rebuild the dataset with TFDS), then reopen. File: {path}"
    )


def read_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    """``n`` bytes at ``offset`` of ``fd``, or InvalidStoreError naming the file when short."""
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise InvalidStoreError(
            f"{path}: truncated record at byte offset {offset}: wanted {n} bytes, the file "
            f"has {len(data)} there. {_fix(path)}"
        )
    return data


def iter_records(path: str, *, check_crc: bool = True) -> Iterator[tuple[int, bytes]]:
    """``(data_offset, data)`` of every record of the TFRecord file ``path``, in order.

    Both CRCs of each record (length and data) are checked when ``check_crc``.

    Raises:
      InvalidStoreError: a bad CRC or a truncated record, naming the file and the
        record's byte offset.
    """
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        pos = 0
        while pos < size:
            head = read_exact(fd, HEADER, pos, path)
            (length,) = struct.unpack_from("<Q", head, 0)
            (length_crc,) = struct.unpack_from("<I", head, 8)
            if check_crc and masked_crc(head[:8]) != length_crc:
                raise InvalidStoreError(
                    f"{path}: bad CRC32C of the record length at byte offset {pos} (the record "
                    f"header is damaged). {_fix(path)}"
                )
            if pos + HEADER + length + FOOTER > size:
                raise InvalidStoreError(
                    f"{path}: truncated record at byte offset {pos}: it declares {length} bytes "
                    f"but the file ends at {size}. {_fix(path)}"
                )
            body = read_exact(fd, length + FOOTER, pos + HEADER, path)
            data = body[:length]
            (data_crc,) = struct.unpack_from("<I", body, length)
            if check_crc and masked_crc(data) != data_crc:
                raise InvalidStoreError(
                    f"{path}: bad CRC32C of the record data at byte offset {pos} ({length} "
                    f"bytes). {_fix(path)}"
                )
            yield pos + HEADER, data
            pos += HEADER + length + FOOTER
