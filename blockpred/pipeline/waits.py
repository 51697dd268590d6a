"""Waits of the main thread that let a signal's handler run while they wait.

The kernel delivers a process's Ctrl-C, SIGTERM or SIGHUP to any of its
threads that does not block it; CPython then notes it, and runs the Python
handler in the main thread at its next bytecode.  A main thread blocked in an
untimed lock wait (``Future.result()``, ``Semaphore.acquire()``,
``Event.wait()``) is woken only when the signal was delivered to it: delivered
to another thread (the network's, a reader's), the handler runs when the wait
ends, after the block in flight (19 s on a CPU; never, for a network that
hangs).  On a loaded machine that happened to about one Ctrl-C in ten: the
"stopping after the blocks in flight" line was not said, and a second Ctrl-C
did not stop the run.

So the main thread's waits here are cut into slices of :data:`SLICE_S`:
between two, the interpreter runs the handlers noted, and a signal's exception
that Python swallowed meanwhile is raised (:func:`.interrupts.raise_swallowed`).  A wait in another
thread is the same wait, sliced for nothing.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as NotYet
from typing import TypeVar

from .interrupts import raise_swallowed

#: The longest a noted signal waits for the main thread to run its handler.
SLICE_S = 0.1

T = TypeVar("T")


def result(future: Future[T]) -> T:
    """``future.result()``: its value or its error, once it is done."""
    while True:
        try:
            future.exception(timeout=SLICE_S)  # returns the future's error; raises only on a timeout (or cancelled)
        except NotYet:
            raise_swallowed()
            continue
        return future.result()


def acquire(lock: threading.Semaphore | threading.Lock) -> None:
    """``lock.acquire()``."""
    while not lock.acquire(timeout=SLICE_S):
        raise_swallowed()

