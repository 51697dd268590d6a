"""Durable local writes: data and names that a crash of the machine does not take.

A write that returned is in the page cache, not on the disk: a power cut or a
kernel panic can lose it, or leave a file renamed into place but empty (a
``zarr.json`` that is no longer JSON).  Process kills cannot show this; only a
crash of the machine can.  What must survive one:

* the output's metadata and a run's markers group, before a block is marked:
  without them a finished block's data cannot be found again, and the next
  run refuses an output it cannot read;
* a block's data, before its mark (tensorstore's commit fsyncs; HDF5 flushes
  and fsyncs; what zarr-python writes goes through :class:`DurableLocalStore`);
* the marks themselves at the end of a job, so a run that said it finished
  is found finished.

A new file's *name* is durable once its directory is fsynced, and a new
directory's once its parent is: :func:`sync_path` does both, up to a root.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from zarr.core.buffer import Buffer
from zarr.storage import LocalStore


def sync_file(path: str | Path) -> None:
    """fsync the file (or directory) at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_path(path: str | Path, root: str | Path) -> None:
    """Make ``path`` (``root`` or a file or directory below it) and its name durable: fsync it, then each
    directory from its parent up to ``root``, then ``root``'s parent (which holds ``root``'s name)."""
    path, root = Path(path), Path(root)
    path.relative_to(root)  # ValueError when path is not below root
    sync_file(path)
    directory = path
    while directory != root:
        directory = directory.parent
        sync_file(directory)
    sync_file(root.parent)


class DurableLocalStore(LocalStore):
    """zarr-python's ``LocalStore``, whose writes return only once the file and its name are durable.

    zarr-python writes a key to a temporary file and renames it into place,
    without an fsync: after a crash of the machine the key may be missing, or
    present and empty.  Here each ``set`` then fsyncs the file and the
    directories up to the store's root.  Metadata writes are few; chunks go
    through here only where tensorstore cannot write the array.
    """

    async def set(self, key: str, value: Buffer) -> None:
        await super().set(key, value)
        await asyncio.to_thread(sync_path, self.root / key, self.root)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        await super().set_if_not_exists(key, value)
        await asyncio.to_thread(sync_path, self.root / key, self.root)
