"""The ``blockpred`` command as a process: its standard streams, its log lines, its signals and its exit.

A run's work is its output; standard output, standard error and the log lines
on it are auxiliary, and never decide a run's fate (issue 46):

* **A standard stream that cannot be written is dropped, with one warning.**
  :class:`StandardStreams` stands in for ``sys.stdout`` and ``sys.stderr``
  while a command runs: the first write or flush that fails (a full disk
  behind ``>out.txt``, ``/dev/full``, a terminal gone, EIO) drops the stream
  for the rest of the command and says so once, in one line naming it
  (``stdout is full``), on the other stream; with ``--json`` a dropped
  stderr is named in the JSON object instead (``"warnings"``), so that
  standard output stays one object.  The run, its output and its exit code
  are what they would have been.  A stream its reader closed (``| head``)
  or the shell closed (``>&-``) is dropped without a word: that was a choice.
  The process's own file descriptor of a dropped stream is pointed at
  ``/dev/null``, so that what the stream still buffers, and what C libraries
  write there, never fail again (the interpreter's last flush would print a
  traceback and exit 120).
* **stderr carries blockpred's own lines.**  :func:`log_to_stderr` shows the
  log lines of blockpred's loggers; those of other libraries (tifffile's
  complaints about a TIFF's metadata, a network's torch warnings, which
  Python's ``warnings`` hand to logging here) only with ``-v`` or ``--debug``.
* **SIGTERM and SIGHUP end a command as Ctrl-C does** (:func:`end_on_signals`):
  one line, exit 143 or 129, the lock released, finished blocks kept.
* **An interrupted command ends at once** (:func:`exit_now`).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

from .progress import GuardedStream

#: Exit codes of a command ended by a signal: 128 + SIGHUP, SIGINT, SIGTERM.
SIGNAL_EXIT_CODES = frozenset(128 + s for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM))
#: The log line's format.
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def stream_failure(name: str, error: BaseException) -> str | None:
    """What went wrong writing the standard stream ``name``, in a few words; None when the stream was closed or its
    reader went away (``>&-``, ``| head``: a choice, not a fault)."""
    number = getattr(error, "errno", None)
    if isinstance(error, ValueError) or number in (errno.EPIPE, errno.ECONNRESET, errno.EBADF):
        return None
    if number == errno.ENOSPC:
        return f"{name} is full"
    if number == errno.EDQUOT:
        return f"{name} is over its disk quota"
    if number == errno.EIO:
        return f"{name} cannot be written (an input/output error: its terminal may be gone)"
    return f"{name} cannot be written ({getattr(error, 'strerror', None) or error})"


def _point_at_devnull(stream) -> None:
    """The process's own stdout or stderr (not a caller's stand-in) to /dev/null: its buffered rest, what C code
    writes there and the interpreter's flush at exit all go nowhere, without failing again."""
    if stream is None or stream not in (sys.__stdout__, sys.__stderr__):
        return
    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError):
        return
    try:
        os.dup2(null, fd)
    except OSError:
        pass
    finally:
        os.close(null)


class StandardStreams:
    """``sys.stdout`` and ``sys.stderr`` as :class:`~blockpred.progress.GuardedStream` while a command runs (a
    context manager).

    A dropped stream is named once on the other one; with ``json_output`` (standard output holds one JSON object)
    a dropped stderr is named in :attr:`warnings` instead, for that object.
    """

    def __init__(self, json_output: bool = False):
        self.json_output = json_output
        #: What went wrong with stderr, for a JSON object on standard output.
        self.warnings: list[str] = []
        self._saved: tuple | None = None

    def __enter__(self) -> "StandardStreams":
        self._saved = (sys.stdout, sys.stderr)
        self.stdout = GuardedStream(sys.stdout, "stdout", self._dropped)
        self.stderr = GuardedStream(sys.stderr, "stderr", self._dropped)
        sys.stdout, sys.stderr = self.stdout, self.stderr
        return self

    def __exit__(self, *exc) -> None:
        self.stdout.flush()  # a failure now is reported as any other
        self.stderr.flush()
        saved, self._saved = self._saved, None
        if sys.stdout is self.stdout:
            sys.stdout = saved[0]
        if sys.stderr is self.stderr:
            sys.stderr = saved[1]

    def _dropped(self, stream: GuardedStream, error: BaseException) -> None:
        _point_at_devnull(stream.wrapped)
        name = stream.name
        reason = stream_failure(name, error)
        if reason is None:
            return
        if name == "stderr" and self.json_output:
            self.warnings.append(f"{reason}; its lines were dropped")
            return
        other = self.stderr if name == "stdout" else self.stdout
        other.write(f"blockpred: warning: {reason}; its lines are dropped, and the run and its output are not "
                    f"affected\n")
        other.flush()


class _StderrHandler(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when a line is logged (as :data:`logging.lastResort`)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _blockpreds(record: logging.LogRecord) -> bool:
    return record.name == "blockpred" or record.name.startswith("blockpred.")


def log_to_stderr(verbose: bool) -> Callable[[], None]:
    """The log lines on stderr: blockpred's from WARNING (INFO with ``verbose``); other libraries' and Python's
    warnings (torch's, tifffile's) only with ``verbose``.  Returns what undoes it.

    As :func:`logging.basicConfig`: where the root logger has handlers already (an application's, pytest's),
    nothing changes.
    """
    root = logging.getLogger()
    if root.handlers:
        return lambda: None
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    if not verbose:
        handler.addFilter(_blockpreds)
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.captureWarnings(True)

    def undo() -> None:
        logging.captureWarnings(False)
        root.removeHandler(handler)

    return undo


#: After a second signal the orderly stop (its cleanup, its line, the lock released) gets this long; past it the
#: process ends anyway, with the signal's exit code and one line.  "At once, wherever the main thread is" can land
#: inside threading's own code and leave a lock held that a cleanup then waits for (see
#: :mod:`blockpred.pipeline.interrupts`): once in a loaded CI run a second Ctrl-C left the run alive for minutes.
STOP_NOW_GRACE_S = 10.0
_interrupts = 0


def _stop_anyway(signum: int) -> None:
    """The process ends :data:`STOP_NOW_GRACE_S` from now, whatever its main thread waits for (a daemon timer)."""
    def stop() -> None:
        name = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)"}.get(signum, "hung up (SIGHUP)")
        try:
            os.write(2, f"blockpred: {name}; stopped now; finished blocks are kept: run the same command again to "
                        f"resume\n".encode())
        except OSError:
            pass
        os._exit(128 + signum)

    timer = threading.Timer(STOP_NOW_GRACE_S, stop)
    timer.daemon = True
    timer.start()


def _interrupt(signum, frame) -> None:
    """Ctrl-C as Python's own handler (``KeyboardInterrupt``), and from the second on, the process's end assured."""
    global _interrupts
    _interrupts += 1
    if _interrupts > 1:
        _stop_anyway(signum)
    raise KeyboardInterrupt


def end_on_signals() -> None:
    """SIGTERM (what SLURM, Kubernetes and ``kill`` send first) and SIGHUP (a closed terminal or SSH session) end
    the command as Ctrl-C does: raised in the main thread as :class:`blockpred.errors.Terminated` and
    :class:`blockpred.errors.HungUp`.  A SIGHUP ignored (``nohup``) stays ignored."""
    from .pipeline import interrupts

    signal.signal(signal.SIGTERM, _terminate)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _terminate)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # an ignored one (a background job) stays so
        signal.signal(signal.SIGINT, _interrupt)
    interrupts.stop_now_hook = _stop_anyway
    default = sys.unraisablehook

    def unraisable(what) -> None:
        """A signal's exception raised in a weakref callback or a finaliser: kept, to be raised by the main
        thread's next wait, not printed and dropped (see blockpred.pipeline.interrupts.swallowed)."""
        if isinstance(what.exc_value, KeyboardInterrupt):
            interrupts.swallowed = what.exc_value
        else:
            default(what)

    sys.unraisablehook = unraisable


def _terminate(signum, frame) -> None:
    from .errors import HungUp, Terminated

    signal.signal(signum, signal.SIG_DFL)  # the same signal again ends the process at once
    raise HungUp() if signum == signal.SIGHUP else Terminated()


def exit_now(code: int) -> None:
    """End an interrupted command at once.  A network pass on the CPU runs on a worker thread of
    :mod:`concurrent.futures` (see :meth:`blockpred.pipeline.infer.Predictor.submit`), which the interpreter joins
    at exit: a dry run or a block of minutes kept the process alive after its "interrupted" line.  atexit's
    handlers still run (an object store's buffered done marks are written), then the process ends."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def process_start_time(fallback: float | None) -> float | None:
    """When this process started (``time.time()``): the command's start-up includes the interpreter and imports.

    From the process's age in clock ticks since boot against the uptime (both 10 ms); psutil's
    ``create_time`` adds the boot time, which /proc gives in whole seconds.
    """
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
            age = float(uptime.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # not Linux: from predict's start instead
        return fallback
    return time.time() - max(0.0, age)
