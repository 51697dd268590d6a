"""The statistics a bioimage.io package's processing needs, computed once over the volume.

Blocks have no per-sample statistics, so a package's ``per_sample`` and
``per_dataset`` statistics (percentiles for ``scale_range`` and ``clip``, mean
and standard deviation for ``zero_mean_unit_variance``) are both computed
"over the volume": by the client, once, before the run (:func:`configure_run`,
called by :func:`blockpred.prepare.prepare`), on a deterministic, bounded
sample of the input (:func:`volume_sample`).  Each step's statistics are taken
of the values the steps before it produced (the same torch modules the device
runs, applied to the sample), per channel when the step's axes leave the
channel out, else over all channels; a postprocessing step that refers to the
input tensor gets statistics of the raw input.  Percentiles are
``numpy.percentile`` (linear interpolation) of the float32 values; mean and
standard deviation are numpy's (ddof 0) in float64.  The numbers go to the
workers in ``model_kwargs`` (:data:`~.bioimageio.STATISTICS_KEY`), so every
worker applies the same constants, and the run's fingerprint holds them: a
resume recomputes them and must find the same.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..errors import InvalidOptionError, ModelLoadError
from ..geometry import Box, Coord
from .bioimageio import STATISTICS_KEY, Package, _architecture, read_package
from .bioimageio_ops import Step, build_op

logger = logging.getLogger(__name__)

#: A volume up to this many voxels (per channel) is read whole for its statistics; a larger one is sampled.
SAMPLE_VOXELS = 1 << 24
#: The tiles a larger volume is sampled in (up to SAMPLE_VOXELS // their size of them, on an even grid).
SAMPLE_TILE = Coord((32, 128, 128))


def volume_sample(source) -> np.ndarray:
    """The voxels statistics are computed on, as float32 (C, N): deterministic and bounded.

    A volume of up to :data:`SAMPLE_VOXELS` voxels (per channel) is read whole.
    A larger one is cut into tiles of :data:`SAMPLE_TILE` on a grid anchored at
    voxel 0; ``m = floor((SAMPLE_VOXELS // tile voxels) ** (1/3))`` evenly
    spaced tile positions per axis (``numpy.linspace`` over the grid, rounded;
    fewer when the grid is smaller; the last moved back to end at the volume's
    edge) give up to ``m**3`` whole tiles (27 tiles, 14.2 Mvox per channel, by
    default): the first, middle and last of each axis.  The whole volume, never the ROI
    or the mask: every run over one volume normalises alike.
    """
    shape, channels = source.spatial_shape, source.num_channels or 1
    if shape.prod() <= SAMPLE_VOXELS:
        boxes = [source.box]
    else:
        tile = SAMPLE_TILE.minimum(shape)
        grid = shape.ceil_div(tile)
        per_axis = int(round((SAMPLE_VOXELS // tile.prod()) ** (1 / 3), 6))
        picks = [np.unique(np.linspace(0, n - 1, min(n, per_axis)).round().astype(np.int64)) for n in grid]
        last = shape - tile  # a tile past the edge is moved back inside: every tile is whole
        boxes = [Box.from_shape(tile, (Coord((z, y, x)) * tile).minimum(last))
                 for z in picks[0] for y in picks[1] for x in picks[2]]
    parts = [source.read(box).reshape(channels, -1).astype(np.float32) for box in boxes]
    return np.concatenate(parts, axis=1)


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


def compute_statistics(package: Package, sample: np.ndarray) -> dict:
    """Every step's statistics (keys ``pre.I`` / ``post.I``), each on the sample as the steps before left it
    (on the raw sample for a step whose ``reference_tensor`` is the input: "the unprocessed input")."""
    raw = torch.from_numpy(np.ascontiguousarray(sample))[None, :, :, None, None]
    statistics, values = {}, raw
    with torch.inference_mode():
        for index, step in enumerate(package.pre):
            stats = _statistics(step, raw if step.of_raw_input else values) if step.stat else None
            if stats is not None:
                statistics[f"pre.{index}"] = stats
            values = build_op(step, stats)(values)
        for index, step in enumerate(package.post):
            if step.stat:
                statistics[f"post.{index}"] = _statistics(step, raw)
    return statistics


def configure_run(cfg, source):
    """The run's config for a package model: normalisation ``none``, the volume's statistics in model_kwargs."""
    from ..normalize import Normalization

    if cfg.normalize.kind not in ("auto", "none"):
        raise InvalidOptionError(f"bioimage.io package {str(cfg.model)!r} brings its own preprocessing; drop "
                                 f"--normalize {cfg.normalize} (it must be auto or none)")
    if cfg.weights is not None:
        raise InvalidOptionError(f"bioimage.io package {str(cfg.model)!r} holds its own weights; drop --weights")
    unknown = sorted(set(cfg.model_kwargs) - {STATISTICS_KEY})
    if unknown:
        raise InvalidOptionError(f"model_kwargs {unknown} do not apply to bioimage.io package {str(cfg.model)!r}")
    package = read_package(cfg.model)
    if package.in_channels != (source.num_channels or 1):
        raise ModelLoadError(f"network {package.name!r} takes {package.in_channels} input channel(s) but "
                             f"{source.path} has {source.num_channels or 1}")
    if package.weights_format == "pytorch_state_dict":
        arch = package.descr.weights.pytorch_state_dict.architecture
        if not getattr(arch, "import_from", None) and not cfg.trust_pickle:
            _architecture(package, arch, trust_pickle=False)  # refuses, before the volume is read
    if any(package.fixed) and cfg.block in (None, "auto"):
        # The one block a fixed input shape allows: never measured or searched (a named other block is refused
        # by the dry run).
        cfg = cfg.replace(block=package.default_block)
    kwargs = {}
    if package.needs_statistics:
        started = time.perf_counter()
        kwargs[STATISTICS_KEY] = compute_statistics(package, volume_sample(source))
        logger.info("%s: statistics of the volume in %.2f s: %s", package.name,
                    time.perf_counter() - started, kwargs[STATISTICS_KEY])
    return cfg.replace(normalize=Normalization("none"), model_kwargs=kwargs)

