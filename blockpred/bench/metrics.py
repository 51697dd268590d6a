"""Throughput arithmetic: dataset sizes, runtime extrapolation, halo overhead.

Mvox/s always means *output* voxels (the voxels of the volume that get a
prediction) per second, unless a name says ``input``.  Extrapolation assumes
blockwise prediction is embarrassingly parallel::

    hours = voxels / (mvox_per_s * 1e6 * gpus * efficiency) / 3600

where ``efficiency`` is the measured multi-worker efficiency (1.0 when none
was measured).  8.1e12 voxels at 12.7 Mvox/s on one GPU is 177.2 h.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InvalidOptionError
from ..geometry import Coord
from ..pipeline.blocking import halo_overhead  # noqa: F401 - what a halo costs, with the blocks

#: Named datasets for ``--extrapolate`` (voxel counts).
NAMED_DATASETS: dict[str, int] = {
    # The CREMI test volumes padded for prediction, 200 x 3072 x 3072.
    "cremi-padded": 200 * 3072 * 3072,
    # The Platynereis EM volume of the seed benchmarks, 8.1 teravoxels.
    "platynereis": int(8.1e12),
}

_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}


@dataclass(frozen=True)
class Dataset:
    name: str
    voxels: int


def parse_size(text: str) -> Dataset:
    """``8.1T``, ``1.9G``, ``200x3072x3072`` or a name of :data:`NAMED_DATASETS`."""
    spec = str(text).strip()
    if spec.lower() in NAMED_DATASETS:
        return Dataset(spec.lower(), NAMED_DATASETS[spec.lower()])
    shape = re.fullmatch(r"(\d+)[x,](\d+)[x,](\d+)", spec.lower())
    if shape:
        return Dataset(spec, Coord(int(v) for v in shape.groups()).prod())
    number = re.fullmatch(r"(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmgtp]?)(?:vox)?", spec.lower())
    if number:
        return Dataset(spec, int(round(float(number.group(1)) * _SUFFIXES[number.group(2)])))
    names = ", ".join(NAMED_DATASETS)
    raise InvalidOptionError(
        f"dataset size must be a voxel count (8.1T, 1.9G), a shape (200x3072x3072) or one of {names}; got {text!r}"
    )


def hours_for(voxels: float, mvox_per_s: float, gpus: int = 1, efficiency: float = 1.0) -> float:
    """Hours to predict ``voxels`` at ``mvox_per_s`` per GPU on ``gpus`` GPUs."""
    if mvox_per_s <= 0 or gpus <= 0 or not 0 < efficiency <= 1:
        raise InvalidOptionError(
            f"throughput, GPU count and efficiency must be positive (efficiency <= 1), "
            f"got {mvox_per_s} Mvox/s, {gpus} GPUs, efficiency {efficiency}"
        )
    return voxels / (mvox_per_s * 1e6 * gpus * efficiency) / 3600.0


def mvox_per_s_for(voxels: float, hours: float, gpus: int = 1) -> float:
    """The per-GPU throughput that predicts ``voxels`` in ``hours`` on ``gpus`` GPUs (inverse of :func:`hours_for`)."""
    return voxels / (hours * 3600.0 * gpus) / 1e6


@dataclass(frozen=True)
class ExtrapolationRow:
    dataset: Dataset
    gpus: int
    hours: float

    @property
    def days(self) -> float:
        return self.hours / 24.0


def extrapolate(datasets: list[Dataset], gpus: list[int], mvox_per_s: float,
                efficiency: float = 1.0) -> list[ExtrapolationRow]:
    """One row per dataset and GPU count (one GPU always at efficiency 1)."""
    return [ExtrapolationRow(d, n, hours_for(d.voxels, mvox_per_s, n, efficiency if n > 1 else 1.0))
            for d in datasets for n in gpus]


def format_extrapolation(rows: list[ExtrapolationRow], mvox_per_s: float, efficiency: float,
                         overhead: float | None, device: str | None = None) -> str:
    """The table printed by ``blockpred bench --extrapolate``; ``device``: the one that measured the figure
    (None: assumed), which names what the figure is per (a GPU, or a CPU worker)."""
    unit = "CPU worker" if device is not None and not str(device).startswith("cuda") else "GPU"
    measured = f"measured on {device}" if device is not None else "assumed"
    lines = [f"runtime at {mvox_per_s:.4g} Mvox/s per {unit} (output voxels, {measured})",
             f"assumption: embarrassingly parallel, N {unit}s = N x one {unit}'s throughput"
             + (f" x measured multi-worker efficiency {efficiency:.2f}" if efficiency < 1 else ""),
             ]
    if overhead is not None:
        lines.append(f"halo overhead: {overhead:.2f} network-input voxels per output voxel (included in the throughput)")
    column = "GPUs" if unit == "GPU" else "CPUs"
    lines.append(f"{'dataset':<16} {'voxels':>10} {column:>5} {'hours':>10} {'days':>8}")
    for row in rows:
        hours = f"{row.hours:.1f}" if row.hours >= 1 else f"{row.hours:.3f}"
        lines.append(f"{row.dataset.name:<16} {row.dataset.voxels:>10.3g} {row.gpus:>5d} "
                     f"{hours:>9}h {row.days:>7.2f}d")
    return "\n".join(lines)
