"""OME-Zarr pyramids: downsampled levels of a finished prediction, written blockwise.

A zarr output is an OME-NGFF image group whose array ``0`` is the prediction.
``--pyramid N`` adds the arrays ``1`` .. ``N``, each made from the one before
(:func:`plan_levels` says how), and then lists all of them in the group's
``multiscales`` metadata, so napari and neuroglancer open the result at any
zoom.

Factors.  Each level halves the axes whose voxels are finest: an axis is
halved when twice its voxel size is at most the largest voxel size of the
level before; when no axis qualifies (the voxels are near isotropic), every
axis is halved.  EM at 40x4x4 nm thus goes 40x8x8, 40x16x16, 40x32x32, then
80x64x64.  An axis of one voxel is never halved; a volume whose axes are all
one voxel has no further level.

Blockwise, bounded memory.  A level is written in units of its own write unit
(its shard, or its chunk when not sharded), each read once from the level
before (the unit times the factor), downsampled (:mod:`blockpred.run.downsample`)
and written whole, by a few threads at a time: memory is a few units, never a
level.  A level's shards cover the region of one shard of the level before
(its shard shape divided by the factor, at least one chunk), so a unit reads
at most one shard of the level before, the size of a prediction block.

Where.  After an in-process run the client writes the levels (threads);
after a run on dask, the cluster's workers do, in tasks of up to
:data:`UNITS_PER_TASK` units, a level at a time (each level reads the one
before), retried like the blocks' tasks.

Crashes.  The metadata names a level only once every level is written; a run
that finds levels it did not name computes them again.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import InvalidOptionError
from ..geometry import Box, Coord
from ..io import VolumePath, create_volume, open_volume
from .downsample import check_method, downsample

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Level:
    """One level of a pyramid: ``index`` 0 is the prediction itself."""

    index: int
    #: Factor from the level before, per axis (z, y, x); (1, 1, 1) for level 0.
    factor: Coord
    #: Factor from level 0, per axis.
    scale: Coord
    shape: Coord
    chunks: Coord
    #: None: not sharded.
    shards: Coord | None

    @property
    def write_unit(self) -> Coord:
        return self.shards if self.shards is not None else self.chunks

    @property
    def unit_grid(self) -> Coord:
        return self.shape.ceil_div(self.write_unit)

    @property
    def num_units(self) -> int:
        return self.unit_grid.prod()

    def unit(self, index: int) -> Box:
        """Write unit ``index`` (C order over :attr:`unit_grid`), cut at the level's edge."""
        grid = self.unit_grid
        z, rest = divmod(index, grid[1] * grid[2])
        y, x = divmod(rest, grid[2])
        begin = Coord((z, y, x)) * self.write_unit
        return Box.from_shape(self.write_unit, begin).intersect(Box.from_shape(self.shape))


def _next_factor(voxel: tuple[float, ...], shape: Coord) -> Coord:
    can = [n > 1 for n in shape]
    if not any(can):
        return Coord((1, 1, 1))
    largest = max(v for v, c in zip(voxel, can) if c)
    finest = [c and 2 * v <= largest for v, c in zip(voxel, can)]
    chosen = finest if any(finest) else can
    return Coord(2 if c else 1 for c in chosen)


def max_levels(shape: Coord) -> int:
    """How many levels a volume of ``shape`` can have beyond level 0 (until every axis is one voxel)."""
    return max(int(n - 1).bit_length() for n in shape)


def plan_levels(shape: Coord, voxel_size: tuple[float, ...] | None, num_levels: int, chunks: Coord,
                shards: Coord | None) -> list[Level]:
    """Level 0 (the prediction: ``shape``, ``chunks``, ``shards``) and ``num_levels`` levels below it."""
    limit = max_levels(shape)
    if not 0 <= num_levels <= limit:
        raise InvalidOptionError(
            f"pyramid levels must be between 0 and {limit} for a volume of shape {tuple(shape)} "
            f"(a level halves an axis; at {limit} every axis is one voxel), got {num_levels}"
        )
    voxel = tuple(float(v) for v in (voxel_size or (1.0, 1.0, 1.0)))
    levels = [Level(0, Coord((1, 1, 1)), Coord((1, 1, 1)), Coord(shape), Coord(chunks), shards)]
    for index in range(1, num_levels + 1):
        before = levels[-1]
        factor = _next_factor(voxel, before.shape)
        voxel = tuple(v * f for v, f in zip(voxel, factor))
        level_shape = before.shape.ceil_div(factor)
        level_chunks = Coord(chunks).minimum(level_shape)
        level_shards = None
        if before.shards is not None:
            covered = before.shards.ceil_div(factor).minimum(level_shape).ceil_div(level_chunks) * level_chunks
            level_shards = covered if covered != level_chunks else None
        levels.append(Level(index, factor, before.scale * factor, level_shape, level_chunks, level_shards))
    return levels


@dataclass(frozen=True)
class PyramidSummary:
    levels: tuple[Level, ...]
    method: str
    seconds: float
    #: Levels found written and named by an earlier run, so not computed again.
    num_kept: int = 0
    #: Dask workers that wrote the levels; 0: this process did.
    num_workers: int = 0

    def __str__(self) -> str:
        shapes = ", ".join(f"{lv.index}: {'x'.join(map(str, lv.shape))}" for lv in self.levels[1:])
        kept = f", {self.num_kept} kept from an earlier run" if self.num_kept else ""
        where = f" on {self.num_workers} dask worker{'s' if self.num_workers > 1 else ''}" if self.num_workers else ""
        return (f"pyramid: {len(self.levels) - 1} levels by {self.method} ({shapes}) in {self.seconds:.2f} s"
                f"{where}{kept}")


def level_path(image: VolumePath, index: int) -> VolumePath:
    """The array of level ``index`` inside the OME-NGFF image group ``image``."""
    name = f"{image.dataset}/{index}" if image.dataset else str(index)
    return VolumePath(image.format, image.container, name)


def build_pyramid(image: VolumePath, num_levels: int, method: str = "mean", *, threads: int = 2,
                  recompute: bool = True, client=None) -> PyramidSummary:
    """Write ``num_levels`` levels below the zarr image ``image`` and name them in its metadata.

    ``recompute=False`` keeps levels the metadata already names (a run that
    predicted nothing new); otherwise every level is written again.  With a
    dask ``client`` the workers write each level's units (tasks of up to
    :data:`UNITS_PER_TASK` units, a level at a time); else this process does,
    in ``threads`` threads.
    """
    from ..io.zarr import read_image_levels, write_image_levels

    method = check_method(method)
    started = time.perf_counter()
    info = read_image_levels(image)
    levels = plan_levels(info.shape, info.voxel_size, num_levels, info.chunks, info.shards)
    if not recompute and info.num_levels - 1 >= num_levels:
        return PyramidSummary(tuple(levels), method, time.perf_counter() - started, num_kept=num_levels)
    workers = 0
    for level in levels[1:]:
        before = levels[level.index - 1]
        create_volume(level_path(image, level.index), spatial_shape=level.shape, num_channels=info.num_channels,
                      dtype=info.dtype, chunk_shape=level.chunks, shard_shape=level.shards, ome=False,
                      overwrite=True).close()
        if client is None:
            write_units(image, before, level, method, 0, level.num_units, threads)
        else:
            workers = max(workers, _write_level_on_dask(client, image, before, level, method))
        logger.info("pyramid level %d: %s by %s from level %d", level.index, tuple(level.shape),
                    tuple(level.factor), before.index)
    write_image_levels(image, [lv.scale for lv in levels], info.voxel_size, centred=method != "stride")
    summary = PyramidSummary(tuple(levels), method, time.perf_counter() - started, num_workers=workers)
    logger.info("%s", summary)
    return summary


#: A dask task of the pyramid writes at most this many write units (a failed task redoes at most these).
UNITS_PER_TASK = 256
#: Tasks per worker a level is cut into, at least (so every worker gets work, and a slow one little).
TASKS_PER_WORKER = 4


def _write_level_on_dask(client, image: VolumePath, before: Level, level: Level, method: str) -> int:
    """The level's units written by the cluster's workers; returns how many workers there were."""
    workers = max(1, len(client.scheduler_info(n_workers=-1)["workers"]))
    per_task = max(1, min(UNITS_PER_TASK, -(-level.num_units // (TASKS_PER_WORKER * workers))))
    futures = [client.submit(write_units, image, before, level, method, first,
                             min(first + per_task, level.num_units), None, pure=False, retries=2)
               for first in range(0, level.num_units, per_task)]
    for future in futures:
        future.result()  # the first error raises here, naming the task's units
    return workers


def write_units(image: VolumePath, before: Level, level: Level, method: str, first: int, stop: int,
                threads: int | None) -> None:
    """Write the units ``first`` .. ``stop - 1`` (C order over the level's grid of write units) of ``level``.

    Each unit is read from ``before`` (the unit times the factor), downsampled
    and written whole; units are disjoint write units, so threads write them at
    once, a few in flight.  ``threads`` None: the cores of this machine, up to 4
    (a dask worker's share).
    """
    threads = threads or max(1, min(4, os.cpu_count() or 1))
    with open_volume(level_path(image, before.index)) as source, \
            open_volume(level_path(image, level.index), mode="r+") as sink, \
            ThreadPoolExecutor(max_workers=threads, thread_name_prefix="blockpred-pyramid") as pool:
        in_flight: deque[Future] = deque()

        def one(unit: Box) -> None:
            read_box = Box(unit.begin * level.factor, (unit.end * level.factor).minimum(before.shape))
            sink.write(unit, downsample(source.read(read_box), level.factor, method))

        for index in range(first, stop):
            in_flight.append(pool.submit(one, level.unit(index)))
            if len(in_flight) >= 2 * threads:  # a few units in memory, never the level
                in_flight.popleft().result()
        while in_flight:
            in_flight.popleft().result()
