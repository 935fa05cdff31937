"""The numba-compiled scan of a ``tf.train.Example`` (imported only where numba is installed).

:func:`scan_example` walks the same wire format as :mod:`example`'s parser, in the
same order, and writes where each feature's values sit into caller-owned arrays
instead of building Python objects per value. It accepts only what the Python
parser accepts, with the same results; anything else (a malformed record, or a
layout it does not take, e.g. a varint wider than 64 bits) returns ``FALLBACK``
and the caller parses that record in Python, which raises the error or handles it.
"""

import numba
import numpy as np

FALLBACK = -1  # parse this record with the Python parser
ENTRIES_FULL = -2  # ``entries`` has too few rows: grow it and scan again
VALUES_FULL = -3  # ``values``/``lengths`` too short: grow them and scan again

NONE, BYTES, FLOAT, INT64 = 0, 1, 2, 3
# Columns of ``entries``: name offset, name length, kind, count, then for bytes and int64
# the first row of ``values``, for float the offset of the first value; float stride.
COLUMNS = 6

_LEN = 2
_U7F = np.uint64(0x7F)

_jit = numba.njit(cache=True, nogil=True)


@_jit
def _varint(buf, pos, end):  # type: ignore[no-untyped-def]
    """``(value, next pos)``; next pos -1 where it runs past ``end``, is longer than 10 bytes
    or holds bits past 64 (Python's parser keeps those; it decides such records)."""
    result = np.uint64(0)
    shift = 0
    while True:
        if pos >= end:
            return np.uint64(0), -1
        b = np.uint64(buf[pos])
        pos += 1
        v = b & _U7F
        if shift == 63 and v > 1:
            return np.uint64(0), -1
        result |= v << np.uint64(shift)
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            return np.uint64(0), -1


@_jit
def _field(buf, pos, end):  # type: ignore[no-untyped-def]
    """``(field, wire, start, stop)`` of the field at ``pos`` (as ``example._fields``); stop -1
    where it is malformed or runs past ``end``."""
    key, pos = _varint(buf, pos, end)
    if pos < 0:
        return 0, 0, 0, -1
    wire = np.int64(key & np.uint64(7))
    field = np.int64(key >> np.uint64(3))
    if wire == _LEN:
        n, pos = _varint(buf, pos, end)
        if pos < 0 or n > np.uint64(end - pos):
            return 0, 0, 0, -1
        return field, wire, pos, pos + np.int64(n)
    if wire == 0:
        _, stop = _varint(buf, pos, end)
        return field, wire, pos, stop
    if wire == 1 or wire == 5:
        stop = pos + (8 if wire == 1 else 4)
        return field, wire, pos, stop if stop <= end else -1
    return 0, 0, 0, -1  # groups and unknown wire types: Python raises


@_jit
def _payload(buf, pos, end):  # type: ignore[no-untyped-def]
    """As ``example._payload`` (``pos < end``)."""
    n, p = _varint(buf, pos, end)
    if p < 0 or n > np.uint64(end - p):
        return -1
    return p if p + np.int64(n) == end else -1


@_jit
def _bytes_list(buf, pos, end, values, lengths, row):  # type: ignore[no-untyped-def]
    """Writes the BytesList's element offsets and lengths from ``row`` on; returns the next
    row, or FALLBACK / VALUES_FULL."""
    while pos < end:
        if buf[pos] != 0x0A:  # another field: skipped, as Python does (field 1 not LEN: raises)
            field, _, _, stop = _field(buf, pos, end)
            if stop < 0 or field == 1:
                return FALLBACK
            pos = stop
            continue
        n, p = _varint(buf, pos + 1, end)
        if p < 0 or n > np.uint64(end - p):
            return FALLBACK
        if row >= values.shape[0]:
            return VALUES_FULL
        values[row] = p
        lengths[row] = np.int64(n)
        row += 1
        pos = p + np.int64(n)
    return row


@_jit
def _ints(buf, pos, end, values, row):  # type: ignore[no-untyped-def]
    """Decodes a packed run of varints (as ``example.decode_varints``: two's complement,
    bits past 64 dropped) into ``values`` from ``row`` on; the next row, or an error code."""
    while pos < end:
        result = np.uint64(0)
        shift = 0
        while True:
            if pos >= end or shift > 63:  # ends inside a varint, or longer than 10 bytes
                return FALLBACK
            b = np.uint64(buf[pos])
            pos += 1
            result |= (b & _U7F) << np.uint64(shift)
            if b < 0x80:
                break
            shift += 7
        if row >= values.shape[0]:
            return VALUES_FULL
        values[row] = np.int64(result)
        row += 1
    return row


@_jit
def _floats(buf, a, b, entry):  # type: ignore[no-untyped-def]
    """A FloatList's payload ``a:b`` in any layout (as ``example._feature_any``): writes count,
    offset and stride into ``entry``; 0, or FALLBACK."""
    count = 0
    packed = -1
    first = last = -1
    contiguous = True
    pos = a
    while pos < b:
        field, wire, start, stop = _field(buf, pos, b)
        if stop < 0:
            return FALLBACK
        pos = stop
        if field != 1:
            continue
        count += 1
        if wire == _LEN:
            packed = start
            entry[3] = (stop - start) // 4
            if (stop - start) % 4:
                return FALLBACK
        elif wire == 5:
            if first < 0:
                first = start
            elif start - last != 5:
                contiguous = False
            last = start
        else:
            return FALLBACK
    if count == 0:
        entry[3], entry[4], entry[5] = 0, 0, 4
        return 0
    if count == 1 and packed >= 0:
        entry[4], entry[5] = packed, 4
        return 0
    if packed >= 0 or not contiguous:
        return FALLBACK  # packed and unpacked runs mixed, or unpacked ones apart: Python raises
    entry[3], entry[4], entry[5] = count, first - 1, 5
    return 0


@_jit
def _feature(buf, start, stop, entry, values, lengths, row):  # type: ignore[no-untyped-def]
    """Fills ``entry`` (kind, count, where) for the Feature ``start:stop``; returns the next
    row of ``values``, or an error code."""
    entry[5] = 4
    if start + 1 < stop and (buf[start] == 0x0A or buf[start] == 0x12 or buf[start] == 0x1A):
        list_kind = np.int64(buf[start] >> 3)
        a = _payload(buf, start + 1, stop)
        if a >= 0:  # one list field filling the Feature
            if list_kind == 1:
                end_row = _bytes_list(buf, a, stop, values, lengths, row)
                entry[2], entry[3], entry[4] = BYTES, end_row - row, row
                return end_row
            if a == stop:  # an empty list
                entry[2], entry[3], entry[4] = (FLOAT if list_kind == 2 else INT64), 0, 0
                return row
            s = _payload(buf, a + 1, stop) if buf[a] == 0x0A and a + 1 < stop else -1
            if s >= 0 and list_kind == 2:
                if (stop - s) % 4:
                    return FALLBACK
                entry[2], entry[3], entry[4] = FLOAT, (stop - s) // 4, s
                return row
            if s >= 0:
                end_row = _ints(buf, s, stop, values, row)
                entry[2], entry[3], entry[4] = INT64, end_row - row, row
                return end_row
    # Any other layout (as example._feature_any): list fields of one kind, the last one wins.
    kind = -1
    a = b = -1
    pos = start
    while pos < stop:
        field, wire, fa, fb = _field(buf, pos, stop)
        if fb < 0 or wire != _LEN or (kind >= 0 and field != kind):
            return FALLBACK
        kind, a, b = field, fa, fb
        pos = fb
    if kind < 0:
        entry[2], entry[3], entry[4] = NONE, 0, 0
        return row
    if kind == 1:
        end_row = _bytes_list(buf, a, b, values, lengths, row)
        entry[2], entry[3], entry[4] = BYTES, end_row - row, row
        return end_row
    if kind == 2:
        entry[2] = FLOAT
        return row if _floats(buf, a, b, entry) == 0 else FALLBACK
    if kind == 3:
        entry[2], entry[4] = INT64, row
        pos = a
        while pos < b:
            field, wire, fa, fb = _field(buf, pos, b)
            if fb < 0:
                return FALLBACK
            pos = fb
            if field != 1:
                continue
            if wire != _LEN and wire != 0:
                return FALLBACK
            row = _ints(buf, fa, fb, values, row)
            if row < 0:
                return row
        entry[3] = row - entry[4]
        return row
    return FALLBACK


@_jit
def _scan(buf, start, end, entries, values, lengths, row):  # type: ignore[no-untyped-def]
    """``(entries written or an error code, next row of values)`` (see :func:`scan_example`);
    the values' rows from ``row`` on."""
    if start < 0 or end > buf.shape[0] or start > end:
        return FALLBACK, row
    n_entries = 0
    pos = start
    while pos < end:
        field, wire, a, b = _field(buf, pos, end)
        if b < 0:
            return FALLBACK, row
        pos = b
        if field != 1 or wire != _LEN:
            continue  # Example.features is field 1
        epos = a
        while epos < b:
            entry, ewire, ea, eb = _field(buf, epos, b)
            if eb < 0:
                return FALLBACK, row
            epos = eb
            if entry != 1 or ewire != _LEN:
                continue  # Features.feature (a map) is field 1
            name = -1
            name_len = 0
            va = vb = 0
            found = False
            n = buf[ea + 1] if ea + 1 < eb and buf[ea] == 0x0A else 0x80
            p = ea + 2 + n
            if n < 0x80 and p < eb and buf[p] == 0x12:  # the usual entry: key, then value
                q = _payload(buf, p + 1, eb) if p + 1 < eb else -1
                if q >= 0:
                    name, name_len, va, vb, found = ea + 2, n, q, eb, True
            if not found:
                name = -1
                va = vb = 0
                kpos = ea
                while kpos < eb:
                    kf, kw, ka, kb = _field(buf, kpos, eb)
                    if kb < 0:
                        return FALLBACK, row
                    kpos = kb
                    if kf == 1 and kw == _LEN:
                        name, name_len = ka, kb - ka
                    elif kf == 2 and kw == _LEN:
                        va, vb = ka, kb
            if name < 0:
                continue
            if n_entries >= entries.shape[0]:
                return ENTRIES_FULL, row
            e = entries[n_entries]
            e[0], e[1] = name, name_len
            if va == 0 and vb == 0:
                e[2], e[3], e[4], e[5] = NONE, 0, 0, 4
            else:
                row = _feature(buf, va, vb, e, values, lengths, row)
                if row < 0:
                    return row, 0
            n_entries += 1
    return n_entries, row


@_jit
def scan_example(buf, start, end, entries, values, lengths):  # type: ignore[no-untyped-def]
    """Scans the Example ``buf[start:end]``: one row of ``entries`` per feature map entry, in
    record order (a later entry of the same name wins, as in Python), their values' rows in
    ``values``/``lengths``. Returns the number of entries, or an error code."""
    return _scan(buf, start, end, entries, values, lengths, 0)[0]


@_jit
def scan_shard(buf, bounds, names, name_ends, entries, slots, values, lengths):  # type: ignore[no-untyped-def]
    """Scans the Examples ``buf[bounds[r, 0]:bounds[r, 1]]`` of a whole shard, keeping the
    features named ``names[name_ends[j]:name_ends[j + 1]]``: ``slots[r, j]`` is record r's
    feature j as (kind, count, where, stride) as in ``entries``, kind -1 where it is not in
    the record (its last entry wins, as in Python). Returns the rows of ``values`` used, or
    an error code (FALLBACK where any record is not the compiled scan's to take)."""
    row = 0
    n_names = name_ends.shape[0] - 1
    for r in range(bounds.shape[0]):
        for j in range(n_names):
            slots[r, j, 0] = -1
        n, row = _scan(buf, bounds[r, 0], bounds[r, 1], entries, values, lengths, row)
        if n < 0:
            return n
        for i in range(n):
            off, size = entries[i, 0], entries[i, 1]
            for j in range(n_names):
                a = name_ends[j]
                if name_ends[j + 1] - a != size:
                    continue
                same = True
                for t in range(size):
                    if buf[off + t] != names[a + t]:
                        same = False
                        break
                if same:
                    for c in range(4):
                        slots[r, j, c] = entries[i, 2 + c]
                    break
    return row
