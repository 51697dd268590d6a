"""The statistics a bioimage.io package's processing needs, of given values: :func:`compute_statistics`.

Percentiles for ``scale_range`` and ``clip``, mean and standard deviation for
``zero_mean_unit_variance``: each step's statistics are taken of the values
the steps before it produced (the same torch modules the device runs,
applied to the values), per channel when the step's axes leave the channel
out, else over all channels; a postprocessing step that refers to the input
tensor gets statistics of the raw input.  Percentiles are
``numpy.percentile`` (linear interpolation) of the float32 values; mean and
standard deviation are numpy's (ddof 0) in float64.  What they are taken of
(the volume, or each plane) and when is the run's:
:mod:`blockpred.run.package_stats`.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np
import torch

from .bioimageio_ops import Step, build_op
from .bioimageio_planes import PLANES_KEY, PlaneStatistics, Processing  # noqa: F401

logger = logging.getLogger(__name__)


def _statistics(step: Step, values: torch.Tensor) -> dict:
    """``step``'s statistics of ``values`` (1, C, N, 1, 1): per channel or over all, as lists of floats."""
    flat = values[0, :, :, 0, 0].double().numpy()
    data = flat if step.per_channel else flat.reshape(1, -1)
    if step.stat == "percentiles":
        out = {}
        for key, q in (("lo", step.params.get("lo_q")), ("hi", step.params.get("hi_q"))):
            if q is not None:
                out[key] = [float(v) for v in np.percentile(data, q, axis=1)]
        return out
    return {"mean": [float(v) for v in data.mean(axis=1)], "std": [float(v) for v in data.std(axis=1)]}


def compute_statistics(package, sample: np.ndarray, *, per_plane: bool = False,
                       given: Mapping[str, Any] | None = None) -> dict:
    """Every step's statistics (keys ``pre.I`` / ``post.I``), each on the sample as the steps before left it
    (on the raw sample for a step whose ``reference_tensor`` is the input: "the unprocessed input").

    ``package``: anything with the steps ``pre`` and ``post`` (a :class:`Package`).  By default the steps
    over the volume (all of a 3D package's), ``sample`` a sample of the volume; the steps per plane (a 2D
    package's per-sample steps) and what follows them are left out.  ``per_plane``: ``sample`` is one plane,
    and the statistics are those of the steps per plane, the steps over the volume before them applied with
    their constants ``given`` (the volume's).
    """
    raw = torch.from_numpy(np.ascontiguousarray(sample))[None, :, :, None, None]
    statistics, values, given = {}, raw, given or {}
    with torch.inference_mode():
        for index, step in enumerate(package.pre):
            if step.per_plane != per_plane and (step.per_plane or not any(s.per_plane for s in package.pre[index:])):
                break  # the volume's pass ends at the first step per plane; a plane's after its last one
            key, stats = f"pre.{index}", None
            if step.stat:
                stats = _statistics(step, raw if step.of_raw_input else values) if step.per_plane == per_plane \
                    else given[key]
                if step.per_plane == per_plane:
                    statistics[key] = stats
            values = build_op(step, stats)(values)
        for index, step in enumerate(package.post):
            if step.stat and step.per_plane == per_plane:
                statistics[f"post.{index}"] = _statistics(step, raw)
    return statistics




