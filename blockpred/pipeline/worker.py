"""The worker loop: prefetch -> batch -> infer -> crop and convert -> write.

:func:`run_blocks` is the one execution path: the CLI, the Python API and (in
later versions) every dask worker run it over the blocks they are given.
Memory is bounded by ``(prefetch + batch_size) x input block bytes`` plus
``2 x num_writers x output block bytes``, never by the volume.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np

from ..blocking import Block
from ..errors import BlockFailedError
from ..io.base import Volume
from ..normalize import Normalization, convert_output
from ..padding import read_padded
from .infer import Predictor
from .prefetch import prefetch
from .writer import BlockWriter


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
    #: A run stops early after this many failed blocks.
    max_failures: int = 10


@dataclass
class RunStats:
    """What a run did.  Stage times are summed over threads, so they can exceed ``seconds``."""

    num_blocks: int = 0
    num_voxels: int = 0
    num_skipped: int = 0
    seconds: float = 0.0
    read_s: float = 0.0
    transfer_s: float = 0.0  # host <-> device copies (CUDA); not part of compute_s
    compute_s: float = 0.0
    write_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            setattr(self, stage, getattr(self, stage) + seconds)

    @property
    def mvox_per_s(self) -> float:
        return self.num_voxels / self.seconds / 1e6 if self.seconds > 0 else 0.0


def _batches(items: Iterator, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


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
) -> RunStats:
    """Predict ``blocks`` from ``source`` into ``sink``; returns when every write is done.

    A block that fails (read, network or write) does not stop the others: when
    all are through, :class:`BlockFailedError` is raised for the first failure
    (its ``failed`` attribute lists every failed block index), after every other
    block has been written.  After ``settings.max_failures`` failures the run
    stops early (a systematic fault should not grind through a whole volume).

    ``on_block_done(block)`` is called from a writer thread once the block's
    data is written.  ``skip(block, data)``, given the block's raw input (before
    normalisation), may say the block needs no network: it is then not written
    and ``on_block_skipped(block)`` is called.
    """
    stats = RunStats()
    start = time.perf_counter()
    channel_index = slice(None) if settings.channels is None else list(settings.channels)
    failures: list[BlockFailedError] = []
    failures_lock = threading.Lock()

    def read(block: Block) -> np.ndarray | None:
        begin = time.perf_counter()
        data = read_padded(source, block.read_box, settings.pad_mode, settings.pad_value)
        if skip is not None and skip(block, data):
            return None
        if data.ndim == 3:
            data = data[np.newaxis]
        data = settings.normalization.apply(data)
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
        with failures_lock:
            failures.append(error)

    def too_many_failures() -> bool:
        with failures_lock:
            return len(failures) >= settings.max_failures

    writer = BlockWriter(sink, num_threads=settings.num_writers, max_pending=2 * settings.num_writers,
                         on_written=written, on_failed=failed)
    reads = prefetch(blocks, read, num_threads=settings.num_readers, depth=settings.prefetch)
    try:
        with contextlib.closing(reads):
            for batch in _batches(_usable(reads, failed, on_block_skipped, stats), settings.batch_size):
                _infer_and_write(batch, predictor, writer, failed, stats, channel_index, settings.output_dtype)
                if too_many_failures():
                    break
    finally:
        writer.close()
    stats.seconds = time.perf_counter() - start
    if failures:
        first = failures[0]
        first.failed = [f.block_index for f in failures]
        if len(failures) > 1:
            first.args = (f"{first.args[0]} ({len(failures)} blocks failed)",)
        raise first
    return stats


def _usable(reads, failed, on_block_skipped, stats) -> Iterator[tuple[Block, np.ndarray]]:
    """The blocks that were read and need the network; failures and skips are reported."""
    for block, data, error in reads:
        if error is not None:
            failed(block, error)
        elif data is None:
            with stats._lock:
                stats.num_skipped += 1
            if on_block_skipped is not None:
                on_block_skipped(block)
        else:
            yield block, data


def _infer_and_write(batch, predictor, writer, failed, stats, channel_index, output_dtype) -> None:
    batch_blocks = [block for block, _ in batch]
    inputs = np.stack([data for _, data in batch])
    del batch
    begin = time.perf_counter()
    try:
        outputs = predictor(inputs)
    except Exception as err:
        batch_note = ""
        if len(batch_blocks) > 1:
            batch_note = f" in a batch with {', '.join(str(tuple(b.index)) for b in batch_blocks)}"
        for block in batch_blocks:
            error = BlockFailedError(block.index, f"the network failed on {block}{batch_note}: {err}")
            error.__cause__ = err
            failed(block, error)
        return
    transfer_s = getattr(predictor, "last_transfer_s", 0.0)
    stats.add("transfer_s", transfer_s)
    stats.add("compute_s", time.perf_counter() - begin - transfer_s)
    del inputs
    for block, values in zip(batch_blocks, outputs):
        cropped = values[channel_index][(slice(None),) + block.output_crop.to_slices()]
        writer.submit(block, convert_output(cropped, output_dtype))
