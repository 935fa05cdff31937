"""``tf.train.Example`` read from its protobuf wire format, keeping where each value sits."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["FeatureValues", "WireError", "decode_varints", "parse_example"]

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_NO_INTS = np.zeros(0, np.int64)
_NO_INTS.flags.writeable = False


class WireError(ValueError):
    """The bytes are not a ``tf.train.Example`` (the caller names file and record)."""


@dataclasses.dataclass
class FeatureValues:
    """One feature of an Example: its list kind and where its values are.

    ``kind`` is ``"bytes"``, ``"float"``, ``"int64"`` or ``"none"`` (an empty
    Feature). Offsets are relative to the start of the Example's bytes.

    - bytes: ``offsets``/``lengths`` of each element.
    - float: ``count`` values in groups of ``stride`` bytes from ``offset``: 4
      when packed, 5 when written unpacked (each group a tag byte, then the float).
    - int64: the decoded ``values``.
    """

    kind: str
    count: int = 0
    offset: int = 0
    stride: int = 4
    offsets: np.ndarray | None = None
    lengths: np.ndarray | None = None
    values: np.ndarray | None = None


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise WireError("a varint runs past the end of its message")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("a varint is longer than 10 bytes")


def _skip(buf: bytes, pos: int, end: int, wire: int) -> int:
    if wire == _VARINT:
        return _varint(buf, pos, end)[1]
    if wire == _I64:
        return pos + 8
    if wire == _I32:
        return pos + 4
    if wire == _LEN:
        n, pos = _varint(buf, pos, end)
        return pos + n
    raise WireError(f"unsupported wire type {wire}")


def _fields(buf: bytes, pos: int, end: int) -> list[tuple[int, int, int, int]]:
    """``(field, wire, start, stop)`` of each field in ``buf[pos:end]``; for LEN fields
    ``start:stop`` is the payload, else the value's bytes."""
    out: list[tuple[int, int, int, int]] = []
    append = out.append
    while pos < end:
        key = buf[pos]  # one-byte tags and lengths inline: the common case by far
        if key < 0x80:
            pos += 1
        else:
            key, pos = _varint(buf, pos, end)
        wire = key & 7
        if wire == _LEN:
            if pos >= end:
                raise WireError(f"field {key >> 3} runs past the end of its message")
            n = buf[pos]
            if n < 0x80:
                pos += 1
            else:
                n, pos = _varint(buf, pos, end)
            start, pos = pos, pos + n
        else:
            start, pos = pos, _skip(buf, pos, end, wire)
        if pos > end:
            raise WireError(f"field {key >> 3} runs past the end of its message")
        append((key >> 3, wire, start, pos))
    return out


def _bytes_list(buf: Any, pos: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and lengths of a BytesList's values (field 1, length-delimited).

    The per-value loop is the index build's hot path (one image a step): the tag is
    compared as a byte and the length's varint decoded inline.
    """
    offsets: list[int] = []
    lengths: list[int] = []
    add_offset, add_length = offsets.append, lengths.append
    while pos < end:
        if buf[pos] != 0x0A:  # field 1, LEN: the only field a BytesList has; skip others
            key, pos = _varint(buf, pos, end)
            if key >> 3 == 1:
                raise WireError("a BytesList value is not length-delimited")
            pos = _skip(buf, pos, end, key & 7)
            continue
        if pos + 1 >= end:
            raise WireError("a BytesList value runs past the end of its message")
        n = buf[pos + 1]
        pos += 2
        if n >= 0x80:  # two- and three-byte lengths unrolled (images); longer ones by _varint
            b1 = buf[pos] if pos < end else 0x80
            if b1 < 0x80:
                n = (n & 0x7F) | b1 << 7
                pos += 1
            else:
                b2 = buf[pos + 1] if pos + 1 < end else 0x80
                if b2 < 0x80:
                    n = (n & 0x7F) | (b1 & 0x7F) << 7 | b2 << 14
                    pos += 2
                else:
                    n, pos = _varint(buf, pos - 1, end)
        add_offset(pos)
        add_length(n)
        pos += n
    if pos > end:
        raise WireError("a BytesList value runs past the end of its message")
    return np.array(offsets, np.int64), np.array(lengths, np.int64)


def decode_varints(data: bytes | memoryview | np.ndarray) -> np.ndarray:
    """The int64 values of a packed run of varints (two's complement, as protobuf's int64)."""
    b = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if b.size == 0:
        return np.zeros(0, np.int64)
    if b[-1] >= 0x80:
        raise WireError("a packed int64 list ends inside a varint")
    high = b >= 0x80
    if not high.any():
        return b.astype(np.int64)
    ends = np.flatnonzero(~high)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lens = ends - starts + 1
    if lens.max() > 10:  # type: ignore[call-overload, unused-ignore]
        raise WireError("a varint is longer than 10 bytes")
    group = np.repeat(np.arange(len(ends)), lens)
    shift = ((np.arange(b.size) - starts[group]) * 7).astype(np.uint64)
    parts = (b & 0x7F).astype(np.uint64) << shift
    return np.bitwise_or.reduceat(parts, starts).view(np.int64)


def _payload(buf: Any, pos: int, end: int) -> int:
    """Where the payload of the length-delimited field whose length varint is at ``pos``
    starts, if it ends exactly at ``end`` (a message's only field); else -1."""
    n = buf[pos]
    if n < 0x80:
        pos += 1
    else:
        try:
            n, pos = _varint(buf, pos, end)
        except WireError:
            return -1
    return pos if pos + n == end else -1


def _feature(buf: Any, start: int, stop: int) -> FeatureValues:
    # The common layout first: one list field (tag 0x0A, 0x12 or 0x1A) filling the Feature,
    # holding one packed run (or the BytesList's values).
    if start + 1 < stop and buf[start] in (0x0A, 0x12, 0x1A):
        kind = buf[start] >> 3
        a = _payload(buf, start + 1, stop)
        if a >= 0:
            if kind == 1:
                offsets, lengths = _bytes_list(buf, a, stop)
                return FeatureValues("bytes", len(offsets), offsets=offsets, lengths=lengths)
            if a == stop:  # an empty list
                return (
                    FeatureValues("float") if kind == 2 else FeatureValues("int64", values=_NO_INTS)
                )
            s = _payload(buf, a + 1, stop) if buf[a] == 0x0A and a + 1 < stop else -1
            if s >= 0 and kind == 2:
                if (stop - s) % 4:
                    raise WireError("a packed FloatList is not a whole number of floats")
                return FeatureValues("float", (stop - s) // 4, offset=s, stride=4)
            if s >= 0:
                ints = decode_varints(np.frombuffer(buf, np.uint8, stop - s, s))
                return FeatureValues("int64", len(ints), values=ints)
    return _feature_any(buf, start, stop)


def _feature_any(buf: Any, start: int, stop: int) -> FeatureValues:
    fields = _fields(buf, start, stop)
    if not fields:
        return FeatureValues("none")
    kinds = {f for f, _, _, _ in fields}
    if len(kinds) != 1 or fields[0][1] != _LEN:
        raise WireError("a Feature holds more than one list kind")
    kind, _, a, b = fields[-1]  # protobuf: the last occurrence of a oneof wins
    if kind == 1:  # BytesList
        offsets, lengths = _bytes_list(buf, a, b)
        return FeatureValues("bytes", len(offsets), offsets=offsets, lengths=lengths)
    items = _fields(buf, a, b)
    if kind == 2:  # FloatList
        values = [(w, s, e) for f, w, s, e in items if f == 1]
        if not values:
            return FeatureValues("float")
        if len(values) == 1 and values[0][0] == _LEN:
            _, s, e = values[0]
            if (e - s) % 4:
                raise WireError("a packed FloatList is not a whole number of floats")
            return FeatureValues("float", (e - s) // 4, offset=s, stride=4)
        if all(w == _I32 for w, _, _ in values):
            starts = np.array([s for _, s, _ in values], np.int64)
            if len(starts) == 1 or np.all(np.diff(starts) == 5):
                # Each value as a 5-byte group: its one-byte tag, then the float.
                return FeatureValues("float", len(starts), offset=int(starts[0]) - 1, stride=5)
        raise WireError("a FloatList mixes packed and unpacked runs, which is not supported")
    if kind == 3:  # Int64List
        parts = []
        for f, w, s, e in items:
            if f != 1:
                continue
            if w not in (_LEN, _VARINT):
                raise WireError("an Int64List value is neither a varint nor packed")
            # A packed run's payload, or one unpacked varint's bytes: both decode alike.
            parts.append(decode_varints(memoryview(buf)[s:e]))
        ints = np.concatenate(parts) if parts else _NO_INTS
        return FeatureValues("int64", len(ints), values=ints)
    raise WireError(f"a Feature has the unknown field {kind}")


def parse_example(
    buf: Any, wanted: set[str] | None = None, start: int = 0, end: int | None = None
) -> dict[str, FeatureValues]:
    """The features of the serialized ``tf.train.Example`` ``buf[start:end]`` (only
    ``wanted`` ones); offsets are positions in ``buf`` (a ``bytes`` or a read-only map of
    a whole shard, parsed in place).

    Raises:
      WireError: ``buf[start:end]`` is not a well-formed Example.
    """
    out: dict[str, FeatureValues] = {}
    names = None if wanted is None else {w.encode("utf-8"): w for w in wanted}
    for field, wire, a, b in _fields(buf, start, len(buf) if end is None else end):
        if field != 1 or wire != _LEN:
            continue  # Example.features is field 1
        for entry, ewire, ea, eb in _fields(buf, a, b):
            if entry != 1 or ewire != _LEN:
                continue  # Features.feature (a map) is field 1
            raw: bytes | None = None
            value = (0, 0)
            n = buf[ea + 1] if ea + 1 < eb and buf[ea] == 0x0A else 0x80
            p = ea + 2 + n
            if n < 0x80 and p < eb and buf[p] == 0x12:  # the usual entry: key, then value
                raw = buf[ea + 2 : p]
                q = _payload(buf, p + 1, eb) if p + 1 < eb else -1
                value = (q, eb) if q >= 0 else (0, 0)
            if raw is None or value == (0, 0):
                raw, value = None, (0, 0)
                for kf, kw, ka, kb in _fields(buf, ea, eb):
                    if kf == 1 and kw == _LEN:
                        raw = buf[ka:kb]
                    elif kf == 2 and kw == _LEN:
                        value = (ka, kb)
            if raw is None:
                continue
            if names is None:
                out[bytes(raw).decode("utf-8", errors="replace")] = _feature(buf, *value)
            elif raw in names:
                out[names[raw]] = _feature(buf, *value)
    return out
