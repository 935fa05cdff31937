"""Names the usual cause of workers that die while starting: no ``__main__`` guard."""

# Spawned workers import the parent's main module again (as ``__mp_main__``). A
# script that builds and iterates a loader at top level then starts workers from
# inside each worker's start-up, which multiprocessing refuses with a long
# traceback per worker, and the consumer only sees workers that exited with code 1.

from __future__ import annotations

import ast
import sys
from typing import Any

__all__ = ["GUARD_FIX", "main_guard_missing", "start_process"]

GUARD_FIX = (
    'Fix: put the code that iterates the loader under `if __name__ == "__main__":` '
    "(spawned worker processes import the main script again), or use worker_count=0."
)


def start_process(process: Any) -> None:
    """``process.start()``; inside a worker's start-up, one line and exit instead of a traceback.

    multiprocessing raises RuntimeError ("... before the current process has
    finished its bootstrapping phase") when a process is started while the main
    module is being imported again in a spawned child. That child can do nothing
    useful: it exits with code 1 and one line naming the fix (SystemExit prints its
    message and no traceback), and the consumer's WorkerDiedError says the same.
    """
    try:
        process.start()
    except RuntimeError as e:
        if "bootstrapping phase" not in str(e):
            raise
        raise SystemExit(
            "grain_replay: a loader worker was started while the main script was being "
            f"imported again by a spawned worker. {GUARD_FIX}"
        ) from e


def main_guard_missing() -> bool:
    """True if ``__main__`` is a Python file with no top-level ``if __name__ == "__main__":``."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not isinstance(path, str) or not path.endswith(".py"):
        return False  # an interactive session, a notebook, python -c: nothing is re-imported
    try:
        with open(path, encoding="utf-8") as f:
            module = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return False
    return not any(isinstance(node, ast.If) and _is_main_test(node.test) for node in module.body)


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    values = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and values == ["__main__"]
