"""Done markers: which blocks of a run are finished, kept beside the output.

A run writes, before any block, a small zarr v3 group beside the output
container (``vol.zarr/prediction`` -> ``vol.zarr.blockpred/prediction``,
``f.h5:/pred`` -> ``f.h5.blockpred/pred``) holding

* the run's *fingerprint* (attributes): everything that decides the output's
  values and layout -- input, model weights, block grid, halo, normalisation,
  output dtype ...;
* two arrays over the block grid, ``done`` and ``skipped``, one chunk per block,
  so workers in different processes mark blocks without ever touching the same
  file.  A block is marked only after its data is written.  The arrays are
  uncompressed, so a mark is its chunk file holding the byte 1, written
  directly (a temporary file renamed into place: tens of microseconds, where
  a zarr-python write costs a millisecond of CPU).

Re-running the same command reads the markers and skips finished blocks; a run
whose fingerprint differs is refused with the list of what changed.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import zarr

from .blocking import Block, BlockPlan
from .geometry import Coord
from .io.base import VolumePath

_ROOT_NAME = "_root"
#: A marker chunk as stored: one uint8 of value 1, no compression.
_MARK = b"\x01"


def markers_path(target: VolumePath) -> Path:
    """Where the markers of an output live: beside its container, named after its dataset."""
    container = Path(os.path.abspath(target.container))
    return container.with_name(container.name + ".blockpred") / (target.dataset or _ROOT_NAME)


def describe_changes(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``["halo (10, 10, 10) -> (8, 8, 8)", ...]`` for every key whose value differs."""
    changes = []
    for key in sorted(set(before) | set(now)):
        if before.get(key) != now.get(key):
            changes.append(f"{key} {_show(before.get(key))} -> {_show(now.get(key))}")
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


@functools.lru_cache(maxsize=64)
def _marker_array(path: str, grid_shape: tuple[int, ...]) -> zarr.Array | None:
    """The open marker array when its chunks are compressed (markers of an older blockpred), else None.

    Opened once per process, not once per block; keyed by the grid shape too,
    so markers re-created for another plan are looked at anew.
    """
    array = zarr.open_array(path, mode="r+")
    return array if array.compressors else None


@dataclass(frozen=True)
class DoneMarkers:
    """The markers of one output; cheap to pickle (it holds paths and the grid only)."""

    path: Path
    grid_begin: Coord
    grid_shape: Coord

    # ----------------------------------------------------------------- life cycle
    @classmethod
    def create(cls, path: Path, plan: BlockPlan, fingerprint: Mapping[str, Any]) -> "DoneMarkers":
        if path.exists():
            shutil.rmtree(path)
        group = zarr.open_group(str(path), mode="w", zarr_format=3)
        group.attrs["blockpred"] = {"fingerprint": as_json(fingerprint),
                                    "grid_begin": list(plan.grid_begin), "grid_shape": list(plan.grid_shape)}
        for name in ("done", "skipped"):
            group.create_array(name, shape=tuple(plan.grid_shape), chunks=(1, 1, 1), dtype="uint8", fill_value=0,
                               compressors=None)
        return cls(path, plan.grid_begin, plan.grid_shape)

    @classmethod
    def open(cls, path: Path) -> "DoneMarkers | None":
        """The markers at ``path``, or None when there are none (or they are unreadable)."""
        if not (path / "zarr.json").is_file():
            return None
        try:
            meta = zarr.open_group(str(path), mode="r").attrs["blockpred"]
            return cls(path, Coord(meta["grid_begin"]), Coord(meta["grid_shape"]))
        except (KeyError, ValueError, TypeError, FileNotFoundError):
            return None

    @property
    def fingerprint(self) -> dict[str, Any]:
        return dict(zarr.open_group(str(self.path), mode="r").attrs["blockpred"]["fingerprint"])

    @staticmethod
    def remove(path: Path) -> None:
        if path.exists():
            shutil.rmtree(path)
        parent = path.parent
        if parent.name.endswith(".blockpred") and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()

    # ----------------------------------------------------------------- marking
    def _key(self, name: str, block: Block) -> Path:
        rel = block.index - self.grid_begin
        return self.path / name / "c" / str(rel[0]) / str(rel[1]) / str(rel[2])

    def _mark(self, name: str, block: Block) -> None:
        rel = block.index - self.grid_begin
        array = _marker_array(str(self.path / name), tuple(self.grid_shape))
        if array is not None:
            array[rel[0], rel[1], rel[2]] = 1
            return
        directory = f"{self.path}/{name}/c/{rel[0]}/{rel[1]}"
        os.makedirs(directory, exist_ok=True)
        temporary = f"{directory}/.{rel[2]}.{os.getpid()}.{threading.get_ident()}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, _MARK)
        finally:
            os.close(fd)
        os.replace(temporary, f"{directory}/{rel[2]}")  # a reader sees no marker or a whole one

    def mark_done(self, block: Block) -> None:
        """Record that ``block``'s data is written (call only after the write)."""
        self._mark("done", block)

    def mark_skipped(self, block: Block) -> None:
        """Record that ``block`` needs no network (masked out or empty)."""
        self._mark("skipped", block)

    def is_finished(self, block: Block) -> bool:
        return self._key("done", block).exists() or self._key("skipped", block).exists()

    # ----------------------------------------------------------------- counting
    def _listed(self, name: str) -> set[Coord]:
        root = self.path / name / "c"
        found = set()
        for dirpath, _, files in os.walk(root):
            rel = Path(dirpath).relative_to(root).parts
            if len(rel) == 2:
                # zarr writes a chunk to a temporary name and renames it: count finished files only.
                found.update(self.grid_begin + Coord((int(rel[0]), int(rel[1]), int(f))) for f in files if f.isdigit())
        return found

    def done_indices(self) -> set[Coord]:
        """Grid indices of the blocks marked done (by listing, without reading every chunk)."""
        return self._listed("done")

    def skipped_indices(self) -> set[Coord]:
        return self._listed("skipped")

    def finished_indices(self) -> set[Coord]:
        return self.done_indices() | self.skipped_indices()


__all__ = ["DoneMarkers", "markers_path", "describe_changes", "as_json"]
