"""The output's storage layout: its chunks and, for zarr v3, its shards.

* **Chunks** are what a reader decompresses at a time.  By default, per axis,
  the largest divisor of the block (of the shard, when sharded) that is at
  most 128.
* **Shards** (zarr v3's ``sharding_indexed`` codec) put many chunks in one
  file.  A teravoxel output in 128^3 chunks is millions of files, which
  cluster file systems handle badly; sharded, it is one file per block.  A
  shard is rewritten whole, so blocks are whole shards (a multiple of the
  shard shape) and each shard is still written once, by one block.

``shards`` is ``"auto"`` (the default), ``"off"``, ``"block"`` (one shard per
block) or a shape.  ``auto`` shards a zarr v3 output by block when the
unsharded output would have more than :data:`MAX_UNSHARDED_CHUNKS` chunks,
and leaves smaller outputs (and zarr v2, N5, HDF5, which cannot shard) as
plain chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidOptionError
from ..geometry import Coord

#: Output chunks are at most this long per axis unless chosen explicitly.
MAX_DEFAULT_CHUNK = 128
#: An automatically laid out zarr v3 output with more chunks than this is sharded by block.
MAX_UNSHARDED_CHUNKS = 100_000


@dataclass(frozen=True)
class OutputLayout:
    chunks: Coord
    #: None: not sharded.
    shards: Coord | None = None

    @property
    def write_unit(self) -> Coord:
        """What one block writes whole: the shard when sharded, else the chunk."""
        return self.shards if self.shards is not None else self.chunks

    def num_files(self, volume_shape: Coord) -> int:
        """Files of one output (channels share a chunk): one per shard, or per chunk."""
        return Coord(volume_shape).ceil_div(self.write_unit).prod()


def default_chunks(shape: Coord, limit: int = MAX_DEFAULT_CHUNK) -> Coord:
    """Per axis the largest divisor of ``shape`` that is at most ``limit``."""
    return Coord(max(d for d in range(1, min(n, limit) + 1) if n % d == 0) for n in shape)


def block_step(downsampling: Coord, chunks: Coord | None, shards) -> Coord:
    """What every block must be a multiple of: the downsampling, and the chunks and shards asked for."""
    step = Coord(downsampling)
    for unit in (chunks, shards):
        if isinstance(unit, Coord):
            step = Coord(math.lcm(a, b) for a, b in zip(step, unit))
    return step


def choose_layout(*, block: Coord, volume_shape: Coord, chunks: Coord | None, shards,
                  can_shard: bool, target: str) -> OutputLayout:
    """The chunks and shards of an output written by blocks of ``block``; checks what the options asked.

    ``chunks`` is what ``--output-chunks`` said (None: default), ``shards``
    what ``--shards`` said (a shape, or one of :data:`SHARD_CHOICES`);
    ``can_shard`` whether the output's format can (zarr v3).
    """
    if isinstance(shards, Coord):
        if not can_shard:
            raise InvalidOptionError(
                f"--shards needs a zarr v3 output, but {target!r} is not one (zarr v2, N5 or HDF5); "
                f"drop --shards or write to a new .zarr container"
            )
        if not block.is_multiple_of(shards):
            raise InvalidOptionError(
                f"block {tuple(block)} is not a multiple of the shard shape {tuple(shards)}: blocks must be whole "
                f"shards, so each shard is written once; choose a block that the shards divide, or --shards block"
            )
        chosen = shards
    elif shards == "block" and can_shard:
        chosen = block
    elif shards == "block":
        raise InvalidOptionError(f"--shards block needs a zarr v3 output, but {target!r} is not one; drop --shards")
    else:
        chosen = None
    if chunks is None:
        chunks = default_chunks(chosen if chosen is not None else block)
    if chosen is None and shards == "auto" and can_shard:
        if Coord(volume_shape).ceil_div(chunks).prod() > MAX_UNSHARDED_CHUNKS and block != chunks:
            chosen = block
    if chosen is not None and not chosen.is_multiple_of(chunks):
        raise InvalidOptionError(
            f"shard shape {tuple(chosen)} is not a multiple of the output chunk shape {tuple(chunks)}; "
            f"choose shards that the chunks divide"
        )
    return OutputLayout(chunks, chosen)
