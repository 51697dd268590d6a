"""The run's normalisation with its numbers, where it came from (a line of the summary), and which one a network
gives an informative output at (``check-model --input``: :func:`try_normalizations`, :func:`suggest`).

``percentile:LOW,HIGH`` and ``meanstd:auto`` are taken of the volume: once per input, before the run, from the
bounded, deterministic sample the package statistics use (:func:`blockpred.run.package_stats.volume_sample`: the
whole volume up to 16 Mvox, else 27 tiles spread over it; never the ROI or the mask, so every run over one volume
normalises alike).  The run then goes on with the numbers (``minmax`` or ``meanstd``): every worker applies the
same, and the run's fingerprint holds them, so a resume, which takes them again of the same sample, finds the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import RunConfig
from .package_stats import volume_sample


def resolve_normalization(cfg: RunConfig, source, *, package: bool = False) -> tuple[RunConfig, str]:
    """``cfg`` with its normalisation's numbers (taken of ``source`` where it needs them), and the summary's line
    of what ran and where it came from."""
    normalize = cfg.normalize
    if package:
        return cfg, "none here: the bioimage.io package's own preprocessing (its statistics of the volume)"
    if normalize.needs_statistics:
        sample = volume_sample(source)
        resolved = normalize.resolved(sample)
        return cfg.replace(normalize=resolved), (f"{resolved}, {normalize} of the volume ({sample.shape[1]:,} "
                                                 f"voxels sampled)")
    if normalize.kind == "auto":
        dtype = np.dtype(source.dtype)
        how = (f"{dtype.name} / {np.iinfo(dtype).max} to [0, 1]" if dtype.kind in "ui"
               else f"{dtype.name} unchanged")
        return cfg, (f"auto ({how}), the default; a network trained on other input needs --normalize "
                     f"(meanstd:auto, percentile:1,99.8, ...)")
    return cfg, f"{normalize}, as named"


#: What ``check-model --input`` tries besides the normalisation named (or the default).
CANDIDATES = ("auto", "meanstd:auto", "percentile:1,99.8")
#: Of one block's centre, at most this many voxels per axis (a 2D network's planes: one plane).
CHECK_BLOCK = (16, 256, 256)


@dataclass(frozen=True)
class NormalizationTrial:
    """One block's input after a normalisation and the network's output on it (the block's centre, halo cut)."""

    normalize: str
    resolved: str
    input_stats: tuple[float, float, float, float]  # mean, std, min, max
    output_stats: tuple[float, float, float, float]

    def line(self) -> str:
        stats = lambda s: f"mean {s[0]:.3g}, std {s[1]:.3g}, {s[2]:.3g} to {s[3]:.3g}"  # noqa: E731
        return f"{self.normalize:<18} input {stats(self.input_stats)}; output {stats(self.output_stats)}"

    def as_dict(self) -> dict:
        return {"normalize": self.normalize, "resolved": self.resolved,
                "input": dict(zip(("mean", "std", "min", "max"), self.input_stats)),
                "output": dict(zip(("mean", "std", "min", "max"), self.output_stats))}


def try_normalizations(module, source, named: str | None, *, halo, downsampling, plane_axis: int | None,
                       in_channels: int = 1) -> list[NormalizationTrial]:
    """One block at the volume's centre (a plane of it for a 2D network) through ``module`` on the CPU, at the
    normalisation named (else the default) and at each of :data:`CANDIDATES`, each resolved as a run would."""
    import torch

    from ..geometry import Box, Coord
    from ..normalize import Normalization
    from ..pipeline import Predictor
    from ..pipeline.padding import read_padded

    shape = source.spatial_shape
    core = Coord(1 if axis == plane_axis else min(n, c) for axis, (n, c) in enumerate(zip(shape, CHECK_BLOCK)))
    size = (core + Coord(halo) * 2).ceil_div(downsampling) * downsampling
    begin = shape // 2 - size // 2
    raw = read_padded(source, Box.from_shape(size, begin))
    raw = raw if source.num_channels else raw[None]
    predictor, sample, trials = Predictor(module, torch.device("cpu")), None, []
    for spec in dict.fromkeys([named or "auto", *CANDIDATES]):
        normalize = Normalization.parse(spec)
        if normalize.needs_statistics:
            sample = volume_sample(source) if sample is None else sample
            normalize = normalize.resolved(sample)
        x = normalize.apply(raw)
        y = predictor(x[None])[0]
        cut = tuple(slice((o - c) // 2, (o - c) // 2 + c) for o, c in zip(y.shape[1:], core))
        y = y[(slice(None), *cut)]
        stats = lambda a: tuple(float(v) for v in (a.mean(), a.std(), a.min(), a.max()))  # noqa: E731
        trials.append(NormalizationTrial(spec, str(normalize), stats(x), stats(y)))
    return trials


def suggest(trials: list[NormalizationTrial]) -> tuple[NormalizationTrial, str]:
    """The trial whose output spreads most (a network fed input unlike its training's gives a near-constant map),
    and a warning where the first (the normalisation named, or the default) gives a near-constant output."""
    best = max(trials, key=lambda t: t.output_stats[1])
    first = trials[0]
    warning = ""
    if first is not best and first.output_stats[1] < 0.25 * best.output_stats[1]:
        warning = (f"the output at --normalize {first.normalize} is near-constant (std {first.output_stats[1]:.3g} "
                   f"against {best.output_stats[1]:.3g} at {best.normalize}): the network was likely trained on "
                   f"other input; try --normalize {best.normalize}")
    return best, warning
