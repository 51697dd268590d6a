"""Neuroglancer precomputed volumes through tensorstore's ``neuroglancer_precomputed`` driver.

Paths (see :func:`blockpred.io.base.parse_volume_path`): ``precomputed://DIR``,
``DIR/info``, or a directory holding an ``info`` whose ``@type`` is
``neuroglancer_multiscale_volume``.  ``#scale=KEY`` after any of them picks a
scale by its ``key`` (``8_8_40``) or, when no key matches, by its index
(``#scale=1``); the default is the first (finest) scale.  The scale is kept in
:attr:`VolumePath.dataset`; the volume's kvstore is always the directory that
holds ``info`` (built by :func:`~blockpred.io.tensorstore_io.kvstore`).

Axis order.  Precomputed stores x, y, z, channel (x fastest); tensorstore's
domain is ``x, y, z, channel`` starting at the scale's ``voxel_offset``.
:class:`PrecomputedVolume` moves the origin to 0 (blockpred's boxes start
at 0; voxel ``[0, 0, 0]`` is the one at ``voxel_offset`` on disk) and
reverses the axes: one channel is presented as (z, y, x), several as
(c, z, y, x).  ``resolution`` (x, y, z, nanometres) is the voxel size,
returned as (z, y, x); ``chunk_sizes[0]`` is the chunk shape.  Sharded
volumes read like any other.

New volumes (:func:`create_volume`) have one scale with key ``s0``, voxel
offset 0, ``type`` ``image``, encoding ``raw`` (jpeg and png are lossy or
limited to few channels and 8/16 bits; compressed_segmentation is for
labels), resolution the voxel size (default 1, 1, 1) and chunk size the
output chunks.  Precomputed compresses raw chunks only inside shards, so:

* ``compression="raw"`` (or None) writes plain, unsharded chunk files
  (``x0-x1_y0-y1_z0-z1``), the form every precomputed reader knows;
* ``"gzip"``, ``"zstd"`` and ``"blosc"`` write **gzip**, each chunk alone in
  its own shard file (``neuroglancer_uint64_sharded_v1`` with no preshift or
  minishard bits), which neuroglancer, tensorstore and CloudVolume read.

Either way every chunk is its own file, so threads may write disjoint,
chunk-aligned boxes at once.  A (c, z, y, x) volume of one channel is marked
``"blockpred": {"axes": ["c", "z", "y", "x"]}`` in ``info`` so it opens with
its channel axis (viewers ignore the key).  Precomputed has no float16 and no
fill value (missing chunks read as 0).
"""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import tensorstore as ts

from ..errors import InputNotFoundError, InvalidOptionError, InvalidVolumeError
from . import stores
from .base import NewVolume, VolumePath, make_room, spatial_voxel_size
from .tensorstore_io import TensorstoreVolume, context, kvstore, open_store

log = logging.getLogger(__name__)

MULTISCALE_TYPE = "neuroglancer_multiscale_volume"
#: The data types precomputed stores (tensorstore's list).
_DATA_TYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "float32")
_CHANNEL_AXES = ["c", "z", "y", "x"]
_SCALE_KEY = "s0"


class PrecomputedVolume(TensorstoreVolume):
    """One scale of a precomputed volume, presented as (z, y, x) or (c, z, y, x) from 0."""

    async_writes = True

    def __init__(self, path: VolumePath, mode: str = "r"):
        super().__init__(path, mode)
        info = _read_info(path)
        if info is None:
            raise InputNotFoundError(
                f"no precomputed volume at {str(path)!r}: its directory has no info file; check the path"
            )
        index = _scale_index(info, path)
        scale = info["scales"][index]
        try:
            on_disk = open_store(_spec(path, index), writable=self.writable)
        except ValueError as error:
            raise InvalidVolumeError(
                f"precomputed volume {str(path)!r} must have a valid info file; tensorstore cannot open it: "
                f"{_first_line(error)}"
            ) from error
        store = on_disk.translate_to[0]  # voxel_offset -> 0
        with_channels = int(info.get("num_channels", 1)) > 1 or _marked_with_channels(info)
        if not with_channels:
            store = store[..., 0]
        self._store = store.T  # (x, y, z[, c]) -> ([c,] z, y, x)
        self.shape = tuple(int(n) for n in self._store.shape)
        self.dtype = np.dtype(self._store.dtype.numpy_dtype)
        chunk = tuple(int(n) for n in scale["chunk_sizes"][0][::-1])
        self.chunk_shape = self.shape[:-3] + chunk
        self.voxel_size = spatial_voxel_size(scale.get("resolution"), reverse=True)
        # A shard of several chunks is rewritten whole: threads must not write two of its chunks at once.
        self.parallel_writes = not _shares_files(scale)
        # tensorstore reads a missing shard as the fill value even when told not to fill (see .tensorstore_io).
        self.counts_missing_chunks = "sharding" not in scale
        log.debug("opened %r", self)


def open_volume(path: VolumePath, mode: str = "r") -> PrecomputedVolume:
    return PrecomputedVolume(path, mode)


def volume_exists(path: VolumePath) -> bool:
    """True when ``path``'s directory holds a precomputed info with the scale the path names."""
    info = _read_info(path, strict=False)
    if info is None:
        return False
    try:
        _scale_index(info, path)
    except InputNotFoundError:
        return False
    return True


def check_removable(path: VolumePath) -> bool:
    """True when ``path`` is a precomputed volume :func:`remove_volume` would remove; one scale is refused."""
    if path.dataset:
        raise InvalidOptionError(
            f"{str(path)!r} names scale {path.dataset!r} of a precomputed volume; blockpred removes whole "
            f"volumes only, drop '#scale={path.dataset}'"
        )
    return _read_info(path, strict=False) is not None


def remove_volume(path: VolumePath) -> None:
    """Remove the precomputed volume at ``path`` (its directory, all scales); nothing when none is there."""
    if not check_removable(path):
        return
    stores.remove_tree(path.container)  # on a store: the volume's objects only (keys below "em/")
    log.info("removed precomputed volume %s", path)


def create_volume(path: VolumePath, new: NewVolume) -> PrecomputedVolume:
    """Create a one-scale precomputed volume at ``path`` (see the module docstring) and open it ``r+``."""
    check_output(path, new.dtype)
    if new.fill_value not in (0, None):
        raise InvalidOptionError(
            f"precomputed has no fill value (missing chunks read as 0); got fill_value={new.fill_value!r}"
        )
    # (an info that is no precomputed volume raises: not ours to replace)
    make_room(path, new, _read_info(path) is not None, remove_volume)
    size = [int(n) for n in new.shape[-3:][::-1]]
    chunk = [int(n) for n in new.chunk_shape[-3:][::-1]]
    scale = {
        "key": _SCALE_KEY,
        "size": size,
        "voxel_offset": [0, 0, 0],
        "chunk_size": chunk,
        "resolution": [1.0, 1.0, 1.0] if new.voxel_size is None else [float(v) for v in new.voxel_size[::-1]],
        "encoding": "raw",
    }
    if new.compression != "raw":
        scale["sharding"] = _one_chunk_shards(size, chunk)
    num_channels = int(new.shape[0]) if len(new.shape) == 4 else 1
    spec = {
        "driver": "neuroglancer_precomputed",
        "kvstore": kvstore(path),
        "multiscale_metadata": {"type": "image", "data_type": new.dtype.name, "num_channels": num_channels},
        "scale_metadata": scale,
    }
    ts.open(spec, create=True, context=context()).result()
    if len(new.shape) == 4 and new.shape[0] == 1:
        store = ts.KvStore.open(kvstore(path), context=context()).result()
        info = json.loads(store.read("info").result().value)
        info["blockpred"] = {"axes": _CHANNEL_AXES}
        store.write("info", json.dumps(info).encode()).result()
    log.info("created precomputed volume %s shape=%s chunks=%s dtype=%s", path, new.shape, new.chunk_shape,
             new.dtype)
    return PrecomputedVolume(path, "r+")


def check_output(path: VolumePath, dtype) -> None:
    """Raise :class:`InvalidOptionError` unless a precomputed output of ``dtype`` can be created at ``path``."""
    if path.dataset:
        raise InvalidOptionError(
            f"a precomputed output is a new volume of one scale, but {str(path)!r} names scale {path.dataset!r}; "
            f"drop '#scale={path.dataset}'"
        )
    dtype = np.dtype(dtype)
    if dtype.name not in _DATA_TYPES:
        raise InvalidOptionError(
            f"precomputed data types are {', '.join(_DATA_TYPES)}; got {dtype} for {str(path)!r}: "
            f"write float32 or uint8 (--output-dtype), or use zarr"
        )
    _read_info(path)  # an info there that is no precomputed volume raises InvalidVolumeError


def _spec(path: VolumePath, scale_index: int) -> dict:
    return {"driver": "neuroglancer_precomputed", "kvstore": kvstore(path), "scale_index": scale_index}


def _read_info(path: VolumePath, strict: bool = True) -> dict | None:
    """The parsed ``info`` of ``path``'s directory; None when there is none (or, unless ``strict``, a bad one)."""
    try:
        store = ts.KvStore.open(kvstore(path), context=context()).result()
        found = store.read("info").result()
    except ValueError:  # a file where the directory should be, say
        return None
    if found.state != "value":
        return None
    try:
        info = json.loads(bytes(found.value))
    except ValueError as error:
        if not strict:
            return None
        raise InvalidVolumeError(f"precomputed info of {str(path)!r} must be JSON: {error}") from error
    scales = info.get("scales") if isinstance(info, dict) else None
    if not isinstance(scales, list) or not scales or info.get("@type", MULTISCALE_TYPE) != MULTISCALE_TYPE:
        if not strict:
            return None
        raise InvalidVolumeError(
            f"precomputed info of {str(path)!r} must describe a {MULTISCALE_TYPE} with a list of scales; "
            f"found @type {info.get('@type') if isinstance(info, dict) else None!r}"
        )
    return info


def _scale_index(info: dict, path: VolumePath) -> int:
    """The index of the scale ``path`` names: by key, else by index; the first when it names none."""
    if not path.dataset:
        return 0
    keys = [str(scale.get("key")) for scale in info["scales"] if isinstance(scale, dict)]
    if path.dataset in keys:
        return keys.index(path.dataset)
    if path.dataset.isdigit() and int(path.dataset) < len(keys):
        return int(path.dataset)
    raise InputNotFoundError(
        f"no scale {path.dataset!r} in precomputed volume {str(path.container)!r}; it has: {keys} "
        f"(name one by key or by index 0-{len(keys) - 1})"
    )


def _marked_with_channels(info: dict) -> bool:
    marker = info.get("blockpred")
    return isinstance(marker, dict) and marker.get("axes") == _CHANNEL_AXES


def _one_chunk_shards(size: list[int], chunk: list[int]) -> dict:
    """Sharding that puts each chunk alone in a shard file: gzip per chunk, no file shared by two chunks.

    A chunk's id is its compressed Morton code (``ceil(log2(grid))`` bits per
    axis); with an identity hash and no preshift or minishard bits, every id
    is its own shard.
    """
    bits = sum(math.ceil(math.log2(-(-s // c))) for s, c in zip(size, chunk))
    return {
        "@type": "neuroglancer_uint64_sharded_v1",
        "hash": "identity",
        "preshift_bits": 0,
        "minishard_bits": 0,
        "shard_bits": bits,
        "minishard_index_encoding": "gzip",
        "data_encoding": "gzip",
    }


def _shares_files(scale: dict) -> bool:
    """True when a shard file of this scale may hold several chunks."""
    sharding = scale.get("sharding")
    if not isinstance(sharding, dict):
        return False
    try:
        size, chunk = scale["size"], scale["chunk_sizes"][0]
        bits = sum(math.ceil(math.log2(-(-int(s) // int(c)))) for s, c in zip(size, chunk))
        return not (sharding.get("preshift_bits") == 0 and sharding.get("minishard_bits") == 0
                    and sharding.get("hash") == "identity" and int(sharding.get("shard_bits", -1)) >= bits)
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
        return True


def _first_line(error: Exception) -> str:
    """tensorstore's message without the spec it appends."""
    return str(error).split(" [tensorstore_spec=")[0].splitlines()[0]
