"""zarr volumes (formats 2 and 3) through zarr-python 3.

A path names either an array (``vol.zarr``, ``vol.zarr/path/in/group``) or
an OME-NGFF image group, whose first scale (``datasets[0].path``) is opened
and whose ``scale`` transformation gives the voxel size.  A plain array takes
its voxel size from the attribute ``resolution`` (z, y, x) when it has one.

New volumes (:func:`create`):

* format: a new container is zarr format 3 unless ``zarr_format`` says 2; a
  dataset inside an existing container takes the container's format.
* ``ome=True`` makes the path an OME-NGFF image group (0.5 for format 3, 0.4
  for format 2, see :mod:`blockpred.io.ome`) holding the array ``<path>/0``;
  ``ome=False`` puts a plain array exactly at the path.
* compression: ``zstd`` level 3 (format 3: ``ZstdCodec``, format 2: numcodecs
  ``Zstd``), ``gzip`` level 5, ``blosc`` (lz4, level 5, byte shuffle), or
  ``raw`` (none).
* format 3 arrays carry ``dimension_names`` (``c``, ``z``, ``y``, ``x``).

Reads and writes go through tensorstore (driver ``zarr`` for format 2,
``zarr3`` for format 3, sharded arrays included; see :mod:`.tensorstore_io`);
zarr-python finds the array (OME-NGFF groups, paths, attributes) and creates
it.  An array tensorstore cannot open (a codec or filter it lacks) is read and
written through zarr-python instead, slower but the same values.  What
zarr-python writes (metadata, and those chunks) is fsynced with its
directories before the write returns (:class:`~.durable.DurableLocalStore`).

Writes to disjoint boxes aligned to :attr:`ZarrVolume.chunk_shape` (the shard
shape of a sharded array) touch disjoint files, so threads may write at once.

On an object store (``s3://bucket/vol.zarr/raw``) zarr-python works on a
:class:`~blockpred.io.kvzarr.KvZarrStore` (its metadata requests go through
tensorstore's kvstore, as the chunks do) instead of a ``LocalStore``; the
rest is the same.  Error messages there list no datasets: listing a prefix
of an object store lists every chunk below it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numcodecs
import numpy as np
import zarr
import zarr.codecs
import zarr.errors
from zarr.storage import LocalStore

from ..errors import (
    BlockpredError,
    InputNotFoundError,
    InvalidOptionError,
    InvalidVolumeError,
)
from ..geometry import Coord
from . import kvzarr, metadata, stores
from .base import NewVolume, Volume, VolumePath, make_room, spatial_voxel_size
from .durable import DurableLocalStore
from .metadata import PARSE_ERRORS, UnreadableMetadataError
from .ome import SCALE_PATH, axis_names, find_multiscales, first_scale, image_attributes
from .tensorstore_io import TensorstoreVolume, kvstore, open_store

log = logging.getLogger(__name__)

_NOT_FOUND = (FileNotFoundError, zarr.errors.NodeNotFoundError)


class ZarrVolume(TensorstoreVolume):
    """A zarr array, or the first scale of an OME-NGFF image group."""

    parallel_writes = True

    def __init__(self, path: VolumePath, mode: str = "r"):
        super().__init__(path, mode)
        self._array, self.voxel_size = _open_array(path, mode)
        self.shape = tuple(self._array.shape)
        self.dtype = np.dtype(self._array.dtype)
        # The shard is the unit a writer rewrites whole; without sharding it is the chunk.
        self.chunk_shape = tuple(self._array.shards or self._array.chunks)
        self.zarr_format: int = self._array.metadata.zarr_format
        self._store = _tensorstore(path, self._array, self.writable)
        self.async_writes = self._store is not None
        self.counts_missing_chunks = self._store is not None  # zarr-python reads missing chunks as the fill value
        log.debug("opened %r", self)

    def _read(self, index: tuple[slice, ...]) -> np.ndarray:
        if self._store is None:
            return self._array[index]
        return super()._read(index)

    def _write(self, index: tuple[slice, ...], data: np.ndarray) -> None:
        if self._store is None:
            self._array[index] = data
        else:
            super()._write(index, data)

    def _write_async(self, index: tuple[slice, ...], data: np.ndarray):
        if self._store is None:
            return Volume._write_async(self, index, data)
        return super()._write_async(index, data)


def _tensorstore(path: VolumePath, array: zarr.Array, writable: bool):
    """The array opened with tensorstore, or None when tensorstore cannot read it (zarr-python then does)."""
    spec = {
        "driver": "zarr3" if array.metadata.zarr_format == 3 else "zarr",
        "kvstore": kvstore(path, array.path),
    }
    try:
        return open_store(spec, writable=writable)
    except ValueError as error:
        log.info("tensorstore cannot open %s (%s); reading and writing it through zarr-python", path, error)
        return None


def open_volume(path: VolumePath, mode: str = "r") -> ZarrVolume:
    return ZarrVolume(path, mode)


def _store(path: VolumePath, *, read_only: bool = False):
    """The zarr-python store of ``path``'s container: a ``LocalStore`` (:class:`DurableLocalStore` to write: its
    writes survive a crash of the machine), or a ``KvZarrStore`` on an object store."""
    if path.is_remote:
        return kvzarr.zarr_store(path.container, read_only=read_only)
    if read_only:
        return LocalStore(path.container, read_only=True)
    return DurableLocalStore(path.container)


def _no_container(path: VolumePath) -> bool:
    """True when a local container is not a directory (on an object store there are no directories to check)."""
    return not path.is_remote and not path.container.is_dir()


def volume_exists(path: VolumePath) -> bool:
    """True when ``path`` holds an array or an OME-NGFF image group, or a node with damaged metadata that holds
    no other (:func:`open_volume` says what is wrong with it; ``overwrite`` replaces it)."""
    if _no_container(path):
        return False
    try:
        node = _node(_store(path, read_only=True), path.dataset)
    except UnreadableMetadataError:
        return metadata.other_nodes(_directory(path)) == []
    return node is not None and (isinstance(node, zarr.Array) or _is_image(node))


def check_removable(path: VolumePath) -> bool:
    """True when ``path`` holds an array or OME-NGFF image that :func:`remove_volume` would remove.

    False when nothing is there; a plain group holding arrays is refused,
    since removing it would remove several datasets, and so is a node whose
    metadata is damaged unless it holds no other (see
    :func:`~blockpred.io.metadata.other_nodes`).
    """
    if _no_container(path):
        return False
    store = _store(path)
    try:
        node = _node(store, path.dataset)
    except UnreadableMetadataError as error:
        metadata.check_removable(str(path), _directory(path), error)
        return True
    if node is None:
        return False
    if isinstance(node, zarr.Group) and not _is_image(node) and _has_members(node):
        raise InvalidOptionError(
            f"{str(path)!r} is a zarr group holding {_list_volumes(store, path.dataset)}; "
            f"blockpred removes one array or OME-NGFF image at a time, name one of them"
        )
    return True


def _has_members(group: zarr.Group) -> bool:
    """True when ``group`` holds anything (a member whose metadata is damaged counts)."""
    try:
        return any(True for _ in group.members())
    except PARSE_ERRORS:
        return True


def remove_volume(path: VolumePath) -> None:
    """Remove the array or OME-NGFF image group at ``path``; nothing else (see :func:`check_removable`)."""
    if not check_removable(path):
        return
    if not path.dataset:
        stores.remove_tree(path.container)  # on a store: the container's objects only (keys below "vol.zarr/")
    else:
        parent, _, name = path.dataset.rpartition("/")
        del zarr.open_group(_store(path), path=parent, mode="r+")[name]
    log.info("removed zarr volume %s", path)


def create_volume(path: VolumePath, new: NewVolume, *, zarr_format: int | None, ome: bool,
                  shard_shape: tuple[int, ...] | None = None) -> ZarrVolume:
    """Create the volume at ``path`` (see the module docstring) and open it ``r+``."""
    fmt = container_format(path, zarr_format)
    store = _store(path)
    if path.dataset and isinstance(_node(store, ""), zarr.Array):
        raise InvalidOptionError(
            f"a dataset inside a zarr container needs a group at its root, but {str(path.container)!r} "
            f"is an array; write to a new container or remove that one"
        )
    if _node(store, path.dataset) is not None:
        make_room(path, new, True, remove_volume)
        store = _store(path)
    array_name = path.dataset
    attributes: dict = {}
    if ome:
        zarr.create_group(store, path=path.dataset, zarr_format=fmt,
                          attributes=image_attributes(len(new.shape), new.voxel_size, fmt))
        array_name = f"{path.dataset}/{SCALE_PATH}" if path.dataset else SCALE_PATH
    elif new.voxel_size is not None:
        attributes["resolution"] = list(new.voxel_size)
    zarr.create_array(
        store,
        name=array_name,
        shape=new.shape,
        chunks=new.chunk_shape,
        shards=shard_shape,
        dtype=new.dtype,
        compressors=_compressor(new.compression, fmt),
        fill_value=new.fill_value,
        zarr_format=fmt,
        dimension_names=axis_names(len(new.shape)) if fmt == 3 else None,
        attributes=attributes,
    )
    log.info("created zarr v%s volume %s shape=%s chunks=%s shards=%s dtype=%s", fmt, path, new.shape,
             new.chunk_shape, shard_shape, new.dtype)
    return ZarrVolume(path, "r+")


def _compressor(name: str, zarr_format: int):
    if name == "raw":
        return None
    if zarr_format == 3:
        return {
            "zstd": lambda: zarr.codecs.ZstdCodec(level=3),
            "gzip": lambda: zarr.codecs.GzipCodec(level=5),
            "blosc": lambda: zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),
        }[name]()
    return {
        "zstd": lambda: numcodecs.Zstd(level=3),
        "gzip": lambda: numcodecs.GZip(level=5),
        "blosc": lambda: numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE),
    }[name]()


def container_format(path: VolumePath, zarr_format: int | None = None) -> int:
    """The zarr format a new array at ``path`` gets: its container's, else ``zarr_format``, else 3."""
    existing_format = _container_format(path)
    if existing_format is not None and zarr_format is not None and zarr_format != existing_format:
        raise InvalidOptionError(
            f"zarr_format must match the existing container: {str(path.container)!r} is zarr format "
            f"{existing_format}, got zarr_format={zarr_format}; drop zarr_format or choose a new container"
        )
    return existing_format or zarr_format or 3


def _container_format(path: VolumePath) -> int | None:
    """The zarr format of the container's root node, or None when there is none."""
    if path.is_remote:
        if any(stores.read_bytes(path.container / name) is not None for name in (".zgroup", ".zarray")):
            return 2
    elif (path.container / ".zgroup").exists() or (path.container / ".zarray").exists():
        return 2
    root = path.container / "zarr.json"
    raw = metadata.read(root)
    if raw is None:
        return None
    try:
        value = metadata.parse_object(raw, str(path.container), root).get("zarr_format", 3)
        if value != 3:
            raise metadata.metadata_error(str(path.container), root, f"says zarr_format {value!r}, not 3")
    except UnreadableMetadataError:
        if path.dataset:
            raise
        return None  # the root is the volume at the path, damaged: nothing to keep (an overwrite replaces it)
    return value


def _node(store, dataset: str) -> zarr.Array | zarr.Group | None:
    """The array or group at ``dataset``, or None when there is neither.

    Metadata that does not parse (not JSON, wrong contents, a codec not
    installed) raises :class:`UnreadableMetadataError`, naming the file.
    """
    try:
        return zarr.open(store=store, path=dataset, mode="r" if store.read_only else "r+")
    except _NOT_FOUND:
        return None
    except BlockpredError:
        raise
    except PARSE_ERRORS as error:
        root = store.root if isinstance(store, LocalStore) else store.url
        directory = root / dataset if dataset else root
        found = metadata.unreadable(str(directory), directory, error)
        if found is None:
            raise
        raise found from error


def _directory(path: VolumePath):
    """The directory (or object-store prefix) of the node at ``path``."""
    return path.container / path.dataset if path.dataset else path.container


def _is_image(group: zarr.Group) -> bool:
    return find_multiscales(group.attrs.asdict()) is not None


def _open_array(path: VolumePath, mode: str) -> tuple[zarr.Array, tuple[float, ...] | None]:
    if _no_container(path):
        raise InputNotFoundError(f"no zarr container at {str(path.container)!r}; check the path")
    store = _store(path, read_only=mode == "r")
    node = _node(store, path.dataset)
    if node is None and path.is_remote and not stores.bucket_exists(path.container):
        raise InputNotFoundError(f"no bucket {path.container.bucket!r} for {str(path)!r}; check the URL and the endpoint")
    if node is None:
        if not path.dataset or (path.is_remote and _container_format(path) is None):
            raise InputNotFoundError(f"no zarr container at {str(path.container)!r}: it has no zarr metadata; "
                                     f"check the path")
        raise InputNotFoundError(
            f"no dataset {path.dataset!r} in {str(path.container)!r}; it has: {_list_volumes(store)}"
        )
    if isinstance(node, zarr.Array):
        return node, spatial_voxel_size(node.attrs.get("resolution"))
    multiscales = find_multiscales(node.attrs.asdict())
    if multiscales is None:
        raise InputNotFoundError(
            f"{str(path)!r} is a zarr group without OME-NGFF multiscales metadata; "
            f"name one of its arrays: {_list_volumes(store, path.dataset)}"
        )
    try:
        scale_path, voxel_size = first_scale(multiscales)
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise InvalidVolumeError(
            f"OME-NGFF metadata of {str(path)!r} must name a first dataset with a scale; "
            f"reading it failed: {error!r}"
        ) from error
    array = _node(store, f"{path.dataset}/{scale_path}" if path.dataset else scale_path)
    if not isinstance(array, zarr.Array):
        raise InvalidVolumeError(
            f"OME-NGFF image {str(path)!r} names its first scale {scale_path!r}, but no array is there; "
            f"repair or rewrite the image"
        )
    return array, voxel_size


def _list_volumes(store, under: str = "") -> list[str] | str:
    """Paths of the arrays and OME-NGFF images below ``under``, for error messages.

    On an object store, a sentence instead: listing there lists every chunk.
    """
    if not isinstance(store, LocalStore):
        return "(not listed on an object store; list it with your S3 client)"
    found: list[str] = []

    def walk(under: str) -> None:  # one node at a time, so that one with damaged metadata is named, not fatal
        directory = store.root / under if under else store.root
        for name in sorted(p.name for p in directory.iterdir() if p.is_dir()):
            path = f"{under}/{name}" if under else name
            try:
                node = _node(store, path)
            except UnreadableMetadataError as error:
                found.append(f"{path} (unreadable {error.file.name})")
                continue
            if isinstance(node, zarr.Array) or (node is not None and _is_image(node)):
                found.append(path)
            elif node is not None:
                walk(path)

    try:
        is_group = isinstance(_node(store, under), zarr.Group)
    except UnreadableMetadataError:
        is_group = True  # a group whose own metadata is damaged may still hold readable nodes
    if is_group:
        walk(under)
    return found


# ---------------------------------------------------------------------- image pyramids (blockpred.run.pyramid)


@dataclass(frozen=True)
class ImageLevels:
    """An OME-NGFF image group blockpred wrote: how many levels its metadata names, and level 0's layout."""

    num_levels: int
    shape: Coord
    voxel_size: tuple[float, ...] | None
    chunks: Coord
    #: None: level 0 is not sharded.
    shards: Coord | None
    #: Level 0's channels (None for a (z, y, x) array) and dtype: every level has them.
    num_channels: int | None
    dtype: np.dtype


def read_image_levels(image: VolumePath) -> ImageLevels:
    """The levels named by the image group at ``image`` and the layout of its array ``0``."""
    store = _store(image, read_only=True)
    group = _node(store, image.dataset)
    multiscales = find_multiscales(group.attrs.asdict()) if isinstance(group, zarr.Group) else None
    if multiscales is None:
        raise InvalidVolumeError(
            f"{str(image)!r} must be an OME-NGFF image group (blockpred writes one for a zarr output); "
            f"it is not one"
        )
    scale_path, voxel_size = first_scale(multiscales)
    array = _node(store, f"{image.dataset}/{scale_path}" if image.dataset else scale_path)
    if not isinstance(array, zarr.Array):
        raise InvalidVolumeError(f"OME-NGFF image {str(image)!r} names its first scale {scale_path!r}, but no array is there")
    shards = array.shards
    return ImageLevels(len(multiscales[0].get("datasets", [])), Coord(array.shape[-3:]), voxel_size,
                       Coord(array.chunks[-3:]), None if shards is None else Coord(shards[-3:]),
                       array.shape[0] if array.ndim == 4 else None, np.dtype(array.dtype))


def write_image_levels(image: VolumePath, scales: list, voxel_size: tuple[float, ...] | None,
                       centred: bool) -> None:
    """Name the levels ``0`` .. ``len(scales) - 1`` (factors from level 0) in the image group's metadata."""
    store = _store(image)
    group = zarr.open_group(store, path=image.dataset, mode="r+")
    base = _node(store, f"{image.dataset}/{SCALE_PATH}" if image.dataset else SCALE_PATH)
    fmt = group.metadata.zarr_format
    group.attrs.update(image_attributes(base.ndim, voxel_size, fmt, scales=[tuple(s) for s in scales],
                                        centred=centred))
