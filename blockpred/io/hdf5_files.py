"""Open HDF5 files: one handle per file per process, its writer lock, and its writes made durable.

**One handle per file.**  The input and the output may be datasets of one file in one process
(``f.h5:/raw`` in, ``f.h5:/prediction`` out), but HDF5 refuses to open a file twice in different modes.  So
every :class:`~blockpred.io.hdf5.HDF5Volume` borrows its ``h5py.File`` from one process-wide registry
(:data:`OPEN_FILES`), keyed by the file itself (one key for every name of it: symlinks, hard links).  A
handle is opened for one of three kinds of access, and reopened (closed, opened again) when a caller needs
another; volumes look their dataset up on every call, so a reopening never leaves them a stale handle:

* ``read``: any open handle serves.  A file flagged "open for writing" by a writer that is gone opens as a
  SWMR reader (HDF5 refuses a plain reader there).
* ``change``: creating or removing a dataset; mode ``"a"``, never in SWMR mode (it forbids such changes).
* ``write``: data into existing datasets; mode ``"a"``, and in HDF5's single-writer/multiple-reader (SWMR)
  mode where the file's format allows it (superblock 3, HDF5 1.10's format: every file blockpred creates).
  SWMR orders HDF5's metadata writes so that the file on disk is always a consistent file: a writer killed in
  the middle of a later write leaves every earlier block, and the file, readable.  An older file (superblock
  0-2: HDF5 1.8, h5py's defaults) is written without it; a kill in the middle of its flush can leave its
  metadata inconsistent (docs/reliability.md says so, and :mod:`blockpred.run` warns).

**The writer lock.**  A process that changes or writes a file holds an exclusive ``flock`` of it for as long
as its handle is writable (HDF5's own locking is off on those handles: HDF5 drops its lock in SWMR mode, and
its lock cannot tell a live writer from a dead one's flags).  Another process writing the file, or any HDF5
program with the file open, holds a lock that refuses ours: one line, nothing touched.  Holding the lock,
a file still flagged "open for writing" was left so by a writer that is gone: its flags are cleared, and its
recorded end moved past what that writer wrote (:mod:`.hdf5_recovery`), with a warning.

**Durability** (the write contract of :meth:`blockpred.io.base.Volume.write_async`).  A write lands in HDF5's
caches; it is durable once the file is flushed (the caches written into the file) and fsynced.  A file's
writes are committed in groups by one thread of its own: each round flushes (under the registry's lock) and
fsyncs (beside the next writes) whatever was written since the last, then completes those writes' futures.
While one round runs the next writes gather, so a slow disk costs one flush and fsync per round, not per
write.  A failed write, flush or fsync (a full disk) fails its writes, and every later write of the file in
this process fails at once: nothing is vouched for after an error HDF5 may not have recovered from.

Every HDF5 call runs under the registry's lock (h5py serialises them anyway).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Literal

import h5py

from ..errors import InvalidVolumeError, OutputLockedError
from .durable import sync_file
from .hdf5_recovery import RecoveryUnavailable, claim_file_end, clear_status_flags, superblock_version

log = logging.getLogger(__name__)

Access = Literal["read", "change", "write"]

#: The format of new files (and of writes to files already in it): HDF5 1.10's, which SWMR needs.
NEW_FILE_LIBVER = ("v110", "latest")


class WriteFailedBefore(OSError):
    """A write, flush or fsync of this file failed earlier in this process: nothing more is written to it."""


class _Writer:
    """A file open for changing or writing: its writer lock, and the thread that commits its writes in groups."""

    def __init__(self, key: str):
        self.key = key
        self.fd = os.open(key, os.O_RDONLY | os.O_CREAT, 0o644)  # a new file starts here, empty
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(self.fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise OutputLockedError(
                    f"HDF5 file {key!r} is open in another process (an HDF5 program, or another run writing "
                    f"it); HDF5 has one writer at a time: close it there, or write the output to another file"
                ) from error
            raise
        self.handle: h5py.File | None = None
        self.failed: BaseException | None = None
        self._pending: list[Future] = []
        self._wake = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    def commit(self, lock: threading.RLock) -> Future:
        """A future that completes once what was written so far is durable (a later round of the thread)."""
        future: Future = Future()
        future.set_running_or_notify_cancel()
        with self._wake:
            self._pending.append(future)
            if self._thread is None:
                self._thread = threading.Thread(target=self._rounds, args=(lock,), daemon=True,
                                                name=f"blockpred-hdf5-commit-{os.path.basename(self.key)}")
                self._thread.start()
            self._wake.notify()
        return future

    def _rounds(self, lock: threading.RLock) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closing:
                    self._wake.wait()
                if not self._pending:
                    return
            batch: list[Future] = []
            try:
                with lock:  # the flush under the registry's lock; the writes in this round all came before it
                    with self._wake:
                        batch, self._pending = self._pending, []
                    if not batch:
                        continue
                    error = self._flush()
                if error is None:
                    error = self._fsync()
            except BaseException as unexpected:  # noqa: BLE001 - never a write left waiting: a run would hang
                error = self.failed = self.failed or unexpected
            _settle(batch, error)

    def _flush(self) -> BaseException | None:
        if self.failed is None:
            try:
                self.handle.flush()
            except Exception as error:  # noqa: BLE001 - fails this round's writes, and every later one
                self.failed = error
        return self.failed

    def _fsync(self) -> BaseException | None:
        try:
            os.fsync(self.fd)
        except OSError as error:
            self.failed = self.failed or error
        return self.failed

    def commit_now(self) -> None:
        """Flush and fsync at once, completing every pending write (hold the registry's lock): before the
        handle is closed or reopened."""
        with self._wake:
            batch, self._pending = self._pending, []
        error = self._flush()
        if error is None:
            error = self._fsync()
        _settle(batch, error)

    def check(self) -> None:
        """Raise when an earlier write of the file failed (see the module docstring)."""
        if self.failed is not None:
            raise _failed_before(self.key, self.failed)

    def stop(self) -> None:
        """End the thread (call without the registry's lock: a round may be waiting for it) and the lock."""
        with self._wake:
            self._closing = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        os.close(self.fd)  # releases the flock


def _settle(batch: list[Future], error: BaseException | None) -> None:
    for future in batch:
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def _failed_before(key: str, error: BaseException) -> WriteFailedBefore:
    number = getattr(error, "errno", None)
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    failure = WriteFailedBefore(number or errno.EIO, f"an earlier write to {key} failed ({reason}); "
                                                     f"nothing more is written to it in this process")
    failure.__cause__ = error
    return failure


@dataclass
class _Open:
    handle: h5py.File
    access: Access
    users: int = 0
    writer: _Writer | None = None
    #: True while the handle writes in SWMR mode.
    swmr: bool = False


class _OpenFiles:
    """Process-wide, thread-safe ``h5py.File`` handles: one per file, counted by users."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._open: dict[str, _Open] = {}

    def file(self, key: str, access: Access) -> h5py.File:
        """The open handle of ``key``, (re)opened for ``access`` where it does not serve; hold :attr:`lock`."""
        entry = self._open.get(key)
        if entry is not None and entry.handle.id.valid:
            if access == "read" or entry.access == access:
                return entry.handle
        return self._reopen(key, access, entry).handle

    def writer(self, key: str) -> _Writer:
        """The writer of ``key``, open for writing (hold :attr:`lock`)."""
        self.file(key, "write")
        return self._open[key].writer

    def swmr(self, key: str) -> bool:
        """True while ``key`` is open and written in SWMR mode."""
        with self.lock:
            entry = self._open.get(key)
            return entry is not None and entry.swmr

    def _reopen(self, key: str, access: Access, entry: _Open | None) -> _Open:
        users = entry.users if entry is not None else 0
        writer = entry.writer if entry is not None else None
        if entry is not None:
            self._close_handle(entry)
        if access != "read" and writer is None:
            try:
                writer = _Writer(key)
            except BaseException:
                if entry is not None:  # the readers go on reading
                    self._open[key] = _Open(self._open_handle(key, "read", None), "read", users)
                raise
        try:
            version = superblock_version(key) if access != "read" else None
            handle = self._open_handle(key, access, version)
            if version is None and access != "read":  # a file made just now
                version = superblock_version(key)
        except BaseException:
            self._open.pop(key, None)
            if writer is not None:
                threading.Thread(target=writer.stop, daemon=True).start()  # not under the lock: see stop()
            raise
        fresh = _Open(handle, access, users, writer)
        if writer is not None:
            writer.handle = handle
            fresh.swmr = access == "write" and _start_swmr(handle, key, version)
        self._open[key] = fresh
        return fresh

    def _open_handle(self, key: str, access: Access, version: int | None) -> h5py.File:
        if access == "read":
            return _open_for_reading(key)
        libver = NEW_FILE_LIBVER if version is None or version >= 3 else None
        try:
            handle = _open_for_writing(key, libver)
        except OSError as error:
            if "already open for" not in str(error):
                raise _unopenable(key, error) from error
            # We hold the writer lock: the writer that flagged the file is gone.
            try:
                clear_status_flags(key)
            except RecoveryUnavailable as unavailable:
                raise InvalidVolumeError(
                    f"HDF5 file {key!r} was left flagged 'open for writing' by a writer that is gone, and blockpred "
                    f"cannot clear the flags here ({unavailable}); run `h5clear --status --increment=0 {key}`, "
                    f"then this command again"
                ) from error
            log.warning("HDF5 file %s was left flagged 'open for writing' by a writer that is gone (a kill or a "
                        "crash): the flags are cleared", key)
            handle = _open_for_writing(key, libver)
        try:
            moved = claim_file_end(handle)
        except RecoveryUnavailable as unavailable:
            log.debug("cannot compare %s's recorded end with its size: %s", key, unavailable)
            moved = None
        if moved is not None:
            log.warning("HDF5 file %s holds %d bytes past its recorded end (written by a writer that ended without "
                        "closing it): its end is moved to %d bytes, so that nothing written there is overwritten",
                        key, moved[1] - moved[0], moved[1])
        return handle

    def _close_handle(self, entry: _Open) -> None:
        """Close ``entry``'s handle, its pending writes committed first (hold :attr:`lock`)."""
        if entry.writer is not None and entry.handle.id.valid:
            entry.writer.commit_now()
        if entry.handle.id.valid:
            name = entry.handle.filename
            try:
                entry.handle.close()
            except Exception as error:  # noqa: BLE001 - a file whose writes failed may not close cleanly
                if entry.writer is None or entry.writer.failed is None:
                    raise
                log.debug("closing %s after a failed write: %s", name, error)
            else:
                if entry.writer is not None:  # what closing wrote (its flags, its last metadata) on the disk too
                    sync_file(name)

    def acquire(self, key: str, access: Access) -> None:
        with self.lock:
            self.file(key, access)
            self._open[key].users += 1

    def release(self, key: str) -> None:
        writer = None
        with self.lock:
            entry = self._open.get(key)
            if entry is None:
                return
            entry.users -= 1
            if entry.users > 0:
                return
            del self._open[key]
            writer = entry.writer
            try:
                self._close_handle(entry)
            finally:
                log.debug("closed %s", key)
        if writer is not None:
            writer.stop()

    @contextmanager
    def borrowed(self, key: str, access: Access) -> Iterator[h5py.File]:
        """The handle for the length of a ``with`` block, under the lock."""
        with self.lock:
            self.acquire(key, access)
            try:
                yield self.file(key, access)
            finally:
                self.release(key)

    def open_keys(self) -> list[str]:
        """Files open now (for tests and debugging)."""
        with self.lock:
            return sorted(self._open)


def _open_for_reading(key: str) -> h5py.File:
    try:
        return h5py.File(key, "r")
    except OSError as error:
        if "already open for" in str(error):  # flagged by a writer (alive in SWMR mode, or gone): a SWMR reader
            try:
                return h5py.File(key, "r", swmr=True)
            except OSError:
                pass
        raise _unopenable(key, error) from error


def _open_for_writing(key: str, libver) -> h5py.File:
    options = {"libver": libver} if libver is not None else {}
    if os.path.getsize(key) == 0:  # new (the writer lock made it): an HDF5 file in the format SWMR needs
        h5py.File(key, "w", locking=False, **options).close()
    # No chunk cache: a chunk is compressed and written by the write itself, so that its error (a full disk) is
    # raised there, never when h5py drops a dataset handle and HDF5 writes the cached chunk (an error that is
    # printed and ignored).  Whole chunks are written: nothing is read back.
    return h5py.File(key, "a", locking=False, rdcc_nbytes=0, **options)


def _start_swmr(handle: h5py.File, key: str, version: int | None) -> bool:
    if version is None or version < 3:
        return False
    try:
        handle.swmr_mode = True
    except (OSError, ValueError) as error:
        log.info("writing %s without SWMR mode: %s", key, error)
        return False
    return True


def _unopenable(key: str, error: OSError) -> InvalidVolumeError:
    return InvalidVolumeError(f"{key!r} must be an HDF5 file that this process can open; h5py failed: {error}; "
                              f"a file damaged (a crash of the machine while it was written) must be restored or "
                              f"removed by hand: blockpred deletes no file it cannot read")


#: The registry every HDF5Volume borrows its file from.
OPEN_FILES = _OpenFiles()
