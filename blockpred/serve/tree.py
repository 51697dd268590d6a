"""The zarr trees ``blockpred serve`` answers with: an OME-NGFF 0.4 image (zarr format 2) per served volume.

Each tree is a group whose arrays ``0`` (the full resolution), ``1`` ... are the
levels of :func:`blockpred.run.pyramid.plan_levels`, every one chunked by the
run's block (the served chunk *is* a block), blosc-lz4 compressed (neuroglancer
decodes it; a local viewer pays little to decompress), with fill value 0.  The
metadata documents are made by zarr-python in a memory store, and every chunk is
encoded by zarr writing it into a memory store of its own, so that the bytes
are exactly what zarr would keep on disk (an edge chunk padded with the fill
value): nothing of the format is written here by hand.

A key is parsed strictly: ``.zgroup``, ``.zattrs``, ``<level>/.zarray``,
``<level>/.zattrs`` or ``<level>/<c.>z.y.x`` with integer indices inside the
level's chunk grid.  Anything else is unknown (the server's 404), so no key can
name anything outside the tree.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

import numpy as np

from ..geometry import Box, Coord
from ..io.ome import image_attributes
from ..run.pyramid import Level, max_levels, plan_levels

#: How the chunks are compressed (numcodecs' Blosc: neuroglancer's zarr v2 reader decodes it).
COMPRESSOR = {"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1, "blocksize": 0}
_CHUNK_KEY = re.compile(r"^(0|[1-9][0-9]{0,2})/((?:0|[1-9][0-9]{0,9})(?:\.(?:0|[1-9][0-9]{0,9})){2,3})$")


@dataclass(frozen=True)
class ChunkKey:
    """A chunk of a level: its (z, y, x) index in the level's chunk grid, and the box of the level it covers."""

    level: int
    index: Coord
    box: Box


class ServedTree:
    """One served volume: ``shape`` (z, y, x), ``channels`` (None: no channel axis), ``dtype``, chunked by ``block``,
    with as many levels below the full resolution as it takes for the volume to fit one chunk."""

    def __init__(self, shape: Coord, channels: int | None, dtype, block: Coord,
                 voxel_size: tuple[float, ...] | None = None):
        import numcodecs
        import zarr

        self.shape, self.channels, self.dtype, self.block = Coord(shape), channels, np.dtype(dtype), Coord(block)
        every = plan_levels(self.shape, voxel_size, max_levels(self.shape), self.block, None)
        fits = next(i for i, level in enumerate(every) if all(n <= b for n, b in zip(level.shape, self.block)))
        self.levels: tuple[Level, ...] = tuple(every[:fits + 1])  # down to the first level that fits one chunk
        self._lead = () if channels is None else (channels,)
        self._store: dict = {}
        group = zarr.open_group(zarr.storage.MemoryStore(self._store), mode="w", zarr_format=2)
        group.attrs.update(image_attributes(len(self._lead) + 3, voxel_size, 2,
                                            scales=[tuple(level.scale) for level in self.levels]))
        self._compressor = numcodecs.get_codec(dict(COMPRESSOR))
        for level in self.levels:
            self._create(group, level)
        self._documents = {key: bytes(value.to_bytes()) for key, value in self._store.items()}
        self._local = threading.local()

    def _create(self, group, level: Level):
        return group.create_array(str(level.index), shape=self._lead + tuple(level.shape),
                                  chunks=self._lead + tuple(self.block), dtype=self.dtype, fill_value=0,
                                  compressors=self._compressor, chunk_key_encoding={"name": "v2", "separator": "."})

    def document(self, key: str) -> bytes | None:
        """A metadata document of the tree (``.zgroup``, ``.zattrs``, ``0/.zarray`` ...), or None."""
        return self._documents.get(key)

    def chunk_key(self, key: str) -> ChunkKey | None:
        """The chunk ``key`` names, or None where it names none (malformed, or outside the level's grid)."""
        found = _CHUNK_KEY.match(key)
        if found is None:
            return None
        level_index = int(found.group(1))
        indices = tuple(int(part) for part in found.group(2).split("."))
        if level_index >= len(self.levels) or len(indices) != len(self._lead) + 3:
            return None
        if self._lead and indices[0] != 0:  # the channels are one chunk
            return None
        level = self.levels[level_index]
        index = Coord(indices[-3:])
        if any(not 0 <= i < n for i, n in zip(index, level.shape.ceil_div(self.block))):
            return None
        box = Box.from_shape(self.block, index * self.block).intersect(Box.from_shape(level.shape))
        return ChunkKey(level_index, index, box)

    def encode(self, chunk: ChunkKey, data: np.ndarray) -> bytes:
        """``data`` (the chunk's box of its level, channels first where there are any) as zarr stores it."""
        import zarr

        local = self._local
        if getattr(local, "arrays", None) is None:  # one memory store per thread: encodings never wait on each other
            store: dict = {}
            group = zarr.open_group(zarr.storage.MemoryStore(store), mode="w", zarr_format=2)
            local.store, local.arrays = store, {level.index: self._create(group, level) for level in self.levels}
        array = local.arrays[chunk.level]
        array[(Ellipsis,) + chunk.box.to_slices()] = np.asarray(data, dtype=self.dtype)
        name = ".".join(map(str, ((0,) if self._lead else ()) + tuple(chunk.index)))
        return bytes(local.store.pop(f"{chunk.level}/{name}").to_bytes())

