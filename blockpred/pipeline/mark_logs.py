"""Where a run's marks are kept: one append-only log per process on a disk, buffered objects on an object store.

A mark is a block id, one little-endian int64 record (:data:`RECORD`).

* **On a disk** a process appends its marks of one kind to its own log,
  ``<markers>/<kind>/<host>-<pid>-<random>.ids``, opened with ``O_APPEND``
  once: a mark is one ``write`` of 8 bytes (microseconds), whole or not at
  all.  The log's name is made durable when it is created (its directory
  fsynced); its marks by a thread of the process at most :data:`SYNC_S`
  seconds after they were made (an fsync of each log written since), when
  the job that made them ends (:func:`sync_logs`) and when the run closes
  them.  A crash of the machine loses at most the last seconds' marks, whose
  blocks the next run computes again; a mark never reaches the disk before
  its block's data, which was durable before the mark was made.
* **On an object store** objects cannot be appended to: a process buffers
  its marks and writes them as a new object (:class:`MarkBuffer`).

Reading takes whole records only: a record cut short by a crash is ignored.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from ..io import stores
from ..io.durable import sync_file
from ..io.stores import ObjectUrl

log = logging.getLogger(__name__)

#: One log record: a block id.
RECORD = np.dtype("<i8")
LOG_SUFFIX = ".ids"
#: On an object store: a process writes its buffered marks as one object every this many marks ...
FLUSH_MARKS = 512
#: ... and at most this many seconds after a mark.
FLUSH_S = 1.0
#: On a disk: a mark is fsynced at most this many seconds after it was made.
SYNC_S = 1.0


def records(raw: bytes) -> np.ndarray:
    """The block ids of a log's bytes; a record cut short (a crash mid-write) is left out."""
    return np.frombuffer(raw[: len(raw) - len(raw) % RECORD.itemsize], dtype=RECORD)


# ----------------------------------------------------------------- logs on a disk

#: Per process: the open log of each marker set and kind, by (markers path, their token, kind, pid).
_Key = tuple[str, str, str, int]
_LOGS: dict[_Key, int] = {}
_LOGS_LOCK = threading.Lock()
#: Per log: marks appended (a count that changes; a lost increment still changes it), and that count when the
#: log was last fsynced.
_APPENDED: dict[_Key, int] = {}
_SYNCED: dict[_Key, int] = {}
#: The pid whose syncing thread runs (a forked child starts its own).
_SYNCER: list[int] = []


def _after_fork() -> None:
    global _LOGS_LOCK
    _LOGS_LOCK = threading.Lock()  # the parent's syncing thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork)


def append(markers: Path, token: str, kind: str, block_id: int) -> None:
    """Append ``block_id`` to this process's log of ``kind`` marks of the markers at ``markers`` (``token``: their
    creation), creating the log, with a durable name, on first use."""
    full = (str(markers), token, kind, os.getpid())
    fd = _LOGS.get(full)
    if fd is None:
        with _LOGS_LOCK:
            fd = _LOGS.get(full)
            if fd is None:
                directory = markers / kind
                name = directory / f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}{LOG_SUFFIX}"
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                sync_file(directory)
                _LOGS[full] = fd
                _start_syncer()
    os.write(fd, RECORD.type(block_id).tobytes())  # one append: a whole record or none
    _APPENDED[full] = _APPENDED.get(full, 0) + 1


def _start_syncer() -> None:
    """Start this process's syncing thread, once (hold ``_LOGS_LOCK``)."""
    if _SYNCER[-1:] != [os.getpid()]:
        _SYNCER.append(os.getpid())
        threading.Thread(target=_sync_every, name="blockpred-mark-sync", daemon=True).start()


def _sync_every() -> None:
    """Every :data:`SYNC_S` seconds, fsync this process's logs written since their last fsync."""
    while True:
        time.sleep(SYNC_S)
        with _LOGS_LOCK:
            _sync([k for k in _LOGS if k[3] == os.getpid() and _APPENDED.get(k) != _SYNCED.get(k)], quiet=True)


def _sync(keys: list[_Key], quiet: bool = False) -> None:
    """fsync the logs ``keys`` (hold ``_LOGS_LOCK``); ``quiet``: a failure is a debug line (a job's end says it)."""
    for key in keys:
        count = _APPENDED.get(key)
        try:
            os.fsync(_LOGS[key])
        except OSError as err:
            if not quiet:
                raise
            log.debug("fsync of a marks log failed (%s); the job's end tries again", err)
            continue
        _SYNCED[key] = count


def _own(markers: Path, token: str) -> list[_Key]:
    return [k for k in _LOGS if k[0] == str(markers) and k[1] == token and k[3] == os.getpid()]


def sync_logs(markers: Path, token: str) -> None:
    """fsync this process's logs of the markers at ``markers`` (``token``: their creation): its marks are durable."""
    with _LOGS_LOCK:
        _sync(_own(markers, token))


def close_logs(markers: Path, token: str) -> None:
    """fsync and close this process's logs of the markers at ``markers``; marking again opens new ones.  (A failed
    fsync is not said here: :func:`sync_logs` at the job's end said it; those marks may be lost, and their blocks
    computed again.)"""
    with _LOGS_LOCK:
        for k in _own(markers, token):
            try:
                _sync([k], quiet=True)
            finally:
                os.close(_LOGS.pop(k))
                _APPENDED.pop(k, None)
                _SYNCED.pop(k, None)


# ----------------------------------------------------------------- marks on an object store


class MarkBuffer:
    """One process's unwritten marks of one kind for one set of markers on an object store."""

    def __init__(self, directory: ObjectUrl):
        self.directory = directory
        self.name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.ids: list[int] = []
        self.seq = 0
        self.last_flush = time.monotonic()
        self.lock = threading.Lock()
        #: Held while marks are written: one write at a time, and a final flush waits for a timer's write.
        self.write_lock = threading.Lock()
        self.timer: threading.Timer | None = None
        #: True once a failure to write these marks was reported (later failures are not said again).
        self.reported = False

    def add(self, block_id: int) -> None:
        """Buffer a mark.  Never writes here: marks come from tensorstore's own callback threads, which must
        not wait on tensorstore; a timer thread writes them (at once when due, else within ``FLUSH_S``)."""
        with self.lock:
            self.ids.append(block_id)
            due = len(self.ids) >= FLUSH_MARKS or time.monotonic() - self.last_flush >= FLUSH_S
            if self.timer is not None and due:
                self.timer.cancel()
                self.timer = None
            if self.timer is None:
                self.timer = threading.Timer(0.0 if due else FLUSH_S, self.flush)
                self.timer.daemon = True
                self.timer.start()

    def flush(self, raise_errors: bool = False) -> None:
        """Write the buffered marks as one new object ``<name>-<seq>.ids``; returns once they are stored."""
        with self.write_lock:
            with self.lock:
                ids, self.ids = self.ids, []
                if self.timer is not None:
                    self.timer.cancel()
                    self.timer = None
                self.last_flush = time.monotonic()
                if not ids:
                    return
                seq, self.seq = self.seq, self.seq + 1
            try:
                stores.write_bytes(self.directory / f"{self.name}-{seq:08d}{LOG_SUFFIX}",
                                   np.asarray(ids, dtype=RECORD).tobytes())
            except Exception as err:
                with self.lock:
                    self.ids[:0] = ids  # kept for the next flush
                if raise_errors:
                    raise
                # Said once: a run that already reported these marks lost (DoneMarkers.flush) ends on its error line.
                say = log.debug if self.reported else log.warning
                say("writing %d done marks to %s failed (%s); kept for the next flush (blocks whose marks are never "
                    "written are computed again by the next run)", len(ids), self.directory, str(err).split("\n", 1)[0])


_BUFFERS: dict[tuple[str, str, str, int], MarkBuffer] = {}


def buffer(path: ObjectUrl, token: str, name: str) -> MarkBuffer:
    """This process's buffer of ``name`` marks for the markers at ``path`` (``token``: their creation)."""
    key = (str(path), token, name, os.getpid())
    found = _BUFFERS.get(key)
    if found is None:
        with _LOGS_LOCK:
            found = _BUFFERS.setdefault(key, MarkBuffer(path / name))
    return found


def buffered(path: ObjectUrl, token: str, name: str) -> MarkBuffer | None:
    """This process's buffer of ``name`` marks for the markers at ``path``, None when it made none."""
    return _BUFFERS.get((str(path), token, name, os.getpid()))


@atexit.register
def _flush_all() -> None:
    """At exit (not on a kill): every buffered mark of this process."""
    for key, pending in list(_BUFFERS.items()):
        if key[3] == os.getpid():
            pending.flush()


def remote_ids(directory: ObjectUrl) -> np.ndarray:
    """The block ids of every mark object below ``directory``, read at once."""
    kv = stores.bucket_kvstore(directory)
    keys = [key for key in stores.list_keys(directory) if key.endswith(LOG_SUFFIX)]
    pending = [kv.read(f"{directory.key}/{key}") for key in keys]
    parts = []
    for key, future in zip(keys, pending):
        try:
            raw = bytes(future.result().value)
        except ValueError as error:
            raise stores.storage_error(directory / key, error) from error
        parts.append(records(raw))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
