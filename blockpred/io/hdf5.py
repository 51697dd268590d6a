"""HDF5 volumes through h5py, e.g. ``file.h5:/raw``.

Every volume borrows its file's one handle from :data:`~blockpred.io.hdf5_files.OPEN_FILES` (see
:mod:`.hdf5_files`: the input and the output may be datasets of one file; the writer lock; SWMR; durable
writes), so every HDF5 call runs under the registry's lock.  h5py allows no concurrent writers, so
``parallel_writes`` is False.  A write returns a future that completes once the data is durable: the file
flushed and fsynced, in groups (:meth:`HDF5Volume.write_async`).

New datasets (:func:`create`):

* a new file is made in HDF5 1.10's format (superblock 3), which SWMR needs: HDF5 1.10 (2016) and newer read
  it, 1.8 does not.
* compression: HDF5 has no built-in zstd, so ``zstd`` (the default) is
  written as **gzip level 1** (fast, most of gzip's ratio); ``gzip`` is gzip
  level 4 (h5py's default); both add the byte shuffle filter for multi-byte
  types.  ``raw`` is none.  ``blosc`` needs a plugin and is refused.
* chunks larger than the dataset are clipped to it (HDF5 requires that).
* the voxel size is stored in the attribute ``resolution`` (z, y, x).

A contiguous (unchunked) dataset reports its whole shape as ``chunk_shape``.
Removing a dataset does not shrink the file (HDF5 never reclaims space).
"""

from __future__ import annotations

import logging
import os
import weakref
from concurrent.futures import Future

import h5py
import numpy as np

from ..errors import InputNotFoundError, InvalidOptionError
from .base import NewVolume, Volume, VolumePath, make_room, spatial_voxel_size
from .hdf5_files import OPEN_FILES

log = logging.getLogger(__name__)

_COMPRESSION = {
    "zstd": {"compression": "gzip", "compression_opts": 1},
    "gzip": {"compression": "gzip", "compression_opts": 4},
    "raw": {},
}


class HDF5Volume(Volume):
    """A dataset in an HDF5 file."""

    parallel_writes = False

    def __init__(self, path: VolumePath, mode: str = "r"):
        super().__init__(path, mode)
        if not path.container.is_file():
            raise InputNotFoundError(f"no HDF5 file at {str(path.container)!r}; check the path")
        self._key = _key(path)
        OPEN_FILES.acquire(self._key, "write" if self.writable else "read")
        self._release = weakref.finalize(self, OPEN_FILES.release, self._key)
        try:
            with OPEN_FILES.lock:
                dataset = self._dataset()
                self.shape = tuple(dataset.shape)
                self.dtype = np.dtype(dataset.dtype)
                self.chunk_shape = tuple(dataset.chunks or dataset.shape)
                attrs = dataset.attrs
                resolution = attrs.get("resolution", attrs.get("element_size_um"))
                self.voxel_size = None if resolution is None else spatial_voxel_size(resolution)
        except BaseException:
            self._release()
            raise
        log.debug("opened %r", self)

    def _dataset(self) -> h5py.Dataset:
        handle = OPEN_FILES.file(self._key, "read")
        node = handle.get(self.path.dataset) if self.path.dataset else None
        if not isinstance(node, h5py.Dataset):
            if not self.path.dataset:
                raise InputNotFoundError(
                    f"an HDF5 path must name a dataset, as '{self.path.container}:/<dataset>'; "
                    f"{str(self.path.container)!r} has: {_list_datasets(handle)}"
                )
            raise InputNotFoundError(
                f"no dataset {self.path.dataset!r} in {str(self.path.container)!r}; it has: {_list_datasets(handle)}"
            )
        return node

    def _read(self, index: tuple[slice, ...]) -> np.ndarray:
        with OPEN_FILES.lock:
            return self._dataset()[index]

    def _write(self, index: tuple[slice, ...], data: np.ndarray) -> None:
        self._write_async(index, data).result()

    def _write_async(self, index: tuple[slice, ...], data: np.ndarray) -> Future:
        """Write into HDF5's caches now; the future completes once a flush and an fsync of the file made it
        durable (or fails with their error: see :mod:`.hdf5_files`)."""
        with OPEN_FILES.lock:
            writer = OPEN_FILES.writer(self._key)
            writer.check()
            try:
                self._dataset()[index] = data
            except OSError as error:  # HDF5's state after a failed write is not to be trusted
                writer.failed = error
                raise
            return writer.commit(OPEN_FILES.lock)

    def close(self) -> None:
        """Give the file back to the registry, which closes it after its last user."""
        self._release()


def open_volume(path: VolumePath, mode: str = "r") -> HDF5Volume:
    return HDF5Volume(path, mode)


def volume_exists(path: VolumePath) -> bool:
    """True when ``path`` names a dataset of an existing HDF5 file."""
    if not path.dataset or not path.container.is_file():
        return False
    with OPEN_FILES.borrowed(_key(path), "read") as handle:
        return isinstance(handle.get(path.dataset), h5py.Dataset)


def remove_volume(path: VolumePath) -> None:
    """Delete the dataset at ``path``; nothing when none is there.  The file stays."""
    if not path.dataset:
        raise InvalidOptionError(
            f"blockpred removes one dataset of an HDF5 file, never the file; name it, as '{path.container}:/<dataset>'"
        )
    if not path.container.is_file():
        return
    with OPEN_FILES.borrowed(_key(path), "change") as handle:
        _remove(handle, path)


def create_volume(path: VolumePath, new: NewVolume) -> HDF5Volume:
    """Create the dataset at ``path`` (see the module docstring) and open it ``r+``."""
    if not path.dataset:
        raise InvalidOptionError(
            f"an HDF5 output needs a dataset name, got {str(path)!r}; write e.g. '{path.container}:/prediction'"
        )
    if new.compression not in _COMPRESSION:
        raise InvalidOptionError(
            f"HDF5 output supports compression zstd (written as gzip level 1), gzip or raw; got {new.compression!r}"
        )
    path.container.parent.mkdir(parents=True, exist_ok=True)
    with OPEN_FILES.borrowed(_key(path), "change") as handle:
        make_room(path, new, path.dataset in handle, lambda _: _remove(handle, path))
        dataset = handle.create_dataset(
            path.dataset,
            shape=new.shape,
            dtype=new.dtype,
            chunks=tuple(min(c, s) for c, s in zip(new.chunk_shape, new.shape)),
            fillvalue=new.fill_value,
            shuffle=bool(_COMPRESSION[new.compression]) and new.dtype.itemsize > 1,
            **_COMPRESSION[new.compression],
        )
        if new.voxel_size is not None:
            dataset.attrs["resolution"] = np.asarray(new.voxel_size, dtype=np.float64)
        log.info("created HDF5 dataset %s shape=%s chunks=%s dtype=%s", path, new.shape, dataset.chunks, new.dtype)
        return HDF5Volume(path, "r+")


#: (st_dev, st_ino) of each HDF5 file opened in this process -> the name it is opened under.
_NAMES: dict[tuple[int, int], str] = {}


def _key(path: VolumePath) -> str:
    """The registry key of the file: one per file, whichever name (symlink, hard link, mount) reaches it."""
    name = str(path.container.resolve())
    try:
        info = os.stat(name)
    except OSError:
        return name
    return _NAMES.setdefault((info.st_dev, info.st_ino), name)


def _remove(handle: h5py.File, path: VolumePath) -> None:
    node = handle.get(path.dataset)
    if node is None:
        return
    if isinstance(node, h5py.Group) and len(node):
        raise InvalidOptionError(
            f"{str(path)!r} is an HDF5 group holding {_list_datasets(node)}; "
            f"blockpred removes one dataset at a time, name one of them"
        )
    del handle[path.dataset]
    log.info("removed HDF5 dataset %s", path)


def _list_datasets(group: h5py.Group) -> list[str]:
    found: list[str] = []
    group.visititems(lambda name, node: found.append(name) if isinstance(node, h5py.Dataset) else None)
    return sorted(found)
