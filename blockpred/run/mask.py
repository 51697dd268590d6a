"""``--mask``: predict only blocks whose region the mask marks.

A mask is a 3D volume (any format blockpred reads) whose nonzero voxels mark
where to predict.  It may have the input's spatial shape or be downsampled:
each axis is scaled by ``input / mask`` (so a 4x smaller mask of a 40 x 4 x 4 nm
volume works as it is).  A block runs when any mask voxel under its write box
is nonzero; the others are skipped (left at the output's fill value).

Which blocks run is decided once, in bulk, before the run: :meth:`Mask.covered`
reads the mask in tiles of bounded size and reduces it along each axis (numpy
over the block grid, no Python per block), so a teravoxel volume with a
downsampled mask plans in seconds.  The result, a :class:`Coverage`, is held at
the mask's resolution where that is coarser than the blocks: blocks that lie on
the same mask voxels along an axis share one value, so a petavoxel grid of
billions of blocks under a small mask is a small array (``blockpred plan``
counts over it).  The blocks left out are recorded with the run's markers in
one write, one byte per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidVolumeError
from ..geometry import Box, Coord
from ..io import open_volume
from ..io.base import Volume, VolumePath
from ..pipeline.blocking import BlockPlan


@dataclass(frozen=True)
class Mask:
    path: VolumePath
    mask_shape: Coord
    volume_shape: Coord

    @classmethod
    def open(cls, path: VolumePath, volume_shape: Coord) -> "Mask":
        with open_volume(path) as mask:
            check_mask(mask, volume_shape)
            return cls(path, Coord(mask.shape), Coord(volume_shape))

    def region(self, box: Box) -> Box:
        """The mask voxels under ``box`` (in voxels of the input volume)."""
        begin = (box.begin * self.mask_shape) // self.volume_shape
        end = (box.end * self.mask_shape).ceil_div(self.volume_shape)
        return Box(begin, end.maximum(begin + 1).minimum(self.mask_shape))

    def _intervals(self, plan: BlockPlan, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Along ``axis``: the distinct runs of mask voxels [lo, hi) under the blocks' write boxes, in order, and
        per block of the grid the index of its run."""
        ms, vs = self.mask_shape[axis], self.volume_shape[axis]
        begin, end = plan.write_bounds(axis)
        lo = begin * ms // vs
        hi = np.minimum(np.maximum(-(-end * ms // vs), lo + 1), ms)
        runs, rows = np.unique(lo * (ms + 1) + hi, return_inverse=True)  # sorted: in the grid's order
        return runs // (ms + 1), runs % (ms + 1), rows.reshape(-1)

    def coverage(self, plan: BlockPlan, max_tile_bytes: int = 64 << 20) -> np.ndarray:
        """A boolean over the block grid: True where the mask marks any voxel of the block's write box."""
        return self.covered(plan, max_tile_bytes).grid()

    def covered(self, plan: BlockPlan, max_tile_bytes: int = 64 << 20) -> Coverage:
        """:meth:`coverage` at the mask's resolution where that is coarser than the blocks (see :class:`Coverage`).

        The same rule as :meth:`region` per block, computed in bulk: the mask
        is read in tiles of at most about ``max_tile_bytes`` (whole grid rows
        in z and y, every x), each reduced along z, y and x (see :func:`_any_between`).
        """
        lo, hi, rows = zip(*(self._intervals(plan, axis) for axis in range(3)))
        grid = np.zeros(tuple(len(r) for r in lo), dtype=bool)
        row_x = int(hi[2][-1] - lo[2][0])
        with open_volume(self.path) as mask:
            for z0, z1 in _tiles(lo[0], hi[0], max(1, max_tile_bytes // max(1, row_x * int(hi[1][-1] - lo[1][0])))):
                zspan = int(hi[0][z1 - 1] - lo[0][z0])
                for y0, y1 in _tiles(lo[1], hi[1], max(1, max_tile_bytes // max(1, row_x * zspan))):
                    origin = Coord((lo[0][z0], lo[1][y0], lo[2][0]))
                    box = Box(origin, Coord((hi[0][z1 - 1], hi[1][y1 - 1], hi[2][-1])))
                    marked = mask.read(box) != 0
                    for axis, (a, b) in enumerate(((lo[0][z0:z1], hi[0][z0:z1]), (lo[1][y0:y1], hi[1][y0:y1]),
                                                   (lo[2], hi[2]))):
                        marked = _any_between(marked, a - origin[axis], b - origin[axis], axis)
                    grid[z0:z1, y0:y1] = marked
        return Coverage(grid, rows)


@dataclass(frozen=True)
class Coverage:
    """Which blocks of a grid a mask marks, at the mask's resolution where that is coarser than the blocks.

    Along each axis, blocks whose write boxes lie on the same mask voxels are
    marked alike: ``marked`` holds one value per such run of blocks and axis,
    and ``rows[axis][i]`` is the run of the grid's ``i``-th block along it.
    It has at most as many values as the grid (a mask as fine as the volume)
    and as few as the mask has voxels, about, where blocks are smaller than
    its voxels.
    """

    marked: np.ndarray
    rows: tuple[np.ndarray, np.ndarray, np.ndarray]

    def grid(self) -> np.ndarray:
        """One boolean per block of the grid: True where the mask marks it."""
        return self.marked[np.ix_(*self.rows)]

    def left_out(self) -> np.ndarray:
        """One boolean per block of the grid: True for the blocks the mask leaves out (what the markers store)."""
        return ~self.grid()

    def weigh(self, per_block: tuple[np.ndarray, np.ndarray, np.ndarray]) -> float:
        """The sum over the marked blocks of ``per_block[0][z] * per_block[1][y] * per_block[2][x]``, each factor
        summed over its runs first: no value per block."""
        runs = [np.bincount(r, weights=w, minlength=n) for r, w, n in zip(self.rows, per_block, self.marked.shape)]
        return float(np.einsum("ijk,i,j,k->", self.marked, *runs, dtype=np.float64))


def check_mask(mask: Volume, volume_shape: Coord) -> None:
    if mask.ndim != 3:
        raise InvalidVolumeError(f"mask {mask.path} has {mask.ndim} axes {mask.shape}; a mask is (z, y, x)")
    if any(m > v or m <= 0 for m, v in zip(mask.shape, volume_shape)):
        raise InvalidVolumeError(
            f"mask {mask.path} has shape {mask.shape}; it must be the input's spatial shape {tuple(volume_shape)} "
            f"or smaller (downsampled) on every axis"
        )


def _tiles(lo: np.ndarray, hi: np.ndarray, max_voxels: int) -> list[tuple[int, int]]:
    """Ranges [i, j) of grid rows whose mask span (hi[j-1] - lo[i]) stays within ``max_voxels`` (one row at least)."""
    tiles, start = [], 0
    for i in range(1, len(lo) + 1):
        if i == len(lo) or hi[i] - lo[start] > max_voxels:
            tiles.append((start, i))
            start = i
    return tiles


def _any_between(marked: np.ndarray, lo: np.ndarray, hi: np.ndarray, axis: int) -> np.ndarray:
    """``out[..., i, ...] = marked[..., lo[i]:hi[i], ...].any()`` along ``axis``, for every i at once.

    One pass of ``np.logical_or.reduceat`` over the segments between all
    interval bounds (neighbouring intervals may share a voxel, so intervals
    may overlap; the segments never do), then an OR over the few segments
    each interval spans.  ``lo[0]`` must be 0 and ``hi[-1]`` the axis length.
    """
    if not marked.any():
        return np.zeros(marked.shape[:axis] + (len(lo),) + marked.shape[axis + 1:], dtype=bool)
    bounds = np.unique(np.concatenate([lo, hi]))
    segments = np.logical_or.reduceat(marked, bounds[:-1], axis=axis)
    first, last = np.searchsorted(bounds, lo), np.searchsorted(bounds, hi)
    out = segments.take(first, axis=axis)
    for step in range(1, int((last - first).max())):
        spans = (first + step < last).reshape((-1,) + (1,) * (marked.ndim - axis - 1))
        out |= segments.take(np.minimum(first + step, segments.shape[axis] - 1), axis=axis) & spans
    return out
