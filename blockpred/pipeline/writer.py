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
    A volume without parallel writes (HDF5) gets one writer thread.  A failed
    write calls ``on_failed(block, error)`` and the others go on.
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
        threads = num_threads if sink.parallel_writes else 1
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="blockpred-write")
        self._slots = threading.BoundedSemaphore(max(max_pending, threads))

    def _write(self, block: Block, data: np.ndarray) -> None:
        try:
            start = time.perf_counter()
            self._sink.write(block.write_box, data)
            if self._on_written is not None:
                self._on_written(block, time.perf_counter() - start)
        except Exception as err:  # noqa: BLE001 - reported through on_failed
            failure = BlockFailedError(block.index, f"writing {block} failed: {err}")
            failure.__cause__ = err
            if self._on_failed is not None:
                self._on_failed(block, failure)
        finally:
            self._slots.release()

    def submit(self, block: Block, data: np.ndarray) -> None:
        self._slots.acquire()
        self._pool.submit(self._write, block, data)

    def close(self) -> None:
        """Wait for every submitted write.

        Also the way out after a failure elsewhere: the writes already submitted
        are finished results (at most ``max_pending``), so they are written rather
        than dropped, and no chunk is left half-written.
        """
        self._pool.shutdown(wait=True)
