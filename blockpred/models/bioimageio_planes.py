"""Per-plane statistics of a 2D bioimage.io package: computed once per run, stored with it, applied per plane.

A 2D package's step whose axes are y and x (or y, x and channel) without
the batch axis takes per-*sample* statistics, and a 2D network's samples are
the planes of the volume (see :mod:`.planes`).  So each plane gets its own
constants:

* **Which planes**: every plane the run's ROI spans along the stacking axis
  (all of them without an ROI), each plane *whole* (the volume's full plane,
  not the ROI's part of it, and never the mask): a plane normalises alike
  whatever the ROI, so a run over an ROI writes what the whole run writes
  there.  A block that reads a plane outside those (the reflected planes of
  a block deeper than the planes left, or planes before or past the ROI that
  fill a block's depth) takes the nearest plane's constants: those planes'
  predictions are never written.
* **Computed** by :func:`compute_plane_statistics` before the run, in slabs of
  planes (the input's chunk depth along the stacking axis, at most
  :data:`SLAB_VOXELS` voxels), in parallel: on the workers of a dask
  scheduler the run joins (``--scheduler``), else on a thread pool of this
  process (a cluster blockpred starts itself is not up yet when the
  statistics are needed: its workers start while they are computed).  Each
  plane's statistics are those of :func:`.bioimageio_stats.compute_statistics`
  on the plane's values: steps over the volume before them apply the
  volume's constants, each per-plane step's statistics are taken of what the
  steps before it produced on that plane.
* **Stored with the run**: the table travels to the workers with the model
  (in ``model_kwargs``, as a :class:`PlaneStatistics`), the run's fingerprint
  holds its sha256 (:meth:`PlaneStatistics.__str__` is its fingerprint form),
  and :func:`store_with_run` writes it beside the markers
  (``<output>.blockpred/<dataset>/plane_statistics.json``) so a resume reads
  it back (:func:`load_from_run`) instead of reading every plane again.
* **Applied** per plane by :class:`~.bioimageio_ops.PlaneNormalize` and
  :class:`~.bioimageio_ops.PlaneClip`: the worker names the volume plane of
  each input plane of each block (:attr:`blockpred.pipeline.DeviceSteps.planes`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from ..errors import InvalidOptionError
from ..geometry import Box, Coord

logger = logging.getLogger(__name__)

#: Where a package's per-plane table sits in the statistics (``model_kwargs[STATISTICS_KEY]``).
PLANES_KEY = "planes"
#: The file the table is stored in, in the run's markers folder.
RUN_FILE = "plane_statistics.json"
#: A slab of planes read at once holds at most this many voxels (per channel), or one plane.
SLAB_VOXELS = 1 << 24


class Processing(NamedTuple):
    """A package's steps (what :func:`.bioimageio_stats.compute_statistics` needs of it), small to ship."""

    pre: tuple
    post: tuple


@dataclass(frozen=True, eq=False)
class PlaneStatistics:
    """The per-plane steps' statistics of planes ``first`` ... ``first + num_planes - 1`` along ``axis``.

    ``values``: step key (``pre.I`` / ``post.I``) -> statistic (``mean``, ``std``, ``lo``, ``hi``) ->
    float64 array (planes, columns): one column per channel, or one for all channels.
    """

    axis: int
    first: int
    values: Mapping[str, Mapping[str, np.ndarray]] = field(repr=False)
    sha256: str

    @classmethod
    def of(cls, axis: int, first: int, rows: Sequence[Mapping[str, Mapping[str, Sequence[float]]]]
           ) -> "PlaneStatistics":
        """From one ``{key: {statistic: [per column]}}`` per plane, in plane order."""
        keys = sorted(rows[0]) if rows else []
        values = {key: {name: np.asarray([row[key][name] for row in rows], dtype=np.float64)
                        for name in sorted(rows[0][key])} for key in keys}
        return cls(int(axis), int(first), values, _digest(int(axis), int(first), values))

    @property
    def num_planes(self) -> int:
        return len(next(iter(next(iter(self.values.values())).values()))) if self.values else 0

    @property
    def end(self) -> int:
        return self.first + self.num_planes

    def __str__(self) -> str:
        """The table's fingerprint form: what a run's fingerprint holds of it (see
        :func:`blockpred.markers.as_json`)."""
        return f"sha256:{self.sha256}"

    def __eq__(self, other) -> bool:
        return isinstance(other, PlaneStatistics) and other.sha256 == self.sha256

    def __hash__(self) -> int:
        return hash(self.sha256)

    def to_json(self) -> str:
        return json.dumps(_plain(self.axis, self.first, self.values) | {"sha256": self.sha256})

    @classmethod
    def from_json(cls, text: str) -> "PlaneStatistics":
        """The table stored by :meth:`to_json`; ``ValueError`` when it is not one, or its sha256 does not match."""
        data = json.loads(text)
        try:
            axis, first = int(data["axis"]), int(data["first"])
            values = {key: {name: np.asarray(array, dtype=np.float64) for name, array in stats.items()}
                      for key, stats in data["values"].items()}
            stated = str(data["sha256"])
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"not a table of plane statistics ({err})") from None
        if _digest(axis, first, values) != stated:
            raise ValueError("its values do not match its sha256")
        return cls(axis, first, values, stated)


def _plain(axis: int, first: int, values) -> dict:
    return {"axis": axis, "first": first,
            "values": {key: {name: np.asarray(array).tolist() for name, array in sorted(stats.items())}
                       for key, stats in sorted(values.items())}}


def _digest(axis: int, first: int, values) -> str:
    return hashlib.sha256(json.dumps(_plain(axis, first, values), sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------------- computing


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
    from .bioimageio_stats import compute_statistics

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
    from ..cluster import _quiet_dask, import_distributed

    import_distributed()
    from distributed import Client

    _quiet_dask()
    with Client(scheduler) as client:
        try:
            client.wait_for_workers(1, timeout=wait_s)
        except TimeoutError:
            raise InvalidOptionError(
                f"no dask worker joined {scheduler} within {wait_s:.0f} s; start the workers first") from None
        futures = [client.submit(_slab_rows_at, source_path, processing, dict(given), axis, begin, end, pure=False)
                   for begin, end in slabs]
        return client.gather(futures)


# ---------------------------------------------------------------------- stored with the run


def table_of(model_kwargs: Mapping[str, Any]) -> PlaneStatistics | None:
    """The per-plane table in a run's ``model_kwargs``, if any."""
    from .bioimageio import STATISTICS_KEY

    statistics = model_kwargs.get(STATISTICS_KEY) or {}
    table = statistics.get(PLANES_KEY) if isinstance(statistics, Mapping) else None
    return table if isinstance(table, PlaneStatistics) else None


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
