"""Open, create and remove volumes; the backend is chosen by the path.

* ``vol.zarr[/path/in/group]`` -> :mod:`blockpred.io.zarr` (zarr formats 2 and 3, OME-NGFF images)
* ``vol.n5/dataset``           -> :mod:`blockpred.io.n5` (tensorstore; axes presented as (c,) z, y, x)
* ``file.h5:/dataset``         -> :mod:`blockpred.io.hdf5` (h5py; one shared handle per file)
* ``precomputed://DIR[#scale=KEY]`` (or ``DIR/info``) -> :mod:`blockpred.io.precomputed`
  (tensorstore; neuroglancer precomputed, axes presented as (c,) z, y, x)
* ``stack.tif`` (``.tiff``, ``.ome.tif``) or a folder of ``.tif``/``.tiff``/``.png``
  slices -> :mod:`blockpred.io.tiff` (tifffile, imagecodecs; read-only: inputs only)

Backends are imported on first use, so opening an HDF5 file never imports
tensorstore.
"""

from __future__ import annotations

import importlib
import os
import uuid
from pathlib import Path
from types import ModuleType

import numpy as np

from ..errors import InvalidOptionError
from .base import (
    SUPPORTED_INPUT_DTYPES,
    SUPPORTED_OUTPUT_DTYPES,
    NewVolume,
    Volume,
    VolumePath,
    check_input_volume,
    check_storage_options,
    parse_volume_path,
)

__all__ = [
    "COMPRESSIONS",
    "SUPPORTED_INPUT_DTYPES",
    "SUPPORTED_OUTPUT_DTYPES",
    "Volume",
    "VolumePath",
    "check_input_volume",
    "check_storage_options",
    "move_aside",
    "moved_aside",
    "create_volume",
    "open_volume",
    "parse_volume_path",
    "remove_volume",
    "supports_sharding",
    "volume_exists",
]

#: Compression names every backend accepts; each backend's docstring says what it writes.
COMPRESSIONS = ("zstd", "gzip", "blosc", "raw")


def open_volume(path: str | Path | VolumePath, mode: str = "r") -> Volume:
    """Open an existing volume for reading (``mode="r"``) or reading and writing (``"r+"``).

    Any array opens; :func:`check_input_volume` says whether blockpred can
    predict it.  An array of two axes (y, x) opens as (z, y, x) one plane deep.  Raises :class:`InputNotFoundError` naming the missing
    container or dataset.
    """
    if mode not in ("r", "r+"):
        raise InvalidOptionError(f"mode must be 'r' or 'r+', got {mode!r}")
    vpath = _as_path(path)
    volume = _backend(vpath).open_volume(vpath, mode)
    if volume.ndim == 2:  # a 2D image: a volume one plane deep
        from .planar import PlanarVolume

        return PlanarVolume(volume)
    return volume


def create_volume(
    path: str | Path | VolumePath,
    *,
    spatial_shape,
    num_channels: int | None,
    dtype,
    chunk_shape,
    compression: str | None = "zstd",
    voxel_size=None,
    overwrite: bool = False,
    zarr_format: int | None = None,
    ome: bool = True,
    fill_value=0,
    shard_shape=None,
) -> Volume:
    """Create a (z, y, x) volume, or (c, z, y, x) when ``num_channels`` is given, and open it ``"r+"``.

    ``chunk_shape`` is spatial (z, y, x); the channel axis is one chunk.
    ``compression`` is ``"zstd"`` (default), ``"gzip"``, ``"blosc"`` or
    ``"raw"``/None; N5 writes zstd as blosc-zstd and HDF5 as gzip level 1
    (see :mod:`.n5`, :mod:`.hdf5`).  ``voxel_size`` is (z, y, x), default
    none (OME-NGFF images then get scale 1).  An existing volume at the path
    raises :class:`OutputExistsError` unless ``overwrite``, which removes it
    first (only it, see :func:`remove_volume`).

    zarr only: ``zarr_format`` (2 or 3) for a new container, default 3 (a
    dataset in an existing container takes the container's format);
    ``ome=True`` writes an OME-NGFF image group holding the array ``0``,
    ``ome=False`` a plain array at the path.  Both are ignored for N5 and HDF5.
    ``shard_shape`` (z, y, x; zarr v3 only, see :func:`supports_sharding`)
    puts the chunks into shards of that shape, a multiple of ``chunk_shape``.
    """
    vpath = _as_path(path)
    spatial = _positive_ints(spatial_shape, "spatial_shape")
    chunks = _positive_ints(chunk_shape, "chunk_shape")
    if num_channels is not None and not (_is_int(num_channels) and num_channels >= 1):
        raise InvalidOptionError(f"num_channels must be None or an int >= 1, got {num_channels!r}")
    lead = () if num_channels is None else (num_channels,)
    name = "raw" if compression is None else str(compression).lower()
    if name not in COMPRESSIONS:
        raise InvalidOptionError(f"compression must be one of {', '.join(COMPRESSIONS)} or None, got {compression!r}")
    if zarr_format not in (None, 2, 3):
        raise InvalidOptionError(f"zarr_format must be 2, 3 or None, got {zarr_format!r}")
    try:
        dtype = np.dtype(dtype)
    except TypeError as error:
        raise InvalidOptionError(f"dtype must be a numpy data type, got {dtype!r}") from error
    voxel = None
    if voxel_size is not None:
        voxel = tuple(float(v) for v in voxel_size)
        if len(voxel) != 3 or not all(v > 0 for v in voxel):
            raise InvalidOptionError(f"voxel_size must be 3 positive numbers (z, y, x), got {voxel_size!r}")
    extra = {"zarr_format": zarr_format, "ome": ome} if vpath.format == "zarr" else {}
    if shard_shape is not None:
        shards = _positive_ints(shard_shape, "shard_shape")
        if not supports_sharding(vpath, zarr_format):
            raise InvalidOptionError(f"shards need a zarr v3 array, but {str(vpath)!r} is not one; drop shard_shape")
        if any(s % c for s, c in zip(shards, chunks)):
            raise InvalidOptionError(f"shard_shape {shards} must be a multiple of chunk_shape {chunks}")
        extra["shard_shape"] = lead + shards
    new = NewVolume(shape=lead + spatial, chunk_shape=lead + chunks, dtype=dtype, compression=name, voxel_size=voxel,
                    fill_value=fill_value, overwrite=overwrite)
    return _backend(vpath).create_volume(vpath, new, **extra)


def supports_sharding(path: str | Path | VolumePath, zarr_format: int | None = None) -> bool:
    """True when a volume created at ``path`` can be sharded: zarr format 3 (a new container's default)."""
    vpath = _as_path(path)
    if vpath.format != "zarr":
        return False
    return _backend(vpath).container_format(vpath, zarr_format) == 3


def volume_exists(path: str | Path | VolumePath) -> bool:
    """True when ``path`` holds a volume :func:`open_volume` can open."""
    vpath = _as_path(path)
    return _backend(vpath).volume_exists(vpath)


def remove_volume(path: str | Path | VolumePath) -> None:
    """Remove exactly the dataset at ``path`` (or the OME-NGFF image group it is).

    The container's other datasets stay; nothing happens when nothing is
    there.  A group holding datasets is refused with :class:`InvalidOptionError`.
    """
    vpath = _as_path(path)
    _backend(vpath).remove_volume(vpath)


#: What a volume moved aside for deletion is named: ``.NAME.deleting-TOKEN`` beside it.
_ASIDE = ".{name}.deleting-{token}"


def move_aside(path: str | Path | VolumePath) -> Path | None:
    """Take the volume at ``path`` out of its place in one rename, to be deleted there; None if none is there.

    A local zarr, N5 or precomputed volume is one directory: renamed to
    ``.NAME.deleting-TOKEN`` beside it, it leaves its place at once, whole,
    and a deletion cut short (a kill, a refused permission) leaves nothing at
    the path.  Raises :class:`NotImplementedError` for what has no directory
    of its own (an HDF5 dataset, an object store): remove those in place.
    The same refusals as :func:`remove_volume` apply (a group of datasets, a
    scale, anything TIFF: blockpred never removes a TIFF input).
    """
    vpath = _as_path(path)
    if vpath.is_remote or vpath.format == "hdf5":
        raise NotImplementedError(f"{vpath} cannot be moved aside; remove it in place")
    if not _backend(vpath).check_removable(vpath):
        return None
    from .identity import data_node

    node = data_node(vpath)
    aside = node.with_name(_ASIDE.format(name=node.name, token=uuid.uuid4().hex[:12]))
    os.rename(node, aside)
    return aside


def moved_aside(path: str | Path | VolumePath) -> list[Path]:
    """What earlier deletions of the volume at ``path`` moved aside and did not finish deleting."""
    vpath = _as_path(path)
    if vpath.is_remote or vpath.format in ("hdf5", "tiff"):  # never moved aside (a TIFF is never removed)
        return []
    from .identity import data_node

    node = data_node(vpath)
    pattern = _ASIDE.format(name=node.name, token="*")
    return sorted(node.parent.glob(pattern)) if node.parent.is_dir() else []


def _as_path(path: str | Path | VolumePath) -> VolumePath:
    return path if isinstance(path, VolumePath) else parse_volume_path(path)


def _backend(path: VolumePath) -> ModuleType:
    return importlib.import_module(f".{path.format}", __name__)


def _positive_ints(values, name: str) -> tuple[int, ...]:
    try:
        items = tuple(values)
    except TypeError:
        items = ()
    if len(items) != 3 or not all(_is_int(v) and v > 0 for v in items):
        raise InvalidOptionError(f"{name} must be 3 positive ints (z, y, x), got {values!r}")
    return tuple(int(v) for v in items)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
