"""``--mask``: predict only blocks whose region the mask marks.

A mask is a 3D volume (any format blockpred reads) whose nonzero voxels mark
where to predict.  It may have the input's spatial shape or be downsampled:
each axis is scaled by ``input / mask`` (so a 4x smaller mask of a 40 x 4 x 4 nm
volume works as it is).  A block runs when any mask voxel under its write box
is nonzero; the others are skipped (left at the output's fill value) and
marked *skipped*, keyed by the block's grid index like done blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .blocking import Block
from .errors import InvalidVolumeError
from .geometry import Box, Coord
from .io import open_volume
from .io.base import Volume, VolumePath


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

    def covers(self, volume: Volume, block: Block) -> bool:
        """True when the mask marks any voxel of the block's write box."""
        return bool(volume.read(self.region(block.write_box)).any())


def check_mask(mask: Volume, volume_shape: Coord) -> None:
    if mask.ndim != 3:
        raise InvalidVolumeError(f"mask {mask.path} has {mask.ndim} axes {mask.shape}; a mask is (z, y, x)")
    if any(m > v or m <= 0 for m, v in zip(mask.shape, volume_shape)):
        raise InvalidVolumeError(
            f"mask {mask.path} has shape {mask.shape}; it must be the input's spatial shape {tuple(volume_shape)} "
            f"or smaller (downsampled) on every axis"
        )
