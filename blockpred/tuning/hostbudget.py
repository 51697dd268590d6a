"""The host memory a run on the CPU may take: its budget (:class:`HostBudget`) and the trials' foresight (:class:`HostMeter`).

On the CPU the device's memory is the host's: a pass holds its input, the
network's activations and its output in this process, and a larger block or
batch holds more (``tiny`` on two cores: 0.18 GiB more for an 84^3 input,
3.3 GiB for 276^3 in torch, 1.7 GiB in OpenVINO).  The size trials
(:mod:`blockpred.tuning.autosize`) so keep to a budget, as they keep to the
GPU's free memory on CUDA:

* **The budget** is a limit on this process's resident memory at its peak
  (what the summary's ``peak memory`` and ``--json``'s ``peak_rss_bytes``
  report): ``--memory-limit`` (``memory_limit``), else what the process holds
  when the trials start plus :data:`SHARE` of the memory available (the
  machine's, or less where the cgroup of a container or a batch job leaves
  less), divided among the local workers.  Half, because a run holds more than
  its pass (the blocks read ahead and the outputs queued for the writers) and
  the machine's other work and the volume's page cache need the rest.
* **Foresight**: a trial's peak is the resident memory before it (after
  :func:`blockpred.pipeline.hostmem.release_freed_memory`) plus its pass's
  growth, scaled by the voxels of the batch's input from the largest pass
  measured so far (or, before the first trial above the start block, from one
  pass at the start block measured for it, unless the trial fits even with the
  process's whole peak so far as that pass's growth and output:
  :meth:`HostMeter.fits_at_most`), plus the pipeline's queue: the
  run's blocks read ahead and outputs waiting for the writers (the bound of
  :mod:`blockpred.pipeline.worker`, in bytes of the input's dtype and of the
  output measured).  A trial foreseen over the budget is not run; one measured
  over it is refused after it ran; both say ``over budget``.  Scaling by voxels
  is cautious: a pass's cost beyond its voxels is scaled with them (``tiny`` in
  torch: 332 bytes per input voxel at 84^3, 230 at 148^3, 162 at 276^3).
* A block the options name is not refused (at batch 1: ``--batch-size auto``
  refuses only larger batches): :func:`named_block_warning` says in one line
  where the peak so far (its dry run's) and the pipeline's queue go over the
  budget.  Where no block the search may choose fits, the run stops with one
  line that names ``--memory-limit``.  :func:`run_budget` is a run's budget from its options.

On CUDA the activations are on the device, whose free memory is the trials'
budget (:data:`blockpred.tuning.autosize.MEMORY_FRACTION`); the host budget
applies on the CPU only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from ..config import RunConfig
from ..geometry import Coord
from ..pipeline.blocking import BlockPlan
from ..pipeline.hostmem import (
    ResidentPeak,
    available_bytes,
    peak_resident_bytes,
    release_freed_memory,
    resident_bytes,
)
from .network import NetworkGeometry
from .sizecache import CachedSizes
from .sizing import OVER_BUDGET, SizeProblem, Trial

logger = logging.getLogger(__name__)

#: The share of the available memory (per local worker) a run's process may grow into, where no limit is named.
SHARE = 0.5


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


@dataclass(frozen=True)
class HostBudget:
    """The run's host memory budget, resolved where the trials run (:meth:`resolve`), and its pipeline's queue.

    ``limit_bytes``: ``--memory-limit``; None: :data:`SHARE` of the available memory over ``workers``.
    ``prefetch`` and ``writers``: the pipeline's blocks read ahead and writer threads (its queue's bound).
    ``output_bytes_per_voxel``: a block's output per voxel as the run keeps it (its channels in its dtype), which
    the queue's outputs take before a trial measured one; 0 where not known.
    """

    limit_bytes: int | None = None
    workers: int = 1
    prefetch: int = 4
    writers: int = 2
    output_bytes_per_voxel: float = 0.0

    def resolve(self) -> tuple[int, str] | None:
        """The limit in bytes of this process's resident memory, and what it is (for messages); None where the
        available memory cannot be told and no limit is named."""
        if self.limit_bytes is not None:
            return self.limit_bytes, f"the memory limit of {gib(self.limit_bytes)}"
        available, held = available_bytes(), resident_bytes()
        if available is None or held is None:
            return None
        limit = held + int(available * SHARE / max(1, self.workers))
        per_worker = f" over {self.workers} workers" if self.workers > 1 else ""
        return limit, f"the memory budget of {gib(limit)} ({gib(held)} held and half the {gib(available)} available{per_worker})"

    def queued_bytes(self, input_bytes: int, output_bytes: float, batch: int) -> int:
        """Bytes the run's pipeline holds beyond one pass of ``batch`` blocks, each of ``input_bytes`` read (in the
        input's dtype) and ``output_bytes`` written: the blocks read ahead (``prefetch`` and a batch) and the outputs
        queued for the writers (two per writer)."""
        return int((self.prefetch + batch) * input_bytes + 2 * self.writers * output_bytes)


@dataclass
class Measured:
    """What :meth:`HostMeter.measuring` measured: a batch's output (the caller's) and the run's peak foreseen."""

    output_bytes: int | None = None
    peak_bytes: int | None = None


class HostMeter:
    """One search's host memory: the budget resolved at its start, the passes measured, each trial's foresight."""

    def __init__(self, budget: HostBudget, problem: SizeProblem):
        self.budget, self.problem = budget, problem
        resolved = budget.resolve()
        self.limit_bytes, self.what = resolved if resolved is not None else (None, "")
        #: (input voxels of a pass, bytes the pass grew the resident memory by) of the largest pass measured.
        self._measured: tuple[int, int] | None = None
        self._output_bytes_per_voxel = budget.output_bytes_per_voxel

    def work(self, block: Coord, batch: int) -> int:
        return self.problem.input_shape(block).prod() * batch

    def queued_bytes(self, block: Coord, batch: int, output_bytes_per_voxel: float | None = None) -> int:
        """The pipeline's queue for a run at ``block`` x ``batch`` (see :meth:`HostBudget.queued_bytes`), at the
        output bytes per voxel measured (or those given)."""
        problem = self.problem
        input_bytes = problem.input_shape(block).prod() * problem.in_channels * np.dtype(problem.raw_dtype).itemsize
        per_voxel = self._output_bytes_per_voxel if output_bytes_per_voxel is None else output_bytes_per_voxel
        return self.budget.queued_bytes(input_bytes, block.prod() * per_voxel, batch)

    def foresee(self, block: Coord, batch: int) -> int | None:
        """The process's peak foreseen for a trial (and the run) at ``block`` x ``batch``; None before a measurement.
        The free heap is handed back first: the foresight starts from what the process holds."""
        if self._measured is None:
            return None
        release_freed_memory()
        voxels, grown = self._measured
        held = resident_bytes() or 0
        return held + int(grown * self.work(block, batch) / voxels) + self.queued_bytes(block, batch)

    def refuse(self, block: Coord, batch: int, probe: Callable[[], int]) -> Trial | None:
        """An ``over budget`` trial where ``block`` x ``batch`` is foreseen over the budget, else None (run it).

        A trial above the start block with nothing measured yet first measures ``probe``, one pass at the start
        block (``problem.base_block``, batch 1), which returns its output's bytes, unless the trial fits even where
        that pass had grown the process by its whole peak so far (:meth:`fits_at_most`).
        """
        if self.limit_bytes is None or self.named(block, batch):
            return None
        if self._measured is None and self.work(block, batch) > self.work(self.problem.base_block, 1) and (
                not self.fits_at_most(block, batch)):
            with self.measuring(self.problem.base_block, 1) as probed:
                probed.output_bytes = probe()
        foreseen = self.foresee(block, batch)
        if foreseen is not None and foreseen > self.limit_bytes:
            logger.info("trial block %s batch %d: not run, foreseen at %s, over %s", "x".join(map(str, block)),
                        batch, gib(foreseen), self.what)
            return Trial(block, batch, OVER_BUDGET, peak_bytes=foreseen)
        return None

    def fits_at_most(self, block: Coord, batch: int) -> bool:
        """Whether ``block`` x ``batch`` fits the budget where a pass at the start block (which the process ran
        before the search: its dry run, the measured defaults' passes) grew it by as much as its peak resident
        memory so far, and wrote an output as large (or as large as the budget's output per voxel says, where it
        does): a bound no pass exceeds, which spares measuring one."""
        peak, held = peak_resident_bytes(), resident_bytes()
        if peak is None or held is None or self.limit_bytes is None:
            return False
        base = self.problem.base_block
        ratio = self.work(block, batch) / self.work(base, 1)
        per_voxel = self.budget.output_bytes_per_voxel or peak / base.prod()
        queued = self.queued_bytes(block, batch, output_bytes_per_voxel=per_voxel)
        return held + peak * ratio + queued <= self.limit_bytes

    def holds(self, block: Coord, batch: int, probe: Callable[[], int] | None = None) -> bool:
        """Whether a run at ``block`` x ``batch``, never timed, is foreseen within the budget: from the largest pass
        measured (:meth:`foresee`), else at most (:meth:`fits_at_most`); True where no budget can be told.  Where
        that bound does not hold it and nothing is measured, ``probe`` (as in :meth:`refuse`) measures one pass at
        the start block first: the bound takes the process's whole peak so far (torch's passes among it) as the
        growth of each start block (``loop-list``'s guess of 128x192x192 for 18.9 Mvox was so refused)."""
        if self.limit_bytes is None:
            return True
        if self._measured is None and probe is not None and not self.fits_at_most(block, batch):
            with self.measuring(self.problem.base_block, 1) as probed:
                probed.output_bytes = probe()
        foreseen = self.foresee(block, batch)
        return foreseen <= self.limit_bytes if foreseen is not None else self.fits_at_most(block, batch)

    @contextlib.contextmanager
    def measuring(self, block: Coord, batch: int) -> Iterator[Measured]:
        """Measure the passes of a trial at ``block`` x ``batch`` run in the ``with`` block, the heap handed back
        first (the passes fault in what they need, as a run's first pass does).  The caller sets the record's
        ``output_bytes`` (a batch's output); after the block its ``peak_bytes`` is the peak of a run at this size:
        the resident memory's during the passes and the pipeline's queue (None where it cannot be read)."""
        release_freed_memory()
        before, record = resident_bytes(), Measured()
        with ResidentPeak() as peak:
            yield record
        if before is None or peak.bytes is None:
            return
        voxels = self.work(block, batch)
        if self._measured is None or voxels >= self._measured[0]:
            self._measured = (voxels, max(0, peak.bytes - before))
        if record.output_bytes:
            self._output_bytes_per_voxel = record.output_bytes / (block.prod() * batch)
        record.peak_bytes = peak.bytes + self.queued_bytes(block, batch)

    def named(self, block: Coord, batch: int) -> bool:
        """Whether ``block`` x ``batch`` is the least the options name (their block at batch 1): never refused, the
        run warns instead (:func:`named_block_warning`)."""
        return block == self.problem.fixed_block and batch == 1

    def over(self, block: Coord, batch: int, peak_bytes: int | None) -> bool:
        """Whether a trial measured at ``peak_bytes`` is over the budget (and refused: see :meth:`named`)."""
        return (self.limit_bytes is not None and peak_bytes is not None and peak_bytes > self.limit_bytes
                and not self.named(block, batch))

    def review(self, cached: CachedSizes | None) -> CachedSizes | None:
        """Cached trials under this budget: one whose peak is over it no longer fits; a search that an earlier, smaller
        budget stopped is not complete (its refused trials are dropped, to be run); None where nothing fits."""
        if cached is None or self.limit_bytes is None:
            return cached
        trials, complete = [], cached.complete
        for trial in cached.trials:
            over = self.over(trial.block, trial.batch_size, trial.peak_bytes)
            if trial.outcome == OVER_BUDGET and trial.peak_bytes is not None and not over:
                complete = False  # it would fit now: the search goes on and runs it
                continue
            if trial.fits and over:
                trial = replace(trial, outcome=OVER_BUDGET)
            trials.append(trial)
        if not any(t.fits for t in trials):
            return None
        return cached._replace(trials=trials, complete=complete)


def run_budget(cfg: RunConfig, writers: int) -> HostBudget:
    """The budget of a run of ``cfg`` whose pipeline writes with ``writers`` threads: its memory limit, else a share
    per local dask worker (one where the run goes in this process, or its workers are a cluster's)."""
    alone = cfg.local or cfg.scheduler is not None or cfg.cluster is not None
    return HostBudget(cfg.memory_limit, workers=1 if alone else cfg.workers or 1, prefetch=cfg.prefetch, writers=writers)


def keeping_outputs(budget: HostBudget | None, cfg: RunConfig, out_channels: int) -> HostBudget | None:
    """``budget`` with the output a run of ``cfg`` keeps per voxel: its channels of the network's ``out_channels``,
    in its output dtype."""
    if budget is None:
        return None
    kept = len(cfg.channels) if cfg.channels else out_channels
    return replace(budget, output_bytes_per_voxel=kept * np.dtype(cfg.output_dtype).itemsize)


def named_block_warning(budget: HostBudget, cfg: RunConfig, plan: BlockPlan, batch: int, geometry: NetworkGeometry,
                        raw_dtype: np.dtype, device_type: str) -> str:
    """One line where the block the options name, at ``batch``, is foreseen over the budget on this process's CPU;
    "" where it is not (or cannot be told).  Not refused: the user named it.

    Foreseen: the process's peak so far (the block's dry run and any batch trials) and the pipeline's queue
    (:meth:`HostBudget.queued_bytes`) of its input in ``raw_dtype`` and its output as the options keep it.
    """
    if cfg.block in (None, "auto") or device_type != "cpu" or cfg.scheduler is not None or cfg.cluster is not None:
        return ""
    resolved, peak = budget.resolve(), peak_resident_bytes()
    if resolved is None or peak is None:
        return ""
    limit, what = resolved
    input_bytes = plan.input_shape.prod() * geometry.in_channels * np.dtype(raw_dtype).itemsize
    output_bytes = plan.block_shape.prod() * keeping_outputs(budget, cfg, geometry.out_channels).output_bytes_per_voxel
    foreseen = peak + budget.queued_bytes(input_bytes, output_bytes, batch)
    if foreseen <= limit:
        return ""
    return (f"block {'x'.join(map(str, plan.block_shape))} at batch {batch} is foreseen to take {gib(foreseen)} of "
            f"memory (the peak so far, and the blocks queued for reading and writing), over {what}; a smaller "
            f"--block or --batch-size takes less (--memory-limit sets the budget)")
