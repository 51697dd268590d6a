"""N5 volumes through tensorstore's ``n5`` driver.

Axis order.  N5 lists dimensions fastest-first: ``attributes.json`` holds
``dimensions`` and ``blockSize`` as (x, y, z[, c]) and a block stores x
fastest.  tensorstore's ``n5`` driver exposes the axes in that on-disk order
(its domain is ``[0, X), [0, Y), [0, Z)``), so :class:`N5Volume` reverses
them and presents (z, y, x) or (c, z, y, x), as z5py and zarr's N5 store do;
on disk the channel axis is therefore the last, slowest one.  Voxel sizes
follow the same rule: ``resolution`` (or ``pixelResolution``) is read as
(x, y, z) and returned as (z, y, x).

New datasets (:func:`create`):

* compression: ``zstd`` (the default) is written as **blosc with zstd inside**
  (level 5, byte shuffle).  tensorstore can write N5's ``zstd`` compression
  type, but that is an extension (n5-zstandard) most N5 readers lack, while
  blosc is read by n5-blosc (Fiji), z5py, zarr and tensorstore alike.
  ``gzip`` is gzip at zlib's default level, ``blosc`` is blosc lz4 (level 5,
  byte shuffle), ``raw`` is none.
* N5 has no float16 and no fill value (missing blocks read as 0).
* a new container gets the root ``attributes.json`` ``{"n5": "2.5.1"}``.

Writes to disjoint, block-aligned boxes touch disjoint block files, so
threads may write at once.

On an object store (``s3://bucket/vol.n5/raw``) ``attributes.json`` is read
and written as an object (:mod:`.stores`), a dataset is removed by deleting
the objects below its prefix, and error messages list no datasets.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import tensorstore as ts

from ..errors import InputNotFoundError, InvalidOptionError, InvalidVolumeError
from . import metadata, stores
from .base import NewVolume, VolumePath, make_room, spatial_voxel_size
from .metadata import N5_FILES, UnreadableMetadataError
from .stores import ObjectUrl
from .tensorstore_io import TensorstoreVolume, context, kvstore, open_store

log = logging.getLogger(__name__)

N5_VERSION = "2.5.1"
_DATA_TYPES = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float32", "float64")
_COMPRESSION = {
    "zstd": {"type": "blosc", "cname": "zstd", "clevel": 5, "shuffle": 1, "blocksize": 0},
    "gzip": {"type": "gzip"},
    "blosc": {"type": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1, "blocksize": 0},
    "raw": {"type": "raw"},
}


class N5Volume(TensorstoreVolume):
    """An N5 dataset, presented as (z, y, x) or (c, z, y, x)."""

    parallel_writes = True
    async_writes = True

    def __init__(self, path: VolumePath, mode: str = "r"):
        super().__init__(path, mode)
        attributes = _dataset_attributes(path)
        try:
            on_disk = open_store(_spec(path), writable=self.writable)
        except ValueError as error:
            if "attributes.json" not in str(error):
                raise InvalidVolumeError(f"tensorstore could not open the N5 dataset {str(path)!r}: "
                                         f"{str(error).split(' [tensorstore_spec=', 1)[0]}") from error
            problem, fix = metadata.tensorstore_problem(error)
            raise metadata.metadata_error(str(path), _directory(path) / "attributes.json", problem, fix) from error
        # (x, y, z[, c]) on disk -> ([c,] z, y, x) for everyone else.
        self._store = on_disk.T
        self.shape = tuple(int(n) for n in self._store.shape)
        self.dtype = np.dtype(self._store.dtype.numpy_dtype)
        self.chunk_shape = tuple(int(n) for n in attributes["blockSize"][::-1])
        self.voxel_size = _voxel_size(attributes)
        log.debug("opened %r", self)


def open_volume(path: VolumePath, mode: str = "r") -> N5Volume:
    return N5Volume(path, mode)


def volume_exists(path: VolumePath) -> bool:
    """True when ``path`` is an N5 dataset (its attributes.json has ``dimensions``), or a node whose
    attributes.json is damaged and that holds no other (``overwrite`` replaces it)."""
    try:
        return _is_dataset(_directory(path))
    except UnreadableMetadataError:
        return metadata.other_nodes(_directory(path), N5_FILES) == []


def check_removable(path: VolumePath) -> bool:
    """True when ``path`` holds a dataset :func:`remove_volume` would remove; a group is refused, and so is a
    node whose attributes.json is damaged unless it holds no other."""
    directory = _directory(path)
    try:
        if path.is_remote:
            if _read_attributes(directory) is None:
                return False
        elif not directory.exists():
            return False
        dataset = _is_dataset(directory)
    except UnreadableMetadataError as error:
        metadata.check_removable(str(path), directory, error, N5_FILES, "N5")
        return True
    if not dataset:
        raise InvalidOptionError(
            f"{str(path)!r} is an N5 group, not a dataset; blockpred removes one dataset at a time, "
            f"name one of: {_list_datasets(directory)}"
        )
    return True


def remove_volume(path: VolumePath) -> None:
    """Remove the dataset at ``path`` (its directory); nothing when none is there (see :func:`check_removable`)."""
    if not check_removable(path):
        return
    stores.remove_tree(_directory(path))  # on a store: the dataset's objects only (keys below "vol.n5/dataset/")
    log.info("removed N5 dataset %s", path)


def create_volume(path: VolumePath, new: NewVolume) -> N5Volume:
    """Create the dataset at ``path`` (see the module docstring) and open it ``r+``."""
    if not path.dataset:
        raise InvalidOptionError(
            f"an N5 output needs a dataset inside the container, got {str(path)!r}; "
            f"name one, e.g. {str(path.sibling('prediction'))!r}"
        )
    if new.dtype == np.float16:
        raise InvalidOptionError("N5 has no float16 data type; write float32 (or uint8) to N5, or use zarr")
    if new.dtype.name not in _DATA_TYPES:
        raise InvalidOptionError(f"N5 data types are {', '.join(_DATA_TYPES)}; got {new.dtype}")
    if new.fill_value not in (0, None):
        raise InvalidOptionError(f"N5 has no fill value (missing blocks read as 0); got fill_value={new.fill_value!r}")
    directory = _directory(path)
    make_room(path, new, (_read_attributes(directory) is not None) if path.is_remote else directory.exists(),
              remove_volume)
    _ensure_container(path.container)
    metadata = {
        "dimensions": list(new.shape[::-1]),
        "blockSize": list(new.chunk_shape[::-1]),
        "dataType": new.dtype.name,
        "compression": _COMPRESSION[new.compression],
    }
    if new.voxel_size is not None:
        metadata["resolution"] = [float(v) for v in new.voxel_size[::-1]] + [1.0] * (len(new.shape) - 3)
    ts.open({**_spec(path), "metadata": metadata}, create=True, context=context()).result()
    log.info("created N5 dataset %s shape=%s chunks=%s dtype=%s", path, new.shape, new.chunk_shape, new.dtype)
    return N5Volume(path, "r+")


def _spec(path: VolumePath) -> dict:
    return {"driver": "n5", "kvstore": kvstore(path, path.dataset)}


def _directory(path: VolumePath) -> Path | ObjectUrl:
    return path.container / path.dataset if path.dataset else path.container


def _read_attributes(directory: Path | ObjectUrl) -> dict | None:
    """``directory``'s attributes.json, None when there is none; raises :class:`UnreadableMetadataError` for one
    that is no JSON object."""
    file = directory / "attributes.json"
    raw = metadata.read(file)
    return None if raw is None else metadata.parse_object(raw, str(directory), file)


def _is_dataset(directory: Path) -> bool:
    attributes = _read_attributes(directory)
    return attributes is not None and "dimensions" in attributes


def _dataset_attributes(path: VolumePath) -> dict:
    if not path.is_remote and not path.container.is_dir():
        raise InputNotFoundError(f"no N5 container at {str(path.container)!r}; check the path")
    attributes = _read_attributes(_directory(path))
    if attributes is None and path.is_remote and not stores.bucket_exists(path.container):
        raise InputNotFoundError(f"no bucket {path.container.bucket!r} for {str(path)!r}; check the URL and the endpoint")
    if attributes is None or "dimensions" not in attributes:
        where = f"dataset {path.dataset!r} in {str(path.container)!r}" if path.dataset else f"dataset at {str(path)!r}"
        raise InputNotFoundError(f"no {where}; it has: {_list_datasets(path.container)}")
    if "blockSize" not in attributes:
        raise metadata.metadata_error(str(path), _directory(path) / "attributes.json", "lacks the key 'blockSize'")
    return attributes


def _voxel_size(attributes: dict) -> tuple[float, ...] | None:
    value = attributes.get("resolution")
    if value is None:
        value = attributes.get("pixelResolution")
        if isinstance(value, dict):  # {"dimensions": [x, y, z], "unit": "um"}
            value = value.get("dimensions")
    return None if value is None else spatial_voxel_size(value, reverse=True)


def _ensure_container(container: Path | ObjectUrl) -> None:
    if isinstance(container, ObjectUrl):
        if stores.read_bytes(container / "attributes.json") is None:
            stores.write_bytes(container / "attributes.json", json.dumps({"n5": N5_VERSION}).encode())
        return
    container.mkdir(parents=True, exist_ok=True)
    root = container / "attributes.json"
    if not root.exists():
        root.write_text(json.dumps({"n5": N5_VERSION}))


def _list_datasets(container: Path | ObjectUrl, max_depth: int = 4) -> list[str] | str:
    """Dataset paths below ``container``, for error messages.

    Never descends into a dataset (its subfolders are block folders) nor
    deeper than ``max_depth`` levels.  On an object store, a sentence instead:
    listing there lists every block.
    """
    if isinstance(container, ObjectUrl):
        return "(not listed on an object store; list it with your S3 client)"
    found: list[str] = []

    def walk(directory: Path, depth: int) -> None:
        name = os.path.relpath(directory, container).replace(os.sep, "/")
        try:
            dataset = _is_dataset(directory)
        except UnreadableMetadataError:  # named, not fatal; below a damaged container's root, the search goes on
            if depth:
                found.append(f"{name} (unreadable attributes.json)")
                return
            dataset = False
        if dataset:
            found.append(name)
            return
        if depth >= max_depth:
            return
        for child in sorted(p for p in directory.iterdir() if p.is_dir()):
            walk(child, depth + 1)

    if container.is_dir():
        walk(container, 0)
    return found
