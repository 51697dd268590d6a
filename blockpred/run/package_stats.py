"""A bioimage.io package's statistics for a run: computed once, by the client, before the run; stored with it.

:func:`configure_run` (called by :func:`blockpred.run.prepare.prepare`) turns a run over a package into one with
normalisation ``none`` and the package's statistics in ``model_kwargs``
(:data:`~blockpred.models.bioimageio.STATISTICS_KEY`), so that every worker applies the same constants and the
run's fingerprint holds them.  What the statistics are, and how each step's are taken of the values the steps
before it produced, is :func:`blockpred.models.bioimageio_stats.compute_statistics`; this module decides what
they are taken *of*:

* **over the volume** (a 3D package's ``per_sample`` and ``per_dataset`` statistics, a 2D package's
  per-dataset ones): a deterministic, bounded sample of the input (:func:`volume_sample`), the whole volume,
  never the ROI or the mask, so every run over one volume normalises alike; a resume recomputes them and must
  find the same;
* **per plane** (a 2D package's per-sample statistics, see :mod:`blockpred.models.bioimageio_planes`): every
  plane the ROI spans, each plane whole, in slabs of planes in parallel (:func:`compute_plane_statistics`: on
  the workers of a dask scheduler the run joins, else a thread pool here), and the table stored beside the
  markers (:func:`store_with_run`) so that a resume reads it back (:func:`load_from_run`) instead of reading
  every plane again.

A new run first has the package reproduce its own test output
(:func:`blockpred.models.check.check_package_once`).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..errors import InvalidOptionError, ModelLoadError
from ..geometry import Box, Coord
from ..models.bioimageio import STATISTICS_KEY, Package, _architecture, read_package
from ..models.bioimageio_planes import PLANES_KEY, PlaneStatistics, Processing, table_of
from ..models.bioimageio_stats import compute_statistics

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


def configure_run(cfg, source, previous=None, source_path=None, *, plan_only: bool = False):
    """The run's config for a package model: normalisation ``none``, the statistics in model_kwargs.

    ``previous``: the markers of the run this one resumes (None: a new run).  A new run first has the
    package reproduce its own test output (:func:`blockpred.models.check.check_package_once`, cached per package).  A 2D
    package's per-plane statistics are read back from the resumed run's markers when they are there
    (see :mod:`blockpred.models.bioimageio_planes`), else computed; ``source_path`` is where dask workers open the input
    when a scheduler computes them.  ``plan_only`` (``blockpred plan``): they are not computed (that reads
    every plane): the first plane's stand for all, for the dry run.
    """
    from ..models.planes import DEFAULT_BLOCK_2D, check_plane, lift
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
    check_plane(cfg.plane)
    plane = (cfg.plane or "yx") if package.planar else None
    if any(package.fixed) and cfg.block in (None, "auto"):
        # The one block a fixed input shape allows: never measured or searched (a named other block is refused
        # by the dry run).  A 2D package's (rows, cols) as a block one plane deep.
        block = package.default_block if plane is None else lift(package.default_block, plane, DEFAULT_BLOCK_2D[0])
        cfg = cfg.replace(block=block)
    if previous is None:
        from ..models.check import check_package_once

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
    from ..models.planes import stack_axis

    axis = stack_axis(plane)
    roi = cfg.roi if cfg.roi is not None else source.box
    first, end = int(roi.begin[axis]), int(roi.end[axis])
    if previous is not None and source_path is not None:
        from ..io.identity import real_name
        from ..pipeline.markers import as_json

        before = previous.fingerprint
        stated = ((before.get("model_kwargs") or {}).get(STATISTICS_KEY) or {}).get(PLANES_KEY)
        sha = stated[len("sha256:"):] if isinstance(stated, str) and stated.startswith("sha256:") else None
        same_input = [before.get(k) for k in ("input", "input_shape", "input_dtype")] == as_json(
            [real_name(source_path), source.shape, str(source.dtype)])  # another volume: its own statistics
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


#: The file the table is stored in, in the run's markers folder.
RUN_FILE = "plane_statistics.json"


#: A slab of planes read at once holds at most this many voxels (per channel), or one plane.
SLAB_VOXELS = 1 << 24


def plane_slabs(source, axis: int, first: int, end: int) -> list[tuple[int, int]]:
    """``[begin, end)`` slabs of planes along ``axis`` covering ``first`` .. ``end``: the input's chunk depth
    (on its chunk grid) where a slab of it holds at most :data:`SLAB_VOXELS` voxels, else fewer planes."""
    shape = Coord(source.spatial_shape)
    plane_voxels = max(1, shape.prod() // shape[axis])
    depth = max(1, int(Coord(source.spatial_chunk_shape)[axis]))
    if depth * plane_voxels > SLAB_VOXELS:
        depth = max(1, SLAB_VOXELS // plane_voxels)
    slabs, begin = [], first
    while begin < end:
        stop = min(end, (begin // depth + 1) * depth)
        slabs.append((begin, stop))
        begin = stop
    return slabs


def slab_rows(source, processing: Processing, given: Mapping[str, Any], axis: int, begin: int, end: int) -> list[dict]:
    """Each plane's statistics (per-plane steps only), for planes ``begin`` .. ``end - 1`` of ``source``."""
    lo, hi = list(source.box.begin), list(source.box.end)
    lo[axis], hi[axis] = begin, end
    data = source.read(Box(Coord(lo), Coord(hi)))
    if source.num_channels is None:
        data = data[np.newaxis]
    channels = data.shape[0]
    return [compute_statistics(processing, np.take(data, i, axis=1 + axis).reshape(channels, -1).astype(np.float32),
                               per_plane=True, given=given)
            for i in range(end - begin)]


def _slab_rows_at(source_path, processing: Processing, given, axis: int, begin: int, end: int) -> list[dict]:
    """:func:`slab_rows` on a dask worker: the input opened there."""
    from ..io import open_volume

    with open_volume(source_path) as source:
        return slab_rows(source, processing, given, axis, begin, end)


def default_threads() -> int:
    """Threads of the pass in this process: the CPU cores, 2 to 8 (reads decompress and numpy reduces
    outside the GIL)."""
    return max(2, min(8, os.cpu_count() or 2))


def compute_plane_statistics(processing: Processing, source, *, axis: int, first: int, end: int,
                             given: Mapping[str, Any], threads: int | None = None, scheduler: str | None = None,
                             source_path=None) -> PlaneStatistics:
    """The per-plane statistics of planes ``first`` .. ``end - 1`` along ``axis``, slab by slab in parallel:
    on the workers of the dask ``scheduler`` (each opens ``source_path``), else on ``threads`` threads here."""
    slabs = plane_slabs(source, axis, first, end)
    started = time.perf_counter()
    if scheduler is not None:
        parts, where = _on_workers(scheduler, source_path, processing, given, axis, slabs), "the dask workers"
    else:
        workers = min(threads or default_threads(), len(slabs)) or 1
        with ThreadPoolExecutor(workers, thread_name_prefix="blockpred-plane-stats") as pool:
            parts = list(pool.map(lambda slab: slab_rows(source, processing, given, axis, *slab), slabs))
        where = f"{workers} thread(s)"
    table = PlaneStatistics.of(axis, first, [row for part in parts for row in part])
    logger.info("computed the per-plane statistics of %d planes (%d to %d along %s) in %.2f s on %s",
                end - first, first, end - 1, "zyx"[axis], time.perf_counter() - started, where)
    return table


def _on_workers(scheduler: str, source_path, processing: Processing, given, axis: int,
                slabs: list[tuple[int, int]], wait_s: float = 60.0) -> list[list[dict]]:
    from ..cluster.scheduler import client_with_workers

    with client_with_workers(scheduler, wait_s) as client:
        futures = [client.submit(_slab_rows_at, source_path, processing, dict(given), axis, begin, end, pure=False)
                   for begin, end in slabs]
        return client.gather(futures)


def store_with_run(markers: Path, model_kwargs: Mapping[str, Any]) -> None:
    """Write the run's per-plane table (if it has one) into its markers folder ``markers`` (a local path
    or an object store's), unless the same table is there already."""
    table = table_of(model_kwargs)
    if table is None:
        return
    from ..io import stores
    from ..io.stores import ObjectUrl

    data = table.to_json().encode()
    location = markers / RUN_FILE
    if isinstance(location, ObjectUrl):
        if stores.read_bytes(location) != data:
            stores.write_bytes(location, data)
        return
    if location.is_file() and location.read_bytes() == data:
        return
    tmp = location.with_name(f".{RUN_FILE}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, location)


def load_from_run(markers: Path, *, axis: int, first: int, end: int, sha256: str | None) -> PlaneStatistics | None:
    """The table stored with an earlier run at ``markers``, when it is for these planes and is the one its
    fingerprint names (``sha256``); else None (then the planes are read again)."""
    from ..io import stores
    from ..io.stores import ObjectUrl

    location = markers / RUN_FILE
    try:
        data = stores.read_bytes(location) if isinstance(location, ObjectUrl) else location.read_bytes()
    except OSError:
        data = None
    if data is None:
        return None
    try:
        table = PlaneStatistics.from_json(data.decode())
    except ValueError as err:
        logger.warning("the per-plane statistics stored at %s are unreadable (%s); computing them again", location, err)
        return None
    if (table.axis, table.first, table.end) != (axis, first, end) or (sha256 is not None and table.sha256 != sha256):
        return None
    return table
