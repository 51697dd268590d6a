"""Out-of-memory back-off: smaller batches, then blocks predicted in parts.

A run must never die of device memory.  When the network runs out of memory
the worker halves its batch and runs the same blocks again; at batch 1 it
predicts each block in parts (equal sub-blocks that cover the block's core,
each with the same halo, cut from the block's already-read input), and assembles
the parts before the block is written -- so every output chunk is still
written once, by its one block.  The sizes that fit stay in force for the
rest of the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import is_out_of_memory  # noqa: F401 - the pipeline's, and every caller's
from ..geometry import Box, Coord

def _part(length: int, parts: int, step: int) -> int:
    """The length of each of ``parts`` parts of ``length``, rounded up to ``step``."""
    return -(-(-(-length // parts)) // step) * step


def split_core(core_shape: Coord, parts: Coord, step: Coord) -> list[Box]:
    """Equal boxes (relative to the core) covering ``core_shape``, about ``parts`` per axis.

    Each part is a multiple of ``step`` (the network's downsampling) long and
    starts on the pooling grid.  All parts have one shape -- the network sees
    one input shape, which a valid-convolution network accepts as it accepted
    the block's -- so where the parts do not divide an axis the last one is
    moved back to end at the core's end, overlapping its neighbour.
    """
    sizes = [_part(c, p, s) for c, p, s in zip(core_shape, parts, step)]
    starts = [sorted({min(b, max(c - n, 0)) for b in range(0, c, n)}) for c, n in zip(core_shape, sizes)]
    size = Coord(min(n, c) for n, c in zip(sizes, core_shape))
    return [Box.from_shape(size, Coord((z, y, x))) for z in starts[0] for y in starts[1] for x in starts[2]]


@dataclass
class Backoff:
    """The batch size and block parts that fit, as learnt from out-of-memory errors."""

    batch_size: int
    #: Parts per axis each block is predicted in (1, 1, 1: whole).
    parts: Coord = Coord((1, 1, 1))
    #: Out-of-memory errors recovered from.
    events: int = 0

    def reduce(self, core_shape: Coord, step: Coord) -> bool:
        """Halve the batch, or else the largest part of a block; False when nothing is left to halve."""
        if self.batch_size > 1:
            self.batch_size //= 2
            self.events += 1
            return True
        current = [_part(c, p, s) for c, p, s in zip(core_shape, self.parts, step)]
        axis = max(range(3), key=lambda a: current[a] if current[a] > step[a] else -1)
        if current[axis] <= step[axis]:
            return False
        target = max(step[axis], _part(current[axis], 2, step[axis]))
        if target >= current[axis]:
            target = current[axis] - step[axis]
        parts = list(self.parts)
        while _part(core_shape[axis], parts[axis], step[axis]) > target:
            parts[axis] += 1
        self.parts = Coord(parts)
        self.events += 1
        return True
