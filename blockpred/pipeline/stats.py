"""What a run did: :class:`RunStats`, filled by the pipeline's threads (see :mod:`.worker`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from ..geometry import Coord


#: Distinct missing input chunks a run lists at most (beyond, only reads of them are counted): bookkeeping stays small.
MAX_LISTED_MISSING_CHUNKS = 10_000


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
    #: Out-of-memory errors recovered from, and the batch size and block parts in force at the end.
    out_of_memory: int = 0
    batch_size: int = 0
    block_parts: Coord = Coord((1, 1, 1))
    #: NaN and inf values the network gave for written voxels (before the output dtype), and the blocks that had any.
    num_nonfinite: int = 0
    num_nonfinite_blocks: int = 0
    #: Missing input chunks read as the fill value: the distinct ones, each by its first voxel (up to
    #: MAX_LISTED_MISSING_CHUNKS of them); the reads of one (a chunk in two blocks' reads counts twice); the
    #: blocks that read one.  ``missing_chunks_counted`` is False when the input cannot tell (HDF5 ...).
    missing_chunks: set = field(default_factory=set)
    num_missing_chunk_reads: int = 0
    num_missing_chunk_blocks: int = 0
    missing_chunks_counted: bool = True
    #: The fastest pass of the network (its compute seconds) per batch size it ran at.
    fastest_pass_s: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            setattr(self, stage, getattr(self, stage) + seconds)

    def add_pass(self, batch_size: int, seconds: float) -> None:
        """One batch's pass of the network: its compute seconds, counted and kept where it is the fastest."""
        with self._lock:
            self.compute_s += seconds
            if seconds > 0 and seconds < self.fastest_pass_s.get(batch_size, float("inf")):
                # A new dict, never one changed in place: a copy of the stats (pickled for the client, or
                # replaced) may iterate the old one meanwhile.
                self.fastest_pass_s = {**self.fastest_pass_s, batch_size: seconds}

    @property
    def mvox_per_s(self) -> float:
        return self.num_voxels / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def recovery_note(self, initial_batch: int) -> str:
        """What out-of-memory recovery did ('' when nothing happened)."""
        if not self.out_of_memory:
            return ""
        changes = []
        if self.batch_size and self.batch_size != initial_batch:
            changes.append(f"batch size {initial_batch} -> {self.batch_size}")
        if self.block_parts != Coord((1, 1, 1)):
            changes.append(f"blocks predicted in {'x'.join(map(str, self.block_parts))} parts")
        return f"recovered from {self.out_of_memory} out-of-memory error(s): {', '.join(changes)}"

    def add_nonfinite(self, per_block: Iterable[int]) -> None:
        """The NaN/inf counts of some written blocks, one per block."""
        per_block = [int(n) for n in per_block]
        with self._lock:
            self.num_nonfinite += sum(per_block)
            self.num_nonfinite_blocks += sum(1 for n in per_block if n)

    def add_missing_chunks(self, chunks: Iterable[tuple[int, ...]], *, reads: int, blocks: int) -> None:
        """Missing input chunks (their first voxels), read ``reads`` times by ``blocks`` blocks."""
        with self._lock:
            for chunk in chunks:
                if len(self.missing_chunks) >= MAX_LISTED_MISSING_CHUNKS:
                    break
                self.missing_chunks.add(tuple(chunk))
            self.num_missing_chunk_reads += reads
            self.num_missing_chunk_blocks += blocks

    def nonfinite_note(self, output_dtype) -> str:
        """What NaN and inf values became ('' when there were none)."""
        if not self.num_nonfinite:
            return ""
        dtype = np.dtype(output_dtype)
        became = ("written as 0 (NaN, -inf) or 255 (+inf)" if dtype == np.uint8 else "kept as NaN/inf")
        return (f"{self.num_nonfinite} network output value(s) in {self.num_nonfinite_blocks} blocks were NaN or inf "
                f"(NaN or inf input, or a diverging network): {became} in the {dtype} output")

    def missing_chunks_note(self) -> str:
        """How many input chunks were missing and read as the fill value ('' when none)."""
        if not self.missing_chunks_counted:
            return "missing input chunks: not counted (this input's format reads them as the fill value unseen)"
        if not self.num_missing_chunk_reads:
            return ""
        listed = len(self.missing_chunks)
        number = f"at least {listed}" if listed >= MAX_LISTED_MISSING_CHUNKS else str(listed)
        first = f", the first at voxel {min(self.missing_chunks)}" if self.missing_chunks else ""
        return (f"{number} input chunk(s) were missing (not stored{first}) and read as the fill value by "
                f"{self.num_missing_chunk_blocks} blocks; on EM data usually a failed transfer: restore them, or "
                f"run with --missing-chunks error to stop at them")
