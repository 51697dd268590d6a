"""Read blocks ahead of the device on a pool of threads, at most ``depth`` at a time."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator

import numpy as np

from ..blocking import Block
from ..errors import BlockFailedError


def prefetch(
    blocks: Iterable[Block],
    read: Callable[[Block], np.ndarray],
    *,
    num_threads: int,
    depth: int,
) -> Iterator[tuple[Block, np.ndarray | None, BlockFailedError | None]]:
    """Yield ``(block, read(block), None)`` in the order of ``blocks``.

    At most ``depth`` blocks are read (or being read) ahead of the consumer, so
    memory stays bounded whatever the number of blocks.  A failed read yields
    ``(block, None, error)``, the error naming the block, and reading goes on.
    Closing the generator cancels the reads not yet started and waits for those
    running.
    """
    depth = max(depth, 1)
    pending: deque[tuple[Block, Future]] = deque()
    source = iter(blocks)
    pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="blockpred-read")

    def refill() -> None:
        while len(pending) < depth:
            block = next(source, None)
            if block is None:
                return
            pending.append((block, pool.submit(read, block)))

    try:
        refill()
        while pending:
            block, future = pending.popleft()
            try:
                data, error = future.result(), None
            except Exception as err:
                data, error = None, BlockFailedError(block.index, f"reading {block} failed: {err}")
                error.__cause__ = err
            refill()
            yield block, data, error
    finally:
        for _, future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
