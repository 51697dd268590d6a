"""One owner per output: a lock beside it, taken before anything is written and held for the run.

Two runs on one output would corrupt it: one deletes or replaces what the
other made, and their markers vouch for each other's chunks.  So a run takes
the output's lock before it writes anything, and keeps it until it ends:

* **Where:** beside the markers, ``<container>.blockpred/<dataset>.lock``
  (``vol.zarr/pred`` -> ``vol.zarr.blockpred/pred.lock``), on the real
  container, so every name of one output (links, mounts) finds one lock.
* **Taking it** is one exclusive creation: a lock file is written under a
  name of its own and hard-linked into place (``link(2)`` fails if the lock
  exists, atomically, on NFS too); on an object store a conditional put
  (``If-None-Match``).  It holds the host, the pid (and the process's start
  time, against pid reuse), the start time and a token.
* **Held:** a heartbeat thread touches the lock every :data:`HEARTBEAT_S`
  seconds and checks that it still holds this run's token.
* **A live holder** makes a second run exit (2) in one line naming it.
* **A stale holder** -- a dead process on this host, or a lock whose heartbeat
  is older than :data:`STALE_S` elsewhere -- is taken over with a warning.
* **Marks only under the owner's token:** every process that marks blocks done
  re-reads the lock at most every :data:`CHECK_S` seconds (a monotonic-clock
  compare per mark otherwise), and a process whose run lost the lock fails
  its next mark (:class:`OwnershipLostError`) instead of vouching for chunks
  another run may have replaced.
* **Released** when the run ends, however it ends; a killed run's lock is
  stale and is taken over by the next run.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import OutputLockedError, OwnershipLostError
from . import stores
from .durable import sync_file
from .stores import ObjectUrl

logger = logging.getLogger(__name__)

#: How often the owner touches its lock.
HEARTBEAT_S = 15.0
#: A lock whose heartbeat is older than this (held on another host) is taken over.
STALE_S = 120.0
#: How often a process that marks blocks re-reads the lock.
CHECK_S = 5.0
#: An empty or unreadable lock younger than this is being written: wait, do not take it over.
_UNREADABLE_GRACE_S = 10.0

Place = Path | ObjectUrl


def lock_path(markers: Place) -> Place:
    """The lock of the output whose markers live at ``markers``."""
    return markers.with_name(markers.name + ".lock")


@dataclass(frozen=True)
class Holder:
    """Who holds an output: the process, where it runs, since when, and its token."""

    host: str
    pid: int
    started: float
    token: str
    #: The process's own start time (psutil), so a reused pid is not taken for the holder.
    process_started: float | None = None
    #: Last heartbeat (epoch seconds; object stores, which have no file times).
    heartbeat: float = 0.0

    @classmethod
    def of_this_process(cls) -> "Holder":
        now = time.time()
        return cls(socket.gethostname(), os.getpid(), now, uuid.uuid4().hex, _process_started(os.getpid()), now)

    def to_bytes(self, heartbeat: float | None = None) -> bytes:
        values = asdict(self)
        if heartbeat is not None:
            values["heartbeat"] = heartbeat
        return json.dumps(values).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Holder | None":
        try:
            values = json.loads(raw)
            return cls(str(values["host"]), int(values["pid"]), float(values["started"]), str(values["token"]),
                       values.get("process_started"), float(values.get("heartbeat") or values["started"]))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host}, started {since}"


def _process_started(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001 - no psutil, or no such process
        return None


def _alive_here(holder: Holder) -> bool:
    """Whether ``holder`` (a process of this host) still runs: the pid, and the same process behind it."""
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    if holder.process_started is not None:
        started = _process_started(holder.pid)
        if started is not None and abs(started - holder.process_started) > 1.0:
            return False  # the pid was reused by a later process
    return True


def stale_reason(holder: Holder | None, age_s: float) -> str | None:
    """Why the lock of ``holder`` (last heartbeat ``age_s`` ago) may be taken over; None while it is live."""
    if holder is None:
        return f"its lock is unreadable and {age_s:.0f} s old" if age_s >= _UNREADABLE_GRACE_S else None
    if holder.host == socket.gethostname():
        return None if _alive_here(holder) else f"process {holder.pid} is no longer running"
    if age_s > STALE_S:
        return f"its last heartbeat is {age_s:.0f} s old (more than {STALE_S:.0f} s)"
    return None


# ----------------------------------------------------------------- the lock file (or object)


class _LocalLock:
    def __init__(self, path: Path):
        self.path = path

    def create(self, holder: Holder) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        draft = self.path.with_name(f"{self.path.name}.{holder.token}")
        try:
            with open(draft, "wb") as file:
                file.write(holder.to_bytes())
                file.flush()
                os.fsync(file.fileno())
            os.link(draft, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:
            draft.unlink(missing_ok=True)
            _remove_empty_parent(self.path)  # a lock that could not be written leaves nothing behind
            raise
        finally:
            draft.unlink(missing_ok=True)

    def read(self) -> tuple[Holder | None, float] | None:
        """The holder (None if unreadable) and the lock's age, or None when there is no lock."""
        try:
            raw = self.path.read_bytes()
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        return Holder.from_bytes(raw), age

    def touch(self) -> None:
        os.utime(self.path)

    def remove_if(self, holder: Holder | None) -> None:
        """Remove the lock if it is still ``holder``'s (None: an unreadable one): moved aside, checked, deleted."""
        aside = self.path.with_name(f"{self.path.name}.stale-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved = Holder.from_bytes(aside.read_bytes())
        if (moved.token if moved else None) != (holder.token if holder else None):
            try:  # a new holder took it in between: put its lock back
                os.link(aside, self.path)
            except FileExistsError:
                pass
        aside.unlink()
        _remove_empty_parent(self.path)
        _sync_nearest(self.path.parent)  # gone for good: a crash of the machine then leaves no stale lock


def _sync_nearest(directory: Path) -> None:
    """fsync ``directory``, or its parent where it is gone (a removal in it is then durable)."""
    for place in (directory, directory.parent):
        try:
            sync_file(place)
            return
        except FileNotFoundError:
            continue


class _ObjectLock:
    def __init__(self, url: ObjectUrl):
        self.url = url
        self.generation = stores.NO_OBJECT

    def create(self, holder: Holder) -> bool:
        generation = stores.write_if(self.url, holder.to_bytes(), stores.NO_OBJECT)
        if generation is not None:
            self.generation = generation
        return generation is not None

    def read(self) -> tuple[Holder | None, float] | None:
        raw, _ = stores.read_versioned(self.url)
        if raw is None:
            return None
        holder = Holder.from_bytes(raw)
        return holder, time.time() - (holder.heartbeat if holder else 0.0)

    def touch(self, holder: Holder) -> bool:
        generation = stores.write_if(self.url, holder.to_bytes(heartbeat=time.time()), self.generation)
        if generation is not None:
            self.generation = generation
        return generation is not None

    def remove_if(self, holder: Holder | None) -> None:
        raw, generation = stores.read_versioned(self.url)
        found = Holder.from_bytes(raw) if raw is not None else None
        if raw is not None and (found.token if found else None) == (holder.token if holder else None):
            stores.write_if(self.url, None, generation)


def _store(path: Place) -> _LocalLock | _ObjectLock:
    return _ObjectLock(path) if isinstance(path, ObjectUrl) else _LocalLock(Path(path))


def _remove_empty_parent(path: Path) -> None:
    """Remove the empty folders above ``path`` up to the ``.blockpred`` one (other outputs' markers stay)."""
    for parent in path.parents:
        if not any(p.name.endswith(".blockpred") for p in (parent, *parent.parents)):
            return
        try:
            parent.rmdir()
        except OSError:
            return  # not empty
        if parent.name.endswith(".blockpred"):
            return


# ----------------------------------------------------------------- the owner's side


class OutputLock:
    """This run's hold on an output: :meth:`acquire` it, and :meth:`release` it (or use ``with``)."""

    def __init__(self, path: Place, holder: Holder, output: str):
        self.path, self.holder, self.output = path, holder, output
        self._store = _store(path)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    @property
    def token(self) -> str:
        return self.holder.token

    @classmethod
    def acquire(cls, path: Place, output: str) -> "OutputLock":
        """Take the lock of ``output`` at ``path``; a stale one is taken over with a warning.

        Raises :class:`OutputLockedError` (one line, naming the holder) while another run holds it.
        """
        holder = Holder.of_this_process()
        lock = cls(path, holder, output)
        for _ in range(5):
            if lock._store.create(holder):
                lock._start_heartbeat()
                return lock
            found = lock._store.read()
            if found is None:
                continue  # released in between: try again
            current, age = found
            reason = stale_reason(current, age)
            if reason is None:
                raise OutputLockedError(_locked_message(output, current, path))
            logger.warning("taking over output %s from the run that held it (%s): %s", output,
                           current.describe() if current else "unknown holder", reason)
            lock._store.remove_if(current)
        raise OutputLockedError(f"output {output!r} is being taken by other runs at the same time (lock {path}); "
                                f"run one at a time")

    def _start_heartbeat(self) -> None:
        _OWNED[(str(self.path), self.token)] = True
        self._thread = threading.Thread(target=self._beat, name="blockpred-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                still = self.check()
                if still:
                    if isinstance(self._store, _ObjectLock):
                        still = self._store.touch(self.holder)
                    else:
                        self._store.touch()
            except Exception as err:  # noqa: BLE001 - a file system hiccup: try again at the next beat
                logger.warning("could not refresh the lock of %s: %s", self.output, err)
                continue
            if not still:
                self.lost = True
                _OWNED[(str(self.path), self.token)] = False
                logger.error("output %s was taken over by another run; this run stops marking blocks", self.output)
                return

    def check(self) -> bool:
        """True while the lock holds this run's token."""
        found = self._store.read()
        return found is not None and found[0] is not None and found[0].token == self.token

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, if it is still this run's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        _OWNED.pop((str(self.path), self.token), None)
        try:
            self._store.remove_if(self.holder)
        except Exception as err:  # noqa: BLE001 - a lock left behind is stale once this process ends
            logger.warning("could not remove the lock of %s (%s); the next run takes it over", self.output, err)

    def __enter__(self) -> "OutputLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _locked_message(output: str, holder: Holder | None, path: Place) -> str:
    who = holder.describe() if holder is not None else "a run whose lock is being written"
    return (f"output {output!r} is in use by another blockpred run ({who}; lock {path}); wait for it to end or "
            f"stop it (a run that died leaves a lock the next run takes over)")


def check_free(path: Place, output: str) -> None:
    """Raise :class:`OutputLockedError` when a live run holds the lock at ``path`` (a quick look; takes nothing)."""
    found = _store(path).read()
    if found is not None and stale_reason(*found) is None:
        raise OutputLockedError(_locked_message(output, found[0], path))


# ----------------------------------------------------------------- the markers' side, in any process

#: This process's own locks: (lock path, token) -> still held (the heartbeat says first).
_OWNED: dict[tuple[str, str], bool] = {}
#: (lock path, token) -> (monotonic time of the last look, held then).
_CHECKED: dict[tuple[str, str], tuple[float, bool]] = {}
_CHECK_LOCK = threading.Lock()


def check_owner(path: Place, token: str) -> None:
    """Raise :class:`OwnershipLostError` unless the run of ``token`` still holds the lock at ``path``.

    Costs a clock read and a dict lookup, except every :data:`CHECK_S` seconds, when the lock is read.
    """
    key = (str(path), token)
    owned = _OWNED.get(key)
    if owned is not None:  # this process's own lock: its heartbeat checks it
        if not owned:
            raise OwnershipLostError(f"another run took over the output (lock {path}); this run stopped marking "
                                     f"blocks done")
        return
    now = time.monotonic()
    checked = _CHECKED.get(key)
    if checked is not None and now - checked[0] < CHECK_S:
        held = checked[1]
    else:
        with _CHECK_LOCK:
            checked = _CHECKED.get(key)
            if checked is not None and now - checked[0] < CHECK_S:
                held = checked[1]
            else:
                found = _store(path).read()
                held = found is not None and found[0] is not None and found[0].token == token
                _CHECKED[key] = (now, held)
    if not held:
        raise OwnershipLostError(f"the run that owns this output no longer holds its lock {path} (another run took "
                                 f"it over, or the run ended); blocks are no longer marked done")
