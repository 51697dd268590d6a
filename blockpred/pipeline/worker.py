"""The worker loop: prefetch -> batch -> device (normalise, network, crop, convert) -> write.

:func:`run_blocks` is the one execution path: the CLI, the Python API and
every dask worker run it over the blocks they are given.  Readers hand over
raw blocks; the device does all the arithmetic (see :mod:`.infer`).  Batch n+1
is submitted before batch n is collected, so on CUDA the copies and the
network overlap.  Memory is bounded by ``(prefetch + 2 x batch_size)`` raw
input blocks plus ``2 x num_writers`` output blocks, never by the volume.
Out-of-memory errors shrink the batch, then the block (see :mod:`.backoff`).
Ctrl-C (or SIGTERM) in the main thread stops the loop between blocks (see
:mod:`.interrupts`); what is on the device and being written is finished.

Silent wrong values are counted in :class:`RunStats`: NaN and inf among the
network's values for the written voxels (before the conversion to the output
dtype turns them into numbers; see :mod:`.infer`), and input chunks that are
not stored and so read as the fill value (see
:meth:`blockpred.io.base.Volume.read_with_missing`).  With
``missing_chunks="error"`` a block that reads a missing chunk fails instead,
permanently (a retry would read the same hole).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from ..errors import DEVICE_LOST_HINT, BlockFailedError, MissingChunkError, first_line, is_device_lost
from ..geometry import Box, Coord
from ..io.base import Volume
from ..normalize import Normalization
from .backoff import Backoff, is_out_of_memory, split_core
from .blocking import Block
from .infer import DeviceSteps, Pending, Predictor
from .interrupts import deferred_interrupts
from .padding import read_padded_with_missing, source_indices
from .prefetch import prefetch
from .stats import RunStats
from .writer import BlockWriter

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PipelineSettings:
    """How one worker moves blocks; the defaults suit one device and a few CPU cores."""

    batch_size: int = 1
    num_readers: int = 2
    num_writers: int = 2
    prefetch: int = 4
    pad_mode: str = "reflect"
    pad_value: float = 0.0
    normalization: Normalization = Normalization("auto")
    output_dtype: np.dtype = np.dtype("float32")
    channels: tuple[int, ...] | None = None
    #: The network's total downsampling: blocks predicted in parts keep to its grid.
    downsampling: Coord = Coord((1, 1, 1))
    #: A run stops early after this many failed blocks.
    max_failures: int = 10
    #: A missing (not stored) input chunk: "warn" reads it as the fill value and counts it; "error" fails the block.
    missing_chunks: str = "warn"
    #: The spatial axis (0 z, 1 y, 2 x) along which the network takes per-plane constants (a 2D bioimage.io
    #: package's per-plane statistics): each batch then names the volume plane of every input plane
    #: (:attr:`DeviceSteps.planes`).  None: a network without.
    planes_along: int | None = None


def run_blocks(
    blocks: Iterable[Block],
    *,
    source: Volume,
    sink: Volume,
    predictor: Predictor,
    settings: PipelineSettings,
    on_block_done: Callable[[Block], None] | None = None,
    skip: Callable[[Block, np.ndarray], bool] | None = None,
    on_block_skipped: Callable[[Block], None] | None = None,
    backoff: Backoff | None = None,
    on_block_failed: Callable[[Block, BlockFailedError], None] | None = None,
    stats: RunStats | None = None,
) -> RunStats:
    """Predict ``blocks`` from ``source`` into ``sink``; returns when every write is done.

    A block that fails (read, network or write) does not stop the others: when
    all are through, :class:`BlockFailedError` is raised for the first failure
    (its ``failed`` attribute lists every failed block index), after every other
    block has been written.  After ``settings.max_failures`` failures the run
    stops early (a systematic fault should not grind through a whole volume).
    Out of memory is not a failure while the batch or the block can shrink:
    the same blocks run again smaller.  ``backoff`` carries the sizes that fit
    from one call to the next (a dask worker keeps one); by default it starts
    at ``settings.batch_size``.

    ``on_block_done(block)`` is called from a writer thread once the block's
    data is written.  ``skip(block, data)``, given the block's raw input, may
    say the block needs no network: it is then not written and
    ``on_block_skipped(block)`` is called.

    A long-lived caller (a block stream: see :mod:`.stream`) passes
    ``on_block_failed(block, error)``: failures then go there, as they happen,
    and neither stop the run nor are raised; and ``stats``, which it can read
    while the run goes on.  ``blocks`` may yield :class:`.prefetch.Idle`: when
    the source runs dry, the partial batch held back is run and written.
    """
    stats = stats if stats is not None else RunStats()
    start = time.perf_counter()
    backoff = backoff if backoff is not None else Backoff(settings.batch_size)
    events_before = backoff.events
    failures: list[BlockFailedError] = []
    failures_lock = threading.Lock()

    stats.missing_chunks_counted = source.counts_missing_chunks

    def read(block: Block) -> np.ndarray | None:
        begin = time.perf_counter()
        data, missing = read_padded_with_missing(source, block.read_box, settings.pad_mode, settings.pad_value)
        if missing:
            _missing_chunks(block, missing, source, settings, stats)
        if skip is not None and skip(block, data):
            return None
        if data.ndim == 3:
            data = data[np.newaxis]
        stats.add("read_s", time.perf_counter() - begin)
        return data

    def written(block: Block, seconds: float) -> None:
        with stats._lock:
            stats.write_s += seconds
            stats.num_blocks += 1
            stats.num_voxels += block.write_box.size
        if on_block_done is not None:
            on_block_done(block)

    def failed(block: Block, error: BlockFailedError) -> None:
        if on_block_failed is not None:
            on_block_failed(block, error)
            return
        with failures_lock:
            failures.append(error)

    def too_many_failures() -> bool:
        """Stop after ``max_failures`` failures, or at the first that a retry would only repeat (a full disk)."""
        with failures_lock:
            return len(failures) >= settings.max_failures or any(f.permanent for f in failures)

    writer = BlockWriter(sink, num_threads=settings.num_writers, max_pending=2 * settings.num_writers,
                         on_written=written, on_failed=failed)
    num_planes = None if settings.planes_along is None else source.spatial_shape[settings.planes_along]
    device = _DeviceFeed(predictor, settings, backoff, writer, failed, stats, num_planes)
    reads = prefetch(blocks, read, num_threads=settings.num_readers, depth=settings.prefetch)
    # Ctrl-C acts between blocks, never inside the locks of the cleanup's waits (see .interrupts).
    with deferred_interrupts() as interrupts:
        try:
            with contextlib.closing(reads):
                for item in _usable(reads, failed, on_block_skipped, stats):
                    interrupts.check()
                    if item is None:  # the source ran dry for now: nothing may wait in a partial batch
                        device.flush()
                        continue
                    device.add(item)
                    if too_many_failures():
                        break
                else:
                    device.flush()
        finally:
            device.close()
            writer.close()
    stats.seconds = time.perf_counter() - start
    stats.out_of_memory = backoff.events - events_before
    stats.batch_size, stats.block_parts = backoff.batch_size, backoff.parts
    if failures:
        raise_failures(failures)
    return stats


def raise_failures(failures: list[BlockFailedError]) -> None:
    """Raise the first failure, naming how many blocks failed; its ``failed`` lists every failed block index."""
    first = failures[0]
    first.failed = [f.block_index for f in failures]
    if len(failures) > 1:
        first.args = (f"{first.args[0]} ({len(failures)} blocks failed)",)
    raise first


def _missing_chunks(block: Block, missing: tuple[Box, ...], source: Volume, settings: PipelineSettings,
                    stats: RunStats) -> None:
    """``block`` read ``missing`` chunks of ``source`` (as the fill value): counted, or with "error" it fails."""
    first = min(missing, key=lambda box: tuple(box.begin))
    if settings.missing_chunks == "error":
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MissingChunkError(
            f"input chunk {first} of {source.path} is missing (not stored){more}; restore it, or run with "
            f"--missing-chunks warn to read missing chunks as the fill value"
        )
    logger.info("%s read %d missing input chunk(s) as the fill value, the first %s", block, len(missing), first)
    stats.add_missing_chunks((tuple(box.begin) for box in missing), reads=len(missing), blocks=1)


def _usable(reads, failed, on_block_skipped, stats) -> Iterator[tuple[Block, np.ndarray] | None]:
    """The blocks that were read and need the network (None: none for now); failures and skips are reported."""
    for block, data, error in reads:
        if block is None:
            yield None
        elif error is not None:
            failed(block, error)
        elif data is None:
            with stats._lock:
                stats.num_skipped += 1
            if on_block_skipped is not None:
                on_block_skipped(block)
        else:
            yield block, data


class _DeviceFeed:
    """Batches read blocks onto the device, one batch in flight, and hands results to the writer.

    Out of memory, whether the submission or the result raises it, puts the
    batch back at the head of the queue after the back-off has shrunk the batch
    or the block parts (once: a batch launched before the shrink and failing
    after it only goes back); any other error fails the batch's blocks.
    Nothing of a batch is written before all of it is back.
    """

    def __init__(self, predictor: Predictor, settings: PipelineSettings, backoff: Backoff, writer: BlockWriter,
                 failed: Callable[[Block, BlockFailedError], None], stats: RunStats, num_planes: int | None = None):
        self._predictor, self._settings, self._backoff = predictor, settings, backoff
        #: The volume's planes along ``settings.planes_along`` (what a padded plane's index is reflected in).
        self._num_planes = num_planes
        self._writer, self._failed, self._stats = writer, failed, stats
        self._queue: deque[tuple[Block, np.ndarray]] = deque()
        #: The batch on the device, its result to come, and the back-off's sizes when it was launched.
        self._in_flight: tuple[list[tuple[Block, np.ndarray]], Pending, tuple] | None = None
        self._closing = False

    def add(self, item: tuple[Block, np.ndarray]) -> None:
        self._queue.append(item)
        while len(self._queue) >= self._backoff.batch_size:
            self._launch()

    def flush(self) -> None:
        while self._queue or self._in_flight is not None:
            if self._queue:
                self._launch()
            else:
                self._collect()

    def close(self) -> None:
        """Collect what is in flight (finished results are written, never dropped; nothing is launched)."""
        self._closing = True
        self._collect()

    def _steps(self, blocks: list[Block], data: np.ndarray, part: Box | None = None) -> DeviceSteps:
        """The steps of a batch of ``blocks`` (or of ``part`` of one block's core, relative to the core).

        Each block's NaN and inf are counted in what it writes (its write box, in the core's frame).
        """
        block = blocks[0]
        part = part if part is not None else Box.from_shape(block.core_box.shape)
        halo = block.core_box.begin - block.output_begin  # a part's window starts at the part: the same halo
        scale, offset = self._settings.normalization.scale_offset(data.dtype)
        counted = tuple(b.write_box.relative_to(b.core_box.begin).intersect(part).relative_to(part.begin).to_slices()
                        for b in blocks)
        steps = DeviceSteps(scale=scale, offset=offset, channels=self._settings.channels,
                            output_dtype=self._settings.output_dtype, counted=counted,
                            planes=self._planes(blocks, data, part))
        return steps.for_core(halo, part.shape)

    def _planes(self, blocks: list[Block], data: np.ndarray, part: Box) -> tuple[tuple[int, ...], ...] | None:
        """Per block, the volume plane each plane of its network input (``data``, (C, Z, Y, X), from ``part``
        on) reads along ``planes_along``: padding past the volume's edge as :mod:`blockpred.pipeline.padding` pads
        (a reflected plane is the plane it mirrors; a constant one is -1)."""
        axis = self._settings.planes_along
        if axis is None:
            return None
        depth, mode = data.shape[1 + axis], self._settings.pad_mode
        return tuple(tuple(int(i) for i in source_indices(begin, begin + depth, self._num_planes, mode))
                     for begin in (b.read_box.begin[axis] + part.begin[axis] for b in blocks))

    def _launch(self) -> None:
        items = [self._queue.popleft() for _ in range(min(self._backoff.batch_size, len(self._queue)))]
        if self._backoff.parts != Coord((1, 1, 1)):
            self._collect()
            for item in items:
                self._in_parts(*item)
            return
        block, data = items[0]
        sizes = self._sizes()
        try:
            pending = self._predictor.submit([d for _, d in items], self._steps([b for b, _ in items], data))
        except Exception as err:  # noqa: BLE001 - out of memory shrinks and retries; the rest fails the batch
            self._collect()
            self._retry_or_fail(items, err, sizes)
            return
        self._collect()
        self._in_flight = (items, pending, sizes)

    def _collect(self) -> None:
        if self._in_flight is None:
            return
        items, pending, sizes = self._in_flight
        self._in_flight = None
        try:
            values = pending.result()
        except Exception as err:  # noqa: BLE001 - out of memory shrinks and retries; the rest fails the batch
            self._retry_or_fail(items, err, sizes, retry=not self._closing)
            return
        self._stats.add_pass(len(items), pending.compute_s)
        self._stats.add("transfer_s", pending.transfer_s)
        if pending.nonfinite is not None:
            self._stats.add_nonfinite(pending.nonfinite)
        release = _after_all(len(items), pending.release)  # the batch's buffer, once every block is written
        for (block, _), core_values in zip(items, values):
            self._write(block, core_values, release)

    def _in_parts(self, block: Block, data: np.ndarray) -> None:
        """One block predicted in parts that tile its core, assembled, then written once."""
        core_shape = block.core_box.shape
        extra = Coord(data.shape[1:]) - core_shape  # 2 x (halo + context), rounded up
        while True:
            parts = split_core(core_shape, self._backoff.parts, self._settings.downsampling)
            try:
                assembled, nonfinite = None, 0
                for part in parts:
                    window = data[(slice(None),) + tuple(slice(b, b + n + e)
                                                         for b, n, e in zip(part.begin, part.shape, extra))]
                    pending = self._predictor.submit([window], self._steps([block], window, part))
                    values = pending.result()[0]
                    self._stats.add("compute_s", pending.compute_s)
                    self._stats.add("transfer_s", pending.transfer_s)
                    nonfinite += int(pending.nonfinite[0])
                    if assembled is None:
                        assembled = np.empty((values.shape[0],) + tuple(core_shape), dtype=values.dtype)
                    assembled[(slice(None),) + part.to_slices()] = values
                    pending.release()
            except Exception as err:  # noqa: BLE001 - as in _launch
                if self._shrink(err, block):
                    continue
                self._fail([(block, data)], err)
                return
            self._stats.add_nonfinite([nonfinite])
            self._write(block, assembled)
            return

    def _sizes(self) -> tuple[int, Coord]:
        return self._backoff.batch_size, self._backoff.parts

    def _retry_or_fail(self, items: list[tuple[Block, np.ndarray]], error: Exception, launched: tuple[int, Coord],
                       *, retry: bool = True) -> None:
        """A batch launched at sizes ``launched`` failed: out of memory puts it back (smaller), the rest fails it."""
        if retry and is_out_of_memory(error) and self._sizes() != launched:
            self._queue.extendleft(reversed(items))  # already shrunk since it was launched: it only goes back
        elif retry and self._shrink(error, items[0][0]):
            self._queue.extendleft(reversed(items))
        else:
            self._fail(items, error)

    def _shrink(self, error: Exception, block: Block) -> bool:
        """After an out-of-memory error: free the device's cache and shrink; False if it cannot help."""
        if not is_out_of_memory(error):
            return False
        self._predictor.release_memory()
        before = (self._backoff.batch_size, self._backoff.parts)
        if not self._backoff.reduce(block.core_box.shape, self._settings.downsampling):
            return False
        logger.warning("out of memory on %s (batch %d, parts %s); retrying with batch %d, block parts %s",
                       block, before[0], "x".join(map(str, before[1])), self._backoff.batch_size,
                       "x".join(map(str, self._backoff.parts)))
        return True

    def _write(self, block: Block, core_values: np.ndarray, release: Callable[[], None] | None = None) -> None:
        crop = block.write_box.relative_to(block.core_box.begin).to_slices()
        self._writer.submit(block, core_values[(slice(None),) + crop], release)

    def _fail(self, items: list[tuple[Block, np.ndarray]], err: Exception) -> None:
        blocks = [block for block, _ in items]
        batch_note = ""
        if len(blocks) > 1:
            batch_note = f" in a batch with {', '.join(str(tuple(b.index)) for b in blocks)}"
        # CUDA's text runs on over lines of debugging advice that does not apply here
        text = f"{first_line(err)}; {DEVICE_LOST_HINT}" if is_device_lost(err) else str(err)
        for block in blocks:
            error = BlockFailedError(block.index, f"the network failed on {block}{batch_note}: {text}")
            error.__cause__ = err
            self._failed(block, error)


def _after_all(count: int, release: Callable[[], None]) -> Callable[[], None]:
    """A callable that calls ``release`` when it has been called ``count`` times (from any threads)."""
    left = [count]
    lock = threading.Lock()

    def one() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            release()

    return one
