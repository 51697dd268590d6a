"""A synthetic EM-like volume: what ``blockpred demo`` predicts, and what the benches and tests run on.

The volume imitates serial-section electron microscopy: cells of a Voronoi
tessellation (anisotropic, like 40 x 4 x 4 nm sections) separated by dark
membranes, with darker organelle-like blobs and shot noise.  It is made from a
seed, so every demo run predicts the same data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..geometry import Box, Coord
from . import create_volume

DEFAULT_SHAPE = Coord((128, 256, 256))
VOXEL_SIZE = (40.0, 4.0, 4.0)  # nm, z y x: CREMI-like anisotropy


#: Standard deviation of the shot noise, in grey values.
NOISE = 14.0


def make_em_volume(shape: Coord = DEFAULT_SHAPE, *, seed: int = 0, num_cells: int = 48,
                   noise: float = NOISE) -> np.ndarray:
    """A uint8 EM-like volume of ``shape`` (z, y, x), with shot noise of standard deviation ``noise``."""
    rng = np.random.default_rng(seed)
    shape = Coord(shape)
    anisotropy = np.array(VOXEL_SIZE) / VOXEL_SIZE[-1]
    centres = rng.uniform(0, 1, size=(num_cells, 3)) * np.array(shape) * anisotropy
    blobs = rng.uniform(0, 1, size=(num_cells // 2, 3)) * np.array(shape) * anisotropy
    yy, xx = np.meshgrid(np.arange(shape[1], dtype=np.float32), np.arange(shape[2], dtype=np.float32), indexing="ij")
    out = np.empty(tuple(shape), dtype=np.uint8)
    for z in range(shape[0]):
        zz = np.float32(z * anisotropy[0])
        d = np.sqrt((zz - centres[:, 0]) ** 2 + (yy[..., None] - centres[:, 1]) ** 2 + (xx[..., None] - centres[:, 2]) ** 2)
        nearest = np.partition(d, 1, axis=-1)
        membrane = np.exp(-(((nearest[..., 1] - nearest[..., 0]) / 2.5) ** 2))
        db = np.sqrt((zz - blobs[:, 0]) ** 2 + (yy[..., None] - blobs[:, 1]) ** 2 + (xx[..., None] - blobs[:, 2]) ** 2)
        organelle = (db.min(axis=-1) < 9.0).astype(np.float32)
        value = 175.0 - 115.0 * membrane - 45.0 * organelle + rng.normal(0.0, noise, size=membrane.shape)
        out[z] = np.clip(value, 0, 255).astype(np.uint8)
    return out


#: The tile a large synthetic volume repeats (2 Mvox: a few seconds to make).
TILE = Coord((32, 256, 256))


def write_em_volume(path: str, shape: Coord, *, chunks: Coord = Coord((64, 64, 64)), ome: bool = False) -> str:
    """A synthetic EM volume of any size at ``path``, quickly: one :data:`TILE` repeated, slab by slab.

    :func:`make_em_volume` makes about half a megavoxel per second, too slow for
    the gigavoxel volumes a GPU benchmark needs.  The tile's cells repeat, but
    every slab gets fresh shot noise, so the volume compresses like EM data
    does (a repeated noisy tile would compress, and so read and write, far too
    well).  Memory: one slab of the tile's depth.
    """
    shape = Coord(shape)
    rng = np.random.default_rng(1)
    tile = make_em_volume(TILE.minimum(shape), noise=0.0).astype(np.int16)
    volume = create_volume(path, spatial_shape=shape, num_channels=None, dtype=np.uint8,
                           chunk_shape=chunks.minimum(shape), ome=ome, overwrite=True)
    reps = (1,) + tuple(-(-s // t) for s, t in zip(shape[1:], tile.shape[1:]))
    plane = np.tile(tile, reps)[:, : shape[1], : shape[2]]
    slab = max(tile.shape[0], chunks[0])
    for z in range(0, shape[0], slab):
        depth = min(slab, shape[0] - z)
        data = np.take(plane, np.arange(z, z + depth) % tile.shape[0], axis=0)
        data = data + np.rint(rng.standard_normal(data.shape, dtype=np.float32) * NOISE).astype(np.int16)
        data = np.clip(data, 0, 255).astype(np.uint8)
        volume.write(Box(Coord((z, 0, 0)), Coord((z + depth, shape[1], shape[2]))), data)
    volume.close()
    return path


def write_demo_volume(directory: Path, shape: Coord = DEFAULT_SHAPE) -> str:
    """Write the demo volume as ``<directory>/volume.zarr/raw`` (zarr v3, OME-NGFF) and return that path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = str(directory / "volume.zarr" / "raw")
    data = make_em_volume(shape)
    volume = create_volume(path, spatial_shape=shape, num_channels=None, dtype=np.uint8,
                           chunk_shape=Coord((64, 64, 64)).minimum(shape), voxel_size=VOXEL_SIZE, overwrite=True)
    volume.write(volume.box, data)
    volume.close()
    return path
