"""A store's metadata parsed in a child process with a timeout: hostile bytes can hang HDF5.

The HDF5 C library can loop forever on a damaged or hostile file (SECURITY.md
shows one), holding the GIL: no thread, signal handler or timeout in the same
process gets it back. ``verify_isolated`` opens the store (its metadata, every
leaf's dataset or array) and reads its first and last row in a fresh Python
process, killed after ``timeout`` seconds; ``grain-replay verify`` does this first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys

__all__ = ["DEFAULT_TIMEOUT_S", "IsolatedCheck", "verify_isolated"]

DEFAULT_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class IsolatedCheck:
    """What opening a store in a child process gave.

    Attributes:
      path: the store, absolute.
      ok: it opened and its first and last rows read.
      hung: the child did not answer within ``timeout`` seconds and was killed.
      message: one line: what happened (the error's message when it failed).
      error: the class name of the error it raised, or ``""``.
      returncode: the child's exit status (negative: killed by that signal).
    """

    path: str
    ok: bool
    hung: bool
    message: str
    error: str = ""
    returncode: int | None = None


def verify_isolated(
    path: str | os.PathLike[str], timeout: float = DEFAULT_TIMEOUT_S
) -> IsolatedCheck:
    """Opens ``path`` and reads its first and last row in a child process, for ``timeout`` s.

    Never hangs and never crashes the caller: a hang or a crash of the child comes
    back as an :class:`IsolatedCheck` (``hung=True``, or ``returncode`` < 0). The
    store is only opened, not checked against its checksums (``grain-replay
    verify`` goes on to that when this returns ``ok``).

    Examples:
      >>> check = verify_isolated("untrusted.h5", timeout=10)
      >>> if not check.ok:
      ...     print(check.message)
    """
    where = os.fspath(path)
    if "://" not in where:
        where = os.path.abspath(where)
    cmd = [sys.executable, "-m", "grain_replay.cli.isolated", where]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:  # run() killed the child
        return IsolatedCheck(
            where, ok=False, hung=True,
            message=f"hung: the HDF5 library (or another format library) did not return "
            f"within {timeout:g} s while opening {where}; do not open this file in-process. "
            "It is damaged or hostile: restore it from a copy or re-write it.",
        )  # fmt: skip
    answer = out.stdout.strip().splitlines()[-1:] if out.stdout else []
    try:
        reply = json.loads(answer[0]) if answer else None
    except ValueError:
        reply = None
    if out.returncode < 0 or not isinstance(reply, dict):
        tail = (out.stderr.strip().splitlines()[-1:] or [""])[0][:300]
        if out.returncode < 0:
            how = f"crashed: the process opening {where} was killed by "
            how += f"{signal.Signals(-out.returncode).name} ({tail}); do not open this file "
            how += "in-process."
        else:
            how = f"failed: opening {where} raised an unexpected error ({tail})."
        return IsolatedCheck(
            where, ok=False, hung=False, returncode=out.returncode,
            message=f"{how} It is damaged or hostile: restore it from a copy or re-write it.",
        )  # fmt: skip
    return IsolatedCheck(
        where, ok=bool(reply.get("ok")), hung=False, message=str(reply.get("message", "")),
        error=str(reply.get("error", "")), returncode=out.returncode,
    )  # fmt: skip


def _child(path: str) -> int:
    """Opens ``path`` and reads its first and last row; prints one JSON line."""
    import numpy as np

    from grain_replay.cli.stores import open_store
    from grain_replay.errors import GrainReplayError

    try:
        src = open_store(path)
        try:
            n = len(src)
            if n:
                src.read_batch(np.unique([0, n - 1]))
            reply = {"ok": True, "message": f"opened: {n:,} records, {len(src.spec)} leaves"}
        finally:
            src.close()
    except (GrainReplayError, OSError) as e:
        reply = {"ok": False, "error": type(e).__name__, "message": str(e)}
    print(json.dumps(reply), flush=True)
    return 0 if reply["ok"] else 1


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
