"""What a served chunk costs: blocks predicted on request, each once, and encoded chunks kept while they fit.

:class:`BlockWork` lives on the server's event loop.  A request for a chunk of
the prediction's full resolution is a request for one block of the run's plan:

* a block the output's markers say is finished is read from the output;
* otherwise it joins the one call already queued or running for that block, or
  queues a new one on the run's pipeline (:class:`blockpred.pipeline.stream.BlockStream`,
  newest first: the viewer's latest view goes ahead of what it scrolled past),
  which batches blocks as ``blockpred run`` does and writes each into the
  output with its done-marker, so a later ``blockpred run`` skips it;
* when every request waiting for a queued block has gone away, the call is
  withdrawn before it reaches the device.

When the server stops (:meth:`BlockWork.stop`), a request waiting for a block
still queued is answered "the server is stopping" (the block withdrawn before it
reaches the device), one whose block is in the pipeline waits for it, and a
new one is answered "stopping" at once (see :mod:`.stopping`).

A chunk of a coarser level is made from the full resolution (window means, as
``--pyramid`` makes them) where every block under it is finished and it covers
at most :data:`MAX_COARSE_BLOCKS` blocks; otherwise it is missing (the viewer's
fill value), so zooming out never floods the device.  Encoded chunks are kept in
a least-recently-used cache of at most ``cache_bytes`` bytes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import BlockFailedError
from ..geometry import Box, Coord
from ..pipeline.blocking import BlockPlan
from ..pipeline.stream import BlockStream
from ..run.downsample import downsample
from .tree import ChunkKey, ServedTree

logger = logging.getLogger(__name__)

#: A coarser level's chunk is made only where it covers at most this many blocks of the full resolution.
MAX_COARSE_BLOCKS = 64


class ServerStopping(Exception):
    """The server is stopping: this chunk is not made (the server's 503)."""


async def unless_hurried(awaitable, hurry: asyncio.Event) -> None:
    """Await ``awaitable`` until it is done or ``hurry`` is set (at once where it is), whichever comes first; what
    is left of it is cancelled."""
    task = asyncio.ensure_future(awaitable)
    hurried = asyncio.ensure_future(hurry.wait())
    await asyncio.wait({task, hurried}, return_when=asyncio.FIRST_COMPLETED)
    task.cancel()
    hurried.cancel()


@dataclass
class Counts:
    """What the server did so far (its ``status.json``)."""

    requests: int = 0
    cache_hits: int = 0
    blocks_predicted: int = 0
    blocks_withdrawn: int = 0
    blocks_failed: int = 0
    missing: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Pending:
    """One block's call on the pipeline and the requests waiting for it."""

    future: asyncio.Future
    ticket: object = None
    waiters: int = 0


class ChunkCache:
    """Encoded chunks, least recently used first out, at most ``limit`` bytes (0: none kept)."""

    def __init__(self, limit: int):
        self.limit, self.size = int(limit), 0
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key) -> bytes | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key, value: bytes) -> None:
        if len(value) > self.limit:
            return
        with self._lock:
            old = self._items.pop(key, None)
            self.size += len(value) - (len(old) if old is not None else 0)
            self._items[key] = value
            while self.size > self.limit:
                _, dropped = self._items.popitem(last=False)
                self.size -= len(dropped)


class BlockWork:
    """The served chunks of one prediction (``prediction``) and of its input (``raw``); see the module docstring.

    ``read_output(box)`` / ``read_input(box)``: (C, Z, Y, X) or (Z, Y, X) data of level 0 in the box (the input
    padded as nothing: a box inside the volume).  ``finished``: the plan's grid of blocks the markers call finished.
    """

    def __init__(self, *, plan: BlockPlan, stream: BlockStream, finished: np.ndarray,
                 prediction: ServedTree, raw: ServedTree, read_output: Callable[[Box], np.ndarray],
                 read_input: Callable[[Box], np.ndarray], cache_bytes: int, threads: int = 4):
        self.plan, self.stream, self.finished = plan, stream, finished
        self.trees = {"prediction": prediction, "raw": raw}
        self._read = {"prediction": read_output, "raw": read_input}
        self.cache = ChunkCache(cache_bytes)
        self.counts = Counts()
        self._pending: dict[Coord, _Pending] = {}
        self._failed_once: set[Coord] = set()
        self._executor = ThreadPoolExecutor(max(1, threads), thread_name_prefix="blockpred-serve")
        #: Set by :meth:`stop`: no new chunk is made.
        self.stopping = False

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def stop(self, hurry: asyncio.Event) -> None:
        """(event loop) Make no new chunk; answer "stopping" to the requests waiting for a block not yet in the
        pipeline (withdrawn), and wait for the blocks that are, until ``hurry`` is set (then answer those
        "stopping" too)."""
        self.stopping = True
        for index, pending in list(self._pending.items()):
            if self.stream.withdraw(pending.ticket):
                self.counts.blocks_withdrawn += 1
                self._stopped(index)
        waiting = {pending.future for pending in self._pending.values()}
        if waiting:
            await unless_hurried(asyncio.wait(waiting), hurry)  # cancelled, asyncio.wait leaves the futures be
        for index in list(self._pending):  # hurried: the blocks still in the pipeline are not waited for
            self._stopped(index)

    def _stopped(self, index: Coord) -> None:
        pending = self._pending.pop(index)
        if not pending.future.done():
            pending.future.set_exception(ServerStopping())
            pending.future.exception()  # retrieved: a request that went away leaves no "never retrieved" note

    # ----------------------------------------------------------------- requests (on the event loop)
    async def chunk(self, name: str, key: ChunkKey, gone: asyncio.Future) -> bytes | None:
        """The encoded chunk ``key`` of tree ``name``; None where it is missing (the fill value), or where the
        request went away (``gone`` done) first.  Raises :class:`BlockFailedError` where the network failed."""
        self.counts.requests += 1
        if self.stopping:
            raise ServerStopping()
        cached = self.cache.get((name, key.level, key.index))
        if cached is not None:
            self.counts.cache_hits += 1
            return cached
        level0 = self._level0_box(name, key)
        blocks = self._blocks_under(level0)
        if blocks is None or (name == "prediction" and not blocks):  # too much to make, or outside the ROI
            self.counts.missing += 1
            return None
        if name == "prediction":
            unfinished = [b for b in blocks if not self.finished[tuple(b - self.plan.grid_begin)]]
            if unfinished and key.level > 0:  # a coarser level shows only what is predicted
                self.counts.missing += 1
                return None
            if unfinished and not await self._predicted(unfinished[0], gone):  # level 0: its one block
                return None
        loop = asyncio.get_running_loop()
        data = await loop.run_in_executor(self._executor, self._encode, name, key, level0)
        self.cache.put((name, key.level, key.index), data)
        return data

    async def _predicted(self, index: Coord, gone: asyncio.Future) -> bool:
        """Wait for block ``index`` to be predicted (joining its call, or queueing one); False when the request went
        away first."""
        pending = self._pending.get(index)
        if pending is None:
            pending = _Pending(asyncio.get_running_loop().create_future())
            self._pending[index] = pending
            loop = asyncio.get_running_loop()

            def finished(ticket) -> None:  # on the stream's thread
                if loop.is_closed():
                    return  # the server is gone, and with it every request that waited
                try:
                    loop.call_soon_threadsafe(self._settle, index, ticket)
                except RuntimeError:  # closed in between
                    pass

            pending.ticket = self.stream.submit([self.plan.block(index)], on_finished=finished)
        pending.waiters += 1
        try:
            await asyncio.wait({pending.future, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pending.waiters -= 1
            if pending.waiters == 0 and not pending.future.done() and self.stream.withdraw(pending.ticket):
                self.counts.blocks_withdrawn += 1
        if not pending.future.done():
            return False
        pending.future.result()  # raises the block's failure
        return True

    def _settle(self, index: Coord, ticket) -> None:
        """(event loop) Block ``index``'s call is through: its waiters hear how."""
        pending = self._pending.pop(index, None)
        if pending is None or pending.future.done():
            return
        if getattr(ticket, "withdrawn", False):
            pending.future.set_result(False)
            return
        try:
            self.stream.outcome(ticket)
        except BlockFailedError as err:
            self.counts.blocks_failed += 1
            if index not in self._failed_once:  # logged once per block; every request for it is answered 500
                self._failed_once.add(index)
                logger.error("block %s failed: %s", "x".join(map(str, index)), err)
            pending.future.set_exception(err)
            pending.future.exception()  # retrieved: a request that went away leaves no "never retrieved" note
            return
        except Exception as err:  # noqa: BLE001 - the pipeline stopped: every waiting request hears of it
            pending.future.set_exception(err)
            pending.future.exception()
            return
        if not ticket.counts.num_blocks + ticket.counts.num_skipped:  # the stream closed before the block ran
            pending.future.set_exception(ServerStopping())
            pending.future.exception()
            return
        self.counts.blocks_predicted += ticket.counts.num_blocks
        self.finished[tuple(index - self.plan.grid_begin)] = True
        pending.future.set_result(True)

    # ----------------------------------------------------------------- geometry and data (any thread)
    def _level0_box(self, name: str, key: ChunkKey) -> Box:
        level = self.trees[name].levels[key.level]
        box = Box(key.box.begin * level.scale, key.box.end * level.scale)
        return box.intersect(Box.from_shape(self.trees[name].levels[0].shape))

    def _blocks_under(self, box: Box) -> list[Coord] | None:
        """The plan's blocks whose write boxes meet ``box`` (level 0), in C order, none outside the ROI; None where
        they are more than :data:`MAX_COARSE_BLOCKS` (never listed one by one)."""
        box = box.intersect(self.plan.roi)
        if box.empty:
            return []
        first, last = box.begin // self.plan.block_shape, (box.end - 1) // self.plan.block_shape
        ranges = [range(a, b + 1) for a, b in zip(first, last)]
        if np.prod([len(r) for r in ranges]) > MAX_COARSE_BLOCKS:
            return None
        return [Coord((z, y, x)) for z in ranges[0] for y in ranges[1] for x in ranges[2]]

    def _encode(self, name: str, key: ChunkKey, level0: Box) -> bytes:
        tree = self.trees[name]
        level = tree.levels[key.level]
        read = level0.intersect(self.plan.roi) if name == "prediction" else level0
        data = np.zeros(((tree.channels,) if tree.channels is not None else ()) + tuple(level0.shape), tree.dtype)
        if not read.empty:
            data[(Ellipsis,) + read.relative_to(level0.begin).to_slices()] = self._read[name](read)
        if key.level > 0:
            data = downsample(data, level.scale, "mean")
        return tree.encode(key, data[(Ellipsis,) + tuple(slice(0, n) for n in key.box.shape)])
