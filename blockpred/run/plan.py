"""``blockpred plan``: what a run would do and how long it would take, with nothing run or written.

A :class:`RunPlan` is made by :func:`blockpred.plan` from the same checks and
planning as :func:`blockpred.predict` (so a plan that prints is a run that
starts), and counts blocks, masked, already done, voxels and output files
without a value per block (:func:`count_left`), so it prints in seconds for
billions of blocks.

The runtime is ``voxels to predict / (Mvox/s per GPU x GPUs)``.  The
throughput is ``--assume-mvox-per-s`` when given, else the last one measured
for this network and precision: by a finished ``blockpred run`` (end to end,
per worker) or by ``blockpred bench`` (see :class:`ThroughputLog`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..cache import JsonFile, default_cache_dir
from ..geometry import Coord
from ..pipeline.blocking import BlockPlan

if TYPE_CHECKING:
    from ..pipeline.markers import DoneMarkers
    from .mask import Coverage

#: A run must have taken this long to be remembered as a throughput (start-up is not throughput).
MIN_RECORDED_S = 2.0


@dataclass(frozen=True)
class Throughput:
    mvox_per_s: float
    #: Where the figure comes from, for the reader: "assumed", "blockpred run on cuda:0, 2026-11-23" ...
    source: str
    #: The device that measured it ("cuda:0", "cpu"); None when assumed or not recorded.
    device: str | None = None

    @property
    def unit(self) -> str:
        """What the figure is per: a GPU, or a CPU worker where a CPU measured it."""
        return "CPU worker" if self.device is not None and not self.device.startswith("cuda") else "GPU"


@dataclass(frozen=True)
class RunPlan:
    input: str
    output: str
    model: str
    device: str
    precision: str
    volume_shape: Coord
    input_dtype: str
    plan: BlockPlan
    batch_size: int
    output_channels: int
    output_dtype: str
    chunks: Coord
    shards: Coord | None
    num_masked: int
    num_done: int
    #: Output voxels of the blocks still to run.
    voxels_to_predict: int
    #: Chunk files (shard files, when sharded) those blocks write.
    output_files: int
    resumed: bool
    throughput: Throughput | None
    gpus: tuple[int, ...] = (1, 2, 4, 8)
    #: How the block, batch and memory format the options left open were chosen (see blockpred.tuning.defaults).
    defaults: str | None = None
    #: The pyramid levels (``pyramid=N``) below level 0: their shapes, and how they are made.
    pyramid: tuple[Coord, ...] = ()
    pyramid_method: str = "mean"
    #: The halo, where it came from and whether it covers the network's receptive field (blockpred.run.halo).
    halo_note: str | None = None

    @property
    def num_todo(self) -> int:
        return self.plan.num_blocks - self.num_masked - self.num_done

    @property
    def halo_overhead(self) -> float:
        """Network-input voxels read per output voxel written (1.0: no halo)."""
        return self.plan.input_shape.prod() / self.plan.block_shape.prod()

    def hours(self, gpus: int) -> float | None:
        if self.throughput is None or self.throughput.mvox_per_s <= 0:
            return None
        return self.voxels_to_predict / (self.throughput.mvox_per_s * 1e6 * gpus) / 3600

    def __str__(self) -> str:
        p = self.plan
        shape = "x".join(map(str, self.volume_shape))
        roi = "whole volume" if p.roi == p.volume_box else str(p.roi)
        files = "shard" if self.shards is not None else "chunk"
        layout = f"chunks {_shape(self.chunks)}" + (f" in shards {_shape(self.shards)}" if self.shards else "")
        lines = [
            f"input     {self.input}: {shape} {self.input_dtype} ({_voxels(self.volume_shape.prod())}), ROI {roi}",
            f"model     {self.model} on {self.device}, {self.precision}, batch {self.batch_size}",
            f"blocks    {_shape(p.block_shape)} + halo {_shape(p.halo)}"
            + (f" + context {_shape(p.context)}" if p.context != Coord((0, 0, 0)) else "")
            + f" -> network input {_shape(p.input_shape)} ({_voxels(p.input_shape.prod())} per block); "
            f"halo overhead {self.halo_overhead:.2f} input voxels per output voxel",
            f"grid      {_shape(p.grid_shape)} = {p.num_blocks:,} blocks: {self.num_todo:,} to run, "
            f"{self.num_masked:,} masked out, {self.num_done:,} already done" + (" (resuming)" if self.resumed else ""),
            f"output    {self.output}: {self.output_channels} x {self.output_dtype}, {layout}; "
            f"{self.output_files:,} {files} file{'' if self.output_files == 1 else 's'} for "
            f"{_voxels(self.voxels_to_predict)} to predict",
        ]
        if self.pyramid:
            shapes = ", ".join(_shape(shape) for shape in self.pyramid)
            lines.append(f"pyramid   {len(self.pyramid)} level{'s' if len(self.pyramid) > 1 else ''} by "
                         f"{self.pyramid_method} after the prediction: {shapes}")
        if self.halo_note is not None:
            lines.insert(3, f"halo      {self.halo_note}")
        if self.defaults is not None:
            lines.insert(2, f"chosen    {self.defaults}")
        if self.throughput is None:
            lines.append("runtime   unknown: no throughput measured for this network yet; "
                         "pass --assume-mvox-per-s, or run `blockpred bench` on the target device")
        else:
            unit = self.throughput.unit
            times = ", ".join(f"{n} {unit}{'s' if n > 1 else ''} {_duration(self.hours(n))}" for n in self.gpus)
            lines.append(f"runtime   {times} at {self.throughput.mvox_per_s:.4g} Mvox/s per {unit} "
                         f"({self.throughput.source})")
        return "\n".join(lines)


@dataclass(frozen=True)
class Work:
    """What a run has left (:func:`count_left`)."""

    num_masked: int
    #: Blocks finished by an earlier run (done, or skipped as empty).
    num_done: int
    #: Output voxels of the blocks still to run, and the chunk files (shard files, when sharded) they write.
    voxels: int
    files: int


def count_left(plan: BlockPlan, write_unit: Coord, *, masked: Coverage | None = None,
               previous: DoneMarkers | None = None) -> Work:
    """The blocks masked out and already done, and the voxels and files of the rest, with no value per block.

    A block's voxels and files are products of its write box's extents (and
    write units) per axis, so the ROI's are products of sums along each axis.
    What does not run is taken away: the blocks a new run's mask leaves out, at
    the mask's resolution (``masked``, see :class:`blockpred.run.mask.Coverage`);
    for a resumed run (``previous``, its markers) the finished blocks by id and
    those its mask left out, stored one byte per block, a slab at a time.
    """
    sizes, units = _per_axis(plan, write_unit)
    voxels, files = (math.prod(int(w.sum()) for w in weights) for weights in (sizes, units))
    if previous is not None:
        num_masked = 0
        for z0, slab in previous.masked_slabs():
            rows = slice(z0, z0 + len(slab))
            num_masked += int(slab.sum())
            voxels -= _weigh(slab, sizes, rows)
            files -= _weigh(slab, units, rows)
        done = previous.finished_ids()
        index = np.unravel_index(done, tuple(plan.grid_shape))
        voxels -= int((sizes[0][index[0]] * sizes[1][index[1]] * sizes[2][index[2]]).sum())
        files -= int((units[0][index[0]] * units[1][index[1]] * units[2][index[2]]).sum())
        return Work(num_masked, len(done), voxels, files)
    if masked is not None:
        kept = round(masked.weigh(tuple(np.ones(len(w), dtype=np.int64) for w in sizes)))
        return Work(plan.num_blocks - kept, 0, round(masked.weigh(sizes)), round(masked.weigh(units)))
    return Work(0, 0, voxels, files)


def _weigh(slab: np.ndarray, weights: tuple[np.ndarray, ...], rows: slice) -> int:
    """The sum over the True blocks of a slab of whole z rows ``rows`` of the product of their ``weights``."""
    return round(float(np.einsum("ijk,i,j,k->", slab, weights[0][rows], weights[1], weights[2], dtype=np.float64)))


def _per_axis(plan: BlockPlan, write_unit: Coord) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """Per axis and block along it (int64): its write box's extent, and the write units (files) it touches."""
    sizes, files = [], []
    for axis in range(3):
        begin, end = plan.write_bounds(axis)
        sizes.append(end - begin)
        files.append(-(-end // write_unit[axis]) - begin // write_unit[axis])
    return tuple(sizes), tuple(files)


class ThroughputLog:
    """The last throughput measured per network and precision, in ``throughput.json`` of the cache directory.

    ``blockpred run`` records its end-to-end Mvox/s per worker after runs of
    at least :data:`MIN_RECORDED_S`; ``blockpred bench`` records what it
    measured.  Keyed by the network as the size cache keys it (name, weights,
    options) and the precision.
    """

    def __init__(self, path: Path | None = None):
        self.path = path if path is not None else default_cache_dir() / "throughput.json"
        self._file = JsonFile(self.path)

    @staticmethod
    def _key(model_key: dict, precision: str) -> str:
        return json.dumps([model_key, precision], sort_keys=True)

    def get(self, model_key: dict, precision: str) -> Throughput | None:
        entry = self._file.read().get(self._key(model_key, precision))
        try:
            device = entry.get("device") if isinstance(entry, dict) else None
            return Throughput(float(entry["mvox_per_s"]), str(entry["source"]),
                              str(device) if device is not None else None)
        except (TypeError, KeyError, ValueError):
            return None

    def put(self, model_key: dict, precision: str, mvox_per_s: float, how: str, device: str) -> None:
        source = f"{how} on {device}, {date.today().isoformat()}"
        self._file.merge({self._key(model_key, precision): {"mvox_per_s": mvox_per_s, "source": source,
                                                            "device": device}}, "the throughput")


def _shape(shape: Coord) -> str:
    return "x".join(map(str, shape))


def _voxels(count: float) -> str:
    for unit, size in (("Pvox", 1e15), ("Tvox", 1e12), ("Gvox", 1e9), ("Mvox", 1e6)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{int(count)} vox"


def _duration(hours: float | None) -> str:
    if hours is None:
        return "?"
    if hours >= 48:
        return f"{hours / 24:.1f} d"
    if hours >= 1:
        return f"{hours:.1f} h"
    seconds = hours * 3600
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.2g} s"


__all__ = ["RunPlan", "Throughput", "ThroughputLog", "Work", "count_left"]
