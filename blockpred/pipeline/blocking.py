"""Block planning: which input box each block reads and which output box it writes.

The output region (the ROI, by default the whole volume) is tiled by a grid of
block *cores* anchored at voxel 0 of the volume::

      volume   0        64       128      192
               |--------|--------|--------|---      block cores (write boxes)
      roi            [==================]           only cores that meet the ROI run
      block 1    <-h-|--------|-h->                 read box = core grown by halo + context
                                                    (and padded up to the network's input shape)

* The core shape is a multiple of the output chunk shape, and the grid starts at
  0 like the chunk grid, so every output chunk lies inside exactly one core: it
  is written once, by one block, and never read-modify-written.
* The core shape is a multiple of the network's total downsampling, so every
  block's input starts on the pooling grid that the whole (padded) volume would
  have: a 'same' U-Net gives the same numbers blockwise as on the whole volume.
* Each block reads ``core.grow(halo + context)``, extended at the end to the
  network input shape; the network's output is cropped back to the core, and the
  core is clipped to the ROI and the volume (the *write box*).  Reads past the
  volume edge are padded (see :mod:`blockpred.pipeline.padding`), so the network always
  sees one input shape, also for the last, partial blocks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..errors import InvalidOptionError
from ..geometry import Box, Coord


def blocks_per_axis(roi: Box, block_shape: Coord) -> Coord:
    """Blocks per axis of the grid (anchored at the volume's origin) that covers ``roi``."""
    return roi.end.ceil_div(block_shape) - roi.begin // block_shape


@dataclass(frozen=True, slots=True)
class Block:
    """One unit of work.  Its status (done, failed) belongs to the scheduler."""

    index: Coord  # position in the block grid
    core_box: Box  # the full core, before clipping to the ROI
    read_box: Box  # what the network reads (may exceed the volume: padded)
    write_box: Box  # what this block writes: core ∩ ROI
    output_begin: Coord  # where the network's output starts: read begin + a valid network's context

    @property
    def output_crop(self) -> Box:
        """The write box in the coordinates of this block's network output."""
        return self.write_box.relative_to(self.output_begin)

    def __str__(self) -> str:
        return f"block {tuple(self.index)} (writes {self.write_box})"


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """A block grid over ``roi``; see the module docstring for the rules it keeps."""

    volume_box: Box
    roi: Box
    block_shape: Coord
    halo: Coord
    context: Coord
    input_shape: Coord

    @property
    def grid_begin(self) -> Coord:
        return self.roi.begin // self.block_shape

    @property
    def grid_shape(self) -> Coord:
        return blocks_per_axis(self.roi, self.block_shape)

    @property
    def num_blocks(self) -> int:
        return self.grid_shape.prod() if not self.roi.empty else 0

    @property
    def num_output_voxels(self) -> int:
        return self.roi.size

    def write_bounds(self, axis: int) -> tuple[np.ndarray, np.ndarray]:
        """Begin and end of every block's write box along ``axis``, one per grid index (numpy, in bulk)."""
        step = self.block_shape[axis]
        grid = np.arange(self.grid_begin[axis], self.grid_begin[axis] + self.grid_shape[axis], dtype=np.int64)
        return np.maximum(grid * step, self.roi.begin[axis]), np.minimum((grid + 1) * step, self.roi.end[axis])

    def block(self, index: Coord) -> Block:
        index = Coord(index)
        core = Box.from_shape(self.block_shape, index * self.block_shape)
        read_begin = core.begin - self.halo - self.context
        return Block(
            index=index,
            core_box=core,
            read_box=Box.from_shape(self.input_shape, read_begin),
            write_box=core.intersect(self.roi),
            output_begin=core.begin - self.halo,
        )

    def block_id(self, index: Coord) -> int:
        """The block's position in C order over the grid (0 .. num_blocks-1)."""
        rel = Coord(index) - self.grid_begin
        shape = self.grid_shape
        return (rel[0] * shape[1] + rel[1]) * shape[2] + rel[2]

    def block_from_id(self, block_id: int) -> Block:
        shape = self.grid_shape
        z, rest = divmod(block_id, shape[1] * shape[2])
        y, x = divmod(rest, shape[2])
        return self.block(self.grid_begin + Coord((z, y, x)))

    def __iter__(self) -> Iterator[Block]:
        if self.roi.empty:
            return
        ranges = [range(b, b + n) for b, n in zip(self.grid_begin, self.grid_shape)]
        for index in itertools.product(*ranges):
            yield self.block(Coord(index))

    def __len__(self) -> int:
        return self.num_blocks


def _check_positive(name: str, value: Coord, allow_zero: bool) -> None:
    bad = any(v < 0 for v in value) if allow_zero else any(v <= 0 for v in value)
    if bad:
        must = "non-negative" if allow_zero else "positive"
        raise InvalidOptionError(f"{name} must be {must} on every axis, got {tuple(value)}")


def halo_overhead(block: Coord, input_shape: Coord) -> float:
    """Network-input voxels per output voxel: what the halo costs (1.0 = none)."""
    return Coord(input_shape).prod() / Coord(block).prod()


def check_block_on_grid(block_shape: Coord, downsampling: Coord) -> None:
    """A block must be a multiple of the network's downsampling (``run``, ``plan`` and ``bench`` alike)."""
    block_shape, downsampling = Coord(block_shape), Coord(downsampling)
    if not block_shape.is_multiple_of(downsampling):
        raise InvalidOptionError(
            f"block {tuple(block_shape)} is not a multiple of the network's downsampling {tuple(downsampling)}; "
            f"use for example --block {','.join(map(str, block_shape.ceil_div(downsampling) * downsampling))}"
        )


def plan_blocks(
    *,
    volume_shape: Coord,
    block_shape: Coord,
    halo: Coord,
    context: Coord = Coord((0, 0, 0)),
    input_shape: Coord | None = None,
    roi: Box | None = None,
    downsampling: Coord = Coord((1, 1, 1)),
    chunk_shape: Coord | None = None,
) -> BlockPlan:
    """Plan the blocks, checking every rule of the module docstring.

    ``input_shape`` defaults to ``block + 2 * (halo + context)`` rounded up to a
    multiple of ``downsampling`` (what a 'same' U-Net needs).
    """
    volume_shape, block_shape, halo, context = map(Coord, (volume_shape, block_shape, halo, context))
    _check_positive("block", block_shape, allow_zero=False)
    _check_positive("halo", halo, allow_zero=True)
    check_block_on_grid(block_shape, downsampling)
    if chunk_shape is not None and not block_shape.is_multiple_of(chunk_shape):
        raise InvalidOptionError(
            f"block {tuple(block_shape)} is not a multiple of the output chunk shape {tuple(chunk_shape)}, "
            f"so output chunks would be written by several blocks; choose a block that the chunks divide"
        )
    volume_box = Box.from_shape(volume_shape)
    roi = volume_box if roi is None else roi
    if roi.empty or not volume_box.contains(roi):
        raise InvalidOptionError(f"ROI {roi} must be a non-empty box inside the volume {volume_box}")
    needed = block_shape + (halo + context) * 2
    if input_shape is None:
        input_shape = needed.ceil_div(downsampling) * downsampling
    input_shape = Coord(input_shape)
    if any(i < n for i, n in zip(input_shape, needed)):
        raise InvalidOptionError(f"network input {tuple(input_shape)} is smaller than block + 2 x (halo + context) = {tuple(needed)}")
    return BlockPlan(volume_box, roi, block_shape, halo, context, input_shape)


def small_block_warning(plan: BlockPlan, step: Coord) -> str | None:
    """One line when the block is smaller than twice its halo on an axis whose ROI has room for a larger one.

    Such a block reads far more than it writes: block 4^3 with halo 8 reads 20^3 voxels for each 64
    it writes (125x).  ``step`` (the block must be a multiple of it) rounds the suggested block up.
    None when the block is large enough, or already as large as the ROI wherever it is not.
    """

    block, halo, roi = plan.block_shape, plan.halo, plan.roi.shape
    if not any(b < 2 * h and b < r for b, h, r in zip(block, halo, roi)):
        return None
    wanted = Coord(max(b, min(2 * h, r)) for b, h, r in zip(block, halo, roi)).ceil_div(step) * step
    shape = lambda c: "x".join(map(str, c))  # noqa: E731
    return (f"block {shape(block)} is smaller than twice its halo {shape(halo)}: the network reads "
            f"{shape(plan.input_shape)} voxels for each {shape(block)} block it writes "
            f"({halo_overhead(block, plan.input_shape):.3g}x the output voxels); a larger block reads less, "
            f"such as --block {','.join(map(str, wanted))}")
