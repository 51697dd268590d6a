"""A pipeline that outlives the calls feeding it: one per dask worker, fed by its tasks.

A pipeline (:func:`.worker.run_blocks`) fills before the device is busy and
drains before the last write: over one call, the device idles at both ends.
A dask task that ran its own pipeline paid that at every task boundary.  A
:class:`BlockStream` runs one pipeline on its own thread for as long as it
is open; :meth:`BlockStream.run` queues a call's blocks behind those already
queued and returns when each of them is written, skipped or failed.  With two
calls waiting on one stream (a dask worker with two threads and two tasks in
flight), the next call's blocks are read while the current call's last
batches are on the device, so the device never drains between tasks.

Bookkeeping costs a dictionary entry and a lock per block, on the worker.

A server (``blockpred serve``) feeds it one request at a time without waiting:
:meth:`BlockStream.submit` queues a call and returns its ticket, whose
``on_finished`` runs when it is through; with ``newest_first`` the newest call
is served first (the viewer's latest view), and :meth:`BlockStream.withdraw`
takes back a call none of whose blocks has entered the pipeline (its request
went away).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from ..errors import BlockFailedError
from .blocking import Block
from .prefetch import Idle
from .stats import RunStats
from .worker import raise_failures

_IDS = itertools.count(1)


class StreamStoppedError(RuntimeError):
    """The stream's pipeline stopped on an error that is not one block's failure."""


@dataclass(eq=False)
class _Ticket:
    """One :meth:`BlockStream.run` call: its blocks not yet handed out, and what became of the others."""

    blocks: Iterator[Block]
    counts: RunStats = field(default_factory=RunStats)
    failures: list[BlockFailedError] = field(default_factory=list)
    outstanding: int = 0  # handed to the pipeline, not yet written, skipped or failed
    exhausted: bool = False
    started: float | None = None
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    #: Called (on whichever thread finished it, without the stream's lock) once the call is through.
    on_finished: Callable[["_Ticket"], None] | None = None
    withdrawn: bool = False


class BlockStream:
    """One long-lived pipeline; :meth:`run` adds blocks to it and waits for them.

    ``runner(blocks, on_block_done=, on_block_skipped=, on_block_failed=, stats=)``
    is :func:`.worker.run_blocks` with its source, sink, predictor and settings
    bound.  ``on_block_done(block)`` and ``on_block_skipped(block)`` run first
    when a block is written or skipped (a job marks it there), before the call
    that queued it hears of it.  A call whose blocks fail ``max_failures``
    times has the rest of its blocks withdrawn (a systematic fault should not
    grind through them).
    """

    def __init__(self, runner: Callable[..., RunStats], *, max_failures: int,
                 on_block_done: Callable[[Block], None] | None = None,
                 on_block_skipped: Callable[[Block], None] | None = None, newest_first: bool = False):
        #: Unique among the pipelines of every process (a restarted worker's counter starts again).
        self.id = f"{os.getpid()}-{next(_IDS)}"
        #: The pipeline's stage times, summed over every call so far (read while it runs).
        self.stats = RunStats()
        self._runner, self._max_failures = runner, max(1, max_failures)
        self._on_block_done, self._on_block_skipped = on_block_done, on_block_skipped
        self._lock = threading.Condition()
        self._queued: deque[_Ticket] = deque()  # tickets with blocks still to hand out, in order
        self._open: set[_Ticket] = set()  # tickets not finished
        self._owner: dict[tuple[int, ...], deque[_Ticket]] = {}  # block index -> tickets it was handed out for
        self._closed = False
        self._newest_first = newest_first
        self._stopped: BaseException | None = None
        self._busy_s, self._busy_since = 0.0, 0.0
        self._thread = threading.Thread(target=self._run, name=f"blockpred-stream-{self.id}", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- callers
    def run(self, blocks: Iterable[Block]) -> RunStats:
        """Run ``blocks`` (lazily iterated, on the stream's thread); their counts and seconds.

        ``seconds`` runs from the moment the first of them entered the
        pipeline.  Raises :class:`BlockFailedError` for the failed ones (every
        index in ``failed``) once all are through, and :class:`StreamStoppedError`
        when the pipeline itself stopped (or any error of iterating ``blocks``).
        """
        return self.outcome(self.submit(blocks), wait=True)

    def submit(self, blocks: Iterable[Block], on_finished: Callable[[_Ticket], None] | None = None) -> _Ticket:
        """Queue ``blocks`` as one call and return at once; ``on_finished(ticket)`` once it is through (then
        :meth:`outcome` says how)."""
        ticket = _Ticket(iter(blocks), on_finished=on_finished)
        with self._lock:
            if self._closed:
                raise StreamStoppedError(f"the block stream is closed{self._reason()}")
            if not self._open:
                self._busy_since = time.perf_counter()
            self._open.add(ticket)
            self._queued.append(ticket)
            self._lock.notify_all()
        return ticket

    @staticmethod
    def outcome(ticket: _Ticket, wait: bool = False) -> RunStats:
        """A call's counts; raises as :meth:`run` does.  ``wait``: until it is through."""
        if wait:
            ticket.finished.wait()
        if ticket.error is not None:
            raise ticket.error
        if ticket.failures:
            raise_failures(ticket.failures)
        return ticket.counts

    def withdraw(self, ticket: _Ticket) -> bool:
        """Take back a call none of whose blocks has entered the pipeline: it finishes with nothing done.
        False (and nothing changes) once one has."""
        with self._lock:
            if ticket.outstanding or ticket.started is not None or ticket not in self._open:
                return False
            ticket.withdrawn = True
            ticket.blocks = iter(())
            if ticket in self._queued:
                self._queued.remove(ticket)
            ticket.exhausted = True
            done = self._finish(ticket)
        self._announce(done)
        return True

    @property
    def busy_s(self) -> float:
        """Seconds so far during which some call was waiting on the stream."""
        with self._lock:
            return self._busy_s + (time.perf_counter() - self._busy_since if self._open else 0.0)

    @property
    def pending_calls(self) -> int:
        """Calls of :meth:`run` not yet returned."""
        with self._lock:
            return len(self._open)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def close(self, *, cancel: bool = False) -> None:
        """Finish what is queued, stop the pipeline and wait for its thread.

        ``cancel``: hand out no more blocks; only those already in the pipeline
        finish (a few batches), and the waiting calls return with what was done.
        """
        with self._lock:
            self._closed = True
            if cancel:
                for ticket in self._queued:
                    ticket.blocks = iter(())
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # ----------------------------------------------------------------- the stream's thread
    def _run(self) -> None:
        error = None
        try:
            self._runner(self._blocks(), on_block_done=self._done, on_block_skipped=self._skipped,
                         on_block_failed=self._failed, stats=self.stats)
        except BaseException as err:  # noqa: BLE001 - handed to every waiting call
            error = err
        with self._lock:
            self._closed = True
            self._stopped = error
            done = []
            for ticket in list(self._open):
                ticket.error = StreamStoppedError(f"the block stream stopped: {error}" if error is not None
                                                  else "the block stream closed before these blocks ran")
                ticket.error.__cause__ = error
                done.append(self._finish(ticket))
            self._queued.clear()
        for ticket in done:
            self._announce(ticket)

    def _blocks(self) -> Iterator[Block | Idle]:
        """The queued calls' blocks in order; :class:`Idle` when there are none for now; ends on close."""
        while True:
            block = self._next()
            if block is not None:
                yield block
                continue
            with self._lock:
                if self._closed and not self._queued:
                    return
            yield Idle(self._wait)

    def _next(self) -> Block | None:
        """The next block to hand out; finishes calls that have nothing left.

        A call's block iterator runs outside the lock (it may be slow; it
        may even wait), so other calls can queue meanwhile.  Only this thread
        takes from the queue.
        """
        while True:
            with self._lock:
                if not self._queued:
                    return None
                ticket = self._queued[-1 if self._newest_first else 0]
                blocks = ticket.blocks
            try:
                block, error = next(blocks, None), None
            except Exception as err:  # noqa: BLE001 - a bad block list fails its call only (raised by run)
                block, error = None, err
            done = None
            with self._lock:
                if ticket.withdrawn:  # taken back while its iterator ran: the block is not handed out
                    continue
                if block is not None:
                    ticket.outstanding += 1
                    if ticket.started is None:
                        ticket.started = time.perf_counter()
                    self._owner.setdefault(block.index, deque()).append(ticket)
                    return block
                self._queued.remove(ticket)
                ticket.exhausted = True
                ticket.error = ticket.error or error
                if ticket.outstanding == 0:
                    done = self._finish(ticket)
            self._announce(done)

    def _wait(self) -> None:
        with self._lock:
            while not self._queued and not self._closed:
                self._lock.wait()

    # ----------------------------------------------------------------- pipeline callbacks (any thread)
    def _done(self, block: Block) -> None:
        if self._on_block_done is not None:
            self._on_block_done(block)  # an error here fails the block (the writer reports it)
        self._settle(block, "written")

    def _skipped(self, block: Block) -> None:
        if self._on_block_skipped is not None:
            self._on_block_skipped(block)
        self._settle(block, "skipped")

    def _failed(self, block: Block, error: BlockFailedError) -> None:
        self._settle(block, "failed", error)

    def _settle(self, block: Block, outcome: str, error: BlockFailedError | None = None) -> None:
        """``block`` is written, skipped or failed: its call hears of it."""
        done = None
        with self._lock:
            owners = self._owner.get(block.index)
            if not owners:
                return  # not handed out by this stream
            ticket = owners.popleft()
            if not owners:
                del self._owner[block.index]
            ticket.outstanding -= 1
            if outcome == "written":
                ticket.counts.num_blocks += 1
                ticket.counts.num_voxels += block.write_box.size
            elif outcome == "skipped":
                ticket.counts.num_skipped += 1
            else:
                ticket.failures.append(error)
                if (len(ticket.failures) >= self._max_failures or error.permanent) and not ticket.exhausted:
                    ticket.blocks = iter(())  # withdrawn: handed out no further
            if ticket.exhausted and ticket.outstanding == 0:
                done = self._finish(ticket)
        self._announce(done)

    def _finish(self, ticket: _Ticket) -> _Ticket | None:
        """(lock held) The call may return; the ticket, for :meth:`_announce` once the lock is released (None
        when it was finished before)."""
        if ticket not in self._open:
            return None
        now = time.perf_counter()
        ticket.counts.seconds = now - ticket.started if ticket.started is not None else 0.0
        self._open.discard(ticket)
        if not self._open:
            self._busy_s += now - self._busy_since
        ticket.finished.set()
        return ticket

    @staticmethod
    def _announce(ticket: _Ticket | None) -> None:
        """(lock released) A finished call's ``on_finished``."""
        if ticket is not None and ticket.on_finished is not None:
            ticket.on_finished(ticket)

    def _reason(self) -> str:
        return f" (it stopped on: {self._stopped})" if self._stopped is not None else ""

