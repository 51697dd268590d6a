"""Write finished blocks on a bounded pool of threads; the first error wins."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from ..blocking import Block
from ..errors import BlockFailedError
from ..io.base import Volume


class BlockWriter:
    """Writes each block's cropped output into ``sink.write(block.write_box, data)``.

    At most ``max_pending`` blocks wait or are being written at once: ``submit``
    blocks the caller beyond that (back-pressure, so memory stays bounded).
    ``on_written(block)`` runs after a block's data is written, never before.
    A volume without parallel writes (HDF5) gets one writer thread.
    """

    def __init__(
        self,
        sink: Volume,
        *,
        num_threads: int,
        max_pending: int,
        on_written: Callable[[Block, float], None] | None = None,
    ):
        self._sink = sink
        self._on_written = on_written
        threads = num_threads if sink.parallel_writes else 1
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="blockpred-write")
        self._slots = threading.BoundedSemaphore(max(max_pending, threads))
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def _write(self, block: Block, data: np.ndarray) -> None:
        try:
            if self._error is not None:
                return
            start = time.perf_counter()
            self._sink.write(block.write_box, data)
            if self._on_written is not None:
                self._on_written(block, time.perf_counter() - start)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            with self._lock:
                if self._error is None:
                    failure = BlockFailedError(block.index, f"writing {block} failed: {err}")
                    failure.__cause__ = err
                    self._error = failure
        finally:
            self._slots.release()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, block: Block, data: np.ndarray) -> None:
        self.raise_if_failed()
        self._slots.acquire()
        self._pool.submit(self._write, block, data)

    def close(self) -> None:
        """Wait for every submitted write; raise the first write error, if any."""
        self._pool.shutdown(wait=True)
        self.raise_if_failed()

    def drain(self) -> None:
        """After a failure elsewhere: finish the writes already submitted, without raising.

        They are finished results (at most ``max_pending`` of them), so they are
        written rather than dropped; no chunk is left half-written.
        """
        self._pool.shutdown(wait=True)
