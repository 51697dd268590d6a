"""TIFF inputs, read-only: multi-page TIFF, OME-TIFF, and folders of 2D slices (TIFF or PNG).

* ``stack.tif`` (``.tiff``, ``.ome.tif``): the file's first series (its first
  level, for a pyramid), read through tifffile's zarr store
  (``TiffPageSeries.aszarr``): a box decodes only the strips or tiles of the
  pages in it.  Its axes (tifffile's ``series.axes``, size-1 axes dropped) may be

  - ``ZYX``: pages are z; a plain multi-page TIFF's page axis (tifffile's
    ``I`` or ``Q``) is z too;
  - ``CZYX`` or ``ZCYX``: channels, presented as (c, z, y, x);
  - ``YX`` or ``CYX``: a 2D image, one plane deep.

  Anything else (a time axis, RGB samples, more axes) is refused in one line.
  ``chunk_shape`` is the store's chunk: one page's strip or tile.  The voxel
  size is an OME-TIFF's ``PhysicalSizeZ/Y/X``, when it has all three.
* a folder of slices: its ``.tif``, ``.tiff`` or ``.png`` files, one per z, in
  natural order of their names (``slice_2`` before ``slice_10``); hidden files
  (``.name``) are not slices, and a folder holds TIFF or PNG slices, not both.
  Every slice must have the first's shape and dtype: checked at open from the
  headers (a TIFF's first page through tifffile, a PNG's IHDR chunk), decoding
  none.  A box decodes only the files of its z range (the first page of a TIFF
  through tifffile, a PNG through imagecodecs), each file whole:
  ``chunk_shape`` is one plane (1, y, x).

Nothing is ever written, created or removed here: opening for writing,
:func:`create_volume`, :func:`remove_volume` and :func:`check_removable` (an
``--overwrite`` of a TIFF) raise :class:`InvalidOptionError`.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tifffile
import zarr

from ..errors import BlockpredError, InputNotFoundError, InvalidOptionError, InvalidVolumeError
from .base import Volume, VolumePath, has_slices, is_slice_name

log = logging.getLogger(__name__)

#: What tifffile calls the page axis of a TIFF without axes metadata (I) or with tifffile's own shape (Q): z here.
_DEPTH_AXES = "ZIQ"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_DTYPES = {8: np.dtype("uint8"), 16: np.dtype("uint16")}
_PNG_COLORS = {2: "an RGB", 3: "a palette", 4: "a grayscale-and-alpha", 6: "an RGBA"}


def read_only_error(path: VolumePath) -> InvalidOptionError:
    return InvalidOptionError(
        f"cannot write {str(path)!r}: TIFF inputs are read-only; write the output to a .zarr, .n5 or .h5 path"
    )


class TiffVolume(Volume):
    """A TIFF file's first series, or a folder of slices, as (z, y, x) or (c, z, y, x)."""

    writable = False

    def __init__(self, path: VolumePath, mode: str = "r"):
        if mode != "r":
            raise read_only_error(path)
        self.path = path
        self._slices: _Slices | None = None
        self._file: _TiffFile | None = None
        if path.container.is_dir():
            self._slices = _Slices.scan(path.container)
            self.shape = (len(self._slices.files),) + self._slices.plane_shape
            self.dtype = self._slices.dtype
            self.chunk_shape = (1,) + self._slices.plane_shape
        elif path.container.is_file():
            self._file = _TiffFile(path.container)
            self.shape, self.dtype = self._file.shape, self._file.dtype
            self.chunk_shape, self.voxel_size = self._file.chunk_shape, self._file.voxel_size
        else:
            raise InputNotFoundError(f"no TIFF file or folder of slices at {str(path.container)!r}; check the path")
        log.debug("opened %r", self)

    def _read(self, index: tuple[slice, ...]) -> np.ndarray:
        if self._slices is not None:
            return self._slices.read(*index)
        return self._file.read(index)

    def write(self, box, data) -> None:
        raise read_only_error(self.path)

    def write_async(self, box, data):
        raise read_only_error(self.path)

    def _write(self, index, data) -> None:
        raise read_only_error(self.path)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __reduce__(self):
        return (type(self), (self.path,))


class _TiffFile:
    """One TIFF file's first series through tifffile's zarr store, as (c,) z, y, x."""

    def __init__(self, file: Path):
        self.file = file
        try:
            self._tif = tifffile.TiffFile(file)
        except OSError as error:
            raise InvalidVolumeError(f"cannot open {str(file)!r}: {error.strerror}; check its permissions") from error
        except (tifffile.TiffFileError, ValueError) as error:
            raise InvalidVolumeError(
                f"{str(file)!r} is not a TIFF file tifffile can read ({_first_line(error)}); check that it is whole, "
                f"or export it again"
            ) from error
        try:
            series = self._tif.series[0]
            self.axes = _depth_as_z(series.axes, series.shape, file)
            self._store = series.aszarr(level=0)
            self._array = zarr.open_array(self._store, mode="r", zarr_format=2)
        except BlockpredError:
            self._tif.close()
            raise
        except Exception as error:  # tifffile's many ways to fail on a damaged file
            self._tif.close()
            raise InvalidVolumeError(
                f"{str(file)!r} cannot be read as a TIFF ({_first_line(error)}); check that it is whole, "
                f"or export it again"
            ) from error
        # Presented axes: (C,) Z, Y, X; a 2D image gets a z of size 1.
        self.presented = ("C" if "C" in self.axes else "") + "ZYX"
        sizes = dict(zip(self.axes, self._array.shape))
        chunks = dict(zip(self.axes, self._array.chunks))
        self.shape = tuple(sizes.get(axis, 1) for axis in self.presented)
        self.chunk_shape = tuple(chunks.get(axis, 1) for axis in self.presented)
        self.dtype = np.dtype(self._array.dtype)
        self.voxel_size = _ome_voxel_size(self._tif) if self._tif.is_ome else None

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        wanted = dict(zip(self.presented, index))
        selection = tuple(wanted[axis] for axis in self.axes)
        try:
            data = self._array[selection]
        except Exception as error:  # a damaged strip or tile
            z = wanted["Z"]
            raise InvalidVolumeError(
                f"pages z={z.start}..{z.stop - 1} of {str(self.file)!r} cannot be read ({_first_line(error)}): the "
                f"file is corrupt or truncated; export it again"
            ) from error
        axes = self.axes
        if "Z" not in axes:
            data, axes = data[..., None, :, :], axes[:-2] + "ZYX"
            data = data[..., wanted["Z"], :, :]
        return np.ascontiguousarray(np.transpose(data, [axes.index(axis) for axis in self.presented]))

    def close(self) -> None:
        self._store.close()
        self._tif.close()


def _depth_as_z(axes: str, shape: tuple[int, ...], file: Path) -> str:
    """tifffile's ``axes`` with the page axis named Z; refuses what is not (C,) (Z,) Y, X in one line."""
    lead = axes[:-2]
    depth = [axis for axis in lead if axis in _DEPTH_AXES]
    if axes.endswith("YX") and len(depth) <= 1 and set(lead) <= set(_DEPTH_AXES + "C") and lead.count("C") <= 1:
        return axes.replace(depth[0], "Z") if depth else axes
    described = f"{str(file)!r} has axes {axes} of shape {tuple(shape)}"
    if "T" in axes:
        raise InvalidVolumeError(
            f"{described}: a time axis; blockpred reads one time point: save each as its own TIFF (ZYX or CZYX)"
        )
    if axes.endswith("S") or "S" in axes:
        raise InvalidVolumeError(
            f"{described}: RGB samples; blockpred reads grayscale or channel stacks: save it as grayscale, or with "
            f"a channel axis (CZYX)"
        )
    raise InvalidVolumeError(f"{described}; blockpred reads TIFF axes ZYX, CZYX, ZCYX, YX or CYX (pages as z)")


def _ome_voxel_size(tif: tifffile.TiffFile) -> tuple[float, ...] | None:
    """(z, y, x) from the OME-XML's ``Pixels`` PhysicalSize attributes, or None without all three."""
    try:
        root = ElementTree.fromstring(tif.ome_metadata or "")
    except ElementTree.ParseError:
        return None
    pixels = next((node for node in root.iter() if node.tag.rsplit("}", 1)[-1] == "Pixels"), None)
    if pixels is None:
        return None
    try:
        return tuple(float(pixels.attrib[f"PhysicalSize{axis}"]) for axis in "ZYX")
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True)
class _Slices:
    """A folder of 2D slices: its files in z order, and the shape and dtype every one has."""

    folder: Path
    files: tuple[Path, ...]
    plane_shape: tuple[int, int]
    dtype: np.dtype

    @classmethod
    def scan(cls, folder: Path) -> "_Slices":
        """The folder's slices, each header checked against the first's (see the module docstring)."""
        try:
            names = [entry.name for entry in os.scandir(folder) if is_slice_name(entry.name) and entry.is_file()]
        except OSError as error:
            raise InputNotFoundError(f"cannot list the folder of slices {str(folder)!r}: {error.strerror}") from error
        if not names:
            raise InputNotFoundError(
                f"no slices in {str(folder)!r}: a folder of slices holds one .tif, .tiff or .png file per z"
            )
        pngs = sum(name.lower().endswith(".png") for name in names)
        if 0 < pngs < len(names):
            raise InvalidVolumeError(
                f"{str(folder)!r} holds {len(names) - pngs} TIFF and {pngs} PNG files: a folder of slices holds one "
                f"kind; move the others out"
            )
        files = tuple(folder / name for name in sorted(names, key=_natural_key))
        first_shape, first_dtype = _header(files[0], 0)
        for z, file in enumerate(files[1:], start=1):
            shape, dtype = _header(file, z)
            if shape != first_shape or dtype != first_dtype:
                found, first = ((_size(shape), _size(first_shape)) if shape != first_shape
                                else (str(dtype), str(first_dtype)))
                raise InvalidVolumeError(
                    f"slice z={z} ({file.name}) is {found}, the first ({files[0].name}) is {first}: every slice of "
                    f"a folder must have one shape and dtype; fix or remove that slice in {str(folder)!r}"
                )
        return cls(folder, files, first_shape, first_dtype)

    def read(self, z: slice, y: slice, x: slice) -> np.ndarray:
        """The box's planes, each from its own file (only the files of ``z`` are opened)."""
        out = np.empty((z.stop - z.start, y.stop - y.start, x.stop - x.start), dtype=self.dtype)
        for i, index in enumerate(range(z.start, z.stop)):
            plane = self._decode(index)
            out[i] = plane[y, x]
        return out

    def _decode(self, z: int) -> np.ndarray:
        file = self.files[z]
        try:
            if file.suffix.lower() == ".png":
                import imagecodecs

                plane = imagecodecs.png_decode(file.read_bytes())
            else:
                with tifffile.TiffFile(file) as tif:
                    plane = tif.pages.first.asarray()
        except FileNotFoundError as error:
            raise InputNotFoundError(
                f"slice z={z} ({file.name}) of {str(self.folder)!r} is gone (it was there when the folder was "
                f"opened); put it back"
            ) from error
        except Exception as error:  # tifffile's and imagecodecs' many ways to fail on a damaged file
            raise InvalidVolumeError(
                f"slice z={z} ({file.name}) of {str(self.folder)!r} cannot be decoded ({_first_line(error)}): it is "
                f"corrupt or truncated; export it again"
            ) from error
        if plane.shape != self.plane_shape or plane.dtype != self.dtype:
            raise InvalidVolumeError(
                f"slice z={z} ({file.name}) of {str(self.folder)!r} decodes to {_size(plane.shape)} {plane.dtype}, "
                f"the folder's slices are {_size(self.plane_shape)} {self.dtype}: every slice must have one shape "
                f"and dtype; export it again as a grayscale image"
            )
        return plane


def _header(file: Path, z: int) -> tuple[tuple[int, int], np.dtype]:
    """A slice's (y, x) shape and dtype from its header, decoding nothing; one-line errors name the slice."""
    where = f"slice z={z} ({file.name}) of {str(file.parent)!r}"
    if file.suffix.lower() == ".png":
        return _png_header(file, where)
    try:
        with tifffile.TiffFile(file) as tif:
            page = tif.pages.first
            shape, dtype = tuple(page.shape), page.dtype
    except Exception as error:  # not a TIFF, truncated, unreadable
        raise InvalidVolumeError(
            f"{where} cannot be read ({_first_line(error)}): it is corrupt or not a TIFF; export it again"
        ) from error
    if len(shape) != 2 or dtype is None:
        raise InvalidVolumeError(
            f"{where} is an image of shape {shape}: a slice is one 2D grayscale image (y, x); save the slices as "
            f"grayscale"
        )
    return shape, np.dtype(dtype)


def _png_header(file: Path, where: str) -> tuple[tuple[int, int], np.dtype]:
    """(height, width) and dtype from a PNG's IHDR chunk (the file's first 26 bytes)."""
    try:
        with open(file, "rb") as stream:
            head = stream.read(26)
    except OSError as error:
        raise InvalidVolumeError(f"{where} cannot be read: {error.strerror}; check its permissions") from error
    if len(head) < 26 or head[:8] != _PNG_SIGNATURE or head[12:16] != b"IHDR":
        raise InvalidVolumeError(f"{where} is not a PNG file (no PNG header): it is corrupt; export it again")
    width, height = struct.unpack(">II", head[16:24])
    bit_depth, color_type = head[24], head[25]
    if color_type != 0:
        raise InvalidVolumeError(
            f"{where} is {_PNG_COLORS.get(color_type, 'a colour')} PNG: blockpred reads grayscale slices; save them "
            f"as 8- or 16-bit grayscale"
        )
    if bit_depth not in _PNG_DTYPES:
        raise InvalidVolumeError(
            f"{where} is a {bit_depth}-bit grayscale PNG: blockpred reads 8- or 16-bit slices; save them as such"
        )
    return (height, width), _PNG_DTYPES[bit_depth]


def _natural_key(name: str) -> list:
    """``slice_2.tif`` before ``slice_10.tif``: runs of digits compare as numbers."""
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]


def _size(shape) -> str:
    return "x".join(str(size) for size in shape)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().split("\n", 1)[0] or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


# ------------------------------------------------------------------------------------------- backend functions


def open_volume(path: VolumePath, mode: str = "r") -> TiffVolume:
    return TiffVolume(path, mode)


def volume_exists(path: VolumePath) -> bool:
    """True when ``path`` is a file, or a directory holding slices (whether they open is :func:`open_volume`'s)."""
    return path.container.is_file() or has_slices(path.container)


def check_removable(path: VolumePath) -> bool:
    """Refused: blockpred never removes or replaces a TIFF (``--overwrite`` onto one)."""
    raise read_only_error(path)


def remove_volume(path: VolumePath) -> None:
    raise read_only_error(path)


def create_volume(path: VolumePath, new=None, **options) -> TiffVolume:
    raise read_only_error(path)
