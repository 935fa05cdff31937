"""HDF5 references out of the store: external links, virtual datasets, external raw storage."""

from __future__ import annotations

import logging
import os
from typing import Any

from grain_replay.errors import InvalidStoreError, ReferenceRefusedError
from grain_replay.store.optional import import_h5py

__all__ = [
    "check_dataset_refs",
    "check_link_path",
    "foreign_datasets",
    "is_own_file",
    "refuse",
    "ReferenceRefusedError",
]

logger = logging.getLogger(__name__)

# Soft links pointing at soft links: deeper chains than this are refused (a cycle).
_MAX_SOFT_DEPTH = 16

_FIX = (
    "A store from elsewhere could read any file on this machine this way. Fix: pass "
    "allow_external=True if you trust it, or copy the data into the file."
)


def refuse(path: str, key: str, what: str) -> InvalidStoreError:
    return ReferenceRefusedError(f"{path}: leaf {key!r} {what}, outside the store. {_FIX}")


def check_link_path(f: Any, path: str, key: str, loc: str, *, _depth: int = 0) -> None:
    """Refuses ``loc`` if it, or a group on the way to it, is an external link.

    Each link is inspected with ``getlink=True`` before anything behind it is
    opened, so an external file (or a FIFO named by a link) is never touched.
    Soft links are followed by checking their target path the same way.
    """
    h5py = import_h5py()
    if _depth > _MAX_SOFT_DEPTH:
        raise InvalidStoreError(
            f"{path}: leaf {key!r}: more than {_MAX_SOFT_DEPTH} soft links lead to {loc!r} "
            "(a cycle?). The file is corrupt; re-create it."
        )
    cur = ""
    for part in loc.strip("/").split("/"):
        cur = f"{cur}/{part}"
        link = f.get(cur, getlink=True)
        if link is None:
            return  # missing: the caller reports it
        if isinstance(link, h5py.ExternalLink):
            raise refuse(
                path, key, f"is reached through an HDF5 external link {cur!r} -> "
                f"{link.filename}:{link.path}",
            )  # fmt: skip
        if isinstance(link, h5py.SoftLink):
            target = link.path
            if not target.startswith("/"):
                target = f"{cur.rsplit('/', 1)[0]}/{target}"
            check_link_path(f, path, key, target, _depth=_depth + 1)


def check_dataset_refs(dset: Any, path: str, key: str) -> None:
    """Refuses a virtual dataset or one whose raw data lives in external files."""
    if getattr(dset, "is_virtual", False):
        sources = sorted({vds.file_name for vds in dset.virtual_sources()})
        raise refuse(path, key, f"is an HDF5 virtual dataset reading {', '.join(sources)}")
    if dset.external:
        files = sorted({os.fsdecode(name) for name, _, _ in dset.external})
        raise refuse(path, key, f"stores its raw data in external files {', '.join(files)}")


def is_own_file(dset: Any, path: str) -> bool:
    """True if ``dset`` lives in the file at ``path`` itself (not behind an external link)."""
    try:
        return os.path.samefile(dset.file.filename, path)
    except OSError:
        return False


def foreign_datasets(f: Any, allow_external: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every dataset of a file written by others, and the external links not followed.

    ``visititems`` does not traverse external links, so links are walked too.
    With ``allow_external`` the dataset or group a link points to is read as
    if it were here (links inside a linked group are not followed further);
    otherwise nothing behind the link is opened and it is returned in
    ``links`` (``{name: h5py.ExternalLink}``) for the caller to refuse.

    Returns:
      ``(datasets, links)``, both keyed by path inside the file.
    """
    h5py = import_h5py()
    found: dict[str, Any] = {}
    links: dict[str, Any] = {}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            found[name] = obj

    def visit_link(name: str, link: Any) -> None:
        if isinstance(link, h5py.ExternalLink):
            links[name] = link

    f.visititems(visit)
    f.visititems_links(visit_link)
    if not allow_external:
        return found, links
    for name in links:
        obj = f.get(name)
        if isinstance(obj, h5py.Dataset):
            found[name] = obj
        elif isinstance(obj, h5py.Group):
            obj.visititems(lambda n, o, name=name: visit(f"{name}/{n}", o))
        else:
            logger.warning("external link %r of %s leads nowhere; skipped", name, f.filename)
    return found, {}
