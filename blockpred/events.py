"""Machine-readable progress: one JSON object per line (``--progress-json FILE``, ``-`` for stderr).

For the scripts and dashboards that watch a run on a cluster, not a terminal
(daisy 2's progress events serve the same).  Three kinds of event, each a
line with ``"event"`` and ``"time"`` (seconds since the epoch):

* ``start``: the plan -- input, output, model, device, blocks in the plan,
  blocks to do in this run, blocks already done (a resume) and masked, the
  voxels of the region, the block, halo and batch, the dask workers asked
  for (``--workers``, ``--jobs``; null for an in-process run).
* ``progress``: at most one a second while blocks finish, and one last
  before ``end``: blocks and voxels done in this run, Mvox/s since the first
  block, the estimated seconds left, and per dask worker its blocks and
  Mvox/s.
* ``end``: ``"ok": true`` and the run's summary (:meth:`PredictionSummary.as_dict`),
  or ``"ok": false`` with the error's one line and the blocks that failed.

The observer is called by the pipeline's threads (in process) or the dask
client's (per worker), so it locks; it writes a line per second, never per block.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import IO, Any

#: Seconds between two progress events at most ... at least.
PROGRESS_EVERY_S = 1.0


class ProgressEvents:
    """The event writer of one run; a no-op without a destination.  Call it with (blocks, voxels[, worker])."""

    def __init__(self, destination: str | None):
        self._file: IO[str] | None = None
        self._own = False
        if destination == "-":
            self._file = sys.stderr
        elif destination is not None:
            self._file, self._own = open(destination, "w", buffering=1), True  # a line is out as it is written
        self._lock = threading.Lock()
        self._blocks = self._voxels = self._todo = 0
        self._workers: dict[str, list[int]] = {}  # name -> [blocks, voxels]
        self._first: float | None = None
        self._last = 0.0
        self._reported = -1  # blocks done at the last progress event

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def start(self, **plan: Any) -> None:
        self._todo = int(plan.get("blocks_todo", 0))
        self._emit("start", plan)

    def __call__(self, blocks: int, voxels: int, worker: str | None = None) -> None:
        if self._file is None:
            return
        with self._lock:
            now = time.time()
            if self._first is None:
                self._first = now
            self._blocks += blocks
            self._voxels += voxels
            if worker is not None:
                counts = self._workers.setdefault(worker, [0, 0])
                counts[0] += blocks
                counts[1] += voxels
            if now - self._last < PROGRESS_EVERY_S:
                return
            self._last, self._reported = now, self._blocks
            event = self._progress(now)
        self._emit("progress", event)

    def _progress(self, now: float) -> dict:
        seconds = now - self._first if self._first is not None else 0.0
        rate = self._voxels / seconds / 1e6 if seconds > 0 else None
        left = self._todo - self._blocks
        eta = left * seconds / self._blocks if self._blocks and seconds > 0 else None
        return {"blocks_done": self._blocks, "blocks_todo": self._todo, "voxels_done": self._voxels,
                "mvox_per_s": _round(rate), "eta_s": _round(eta),
                "workers": {name: {"blocks": b, "mvox_per_s": _round(v / seconds / 1e6 if seconds > 0 else None)}
                            for name, (b, v) in sorted(self._workers.items())}}

    def end(self, summary: dict | None = None, error: str | None = None, failed_blocks: int = 0) -> None:
        """The last progress, then the end: the summary, or the error (and the blocks that failed)."""
        if self._file is None:
            return
        with self._lock:
            last = self._progress(time.time())
            fresh = self._blocks != self._reported
        if fresh:
            self._emit("progress", last)
        if error is None:
            self._emit("end", {"ok": True, "summary": summary})
        else:
            self._emit("end", {"ok": False, "error": error, "failed_blocks": failed_blocks,
                               "blocks_done": last["blocks_done"]})

    def close(self) -> None:
        if self._own and self._file is not None:
            self._file.close()
        self._file = None

    def __enter__(self) -> "ProgressEvents":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _emit(self, kind: str, fields: dict) -> None:
        if self._file is None:
            return
        line = json.dumps({"event": kind, "time": round(time.time(), 3), **fields}, default=_plain)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()


def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), 3)


def _plain(value: Any) -> Any:
    """numpy numbers and Coords as JSON numbers and lists."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    return str(value)
