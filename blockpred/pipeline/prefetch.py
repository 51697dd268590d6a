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
) -> Iterator[tuple[Block, np.ndarray]]:
    """Yield ``(block, read(block))`` in the order of ``blocks``.

    At most ``depth`` blocks are read (or being read) ahead of the consumer, so
    memory stays bounded whatever the number of blocks.  A failed read raises
    :class:`BlockFailedError` naming the block.  Closing the generator cancels
    the reads not yet started and waits for those running.
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
                data = future.result()
            except Exception as err:
                raise BlockFailedError(block.index, f"reading {block} failed: {err}") from err
            refill()
            yield block, data
    finally:
        for _, future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
