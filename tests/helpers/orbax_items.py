"""Saving and restoring an iterator as one Orbax item through grain's checkpoint handler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grain


def save_item(it: Any, directory: Path, step: int) -> None:
    """``CheckpointSave(it)`` as the item ``data`` of step ``step`` under ``directory``."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(directory, item_names=("data",)) as mgr:
        mgr.save(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        mgr.wait_until_finished()


def restore_item(it: Any, directory: Path, step: int) -> None:
    """``CheckpointRestore(it)`` of what :func:`save_item` saved; restores ``it`` in place."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(directory, item_names=("data",)) as mgr:
        restored = mgr.restore(
            step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(it))
        )
    assert restored["data"] is it
