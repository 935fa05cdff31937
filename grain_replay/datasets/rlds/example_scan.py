"""``tf.train.Example`` parsed by a compiled scan (numba), with :func:`example.parse_example`
as the reference and fallback.

The Python parser builds ints and lists per value (one image, one text a step): for
an RLDS shard that is most of the index build. With numba installed (the ``fast``
extra), :class:`ExampleScanner` runs ``_scan_kernels.scan_example`` over the record's
bytes in place, which writes every feature's offsets, lengths and int64 values into
reused arrays, then builds the same :class:`~example.FeatureValues` from them: one
Python object per feature, none per value. The compiled scan takes only records the
Python parser takes, with the same results; any record it does not take (malformed,
or a layout it leaves alone) is parsed by the Python parser, which raises its error
or handles it, so both give the same results and the same errors.

Importing numba and loading the compiled scan from its cache takes a second or
more: :func:`loaded` starts that in a daemon thread, once per process, and the
Python parser indexes meanwhile (small datasets are indexed before it is there).
Without numba, or with ``GRAIN_REPLAY_NO_NUMBA=1``, only the Python parser runs.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import numpy as np

from grain_replay.datasets.rlds.example import FeatureValues, parse_example
from grain_replay.sources.reading.kernel_load import BackgroundLoad

__all__ = ["KINDS", "ExampleScanner", "compiled", "loaded", "scanner"]

logger = logging.getLogger(__name__)

_NO_INTS = np.zeros(0, np.int64)
_NO_INTS.flags.writeable = False


@functools.cache
def compiled() -> Any:
    """The module of compiled kernels, or None without numba (or with GRAIN_REPLAY_NO_NUMBA=1)."""
    if os.environ.get("GRAIN_REPLAY_NO_NUMBA"):
        return None
    try:
        import numba  # noqa: F401
    except ImportError:
        logger.info(
            "numba is not installed: RLDS records are indexed in Python (pip install numba)"
        )
        return None
    from grain_replay.datasets.rlds import _scan_kernels

    return _scan_kernels


# Kind codes of the compiled scan's results (those of ``_scan_kernels``), by wire kind.
KINDS = {"bytes": 1, "float": 2, "int64": 3}


def _warm(kernels: Any) -> None:
    # A record of one float feature, read-only as a map's bytes are.
    data = b"\x0a\x0f\x0a\x0d\x0a\x01f\x12\x08\x12\x06\x0a\x04\x00\x00\x80\x3f"
    record = np.frombuffer(data, np.uint8)
    scanner = ExampleScanner(kernels)
    scanner.parse(record, data, None, 0, len(record))
    scanner.scan_records(record, np.array([[0, len(data)]]), ["f"])


_LOADER = BackgroundLoad(compiled, _warm, "the compiled RLDS record scan")


def loaded(wait: bool = False) -> Any:
    """:func:`compiled` once this process has loaded it, else None (the Python parser).

    The first call starts loading it in a daemon thread (importing numba, loading the
    scan from numba's cache and dispatching it once on the argument types the index
    build passes); ``wait=True`` loads it here instead.
    """
    return _LOADER.loaded(wait)


def scanner(compiled_scan: bool | None = None) -> ExampleScanner | None:
    """A scanner for one thread's records, or None for the Python parser.

    ``compiled_scan``: None: the compiled scan if this process has loaded it (else its
    loading starts, see :func:`loaded`); True: wait for it to load (None without numba);
    False: the Python parser.
    """
    if compiled_scan is False:
        return None
    kernels = loaded(wait=bool(compiled_scan))
    return None if kernels is None else ExampleScanner(kernels)


class ExampleScanner:
    """Parses Examples with the compiled scan, reusing its arrays (one scanner a thread)."""

    def __init__(self, kernels: Any) -> None:
        self._k = kernels
        self._entries = np.empty((64, kernels.COLUMNS), np.int64)
        self._values = np.empty(1 << 12, np.int64)
        self._lengths = np.empty(1 << 12, np.int64)
        self.fallbacks = 0  # records handed to the Python parser

    def parse(
        self, view: np.ndarray, buf: Any, wanted: dict[bytes, str] | None, start: int, end: int
    ) -> dict[str, FeatureValues]:
        """As :func:`example.parse_example` ``(buf, wanted, start, end)``; ``view`` is ``buf``
        as a uint8 array, ``wanted`` maps each wanted name's UTF-8 bytes to the name.

        Raises:
          WireError: ``buf[start:end]`` is not a well-formed Example (the Python parser's).
        """
        k = self._k
        while True:
            n = k.scan_example(view, start, end, self._entries, self._values, self._lengths)
            if n >= 0:
                break
            if n == k.ENTRIES_FULL:
                self._entries = np.empty((2 * len(self._entries), k.COLUMNS), np.int64)
            elif n == k.VALUES_FULL:
                self._values = np.empty(2 * len(self._values), np.int64)
                self._lengths = np.empty(2 * len(self._lengths), np.int64)
            else:
                self.fallbacks += 1
                return parse_example(buf, None if wanted is None else set(wanted.values()),
                                     start, end)  # fmt: skip
        values, lengths = self._values, self._lengths
        out: dict[str, FeatureValues] = {}
        for off, size, kind, count, at, stride in self._entries[:n].tolist():
            raw = buf[off : off + size]
            if wanted is None:
                name = bytes(raw).decode("utf-8", errors="replace")
            else:
                got = wanted.get(bytes(raw))
                if got is None:
                    continue
                name = got
            if kind == k.BYTES:
                out[name] = FeatureValues(
                    "bytes",
                    count,
                    offsets=values[at : at + count].copy(),
                    lengths=lengths[at : at + count].copy(),
                )
            elif kind == k.FLOAT:
                out[name] = FeatureValues("float", count, offset=at, stride=stride)
            elif kind == k.INT64:
                ints = values[at : at + count].copy() if count else _NO_INTS
                out[name] = FeatureValues("int64", count, values=ints)
            else:
                out[name] = FeatureValues("none")
        return out

    def scan_records(
        self, view: np.ndarray, bounds: np.ndarray, names: list[str]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Scans every record ``view[bounds[r, 0]:bounds[r, 1]]`` of a shard at once, keeping
        the features ``names``: ``(slots, values, lengths)``, ``slots[r, j]`` record r's
        feature j as ``(kind, count, where, stride)`` (kind -1 where the record lacks it;
        bytes and int64 features' rows ``where:where + count`` of ``values``/``lengths``,
        a float feature's first value at byte ``where``). None where some record is not
        the compiled scan's to take (the caller then goes record by record).
        """
        k = self._k
        encoded = [n.encode("utf-8") for n in names]
        name_bytes = np.frombuffer(b"".join(encoded), np.uint8).copy()
        name_ends = np.cumsum([0] + [len(e) for e in encoded]).astype(np.int64)
        slots = np.empty((len(bounds), len(names), 4), np.int64)
        bounds = np.ascontiguousarray(bounds, np.int64)
        if len(self._values) < 256 * len(bounds):  # a guess (images and texts a step)
            self._values = np.empty(256 * len(bounds), np.int64)
            self._lengths = np.empty(256 * len(bounds), np.int64)
        while True:
            n = k.scan_shard(
                view, bounds, name_bytes, name_ends, self._entries, slots, self._values,
                self._lengths,
            )  # fmt: skip
            if n >= 0:
                return slots, self._values[:n], self._lengths[:n]
            if n == k.ENTRIES_FULL:
                self._entries = np.empty((2 * len(self._entries), k.COLUMNS), np.int64)
            elif n == k.VALUES_FULL:
                self._values = np.empty(4 * len(self._values), np.int64)
                self._lengths = np.empty(4 * len(self._lengths), np.int64)
            else:
                self.fallbacks += 1
                return None
