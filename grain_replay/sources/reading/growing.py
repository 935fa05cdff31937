"""A read-only file mapping that grows in place as a store's file is appended to.

A ``ReplayWriter`` appends rows to a ``.npy`` file while readers map it. Remapping
the whole file after each commit costs a reopen (milliseconds) and then a page
fault per page touched again (the new mapping starts with no page table). This
map reserves address space ahead (``PROT_NONE``, no memory) and maps the file's
new pages behind the ones already mapped (``MAP_FIXED``): a commit costs one
``mmap`` per leaf, and arrays over the old rows stay valid and warm.

Linux only; :func:`map_file` returns None elsewhere (callers map the file whole).
"""

from __future__ import annotations

import os

import numpy as np

from grain_replay.sources.reading.files import Descriptor, MappedFile
from grain_replay.sources.reading.stitch import _Reservation, headroom_for, place, reserve
from grain_replay.store.formats import PAGE

__all__ = ["GrowingMap", "map_file"]


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


class GrowingMap:
    """The first bytes of one file, mapped read-only into a reserved range that can grow.

    Args:
      path: the file.
      needed: bytes to map now (the file holds at least that many).
    """

    def __init__(self, path: str, needed: int, descriptor: Descriptor, reservation: _Reservation):
        self.path = path
        self._descriptor = descriptor
        st = os.fstat(descriptor.fd)
        self._ino = st.st_ino
        self._reservation = reservation  # unmaps the whole range when the last array goes
        self._mapped = 0
        self.file = MappedFile(path, needed, descriptor)
        if st.st_size < needed or not self._map_to(needed):
            raise OSError(f"{path}: mapping {needed:,} bytes failed")

    def _map_to(self, needed: int) -> bool:
        end = _pages(needed)
        if end <= self._mapped:
            return True
        if end > self._reservation.size:
            return False
        addr = self._reservation.addr + self._mapped
        if not place(addr, end - self._mapped, self._descriptor.fd, self._mapped):
            return False
        self._mapped = end
        return True

    def grow(self, needed: int) -> bool:
        """Maps the file up to ``needed`` bytes; False if it cannot grow in place.

        It cannot when the file at ``path`` is another file now (replaced), holds
        fewer bytes, or the reservation is too small: the caller maps anew.
        """
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        if st.st_ino != self._ino or st.st_size < needed:
            return False
        if not self._map_to(needed):
            return False
        self.file.needed = max(self.file.needed, needed)
        return True

    def array(self, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A read-only C-ordered array of ``shape`` at byte ``offset`` of the file."""
        used = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if used > self._mapped:
            raise ValueError(f"{self.path}: {used:,} bytes wanted, {self._mapped:,} mapped")
        flat = np.asarray(self._reservation.window(used))
        array = flat[offset:].view(dtype).reshape(shape)
        array.flags.writeable = False
        return array


def map_file(path: str, needed: int) -> GrowingMap | None:
    """A :class:`GrowingMap` of ``path``'s first ``needed`` bytes, or None where unsupported."""
    if needed <= 0:
        return None
    reservation = reserve(_pages(needed + headroom_for(needed)))
    if reservation is None:
        return None
    try:
        return GrowingMap(path, needed, Descriptor(path), reservation)
    except OSError:
        return None  # the reservation unmaps itself once dropped
