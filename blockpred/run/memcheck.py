"""A block's memory, checked before the network runs at it: :func:`foresee` and :func:`check_block`.

A block that does not fit must not reach its dry run: on the CPU the dry run
of ``--block 512`` with ``tiny`` (input 532^3) grew a process past 20 GB on a
24 GB machine until the kernel killed it, and the kernel may kill other
processes with it.  So before the dry run, the block's pass is foreseen from
the network's memory per voxel (:mod:`blockpred.tuning.passmemory`: counted
once at a small shape, cached), with what the process holds and, on the CPU,
the pipeline's queue (the blocks read ahead, the outputs waiting for the
writers: :meth:`blockpred.tuning.hostbudget.HostBudget.queued_bytes`):

* a block the options name (or the one the output being resumed started with)
  foreseen over the most the run may take (``--memory-limit``, else what the
  process holds and the machine has available; on CUDA the device's free
  memory) is refused in one line that names the largest block of the same
  proportions within the budget (on CUDA, and under the index limit of
  :mod:`blockpred.tuning.tensors`);
* the start block blockpred chose itself is made smaller until it is within
  the budget (a line at INFO says so);
* a ``--memory-limit`` below what the smallest block (:func:`least_block`) takes
  is refused in one line.

Where the memory cannot be told, or the network's pass cannot be counted, the
block goes on to its dry run as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ..config import RunConfig
from ..errors import MemoryBudgetError
from ..geometry import Coord
from ..pipeline import Predictor
from ..tuning.autosize import MEMORY_FRACTION
from ..tuning.hostbudget import HostBudget, keeping_outputs
from ..tuning.passmemory import MemoryRoom, PassMemory, pass_memory, size_text
from ..tuning.tensors import over_index_limit

logger = logging.getLogger(__name__)

#: The smallest block worth running, per axis (on the network's grid, and no larger than the region needs).
LEAST_SIDE = 16
#: Each smaller block tried for a suggestion is this much smaller per axis (twice fewer voxels).
SHRINK = 2 ** (-1 / 3)


def least_block(step: Coord, region_shape: Coord, smallest: Coord | None = None) -> Coord:
    """The smallest block worth running: :data:`LEAST_SIDE` per axis on ``step``, at least ``smallest`` (the least the
    network takes), at most the region rounded up to ``step``."""
    least = Coord(-(-LEAST_SIDE // s) * s for s in step)
    if smallest is not None:
        least = least.maximum(smallest.ceil_div(step) * step)
    return least.minimum(region_shape.ceil_div(step) * step)


def measure_input(downsampling: Coord, min_shape: Coord | None = None) -> Coord:
    """The input a 'same' network's pass is counted at: 32 voxels per axis, on its grid (at least ``min_shape``, the
    least it takes, in steps of the downsampling from there)."""
    low = min_shape if min_shape is not None else downsampling
    return Coord(lo + max(0, -(-(32 - lo) // d)) * d for lo, d in zip(low, downsampling))


@dataclass(frozen=True)
class Foresight:
    """A block's memory foreseen before it runs: its pass, what is held already and (on the CPU) the queue."""

    memory: PassMemory
    room: MemoryRoom
    halo: Coord
    downsampling: Coord
    #: On the CPU, the pipeline whose queue the process holds beside the pass (None on CUDA: the queue is the host's).
    queue: HostBudget | None
    #: Bytes of the input as read, per voxel (its dtype, its channels).
    raw_bytes_per_voxel: int
    #: On CUDA: a block suggested keeps every tensor under the 32-bit index limit (:mod:`blockpred.tuning.tensors`).
    index_limited: bool = False

    def input_shape(self, block: Coord) -> Coord:
        """The network's input for ``block`` (a 'same' network's rounded up to the downsampling)."""
        context = self.memory.context
        if context == Coord((0, 0, 0)):
            return (block + self.halo * 2).ceil_div(self.downsampling) * self.downsampling
        return block + (self.halo + context) * 2

    def bytes(self, block: Coord, batch: int = 1) -> int:
        """What the room holds at the peak of a run at ``block`` x ``batch``."""
        input_shape = self.input_shape(block)
        total = self.room.held_bytes + self.memory.pass_bytes(input_shape, batch)
        if self.queue is not None:
            total += self.queue.queued_bytes(input_shape.prod() * self.raw_bytes_per_voxel,
                                             block.prod() * self.queue.output_bytes_per_voxel, batch)
        return total

    def describe(self, block: Coord, batch: int = 1) -> str:
        """``block 512x512x512 (input 532x532x532, batch 1) is foreseen to take 28.91 GiB of memory``"""
        return (f"block {'x'.join(map(str, block))} (input {'x'.join(map(str, self.input_shape(block)))}, batch "
                f"{batch}) is foreseen to take {size_text(self.bytes(block, batch))} of {self.room.where}")

    def fitting(self, block: Coord, batch: int, bound: int, step: Coord, least: Coord) -> Coord | None:
        """The largest block of ``block``'s proportions (each axis a multiple of ``step``, at least ``least``'s)
        foreseen within ``bound`` bytes (and, :attr:`index_limited`, the index limit); None where even ``least``
        is not."""
        least = least.minimum(block)
        candidate, factor = block, 1.0
        while True:
            indexed = not self.index_limited or over_index_limit(
                self.memory.largest_per_voxel, self.input_shape(candidate).prod(), batch) is None
            if self.bytes(candidate, batch) <= bound and indexed:
                return candidate
            if candidate == least:
                return None
            factor *= SHRINK
            candidate = Coord(max(lo, int(b * factor) // s * s) for b, s, lo in zip(block, step, least))


def foresee(cfg: RunConfig, predictor: Predictor, model_key: dict, budget: HostBudget, *, measure_input: Coord,
            halo: Coord, downsampling: Coord, raw_dtype, in_channels: int) -> Foresight | None:
    """The foresight of this run's blocks: the network counted at ``measure_input`` (or its cached count; a new
    count is cached by :func:`blockpred.tuning.passmemory.remember` once the run has passed every check) and the
    room of this process's memory (CUDA: the device's); None where either cannot be told."""
    cuda = predictor.device.type == "cuda"
    room = MemoryRoom.of_device(predictor, MEMORY_FRACTION) if cuda else MemoryRoom.of_host(budget)
    if room is None:
        return None
    memory = pass_memory(predictor, in_channels, measure_input, model_key, store=False)
    if memory is None:
        return None
    queue = None if cuda else keeping_outputs(budget, cfg, memory.out_channels)
    return Foresight(memory, room, halo, downsampling, queue, in_channels * np.dtype(raw_dtype).itemsize,
                     index_limited=cuda)


def check_limit(foresight: Foresight, least: Coord) -> None:
    """One line where ``--memory-limit`` is below what the ``least`` block takes (:func:`least_block`)."""
    room = foresight.room
    if room.named and foresight.bytes(least) > room.most_bytes:
        raise MemoryBudgetError(
            f"--memory-limit {size_text(room.most_bytes)} is below what a run takes: this process holds "
            f"{size_text(room.held_bytes)} before any block, and {foresight.describe(least)} with the blocks queued "
            f"for reading and writing; name a limit of {size_text(foresight.bytes(least) * 2)} or more"
        )


def check_block(foresight: Foresight, block: Coord, *, batch: int, origin: str, step: Coord, least: Coord) -> Coord:
    """``block`` where it fits (see the module docstring), a smaller start block, or one line
    (:class:`~blockpred.errors.MemoryBudgetError`).

    ``origin``: ``named`` (the options'), ``resumed`` (the output's) or ``default`` (blockpred's start block).
    """
    room = foresight.room
    check_limit(foresight, least)
    foreseen = foresight.bytes(block, batch)
    over_most = foreseen > room.most_bytes
    if not over_most and (origin != "default" or foreseen <= room.budget_bytes):
        return block
    fitting = foresight.fitting(block, batch, room.budget_bytes, step, least)
    if fitting is None:
        fitting = foresight.fitting(block, batch, room.most_bytes, step, least)
    if origin == "default" and fitting is not None:
        logger.info("start block %s is foreseen over %s: starting at %s (%s)", "x".join(map(str, block)),
                    room.budget_what, "x".join(map(str, fitting)), size_text(foresight.bytes(fitting, batch)))
        return fitting
    over = f"{foresight.describe(block, batch)}, more than {room.most_what}"
    if fitting is None:
        raise MemoryBudgetError(
            f"{over}, and even {foresight.describe(least, batch)}; free memory"
            f"{', raise --memory-limit' if room.named else ''}, or use a smaller --batch-size, --precision bf16 or a "
            f"smaller network"
        )
    within = room.budget_what if foresight.bytes(fitting, batch) <= room.budget_bytes else room.most_what
    name = ",".join(map(str, fitting))
    if origin == "resumed":
        raise MemoryBudgetError(
            f"this output was started with {over}; free memory, or start again with --overwrite --block {name} "
            f"(foreseen at {size_text(foresight.bytes(fitting, batch))}, within {within})"
        )
    raise MemoryBudgetError(
        f"{over}; --block {name} is foreseen at {size_text(foresight.bytes(fitting, batch))}, within {within}; "
        f"--block auto measures the fastest block that fits{'' if room.named else ', --memory-limit sets the budget'}"
    )
