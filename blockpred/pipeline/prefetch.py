"""Read blocks ahead of the device on a pool of threads, at most ``depth`` at a time."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from ..errors import BlockFailedError
from . import waits
from .blocking import Block


@dataclass(frozen=True)
class Idle:
    """What a block source that outlives its blocks (see :mod:`.stream`) yields when it has none right now.

    ``wait()`` blocks until it may have some again (or has ended).
    """

    wait: Callable[[], None]


def prefetch(
    blocks: Iterable[Block | Idle],
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

    ``blocks`` may yield :class:`Idle`: nothing to read right now.  Reading
    goes on with what is already pending; once that is handed out, one
    ``(None, None, None)`` says the source ran dry (the consumer may flush what
    it holds back, a partial batch), then the idle item's ``wait()`` blocks
    until the source has blocks again.
    """
    depth = max(depth, 1)
    pending: deque[tuple[Block, Future]] = deque()
    source = iter(blocks)
    pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="blockpred-read")
    idle: Idle | None = None

    def refill() -> None:
        nonlocal idle
        idle = None
        while len(pending) < depth:
            block = next(source, None)
            if block is None:
                return
            if isinstance(block, Idle):
                idle = block
                return
            pending.append((block, pool.submit(read, block)))

    try:
        refill()
        while pending or idle is not None:
            if not pending:
                waiting = idle
                yield None, None, None
                waiting.wait()
                refill()
                continue
            block, future = pending.popleft()
            try:
                data, error = waits.result(future), None
            except Exception as err:
                data, error = None, BlockFailedError(block.index, f"reading {block} failed: {err}")
                error.__cause__ = err
            refill()
            yield block, data, error
    finally:
        for _, future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
