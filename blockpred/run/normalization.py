"""The run's normalisation with its numbers, and where it came from (a line of the summary).

``percentile:LOW,HIGH`` and ``meanstd:auto`` are taken of the volume: once per input, before the run, from the
bounded, deterministic sample the package statistics use (:func:`blockpred.run.package_stats.volume_sample`: the
whole volume up to 16 Mvox, else 27 tiles spread over it; never the ROI or the mask, so every run over one volume
normalises alike).  The run then goes on with the numbers (``minmax`` or ``meanstd``): every worker applies the
same, and the run's fingerprint holds them, so a resume, which takes them again of the same sample, finds the same.
"""

from __future__ import annotations

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
