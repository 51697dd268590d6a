"""The statistics a bioimage.io package's processing needs, computed once, before the run.

A 3D package's ``per_sample`` and ``per_dataset`` statistics (percentiles for
``scale_range`` and ``clip``, mean and standard deviation for
``zero_mean_unit_variance``) are both computed "over the volume" (blocks have
no per-sample statistics), and so are a 2D package's per-dataset ones (axes
with the batch, or none named): by the client, once, before the run
(:func:`configure_run`, called by :func:`blockpred.prepare.prepare`), on a
deterministic, bounded sample of the input (:func:`volume_sample`).  A 2D
package's per-sample statistics (axes y and x without the batch) are per
plane: one set per plane, see :mod:`.bioimageio_planes`.  Each step's
statistics are taken of the values the steps before it produced (the same
torch modules the device runs, applied to the sample), per channel when the
step's axes leave the channel out, else over all channels; a postprocessing
step that refers to the input tensor gets statistics of the raw input.
Percentiles are ``numpy.percentile`` (linear interpolation) of the float32
values; mean and standard deviation are numpy's (ddof 0) in float64.  The
numbers go to the workers in ``model_kwargs``
(:data:`~.bioimageio.STATISTICS_KEY`), so every worker applies the same
constants, and the run's fingerprint holds them: a resume recomputes the
volume's and must find the same (the per-plane ones it reads back).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

import numpy as np
import torch

from ..errors import InvalidOptionError, ModelLoadError
from ..geometry import Box, Coord
from .bioimageio import STATISTICS_KEY, Package, _architecture, read_package
from .bioimageio_ops import Step, build_op
from .bioimageio_planes import (PLANES_KEY, PlaneStatistics, Processing, compute_plane_statistics,
                                load_from_run)

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


def configure_run(cfg, source, previous=None, source_path=None, *, plan_only: bool = False):
    """The run's config for a package model: normalisation ``none``, the statistics in model_kwargs.

    ``previous``: the markers of the run this one resumes (None: a new run).  A new run first has the
    package reproduce its own test output (:func:`.check.check_package_once`, cached per package).  A 2D
    package's per-plane statistics are read back from the resumed run's markers when they are there
    (see :mod:`.bioimageio_planes`), else computed; ``source_path`` is where dask workers open the input
    when a scheduler computes them.  ``plan_only`` (``blockpred plan``): they are not computed (that reads
    every plane): the first plane's stand for all, for the dry run.
    """
    from ..normalize import Normalization
    from .planes import DEFAULT_BLOCK_2D, check_plane, lift

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
    check_plane(cfg.plane)
    plane = (cfg.plane or "yx") if package.planar else None
    if any(package.fixed) and cfg.block in (None, "auto"):
        # The one block a fixed input shape allows: never measured or searched (a named other block is refused
        # by the dry run).  A 2D package's (rows, cols) as a block one plane deep.
        block = package.default_block if plane is None else lift(package.default_block, plane, DEFAULT_BLOCK_2D[0])
        cfg = cfg.replace(block=block)
    if previous is None:
        from .check import check_package_once

        check_package_once(cfg.model, trust_pickle=cfg.trust_pickle)
    kwargs = {}
    if package.needs_statistics:
        started = time.perf_counter()
        over_volume = any(step.stat and not step.per_plane for step in package.pre + package.post)
        statistics = compute_statistics(package, volume_sample(source)) if over_volume else {}
        if statistics:
            logger.info("%s: statistics of the volume in %.2f s: %s", package.name, time.perf_counter() - started,
                        statistics)
        if any(step.per_plane for step in package.pre + package.post):
            statistics[PLANES_KEY] = _plane_statistics(cfg, source, source_path, package, plane, statistics, previous,
                                                       plan_only)
        kwargs[STATISTICS_KEY] = statistics
    return cfg.replace(normalize=Normalization("none"), model_kwargs=kwargs)


def _plane_statistics(cfg, source, source_path, package: Package, plane: str, given: dict,
                      previous, plan_only: bool = False) -> PlaneStatistics:
    """The per-plane statistics of the planes the run's ROI spans: the resumed run's, else computed."""
    from .planes import stack_axis

    axis = stack_axis(plane)
    roi = cfg.roi if cfg.roi is not None else source.box
    first, end = int(roi.begin[axis]), int(roi.end[axis])
    if previous is not None and source_path is not None:
        from ..markers import as_json
        from ..prepare import _real_name

        before = previous.fingerprint
        stated = ((before.get("model_kwargs") or {}).get(STATISTICS_KEY) or {}).get(PLANES_KEY)
        sha = stated[len("sha256:"):] if isinstance(stated, str) and stated.startswith("sha256:") else None
        same_input = [before.get(k) for k in ("input", "input_shape", "input_dtype")] == as_json(
            [_real_name(source_path), source.shape, str(source.dtype)])  # another volume: its own statistics
        table = load_from_run(previous.path, axis=axis, first=first, end=end, sha256=sha) if sha and same_input \
            else None
        if table is not None:
            logger.info("%s: the per-plane statistics of %d planes stored with the run at %s, not computed again",
                        package.name, table.num_planes, previous.path)
            return table
    processing = Processing(package.pre, package.post)
    if plan_only:
        one = compute_plane_statistics(processing, source, axis=axis, first=first, end=first + 1, given=given)
        logger.info("%s: the per-plane statistics are computed by the run; the plan's dry run takes the first "
                    "plane's for all", package.name)
        return PlaneStatistics.of(axis, first, [{key: {name: array[0].tolist() for name, array in stats.items()}
                                                 for key, stats in one.values.items()}] * (end - first))
    return compute_plane_statistics(
        processing, source, axis=axis, first=first, end=end, given=given,
        scheduler=cfg.scheduler, source_path=None if source_path is None else source_path.absolute())
