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

The destination is auxiliary, and it is handled so:

* checked before the run starts (:func:`check_destination`): not a folder,
  in a folder that exists, and not an existing file other than a progress
  log (an HDF5 file, a zarr array's metadata): such a file is never
  truncated.  That it is none of the run's volumes is checked with the
  other paths (:func:`blockpred.io.identity.refuse_inside`);
* opened at the ``start`` event, once every check of the run has passed: a
  run refused by its checks writes no progress file;
* a FIFO is opened without waiting for its reader: with none, one warning
  and the run goes on without events;
* a reader that goes away (a closed pipe) or stops reading for
  :data:`STALLED_S`, a full disk or any other failure to write or close it
  ends the events with one warning naming the file and why
  ("cannot write the progress file X: its file system is full"); the run,
  its output and its exit code are as they would be without it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import select
import stat
import sys
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

#: Seconds between two progress events at most ... at least.
PROGRESS_EVERY_S = 1.0
#: Seconds a reader of a pipe may leave a line unread before the events stop.
STALLED_S = 5.0
#: How every line of a progress log begins (what :func:`check_destination` lets be replaced).
FIRST_BYTES = b'{"event": '


def check_destination(destination: str | None, option: str = "--progress-json") -> None:
    """Refuse, in one line, a progress destination that cannot be written or must not be replaced."""
    from .errors import InvalidOptionError

    if destination is None or destination == "-":
        return
    if not isinstance(destination, str) or not destination:
        raise InvalidOptionError(f"{option} must name a file (or - for stderr), got {destination!r}")
    folder = os.path.dirname(os.path.abspath(destination))
    try:
        info = os.stat(destination)
    except FileNotFoundError:
        if not os.path.isdir(folder):
            raise InvalidOptionError(f"{option} {destination!r}: its folder {folder} does not exist; create it "
                                     f"or name a file in an existing folder") from None
        return
    except OSError as err:
        raise InvalidOptionError(f"{option} {destination!r} cannot be reached: {err.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise InvalidOptionError(f"{option} {destination!r} is a folder; name a file in it, such as "
                                 f"{os.path.join(destination, 'progress.jsonl')}")
    if stat.S_ISREG(info.st_mode) and info.st_size > 0 and not _is_progress_log(destination):
        raise InvalidOptionError(f"{option} {destination!r} is an existing file that is not a progress log of "
                                 f"blockpred; it is never replaced: name a new file, or delete it first")


def _is_progress_log(path: str) -> bool:
    try:
        with open(path, "rb") as file:
            return file.read(len(FIRST_BYTES)) == FIRST_BYTES
    except OSError:
        return False


class ProgressEvents:
    """The event writer of one run; a no-op without a destination.  Call it with (blocks, voxels[, worker])."""

    def __init__(self, destination: str | None):
        self._destination = destination
        self._fd: int | None = None  # a file's, opened by start(); stderr's for "-"
        self._lock = threading.Lock()
        self._blocks = self._voxels = self._todo = 0
        self._workers: dict[str, list[int]] = {}  # name -> [blocks, voxels]
        self._first: float | None = None
        self._last = 0.0
        self._reported = -1  # blocks done at the last progress event

    @property
    def enabled(self) -> bool:
        return self._destination is not None

    def start(self, **plan: Any) -> None:
        """The plan, as the first line: the destination is opened now, when every check of the run has passed."""
        self._todo = int(plan.get("blocks_todo", 0))
        if self._destination is not None:
            self._fd = self._open(self._destination)
            if self._fd is None:
                self._destination = None
        self._emit("start", plan)

    def _open(self, destination: str) -> int | None:
        if destination == "-":
            return sys.stderr.fileno() if sys.stderr is not None else None
        try:  # without O_NONBLOCK a FIFO with no reader would hold the run here, before any block
            fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as err:
            why = ("it is a FIFO that no process reads; start the reader first" if err.errno == errno.ENXIO
                   else err.strerror)
            logger.warning("cannot write the progress file %s (%s): the run goes on without progress events",
                           destination, why)
            return None
        return fd

    def __call__(self, blocks: int, voxels: int, worker: str | None = None) -> None:
        if self._fd is None:
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
        """The last progress, then the end: the summary, or the error (and the blocks that failed).

        Nothing when the run never started (a run its checks refused writes no progress file).
        """
        if self._fd is None:
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
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None and self._destination != "-":
            try:
                os.close(fd)
            except OSError as err:  # a file system that reports a failed write only now (NFS)
                logger.warning("cannot write the progress file %s (%s); the run is not affected",
                               self._destination, _why(err))

    def __enter__(self) -> "ProgressEvents":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _emit(self, kind: str, fields: dict) -> None:
        line = json.dumps({"event": kind, "time": round(time.time(), 3), **fields}, default=_plain) + "\n"
        with self._lock:
            if self._fd is None:
                return
            try:
                _write_all(self._fd, line.encode())
            except OSError as err:  # progress is auxiliary: the run goes on without it
                logger.warning("cannot write %s: %s; the run goes on without progress events",
                               "the progress events to stderr" if self._destination == "-"
                               else f"the progress file {self._destination}", _why(err))
                if self._destination != "-":
                    with contextlib.suppress(OSError):
                        os.close(self._fd)
                self._fd = None


def _why(err: OSError) -> str:
    """Why a progress file could not be written, in a few words."""
    if err.errno in (errno.EPIPE, errno.ECONNRESET):
        return "its reader went away"
    if err.errno == errno.ETIMEDOUT:
        return f"its reader read nothing for {STALLED_S:.0f} s"
    if err.errno == errno.ENOSPC:
        return "its file system is full"
    if err.errno == errno.EDQUOT:
        return "its disk quota is used up"
    return err.strerror or str(err)


def _write_all(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd`` (a pipe may take part of a line, or none while it is full), else OSError."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            if not select.select([], [fd], [], STALLED_S)[1]:
                raise OSError(errno.ETIMEDOUT, "stalled") from None


def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), 3)


def _plain(value: Any) -> Any:
    """numpy numbers and Coords as JSON numbers and lists."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    return str(value)
