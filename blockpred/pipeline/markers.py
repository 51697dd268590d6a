"""Done markers: which blocks of a run are finished, kept beside the output.

A run writes, before any block, a small zarr v3 group beside the output
container (``vol.zarr/prediction`` -> ``vol.zarr.blockpred/prediction``,
``f.h5:/pred`` -> ``f.h5.blockpred/pred``) holding

* the run's *fingerprint* (attributes): everything that decides the output's
  values and layout -- input, model weights, block grid, halo, normalisation,
  output dtype ...;
* ``masked``, when the run has a mask: one byte per block of the grid, 1 for the
  blocks the mask leaves out, written once, in bulk, when the run is created
  (a teravoxel volume with a small mask skips millions of blocks without a
  write each);
* ``done/`` and ``skipped/``: append-only logs of block ids (little-endian
  int64, the block's C-order position in the grid, see
  :meth:`blockpred.pipeline.blocking.BlockPlan.block_id`), one file per process, so
  workers never share a file.  A mark is one ``write`` of 8 bytes to a file
  opened with ``O_APPEND`` (microseconds, and no file per block: 30 million
  blocks make a few files, not 30 million).  A block is marked only after its
  data is durable; a record cut short by a crash is ignored.

The group, its fingerprint and the logs' names are fsynced before a block is
marked, and the marks at the end of every job (see :mod:`.mark_logs`): after
a crash of the machine the same command resumes, computing again only the
blocks of the jobs that were running.

Reading the finished set is a bulk read of those few files into a boolean
grid; re-running the same command skips finished blocks, and a run whose
fingerprint differs is refused with the list of what changed.  Markers of an
older blockpred (one chunk file per block under ``done/c/``) are still read.

On an object store (an ``s3://`` output) the markers live on the same store
beside the output (``s3://b/vol.zarr/raw`` -> ``s3://b/vol.zarr.blockpred/raw``).
Objects cannot be appended to, so a process buffers its marks and writes them
as a new small object ``done/<host>-<pid>-<random>-<seq>.ids`` (same records)
every :data:`~.mark_logs.FLUSH_MARKS` marks, at most :data:`~.mark_logs.FLUSH_S`
seconds after a mark (a timer), at the end of every job (:meth:`DoneMarkers.flush`) and at exit.
A mark is still made only after the block's write committed; a crash loses at
most the marks not yet flushed, and those blocks are computed again, writing
the same values.  Reading lists ``done/`` and reads its objects at once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import zarr

from ..errors import RunFailedError
from ..geometry import Coord
from ..io import kvzarr, stores
from ..io.base import VolumePath
from ..io.durable import DurableLocalStore, sync_file, sync_path
from ..io.ownership import check_owner, lock_path
from ..io.stores import ObjectUrl
from . import mark_logs
from .blocking import Block, BlockPlan

log = logging.getLogger(__name__)

_ROOT_NAME = "_root"
#: Chunks of the ``masked`` array, in blocks (a few chunks even for millions of blocks).
_MASKED_CHUNKS = (64, 128, 128)


def markers_path(target: VolumePath) -> Path | ObjectUrl:
    """Where the markers of an output live: beside its (real, links resolved) container, named after its dataset."""
    container = target.absolute().container
    if not isinstance(container, ObjectUrl):  # one output, one set of markers, whichever link reaches it
        container = Path(os.path.realpath(container))
    return container.with_name(container.name + ".blockpred") / (target.dataset or _ROOT_NAME)


#: Fingerprint keys left out at their default (so outputs of runs before the key existed still resume): that value.
FINGERPRINT_DEFAULTS = {"tta": "off"}


def describe_changes(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``["halo (10, 10, 10) -> (8, 8, 8)", ...]`` for every key whose value differs."""
    changes = []
    for key in sorted(set(before) | set(now)):
        was, is_ = (values.get(key, FINGERPRINT_DEFAULTS.get(key)) for values in (before, now))
        if was != is_:
            changes.append(f"{key} {_show(was)} -> {_show(is_)}")
    return changes


def _show(value: Any) -> str:
    if isinstance(value, list):
        return "(" + ", ".join(_show(v) for v in value) + ")"
    if isinstance(value, str) and len(value) > 16 and all(c in "0123456789abcdef" for c in value):
        return value[:12]  # a hash: its start is enough to tell two apart
    return str(value)


def as_json(value: Any) -> Any:
    """A fingerprint value in the plain form JSON stores (tuples become lists)."""
    return json.loads(json.dumps(value, default=lambda v: list(v) if isinstance(v, (tuple, Coord)) else str(v)))


# Per process: the blocks this process marked, per marker set (a bit per block).
_MARKED: dict[tuple[str, str], "_Bits"] = {}
_MARKED_LOCK = threading.Lock()


class _Bits:
    """One bit per block of a grid: flat memory (3.8 MB for 30 million blocks), not a Python int per block."""

    def __init__(self, size: int):
        self._bytes = np.zeros((size + 7) // 8, dtype=np.uint8)

    def add(self, index: int) -> None:
        self._bytes[index >> 3] |= np.uint8(1 << (index & 7))

    def __contains__(self, index: int) -> bool:
        return bool(self._bytes[index >> 3] & (1 << (index & 7)))


@dataclass(frozen=True)
class DoneMarkers:
    """The markers of one output; cheap to pickle (it holds paths and the grid only)."""

    path: Path | ObjectUrl
    grid_begin: Coord
    grid_shape: Coord
    #: Tells one creation of the markers from another at the same path (a log is never reused).
    token: str = ""
    #: The token of the run that owns the output (its lock, see :mod:`blockpred.io.ownership`): marks are made
    #: only while that run holds the lock.  "" checks nothing (markers used outside a run).
    owner: str = ""

    # ----------------------------------------------------------------- life cycle
    @property
    def remote(self) -> bool:
        """True for markers on an object store (marks buffered and written as objects)."""
        return isinstance(self.path, ObjectUrl)

    @classmethod
    def create(cls, path: Path | ObjectUrl, plan: BlockPlan, fingerprint: Mapping[str, Any],
               masked: np.ndarray | None = None) -> "DoneMarkers":
        """New markers for ``plan``; ``masked`` (a boolean grid) marks the blocks a mask leaves out."""
        remote = isinstance(path, ObjectUrl)
        stores.remove_tree(path)
        token = uuid.uuid4().hex
        group = zarr.open_group(_zarr_location(path), mode="w", zarr_format=3)
        group.attrs["blockpred"] = {"fingerprint": as_json(fingerprint), "grid_begin": list(plan.grid_begin),
                                    "grid_shape": list(plan.grid_shape), "token": token}
        if masked is not None and masked.any():
            if masked.shape != tuple(plan.grid_shape):
                raise ValueError(f"masked grid {masked.shape} is not the block grid {tuple(plan.grid_shape)}")
            chunks = tuple(min(c, n) for c, n in zip(_MASKED_CHUNKS, masked.shape))
            array = group.create_array("masked", shape=masked.shape, chunks=chunks, dtype="uint8", fill_value=0)
            array[...] = masked.astype(np.uint8)
        if not remote:  # an object store has no directories: the logs' keys make them
            for name in ("done", "skipped"):
                (path / name).mkdir()
            sync_path(path, path.parent)  # their names, and the names up to the one beside the output
        return cls(path, plan.grid_begin, plan.grid_shape, token)

    @classmethod
    def open(cls, path: Path | ObjectUrl) -> "DoneMarkers | None":
        """The markers at ``path``, or None when there are none (or they are unreadable)."""
        if isinstance(path, ObjectUrl):
            if stores.read_bytes(path / "zarr.json") is None:
                return None
        elif not (path / "zarr.json").is_file():
            return None
        try:
            meta = zarr.open_group(_zarr_location(path, read_only=True), mode="r").attrs["blockpred"]
            return cls(path, Coord(meta["grid_begin"]), Coord(meta["grid_shape"]), meta.get("token", ""))
        except (KeyError, ValueError, TypeError, FileNotFoundError):
            return None

    @property
    def fingerprint(self) -> dict[str, Any]:
        return dict(zarr.open_group(_zarr_location(self.path, read_only=True), mode="r").attrs["blockpred"]["fingerprint"])

    @staticmethod
    def invalidate(path: Path | ObjectUrl) -> None:
        """Make the markers at ``path`` vouch for nothing, at once, then remove them.

        Their group's ``zarr.json`` goes first (one unlink, made durable): from then on
        :meth:`open` finds no markers, so an output whose deletion is cut short
        (a kill, a full disk, a refused permission) is never resumed as finished.
        """
        head = path / "zarr.json"
        if isinstance(head, ObjectUrl):
            stores.delete_prefix(head)
        else:
            try:
                os.unlink(head)
                sync_file(path)  # gone for good before the output goes: a crash then cannot bring it back
            except FileNotFoundError:
                pass
        stores.remove_tree(path)

    @staticmethod
    def remove(path: Path | ObjectUrl) -> None:
        stores.remove_tree(path)
        if isinstance(path, ObjectUrl):
            return
        parent = path.parent
        if parent.name.endswith(".blockpred") and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()

    # ----------------------------------------------------------------- marking
    def block_id(self, index: Coord) -> int:
        rel = index - self.grid_begin
        return (rel[0] * self.grid_shape[1] + rel[1]) * self.grid_shape[2] + rel[2]

    def _mark(self, name: str, block: Block) -> None:
        if self.owner:
            check_owner(lock_path(self.path), self.owner)
        block_id = self.block_id(block.index)
        if self.remote:
            mark_logs.buffer(self.path, self.token, name).add(block_id)
        else:
            mark_logs.append(self.path, self.token, name, block_id)
        with _MARKED_LOCK:
            marked = _MARKED.get((str(self.path), self.token))
            if marked is None:
                marked = _MARKED[(str(self.path), self.token)] = _Bits(self.grid_shape.prod())
            marked.add(block_id)

    def mark_done(self, block: Block) -> None:
        """Record that ``block``'s data is written (call only after the write)."""
        self._mark("done", block)

    def mark_skipped(self, block: Block) -> None:
        """Record that ``block`` needs no network (its input is empty)."""
        self._mark("skipped", block)

    def flush(self, *, quiet: bool = False) -> None:
        """At a job's end: make this process's marks durable (on a disk, an fsync of its logs; on an object
        store, its buffered marks written).

        A failure raises :class:`RunFailedError` (the blocks are written, their marks are not: the next run
        computes them again), or with ``quiet`` (a run already failing) is one warning line.
        """
        if not self.remote:
            try:
                mark_logs.sync_logs(self.path, self.token)
            except OSError as err:
                self._lost(f"the marks of this process's finished blocks could not be made durable in {self.path} "
                           f"({err.strerror or err})", err, quiet)
            return
        for name in ("done", "skipped"):
            buffer = mark_logs.buffered(self.path, self.token, name)
            if buffer is None:
                continue
            try:
                buffer.flush(raise_errors=True)
            except Exception as err:  # noqa: BLE001 - said in one line
                buffer.reported = True
                self._lost(f"the marks of {len(buffer.ids)} finished block(s) could not be written to "
                           f"{self.path / name} ({str(err).split(chr(10), 1)[0]})", err, quiet)

    @staticmethod
    def _lost(what: str, err: BaseException, quiet: bool) -> None:
        text = f"{what}; the next run computes those blocks again"
        if not quiet:
            raise RunFailedError(text) from err
        log.warning("%s", text)

    def close(self) -> None:
        """At the run's end: close this process's logs of these markers and forget what it marked here.

        The marks stay on disk, fsynced.  A process that runs many runs (a notebook, a worker of a long-lived
        cluster) would otherwise keep a descriptor open per run and output.  Marking again opens a new log.
        """
        try:
            mark_logs.close_logs(self.path, self.token)
        finally:
            with _MARKED_LOCK:
                _MARKED.pop((str(self.path), self.token), None)

    def marked_here(self, block: Block) -> bool:
        """True when this process marked ``block`` (a retried task skips what it finished)."""
        marked = _MARKED.get((str(self.path), self.token))
        return marked is not None and self.block_id(block.index) in marked

    # ----------------------------------------------------------------- reading, in bulk
    def _ids(self, name: str) -> np.ndarray:
        """Every block id in the ``name`` logs (and an older blockpred's chunk files), unsorted."""
        if self.remote:
            return mark_logs.remote_ids(self.path / name)
        parts = []
        directory = self.path / name
        for entry in os.scandir(directory) if directory.is_dir() else ():
            if entry.name.endswith(mark_logs.LOG_SUFFIX):
                parts.append(mark_logs.records(Path(entry.path).read_bytes()))
        legacy = directory / "c"
        if legacy.is_dir():
            indices = [index - self.grid_begin for index in self._listed(legacy)]
            parts.append(np.ravel_multi_index(tuple(np.array(indices, dtype=np.int64).reshape(-1, 3).T),
                                              tuple(self.grid_shape)).astype(np.int64))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _listed(self, root: Path) -> list[Coord]:
        found = []
        for dirpath, _, files in os.walk(root):
            rel = Path(dirpath).relative_to(root).parts
            if len(rel) == 2:
                # zarr wrote a chunk to a temporary name and renamed it: count finished files only.
                found.extend(self.grid_begin + Coord((int(rel[0]), int(rel[1]), int(f))) for f in files if f.isdigit())
        return found

    def _masked_array(self):
        """The ``masked`` array (one byte per block), None when the run had no mask (or it left nothing out)."""
        if self.remote:
            if stores.read_bytes(self.path / "masked" / "zarr.json") is None:
                return None
        elif not (self.path / "masked" / "zarr.json").is_file():
            return None
        return zarr.open_array(_zarr_location(self.path / "masked", read_only=True), mode="r")

    def masked(self) -> np.ndarray:
        """The boolean grid of blocks the run's mask leaves out (all False without a mask)."""
        array = self._masked_array()
        return np.zeros(tuple(self.grid_shape), dtype=bool) if array is None else array[...].astype(bool)

    def masked_slabs(self, max_bytes: int = 64 << 20) -> Iterator[tuple[int, np.ndarray]]:
        """The blocks the run's mask leaves out, as (first z row, boolean slab of whole z rows of the grid), about
        ``max_bytes`` at a time; nothing without a mask."""
        array = self._masked_array()
        if array is None:
            return
        chunk = array.chunks[0]  # whole chunks per slab: each is read once
        rows = max(1, max_bytes // max(1, int(self.grid_shape[1] * self.grid_shape[2])) // chunk) * chunk
        for z0 in range(0, self.grid_shape[0], rows):
            yield z0, array[z0:z0 + rows] != 0

    def finished_ids(self) -> np.ndarray:
        """The ids of the blocks marked done or skipped, sorted, each once.  A block the mask left out is never
        run, so never among them: finished blocks are these and :meth:`masked_slabs`' (no value per block)."""
        return np.unique(np.concatenate([self._ids("done"), self._ids("skipped")]))

    def num_finished(self) -> int:
        """Blocks done, skipped or masked out, counted without a value per block (but the mask's bytes, in slabs)."""
        return len(self.finished_ids()) + sum(int(slab.sum()) for _, slab in self.masked_slabs())

    def _grid(self, *names: str) -> np.ndarray:
        grid = np.zeros(self.grid_shape.prod(), dtype=bool)
        for name in names:
            grid[self._ids(name)] = True
        return grid.reshape(tuple(self.grid_shape))

    def finished(self) -> np.ndarray:
        """The boolean grid of finished blocks: done, skipped or masked."""
        grid = self._grid("done", "skipped")
        for z0, slab in self.masked_slabs():
            grid[z0:z0 + len(slab)] |= slab
        return grid

    def todo_ids(self) -> np.ndarray:
        """The ids of the blocks not finished, in C order over the grid (one boolean per block on the way)."""
        todo = self.finished().reshape(-1)
        return np.flatnonzero(np.logical_not(todo, out=todo))

    def _indices(self, grid: np.ndarray) -> set[Coord]:
        return {self.grid_begin + Coord(index) for index in np.argwhere(grid)}

    def done_indices(self) -> set[Coord]:
        """Grid indices of the blocks marked done."""
        return self._indices(self._grid("done"))

    def skipped_indices(self) -> set[Coord]:
        """Grid indices of the blocks skipped: masked out, or found empty."""
        return self._indices(self._grid("skipped") | self.masked())

    def finished_indices(self) -> set[Coord]:
        return self._indices(self.finished())


def _zarr_location(path: Path | ObjectUrl, read_only: bool = False):
    """What zarr-python opens the markers' group (or array) at: a local path (to write, a store whose writes
    are durable), or a store on the object store."""
    if isinstance(path, ObjectUrl):
        return kvzarr.zarr_store(path, read_only=read_only)
    return str(path) if read_only else DurableLocalStore(path)


__all__ = ["DoneMarkers", "markers_path", "describe_changes", "as_json"]
