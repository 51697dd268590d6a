"""Write finished blocks, a bounded number at a time; a failed write fails only its block."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from ..errors import BlockFailedError, first_line, os_fault
from ..io import stores
from ..io.base import Volume
from . import waits
from .blocking import Block


class BlockWriter:
    """Writes each block's cropped output into ``sink`` at the block's write box.

    Every sink keeps one contract (:meth:`~blockpred.io.base.Volume.write_async`):
    the write's future completes once the data is durable, and fails with the
    write's error.  A sink with asynchronous writes (tensorstore: zarr, N5,
    precomputed) encodes and stores on its own thread pool: ``submit`` starts
    the write and returns.  Any other sink (HDF5) starts its writes on
    ``num_threads`` threads of this writer (one when the sink has no parallel
    writes); its futures complete when the sink has made them durable (HDF5:
    a flush and an fsync, in groups).  Either way at most ``max_pending``
    blocks are being written at once: ``submit`` blocks the caller beyond that
    (back-pressure, so memory stays bounded).

    This is the one place a block's write is declared done: when its future
    completes, ``on_written(block, seconds)`` runs (from whichever thread
    completed it), never before; then ``release()``, if the block was
    submitted with one, says its buffer may be reused.  A failed write calls
    ``on_failed(block, error)`` instead and the others go on.
    """

    def __init__(
        self,
        sink: Volume,
        *,
        num_threads: int,
        max_pending: int,
        on_written: Callable[[Block, float], None] | None = None,
        on_failed: Callable[[Block, BlockFailedError], None] | None = None,
    ):
        self._sink = sink
        self._on_written = on_written
        self._on_failed = on_failed
        self._pool = None
        if not sink.async_writes:
            threads = num_threads if sink.parallel_writes else 1
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="blockpred-write")
            max_pending = max(max_pending, threads)
        self._slots = threading.BoundedSemaphore(max_pending)
        self._max_pending = max_pending
        #: An object store: a write is not even started while the store was found unreachable a moment ago.
        self._store = sink.path.container if getattr(sink.path, "is_remote", False) else None

    def submit(self, block: Block, data: np.ndarray, release: Callable[[], None] | None = None) -> None:
        waits.acquire(self._slots)
        start = time.perf_counter()
        if self._store is not None:
            try:
                stores.check_reachable(self._store)
            except Exception as err:  # noqa: BLE001 - fails this block at once, not after a minute of retries
                self._finish(block, start, release, err)
                return
        if self._pool is not None:
            self._pool.submit(self._start, block, data, start, release)
        else:
            self._start(block, data, start, release)

    def _start(self, block: Block, data: np.ndarray, start: float, release) -> None:
        try:
            future = self._sink.write_async(block.write_box, data)
        except Exception as err:  # noqa: BLE001 - a bad box, data or a failed write fails its block only
            self._finish(block, start, release, err)
            return
        future.add_done_callback(lambda done: self._finish(block, start, release, done.exception()))

    def _finish(self, block: Block, start: float, release, error: BaseException | None) -> None:
        try:
            if error is None:
                if self._on_written is not None:
                    self._on_written(block, time.perf_counter() - start)
            elif self._on_failed is not None:
                if self._store is not None:
                    stores.note_failure(self._store, error)
                failure = BlockFailedError(block.index, f"writing {block} to {self._sink.path} failed: "
                                                        f"{_reason(error)}")
                failure.__cause__ = error
                self._on_failed(block, failure)
        except Exception as err:  # noqa: BLE001 - marking a block done failed: the block is not done
            if self._on_failed is not None and error is None:
                failure = BlockFailedError(block.index, f"recording {block} as written failed: {err}")
                failure.__cause__ = err
                self._on_failed(block, failure)
        finally:
            if release is not None:
                release()
            self._slots.release()

    def close(self) -> None:
        """Wait for every submitted write.

        Also the way out after a failure elsewhere: the writes already submitted
        are finished results (at most ``max_pending``), so they are written rather
        than dropped, and no chunk is left half-written.
        """
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for _ in range(self._max_pending):  # every slot back: every write has finished
            waits.acquire(self._slots)
        for _ in range(self._max_pending):
            self._slots.release()


def _reason(error: BaseException) -> str:
    """What a failed write met, in one line: a fault of the file system in words, with its cure."""
    fault = os_fault(error)
    if fault is not None:
        return "; ".join(fault)
    return first_line(error).split(" [tensorstore_spec=", 1)[0]
