"""The one volume interface every backend implements, and path parsing.

A :class:`Volume` is a 3D array (z, y, x) with an optional leading channel
axis (c, z, y, x); a 2D image (y, x) opens as one plane deep (see :mod:`.planar`).  ``read`` and ``write`` take a *spatial* :class:`Box`; the
channel axis, when there is one, is always read and written whole.

Paths name a format by their shape (:func:`parse_volume_path`):

* ``vol.zarr`` or ``vol.zarr/path/in/group``  -> zarr (formats 2 and 3)
* ``vol.n5/dataset``                          -> N5 (through tensorstore)
* ``file.h5:/dataset`` (also ``.hdf5``, ``.hdf``) -> HDF5 (through h5py)
* ``precomputed://DIR``, ``DIR/info``, or a directory holding a precomputed
  ``info`` -> neuroglancer precomputed (through tensorstore); ``#scale=KEY``
  (or ``#scale=INDEX``) picks a scale, kept as the path's dataset
* ``stack.tif`` (also ``.tiff``, ``.ome.tif``), or a directory holding 2D
  slices (``.tif``, ``.tiff`` or ``.png`` files, one per z) and no zarr, N5 or
  precomputed volume -> TIFF (through tifffile; read-only, inputs only)

Any of these but HDF5 and TIFF may live on an object store: ``s3://bucket/path/vol.zarr/raw``,
``s3://bucket/vol.n5/raw``, ``precomputed://s3://bucket/em`` (``gs://`` alike).  The
container is then an :class:`~blockpred.io.stores.ObjectUrl` carrying the storage
options that reach it (see :mod:`blockpred.io.stores`).
"""

from __future__ import annotations

import abc
import json
import os
import re
from concurrent.futures import Future
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import numpy as np

from ..errors import InvalidOptionError, InvalidVolumeError, OutputExistsError
from ..geometry import Box, Coord
from .stores import ObjectUrl, StorageOptions, is_url, parse_url

Format = Literal["zarr", "n5", "hdf5", "precomputed", "tiff"]

#: Input dtypes blockpred can normalise and feed to a network.
SUPPORTED_INPUT_DTYPES = tuple(
    np.dtype(t) for t in ("uint8", "uint16", "uint32", "int8", "int16", "int32", "float16", "float32", "float64")
)
#: Output dtypes blockpred writes (uint8 is the prediction scaled from [0, 1] to 0-255).
SUPPORTED_OUTPUT_DTYPES = tuple(np.dtype(t) for t in ("float32", "float16", "uint8"))

_HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf")
_TIFF_SUFFIXES = (".tif", ".tiff")  # .ome.tif and .ome.tiff end in these too
#: The files a folder of 2D slices holds, one per z (see :mod:`.tiff`).
SLICE_SUFFIXES = (".tif", ".tiff", ".png")
PRECOMPUTED_SCHEME = "precomputed://"


@dataclass(frozen=True, slots=True)
class VolumePath:
    """Where a volume lives: its format, its container (a local path or an object-store URL), and the dataset inside."""

    format: Format
    container: Path | ObjectUrl
    dataset: str = ""

    @property
    def is_remote(self) -> bool:
        """True when the container is on an object store (``s3://``, ``gs://``)."""
        return isinstance(self.container, ObjectUrl)

    def absolute(self) -> "VolumePath":
        """The path as processes in other directories see it (a URL is already absolute)."""
        if self.is_remote:
            return self
        return VolumePath(self.format, Path(os.path.abspath(self.container)), self.dataset)

    def __str__(self) -> str:
        if self.format == "hdf5":
            return f"{self.container}:/{self.dataset}"
        if self.format == "precomputed":  # the dataset is a scale (key or index)
            return f"{PRECOMPUTED_SCHEME}{self.container}" + (f"#scale={self.dataset}" if self.dataset else "")
        return str(self.container / self.dataset) if self.dataset else str(self.container)

    def sibling(self, name: str) -> "VolumePath":
        """The dataset ``name`` beside this one in the same container."""
        parent = self.dataset.rsplit("/", 1)[0] if "/" in self.dataset else ""
        return VolumePath(self.format, self.container, f"{parent}/{name}" if parent else name)


def folder_format(path: Path) -> Format | None:
    """The format whose metadata a folder holds at its top -- ``zarr`` (v3 or v2, a group or an array) or ``n5`` --
    else None (no folder, or a plain one)."""
    if any((path / name).exists() for name in ("zarr.json", ".zarray", ".zgroup")):
        return "zarr"
    if (path / "attributes.json").exists():
        return "n5"
    return None


def parse_volume_path(text: str | Path | VolumePath, storage_options=None) -> VolumePath:
    """Split a user's path into format, container and dataset (a :class:`VolumePath` is that already: returned
    as it is).

    ``storage_options`` (a :class:`StorageOptions`, a mapping or ``KEY=VALUE``
    strings) go with an object-store URL's container; a local path ignores them.
    Raises :class:`InvalidOptionError` when no format can be told from the path.
    """
    if isinstance(text, VolumePath):
        return text
    text = str(text)
    options = StorageOptions.parse(storage_options)
    if text.startswith(PRECOMPUTED_SCHEME):
        return _precomputed_path(text[len(PRECOMPUTED_SCHEME) :], text, options)
    path = _url_path(text, options) if is_url(text) else _local_path(text)
    _check_dataset(path, text)
    return path


def check_storage_options(storage_options, *paths: VolumePath | None) -> None:
    """Refuse storage options when none of ``paths`` (a run's input, output, mask) is on an object store.

    A local path ignores them (see :func:`parse_volume_path`), so options
    given to a run of local paths only would be dropped unseen: a mistyped
    ``s3://`` path, or options meant for another run.
    """
    options = StorageOptions.parse(storage_options)
    if options == StorageOptions() or any(path is not None and path.is_remote for path in paths):
        return
    given = ", ".join(f"{f.name}={str(value).lower() if isinstance(value, bool) else value}" for f in fields(options)
                      if (value := getattr(options, f.name)) != f.default)
    local = ", ".join(repr(str(path)) for path in paths if path is not None)
    raise InvalidOptionError(
        f"storage options ({given}) apply to s3:// paths only, but every path of this run is local ({local}); "
        f"drop --storage-option, or name the s3:// path"
    )


def _check_dataset(path: VolumePath, text: str) -> None:
    """Refuse a dataset path with '.', '..' or empty parts: inside a container they name nothing
    (zarr refuses them; HDF5 and object stores would look for a member called '..')."""
    parts = path.dataset.strip("/").split("/") if path.dataset and path.format != "precomputed" else []
    bad = [part for part in parts if part in ("", ".", "..")]
    if bad:
        shown = "an empty part ('//')" if not bad[0] else f"a {bad[0]!r} part"
        tidy = VolumePath(path.format, path.container, _tidy(parts))
        raise InvalidOptionError(
            f"dataset path {path.dataset!r} in {text!r} has {shown}; write the path inside the container without "
            f"'.', '..' or empty parts, such as {str(tidy)!r}"
        )


def _tidy(parts: list[str]) -> str:
    """The dataset ``parts`` with '.' and empty parts dropped and each '..' taking its parent away."""
    kept: list[str] = []
    for part in parts:
        if part == "..":
            if kept:
                kept.pop()
        elif part not in ("", "."):
            kept.append(part)
    return "/".join(kept)


def _local_path(text: str) -> VolumePath:
    match = re.match(r"^(.*?\.(?:h5|hdf5|hdf))(?::/?|/)(.*)$", text, flags=re.IGNORECASE)
    if match:
        return VolumePath("hdf5", Path(match.group(1)), match.group(2).strip("/"))
    if text.lower().endswith(_HDF5_SUFFIXES):
        return VolumePath("hdf5", Path(text), "")
    parts = Path(text).parts
    for i, part in enumerate(parts):
        lower = part.lower()
        if lower.endswith(".zarr") or lower.endswith(".n5"):
            fmt: Format = "zarr" if lower.endswith(".zarr") else "n5"
            return VolumePath(fmt, Path(*parts[: i + 1]), "/".join(parts[i + 1 :]))
    if text.lower().rstrip("/").endswith(_TIFF_SUFFIXES):
        return VolumePath("tiff", Path(text), "")
    path = Path(text)
    found_format = folder_format(path)
    if found_format is not None:
        return VolumePath(found_format, path, "")
    base = text.partition("#")[0]
    if Path(base).name == "info" or _is_precomputed_directory(Path(base)):
        return _precomputed_path(text, text)
    if has_slices(path):
        return VolumePath("tiff", path, "")
    found = " (a directory holding no .tif, .tiff or .png slices)" if path.is_dir() else ""
    raise InvalidOptionError(
        f"cannot tell the format of {text!r}{found}: name a zarr (vol.zarr[/dataset]), "
        f"N5 (vol.n5/dataset), HDF5 (file.h5:/dataset) or precomputed (precomputed://DIR) volume, "
        f"a TIFF (stack.tif) or a folder of .tif, .tiff or .png slices"
    )


def is_slice_name(name: str) -> bool:
    """True when a file called ``name`` is a slice of a folder of slices (hidden files, such as macOS's
    ``._slice_1.tif``, are not)."""
    return not name.startswith(".") and name.lower().endswith(SLICE_SUFFIXES)


def has_slices(path: Path) -> bool:
    """True when ``path`` is a directory holding at least one slice file (stops at the first)."""
    try:
        with os.scandir(path) as entries:
            return any(is_slice_name(entry.name) and entry.is_file() for entry in entries)
    except OSError:  # not a directory, or not there
        return False


def _url_path(text: str, options: StorageOptions) -> VolumePath:
    """``s3://bucket/a/vol.zarr/raw`` -> zarr in container ``s3://bucket/a/vol.zarr``, dataset ``raw``."""
    url = parse_url(text, options)
    parts = url.key.split("/") if url.key else []
    for i, part in enumerate(parts):
        lower = part.lower()
        if lower.endswith(_HDF5_SUFFIXES) or re.search(r"\.(h5|hdf5|hdf):", lower):
            raise InvalidOptionError(
                f"HDF5 is read and written as a local file only, got {text!r}; copy it to a local disk, "
                f"or convert it to zarr"
            )
        if i == len(parts) - 1 and lower.endswith(_TIFF_SUFFIXES):
            raise InvalidOptionError(
                f"TIFF is read as a local file (or folder of slices) only, got {text!r}; copy it to a local disk, "
                f"or convert it to zarr"
            )
        if lower.endswith(".zarr") or lower.endswith(".n5"):
            fmt: Format = "zarr" if lower.endswith(".zarr") else "n5"
            container = ObjectUrl(url.scheme, url.bucket, "/".join(parts[: i + 1]), options)
            return VolumePath(fmt, container, "/".join(parts[i + 1 :]))
    raise InvalidOptionError(
        f"cannot tell the format of {text!r}: on an object store name a zarr ({url.scheme}://bucket/vol.zarr[/dataset]), "
        f"N5 ({url.scheme}://bucket/vol.n5/dataset) or precomputed (precomputed://{url.scheme}://bucket/dir) volume"
    )


def _precomputed_path(location: str, text: str, options: StorageOptions | None = None) -> VolumePath:
    """``DIR[/info][#scale=KEY|INDEX]`` as a precomputed path; the scale goes into the dataset."""
    location, hash_sign, fragment = location.partition("#")
    scale = ""
    if hash_sign:
        if not fragment.startswith("scale=") or not fragment[len("scale=") :]:
            raise InvalidOptionError(
                f"a precomputed path ends in '#scale=KEY' or '#scale=INDEX' (such as #scale=0), got {text!r}"
            )
        scale = fragment[len("scale=") :]
    if not location:
        raise InvalidOptionError(f"{text!r} names no directory; write precomputed://DIR, such as precomputed://em")
    path = parse_url(location, options) if is_url(location) else Path(location)
    if path.name == "info":
        path = path.parent
    return VolumePath("precomputed", path, scale)


def _is_precomputed_directory(path: Path) -> bool:
    """True when ``path`` holds an ``info`` file of @type neuroglancer_multiscale_volume."""
    try:
        info = json.loads((path / "info").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("@type") == "neuroglancer_multiscale_volume"


@dataclass(frozen=True, kw_only=True)
class NewVolume:
    """What a volume to be created is, checked once by :func:`blockpred.io.create_volume` for every backend."""

    #: Full rank: (z, y, x) or (c, z, y, x); the channel axis is one chunk.
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    dtype: np.dtype
    #: One of zstd, gzip, blosc, raw; each backend's docstring says what it writes for each.
    compression: str
    #: (z, y, x), or None for none.
    voxel_size: tuple[float, ...] | None
    fill_value: object
    #: Replace a volume at the path (only it, see :func:`make_room`).
    overwrite: bool


def make_room(path: VolumePath, new: NewVolume, exists: bool, remove) -> None:
    """Before a backend creates ``new`` at ``path``: an existing volume there (``exists``) is refused, or with
    ``new.overwrite`` removed by ``remove(path)``."""
    if exists:
        if not new.overwrite:
            raise OutputExistsError(f"{str(path)!r} exists; pass overwrite to replace it, or choose another output")
        remove(path)


class Volume(abc.ABC):
    """A chunked 3D volume with an optional leading channel axis.

    Subclasses call ``super().__init__(path, mode)``, set ``shape``,
    ``dtype``, ``chunk_shape`` and ``voxel_size``, and implement
    :meth:`_read` and :meth:`_write` (or :meth:`_write_async`) on full-rank
    index tuples, keeping the write contract of :meth:`write_async`.
    """

    path: VolumePath
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...]
    #: Voxel size in (z, y, x) order, in the file's units, or None when the file has none.
    voxel_size: tuple[float, ...] | None = None
    #: True when writes of disjoint, chunk-aligned boxes may run in parallel threads.
    parallel_writes: bool = True
    #: True when :meth:`write_async` returns at once and the write runs elsewhere (tensorstore's threads).
    async_writes: bool = False
    #: False for a volume opened with mode "r"; :meth:`write` then raises.
    writable: bool = True
    #: True when :meth:`read_with_missing` can tell a missing (not stored) chunk from a stored one.
    counts_missing_chunks: bool = False

    def __init__(self, path: VolumePath, mode: str = "r"):
        self.path = path
        self._mode = mode
        self.writable = mode == "r+"

    def __reduce__(self):  # a volume travels (to a dask worker) as its path and mode, and opens again there
        return (type(self), (self.path, self._mode))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_channels(self) -> int | None:
        """Channel count for a (c, z, y, x) volume, None for a (z, y, x) one."""
        return self.shape[0] if len(self.shape) == 4 else None

    @property
    def spatial_shape(self) -> Coord:
        return Coord(self.shape[-3:])

    @property
    def spatial_chunk_shape(self) -> Coord:
        return Coord(self.chunk_shape[-3:])

    @property
    def box(self) -> Box:
        """The whole spatial extent, ``[0:z, 0:y, 0:x]``."""
        return Box.from_shape(self.spatial_shape)

    def _index(self, box: Box) -> tuple[slice, ...]:
        if box.ndim != min(self.ndim, 3):  # (an array of two axes is indexed by (y, x) boxes)
            raise ValueError(f"box {box} has {box.ndim} axes; volume {self.path} is indexed by (z, y, x) boxes")
        if not self.box.contains(box):
            raise ValueError(f"box {box} is outside volume {self.path} of spatial shape {tuple(self.spatial_shape)}")
        lead = (slice(None),) * (self.ndim - 3)
        return lead + box.to_slices()

    def read(self, box: Box) -> np.ndarray:
        """The data inside ``box`` (spatial), all channels, as a new numpy array."""
        return np.asarray(self._read(self._index(box)))

    def read_with_missing(self, box: Box) -> tuple[np.ndarray, tuple[Box, ...]]:
        """:meth:`read`, and the chunks it found missing (not stored), which it read as the fill value.

        A chunk is named by its box in the array (channels included, clipped to
        the array).  A backend that cannot tell (:attr:`counts_missing_chunks`
        False) names none.
        """
        return self.read(box), ()

    def write(self, box: Box, data: np.ndarray) -> None:
        """Write ``data`` (all channels) into ``box`` (spatial); returns once the data is durable (see
        :meth:`write_async`), raises the write's error."""
        self._write(self._index(box), self._checked(box, data))

    def write_async(self, box: Box, data: np.ndarray) -> Future:
        """Start writing ``data`` into ``box``: **the write contract** every backend keeps.

        The future completes once the data is *durable* -- on disk, where neither a ``kill -9`` of this
        process nor a crash of the machine takes it (tensorstore's commit, which fsyncs; HDF5's flush and
        fsync) -- and fails with the write's error otherwise (a full disk included).  A block is marked
        done only after its future completed (:class:`blockpred.pipeline.writer.BlockWriter` is the one
        caller that does), so a mark always vouches for data that is there.  ``data`` must not change until
        then.  Backends with :attr:`async_writes` return at once; the others may write before they return.
        """
        return self._write_async(self._index(box), self._checked(box, data))

    def _checked(self, box: Box, data: np.ndarray) -> np.ndarray:
        if not self.writable:
            raise PermissionError(f"{self.path} was opened read-only; open it with mode 'r+' to write")
        expected = self.shape[:-3] + tuple(box.shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"data of shape {data.shape} does not fit box {box} of {self.path}: expected {expected}")
        return np.asarray(data, dtype=self.dtype)  # no copy when the dtype already matches

    @abc.abstractmethod
    def _read(self, index: tuple[slice, ...]) -> np.ndarray: ...

    @abc.abstractmethod
    def _write(self, index: tuple[slice, ...], data: np.ndarray) -> None:
        """Write ``data`` at ``index``; return once it is durable (:meth:`write_async`'s contract)."""

    def _write_async(self, index: tuple[slice, ...], data: np.ndarray) -> Future:
        future: Future = Future()
        self._write(index, data)
        future.set_result(None)
        return future

    def close(self) -> None:
        """Release file handles (a no-op for most backends)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, shape={self.shape}, dtype={self.dtype}, chunks={self.chunk_shape})"


def check_input_volume(volume: Volume) -> None:
    """Raise :class:`InvalidVolumeError` unless ``volume`` can be predicted."""
    if volume.ndim not in (3, 4):
        raise InvalidVolumeError(
            f"{volume.path} has {volume.ndim} axes {volume.shape}; blockpred needs (y, x), (z, y, x) or (c, z, y, x)"
            + _singleton_hint(volume.shape)
        )
    if 0 in volume.shape:
        raise InvalidVolumeError(f"{volume.path} has shape {volume.shape}: an empty axis; there is nothing to predict")
    if volume.dtype not in SUPPORTED_INPUT_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_INPUT_DTYPES)
        raise InvalidVolumeError(f"{volume.path} has dtype {volume.dtype}; supported input dtypes: {names}")


def _singleton_hint(shape: tuple[int, ...]) -> str:
    """For more than 4 axes: which have size 1 and could be dropped ("" when that would not help)."""
    ones = [axis for axis, size in enumerate(shape) if size == 1]
    surplus = len(shape) - 4  # axes to drop for (c, z, y, x); one more for (z, y, x)
    if surplus <= 0 or len(ones) < surplus:
        return ""
    named = f"axis {ones[0]} has" if len(ones) == 1 else f"axes {', '.join(map(str, ones))} have"
    left = len(shape) - len(ones)
    if left in (3, 4):
        them = "it" if len(ones) == 1 else "them"
        return f": {named} size 1; save the array without {them}, as {'(z, y, x)' if left == 3 else '(c, z, y, x)'}"
    return f": {named} size 1; save the array without {len(shape) - 3} of them, as (z, y, x)"


def spatial_voxel_size(value, *, reverse: bool = False) -> tuple[float, ...] | None:
    """The (z, y, x) voxel size from an attribute value, or None when it is not one.

    ``value`` holds one number per axis; a fourth, leading (z, y, x order) or
    trailing (x, y, z order, ``reverse=True``) entry for the channel axis is
    dropped.  ``reverse`` flips an (x, y, z) list, as N5 stores it.
    """
    try:
        numbers = [float(v) for v in value]
    except (TypeError, ValueError):
        return None
    if reverse:
        numbers = numbers[::-1]
    if len(numbers) not in (3, 4):
        return None
    return tuple(numbers[-3:])
