"""Decoded frames of RLDS image leaves on local disk: each step's image is decoded once.

One file per image leaf, beside the step index (``.grain_replay_rlds/`` or the
user cache, see :func:`~grain_replay.datasets.rlds.index.cache_dirs`): a page of
JSON header, then one slot per step, ``SLOT_HEADER`` bytes (a magic and the
file's random generation) before the frame's ``H * W * C`` bytes. Disk space is
reserved when the file is created (``posix_fallocate``); a slot is filled the
first time a process decodes that step (frame first, slot header last, with
``pwrite``) and read after that with one ``preadv`` into the batch (no map: the
page cache holds the frames, not the reader's RSS, and a file truncated under
the reader gives a short read, never SIGBUS). Worker processes share the file;
two of them filling one slot write the same bytes.

A process that dies between the two writes leaves a slot without its header:
decoded again. The kernel may write pages back in any order, so after a
crash of the machine a slot could have its header and not its frame: a file
written during another boot (``/proc/sys/kernel/random/boot_id``) is therefore
discarded and filled again. A file whose signature (shard sizes and times,
feature, decoder) differs is replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Sequence

import numpy as np

from grain_replay.store.filesync import temp_path

__all__ = ["SLOT_HEADER", "FrameCache", "boot_id", "open_frame_cache"]

logger = logging.getLogger(__name__)

_MAGIC = b"GRFRAME1"
SLOT_HEADER = 16  # magic (8) + the file's generation (8)
_PAGE = 4096
_VERSION = 1
# Free space left on the disk after a cache file is reserved.
_DISK_MARGIN = 1 << 30


def boot_id() -> str:
    """This boot of the machine (Linux), or "" where it cannot be told."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class FrameCache:
    """The decoded frames of one image leaf, one slot per step, read and filled by batch.

    Thread-safe (``preadv``/``pwrite`` at offsets; no shared position). After a
    read or write error the cache turns itself off for this process (the frames
    are decoded instead) and says so once in the log.
    """

    def __init__(self, path: str, fd: int, steps: int, frame_bytes: int, generation: bytes):
        self.path = path
        self.steps = int(steps)
        self.frame_bytes = int(frame_bytes)
        self._fd: int | None = fd
        self._slot = SLOT_HEADER + self.frame_bytes
        self._header = _MAGIC + generation

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def _off(self, step: int) -> int:
        return _PAGE + step * self._slot

    def _fail(self, what: str, e: OSError) -> None:
        logger.warning(
            "%s: cannot %s the decoded-frame cache (%s); decoding every image from now on "
            "in this process. Fix: free disk space, or pass frame_cache_bytes=0.",
            self.path,
            what,
            e,
        )
        self.close()

    def read(self, steps: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fills ``out[k]`` with the frame of ``steps[k]`` where cached; returns the hit mask."""
        n = len(steps)
        hits = np.zeros(n, bool)
        fd = self._fd
        if fd is None or not n:
            return hits
        rows = out.reshape(-1).view(np.uint8).data
        heads = memoryview(bytearray(n * SLOT_HEADER))
        want, slot, fb, h = self._header, self._slot, self.frame_bytes, SLOT_HEADER
        try:
            for k, s in enumerate(steps.tolist()):
                head = heads[k * h : (k + 1) * h]
                got = os.preadv(fd, [head, rows[k * fb : (k + 1) * fb]], _PAGE + s * slot)
                hits[k] = got == slot and head == want
        except OSError as e:
            self._fail("read", e)
            hits[:] = False
        return hits

    def write(self, steps: Sequence[int], frames: np.ndarray) -> None:
        """Stores ``frames[k]`` (decoded, of this leaf's shape) as the frame of ``steps[k]``."""
        fd = self._fd
        if fd is None:
            return
        flat = frames.reshape(len(frames), -1).view(np.uint8)
        try:
            for k, s in enumerate(steps):
                off = self._off(int(s))
                if os.pwrite(fd, flat[k].tobytes(), off + SLOT_HEADER) != self.frame_bytes:
                    raise OSError(f"short write at byte offset {off + SLOT_HEADER}")
                os.pwrite(fd, self._header, off)  # last: the slot is complete
        except OSError as e:
            self._fail("write", e)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _digest(signature: str) -> str:
    return hashlib.sha256(signature.encode()).hexdigest()


def _meta(signature: str, steps: int, frame_bytes: int, generation: bytes) -> bytes:
    meta = {
        "v": _VERSION,
        "signature": _digest(signature),
        "boot_id": boot_id(),
        "generation": generation.hex(),
        "steps": steps,
        "frame_bytes": frame_bytes,
    }
    raw = json.dumps(meta).encode()
    return raw + b"\n" * (_PAGE - len(raw))


def _open_existing(path: str, signature: str, steps: int, frame_bytes: int) -> FrameCache | None:
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        meta = json.loads(os.pread(fd, _PAGE, 0).rstrip(b"\n"))
        expect = _PAGE + steps * (SLOT_HEADER + frame_bytes)
        if (
            meta.get("v") == _VERSION
            and meta.get("signature") == _digest(signature)
            and meta.get("boot_id") == boot_id()
            and meta.get("steps") == steps
            and meta.get("frame_bytes") == frame_bytes
            and os.fstat(fd).st_size == expect
        ):
            return FrameCache(path, fd, steps, frame_bytes, bytes.fromhex(meta["generation"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    os.close(fd)
    return None


def _create(path: str, signature: str, steps: int, frame_bytes: int) -> FrameCache | None:
    """A new cache file at ``path``, made under another name and linked into place."""
    size = _PAGE + steps * (SLOT_HEADER + frame_bytes)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    st = os.statvfs(folder)
    if st.f_bavail * st.f_frsize < size + _DISK_MARGIN:
        raise OSError(f"{size:,} bytes needed, {st.f_bavail * st.f_frsize:,} free")
    generation = secrets.token_bytes(8)
    # Not filesync.atomic_replace: the file is linked into place only if absent (another
    # process's cache is kept), and its fd stays open as the cache's after the link.
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        os.pwrite(fd, _meta(signature, steps, frame_bytes, generation), 0)
        try:
            os.posix_fallocate(fd, 0, size)  # the space is there when slots are filled
        except OSError as e:
            if e.errno not in (95, 22):  # EOPNOTSUPP / EINVAL: a sparse file instead
                raise
            os.ftruncate(fd, size)
        try:
            os.link(tmp, path)
        except FileExistsError:
            # Another process made it first, or a stale one is in the way.
            found = _open_existing(path, signature, steps, frame_bytes)
            if found is not None:
                os.close(fd)
                return found
            os.replace(tmp, path)
        return FrameCache(path, fd, steps, frame_bytes, generation)
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def open_frame_cache(
    dirs: Sequence[str], name: str, signature: str, steps: int, frame_bytes: int
) -> FrameCache | None:
    """The cache file ``name`` in the first of ``dirs`` that holds or can take it, or None."""
    for d in dirs:
        found = _open_existing(os.path.join(d, name), signature, steps, frame_bytes)
        if found is not None:
            return found
    for d in dirs:
        try:
            return _create(os.path.join(d, name), signature, steps, frame_bytes)
        except OSError as e:
            logger.info("%s: cannot create the decoded-frame cache here (%s)", d, e)
    return None
