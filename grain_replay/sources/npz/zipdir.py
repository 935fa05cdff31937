"""A zip archive's central directory, read without ``zipfile``: where each member's bytes sit."""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import BinaryIO

from grain_replay.errors import InvalidStoreError

__all__ = ["DEFLATED", "STORED", "Member", "read_members"]

STORED = 0
DEFLATED = 8
_METHODS = {STORED: "stored", DEFLATED: "deflated", 12: "bzip2", 14: "lzma", 93: "zstandard"}

_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory record
_EOCD_SIG = 0x06054B50
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_ZIP64_LOCATOR_SIG = 0x07064B50
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")
_ZIP64_EOCD_SIG = 0x06064B50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_CENTRAL_SIG = 0x02014B50
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIG = 0x04034B50
_ZIP64_EXTRA = 0x0001
_MAX_COMMENT = 0xFFFF


@dataclasses.dataclass(frozen=True)
class Member:
    """One member of the archive: its name and where its (compressed) bytes are."""

    name: str
    method: int
    crc32: int
    compressed_size: int
    size: int
    data_offset: int  # first byte of the member's data in the archive file

    @property
    def method_name(self) -> str:
        return _METHODS.get(self.method, f"method {self.method}")


def _bad(path: str, what: str) -> InvalidStoreError:
    return InvalidStoreError(
        f"{path}: not a readable .npz (zip) archive: {what}. The file is truncated or not "
        "a zip archive. Fix: re-create it with np.savez / np.savez_compressed, or download "
        "it again."
    )


def read_members(path: str) -> list[Member]:
    """Every member of the zip archive at ``path``, in archive order.

    Reads the end-of-central-directory record (zip64 included), the central
    directory and each member's local header (whose own name and extra
    lengths place the data). Never reads member data.

    Raises:
      InvalidStoreError: truncated or malformed archives, encrypted members,
        members whose data would lie past the end of the file; naming the file
        and the member.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        tail_len = min(size, _EOCD.size + _MAX_COMMENT)
        f.seek(size - tail_len)
        tail = f.read(tail_len)
        at = tail.rfind(struct.pack("<I", _EOCD_SIG))
        if at < 0 or at + _EOCD.size > len(tail):
            raise _bad(path, "no end-of-central-directory record")
        eocd_pos = size - tail_len + at
        _, disk, _, _, entries, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
        if disk != 0:
            raise _bad(path, "a multi-disk (split) archive")
        if 0xFFFF in (entries,) or 0xFFFFFFFF in (cd_size, cd_offset):
            entries, cd_size, cd_offset = _zip64_end(f, path, eocd_pos)
        if cd_offset + cd_size > size:
            raise _bad(
                path, f"the central directory ends at byte {cd_offset + cd_size:,} of {size:,}"
            )
        f.seek(cd_offset)
        directory = f.read(cd_size)
        members = []
        pos = 0
        for _ in range(entries):
            if pos + _CENTRAL.size > len(directory):
                raise _bad(path, "the central directory is cut short")
            fields = _CENTRAL.unpack_from(directory, pos)
            sig, flags, method, crc, csize, usize = fields[0], fields[3], fields[4], *fields[7:10]
            nlen, elen, clen, local = fields[10], fields[11], fields[12], fields[16]
            if sig != _CENTRAL_SIG:
                raise _bad(path, f"a bad central directory entry at byte {cd_offset + pos:,}")
            raw_name = directory[pos + _CENTRAL.size : pos + _CENTRAL.size + nlen]
            name = raw_name.decode("utf-8" if flags & 0x800 else "cp437", errors="replace")
            extra = directory[pos + _CENTRAL.size + nlen : pos + _CENTRAL.size + nlen + elen]
            pos += _CENTRAL.size + nlen + elen + clen
            usize, csize, local = _zip64_sizes(extra, usize, csize, local)
            if flags & 0x1:
                raise InvalidStoreError(
                    f"{path}: member {name!r} is encrypted. Fix: save the arrays without "
                    "encryption (np.savez / np.savez_compressed)."
                )
            members.append(
                Member(name, method, crc, csize, usize, _data_offset(f, path, name, local))
            )
        for m in members:
            reach = m.data_offset + m.compressed_size
            if reach > size:
                raise InvalidStoreError(
                    f"{path}: member {m.name!r} needs bytes up to {reach:,}"
                    f" but the file holds {size:,}: it is truncated. Fix: download or write "
                    "it again."
                )
    return members


def _zip64_end(f: BinaryIO, path: str, eocd_pos: int) -> tuple[int, int, int]:
    """Entries, central directory size and offset from the zip64 end records."""
    if eocd_pos < _ZIP64_LOCATOR.size:
        raise _bad(path, "the zip64 end-of-central-directory locator is missing")
    f.seek(eocd_pos - _ZIP64_LOCATOR.size)
    sig, _, record, _ = _ZIP64_LOCATOR.unpack(f.read(_ZIP64_LOCATOR.size))
    if sig != _ZIP64_LOCATOR_SIG:
        raise _bad(path, "the zip64 end-of-central-directory locator is missing")
    f.seek(record)
    raw = f.read(_ZIP64_EOCD.size)
    if len(raw) < _ZIP64_EOCD.size:
        raise _bad(path, "the zip64 end-of-central-directory record is cut short")
    sig, _, _, _, _, _, _, entries, cd_size, cd_offset = _ZIP64_EOCD.unpack(raw)
    if sig != _ZIP64_EOCD_SIG:
        raise _bad(path, "a bad zip64 end-of-central-directory record")
    return entries, cd_size, cd_offset


def _zip64_sizes(extra: bytes, usize: int, csize: int, local: int) -> tuple[int, int, int]:
    """The 64-bit sizes and offset of the zip64 extra field, for those saturated at 32 bits."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + length]
        pos += 4 + length
        if tag != _ZIP64_EXTRA:
            continue
        values = [v for (v,) in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
        it = iter(values)
        if usize == 0xFFFFFFFF:
            usize = next(it, usize)
        if csize == 0xFFFFFFFF:
            csize = next(it, csize)
        if local == 0xFFFFFFFF:
            local = next(it, local)
    return usize, csize, local


def _data_offset(f: BinaryIO, path: str, name: str, local: int) -> int:
    """Where the member's data starts: after its local header, name and extra field."""
    f.seek(local)
    raw = f.read(_LOCAL.size)
    if len(raw) < _LOCAL.size or _LOCAL.unpack(raw)[0] != _LOCAL_SIG:
        raise _bad(path, f"member {name!r} has no local header at byte {local:,}")
    fields = _LOCAL.unpack(raw)
    return local + _LOCAL.size + fields[9] + fields[10]
