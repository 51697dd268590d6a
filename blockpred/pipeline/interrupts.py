"""Ctrl-C while a pipeline runs in the main thread: acted on between blocks, never inside a lock.

Python raises ``KeyboardInterrupt`` in the main thread at whatever bytecode
it runs next, also inside ``threading``'s own code, which is Python around a
plain lock: interrupted in ``Semaphore.acquire`` or ``release``, a semaphore
can keep its lock held or lose a count, and interrupted between taking a
writer's slot and handing the write its callback, the slot is never given
back.  The pipeline's cleanup (every submitted write finished, every slot
back) then waits forever in ``BlockWriter.close``, its other threads idle
(issue 38: a SIGINT 2.2 s into a run once left a process alive for ten
minutes).  A SIGINT at a random moment of a pipeline of 256 tiny blocks,
whose main thread is busy submitting, hung it within the first ten such
interrupts in each of eight tries; deferred as below, none of 781 did.

So while :func:`deferred_interrupts` is active, SIGINT, SIGTERM and SIGHUP
are only noted; the pipeline calls :meth:`Interrupts.check` between blocks,
where it holds no lock, and the signal's own handler runs there (Python's
raises ``KeyboardInterrupt``; the CLI's SIGTERM and SIGHUP handler raises
:class:`blockpred.errors.Terminated`).  The waits in between are bounded by
the pipeline's progress (a read, a batch, a write), so a Ctrl-C takes effect
within about one batch, as before: an interrupted run always waited for the
batch on the device and the writes in flight.  That wait can be long (a
block of 19 s on a CPU), so the first signal says at once, in one line on
stderr, that the run stops after the blocks in flight and how to stop it now
(:func:`noted_line`).  A second signal runs its handler at once: the run
ends without waiting for those blocks (they are done again by a resume).
"At once" holds also where the kernel hands the signal to another thread:
the main thread's waits are sliced (:mod:`.waits`).

Only in the main thread (the only one where Python runs signal handlers),
and only for signals with a Python handler: one ignored (a background job
of a non-interactive shell ignores SIGINT) or left to the system stays so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

#: The signals deferred: a terminal's Ctrl-C, what batch systems and ``kill`` send first, a terminal closed.
DEFERRED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Called with the signal where a second one asks to stop now (the command's guarantee that the process ends:
#: :func:`blockpred.process.end_on_signals`); None in a process that set none (the API's caller's).
stop_now_hook: Callable[[int], None] | None = None
#: A signal's exception that Python swallowed: raised in the main thread while it ran a weakref callback or a
#: finaliser (the garbage collector's, at any bytecode), it is printed as "Exception ignored" and dropped, and a
#: second Ctrl-C did not stop the run (twice in loaded CI runs).  The command's unraisable hook keeps it here
#: (:func:`blockpred.process.end_on_signals`) and the main thread's next wait raises it (:func:`raise_swallowed`).
swallowed: BaseException | None = None


def raise_swallowed() -> None:
    """Raise the signal's exception Python swallowed, once (see :data:`swallowed`)."""
    global swallowed
    if swallowed is not None:
        error, swallowed = swallowed, None
        raise error


def noted_line(signum: int) -> str:
    """What the first signal says at once: the run stops after the blocks in flight, and how to stop it now."""
    if signum == signal.SIGINT:
        return "blockpred: stopping after the blocks in flight; Ctrl-C again to stop now"
    return f"blockpred: {signal.Signals(signum).name}: stopping after the blocks in flight; send it again to stop now"


def _say_at_once(line: str) -> None:
    """``line`` on stderr from a signal handler: written to the file descriptor, not through ``sys.stderr``, whose
    buffer the main thread may be inside of (Python raises "reentrant call" there); a stderr that cannot be written
    takes nothing.  On a terminal, the line first clears the one it is on (a progress bar, redrawn below)."""
    try:
        os.write(2, (("\r\x1b[K" if os.isatty(2) else "") + line + "\n").encode())
    except OSError:
        pass


class Interrupts:
    """The signals noted while a pipeline runs; :meth:`check` acts on them at a point that holds no lock."""

    def __init__(self) -> None:
        self._handlers: dict[int, Callable] = {}  # the handlers replaced, by signal
        self._noted: list[int] = []

    def check(self) -> None:
        """Run the handler of a signal noted since the last check (it raises, as it would have at once)."""
        if self._noted:
            self._act(self._restore())

    def _install(self) -> None:
        for signum in DEFERRED:
            handler = signal.getsignal(signum)
            if callable(handler):
                self._handlers[signum] = handler
                signal.signal(signum, self._note)

    def _note(self, signum: int, frame) -> None:
        self._noted.append(signum)
        if len(self._noted) > 1:  # asked twice: at once, wherever the main thread is
            if stop_now_hook is not None:
                stop_now_hook(signum)
            self._act(self._restore())
        else:
            _say_at_once(noted_line(signum))

    def _restore(self) -> dict[int, Callable]:
        """The handlers back in place (from here on signals act at once, as outside a pipeline); returns them."""
        handlers, self._handlers = self._handlers, {}
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        return handlers

    def _act(self, handlers: dict[int, Callable]) -> None:
        if self._noted:
            signum = self._noted[-1]
            self._noted.clear()
            handlers[signum](signum, None)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[Interrupts]:
    """SIGINT, SIGTERM and SIGHUP deferred to :meth:`Interrupts.check` (see the module docstring) until the block ends;
    one noted and not yet acted on (after the last check, or as the handlers went back) is acted on as it ends.
    Outside the main thread nothing is deferred."""
    interrupts = Interrupts()
    if threading.current_thread() is threading.main_thread():
        interrupts._install()
    try:
        yield interrupts
    finally:
        handlers = interrupts._restore()
        interrupts._act(handlers)
