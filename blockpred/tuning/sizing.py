"""The sizes a run's trials are about: :class:`SizeProblem` (the network's geometry and the run's constraints),
:class:`Trial` (one timed pass) and :class:`SizeChoice` (what the search chose); see :mod:`blockpred.tuning.autosize`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from ..geometry import Box, Coord
from ..pipeline import DeviceSteps
from ..pipeline.blocking import blocks_per_axis

#: The outcome of a trial the network refused (the rest of the outcome says why).
FAILED = "failed"
#: The outcome of a trial over the memory budget: the device's (CUDA), or the host's on the CPU (foreseen, then not
#: run, or measured; see :mod:`blockpred.tuning.hostbudget`).
OVER_BUDGET = "over budget"


@dataclass(frozen=True)
class Trial:
    block: Coord
    batch_size: int
    #: "ok", "out of memory", "over budget" or "failed: <why>" (a shape the network refused).
    outcome: str
    mvox_per_s: float = 0.0
    seconds_per_pass: float = 0.0
    peak_bytes: int | None = None

    @property
    def fits(self) -> bool:
        return self.outcome == "ok"

    @property
    def failed(self) -> bool:
        return self.outcome.startswith(FAILED)


@dataclass(frozen=True)
class SizeChoice:
    block: Coord
    batch_size: int
    mvox_per_s: float
    trials: tuple[Trial, ...] = ()
    cached: bool = False
    #: The block was not timed: its pass is the largest timed one's scaled by input voxels (see :func:`pick`).
    estimated: bool = False
    #: False when the search's time ended before it did: a later run may go on where it stopped.
    complete: bool = True
    #: An estimated block's cache entry (its key and problem), where the run's own passes time it
    #: (:func:`blockpred.tuning.autosize.confirm_guess`); None otherwise.
    guess: tuple | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        how = "cached trials" if self.cached else "trials"
        what = "estimated from the largest" if self.estimated else "fastest"
        over = sum(t.outcome == OVER_BUDGET for t in self.trials)
        return (f"block {'x'.join(map(str, self.block))}, batch {self.batch_size}: {what} of "
                f"{sum(t.fits for t in self.trials)} that fit ({how}{f'; {over} over the memory budget' if over else ''}), "
                f"{self.mvox_per_s:.2f} Mvox/s over the region")


@dataclass(frozen=True)
class SizeProblem:
    """What the trials need to know: the network's geometry and the run's constraints."""

    in_channels: int
    raw_dtype: np.dtype
    halo: Coord
    context: Coord
    #: Network input minus (block + 2 x (halo + context)) of any block that is a multiple of ``step``.
    input_extra: Coord
    #: Blocks are multiples of this (downsampling, and output chunks when given).
    step: Coord
    #: Where the search starts: the model's default block (or the one given).
    base_block: Coord
    #: The region to predict: blocks are scored by how fast they would tile it.
    roi: Box
    steps: DeviceSteps = DeviceSteps()
    fixed_block: Coord | None = None
    fixed_batch: int | None = None
    max_batch: int = 64
    #: Network input voxels over a batch whose largest tensor stays under CUDA's 32-bit index limit (see
    #: :mod:`blockpred.tuning.tensors`); None: no limit (the CPU, or a network whose tensors were not counted).
    max_input_voxels: int | None = None

    @property
    def max_block(self) -> Coord:
        """No block need be larger than the region to predict, rounded up to the step."""
        return self.roi.shape.ceil_div(self.step) * self.step

    def passes_over_region(self, trial: Trial) -> int:
        """Passes of ``trial``'s block and batch that tile the region."""
        return -(-self.blocks_over_region(trial.block).prod() // trial.batch_size)

    def roi_mvox_per_s(self, trial: "Trial") -> float:
        """Mvox/s over the region: its voxels per second of the passes that tile it with ``trial``'s block."""
        return self.roi.size / (self.passes_over_region(trial) * trial.seconds_per_pass) / 1e6

    def input_shape(self, block: Coord) -> Coord:
        return block + (self.halo + self.context) * 2 + self.input_extra

    def under_index_limit(self, block: Coord, batch_size: int = 1) -> bool:
        """Whether ``batch_size`` blocks of ``block`` keep every tensor under :attr:`max_input_voxels`."""
        return self.max_input_voxels is None or self.input_shape(block).prod() * batch_size <= self.max_input_voxels

    def computed_voxels(self, block: Coord) -> int:
        """Input voxels the network computes to tile the region with ``block``: halo and overhang included."""
        return self.blocks_over_region(block).prod() * self.input_shape(block).prod()

    def candidates(self, coarse: bool = False) -> list[Coord]:
        """Blocks from smallest to largest, each a multiple of the step, none above ``max_block``.

        ``coarse`` (the measured defaults): from the base block up, twice as long per axis each
        step (eight times the voxels), so a few trials reach blocks that cover the region.
        Each candidate is :meth:`balanced` over the region.  None is over the index limit
        (:meth:`under_index_limit`), except the smallest where every one is; where the limit cuts the
        coarse ladder, the largest block of the fine one under it is the last candidate.
        """
        if self.fixed_block is not None:
            return [self.fixed_block]
        ordered = self._ladder(range(0, 19, 3) if coarse else range(-9, 19))
        kept = [b for b in ordered if self.under_index_limit(b)] or ordered[:1]
        if coarse and len(kept) < len(ordered):
            # The limit cut the ladder: the largest block under it (on the fine ladder, at least half the limit)
            # is a candidate too, else the coarse steps (8x the voxels) would stop at up to 1/8 of it.
            under = [b for b in self._ladder(range(-9, 19)) if self.under_index_limit(b)]
            if under and under[-1].prod() > kept[-1].prod():
                kept.append(under[-1])
        return kept

    def _ladder(self, steps: range) -> list[Coord]:
        """The base block times 2^(k/3) per axis for ``k`` in ``steps``, on the step, balanced, smallest first."""
        seen: list[Coord] = []
        for k in steps:
            factor = 2 ** (k / 3)
            block = self.balanced(Coord(min(math.ceil(b * factor / s) * s, m)
                                        for b, s, m in zip(self.base_block, self.step, self.max_block)))
            if block not in seen:
                seen.append(block)
        return sorted(seen, key=lambda b: (b.prod(), tuple(b)))

    def blocks_over_region(self, block: Coord) -> Coord:
        """Blocks per axis that cover the region (the grid starts at the volume's origin)."""
        return blocks_per_axis(self.roi, block)

    def balanced(self, block: Coord) -> Coord:
        """The smallest block (on the step) that covers the region in as many blocks per axis as ``block``.

        128 on an axis of 704 needs 6 blocks and computes 768; 120 needs 6 too and computes 720.  Same
        count, same halo per block, less to compute: never slower, and it fits wherever ``block`` fits.
        """
        count = self.blocks_over_region(block)
        fitted = self.roi.end.ceil_div(count).ceil_div(self.step) * self.step
        fitted = fitted.minimum(block)
        return fitted if self.blocks_over_region(fitted) == count else block


def foreseen_saving_s(problem: SizeProblem, trials: list[Trial] | tuple[Trial, ...], block: Coord) -> float:
    """Seconds ``block`` may save over the region against the fastest fitting trial at its batch.

    The halo it saves (the region's computed voxels, :meth:`SizeProblem.computed_voxels`, at the
    fastest trial's block over those at ``block``), discounted by how much of the halo it saved the
    largest block timed so far gave against the block below it: on a CPU a larger block is slower per
    voxel (unet12, 2 cores: 128x240x240 computes 0.80x the voxels of 128x120x120 over the region but
    ran its pipeline only 4% faster, after a cold 15.3 s trial).
    """
    fitting = sorted((t for t in trials if t.fits and t.batch_size == (problem.fixed_batch or 1)),
                     key=lambda t: t.block.prod())
    if not fitting:
        return 0.0
    score = problem.roi_mvox_per_s
    best = max(fitting, key=score)
    gain = problem.computed_voxels(best.block) / problem.computed_voxels(block)
    if len(fitting) >= 2:
        below, largest = fitting[-2], fitting[-1]
        foreseen = problem.computed_voxels(below.block) / problem.computed_voxels(largest.block)
        if foreseen > 1:
            gain **= min(1.0, math.log(max(score(largest) / score(below), 1e-9)) / math.log(foreseen))
    run_s = problem.roi.size / (score(best) * 1e6)
    return run_s * (1 - 1 / gain)


def foreseen_batch_saving_s(problem: SizeProblem, trials: list[Trial] | tuple[Trial, ...], block: Coord,
                            batch_size: int) -> float:
    """Seconds a batch of ``batch_size`` at ``block`` may save over the region against half that batch.

    A batch saves what a call costs beyond its voxels, once per call it saves: the intercept of the
    seconds of a pass against its input voxels, through ``block``'s pass and the nearest other block
    timed at batch 1 (the one below, else the one above).  A device that computes a pass in proportion
    to its voxels gains nothing by batching it (tiny on 2 CPU cores over 63 Mvox: 64^3, 128x118x118 and
    128x236x236 gave a call 0.08 s beyond its voxels, 0.35 s over the region's 9 blocks, and a batch of
    two 128x236x236 blocks took a 3-4 s trial of a 35 s first run to lose).  Infinite while no two blocks
    were timed: the trial decides.
    """
    single = sorted((t for t in trials if t.fits and t.batch_size == 1), key=lambda t: t.block.prod())
    at = next((t for t in single if t.block == block), None)
    others = [t for t in single if t.block != block]
    if at is None or not others:
        return math.inf
    below = [t for t in others if t.block.prod() < block.prod()]
    other = below[-1] if below else others[0]
    voxels, other_voxels = problem.input_shape(block).prod(), problem.input_shape(other.block).prod()
    slope = (at.seconds_per_pass - other.seconds_per_pass) / (voxels - other_voxels)
    per_call = at.seconds_per_pass - slope * voxels
    calls_saved = -(-problem.blocks_over_region(block).prod() // batch_size)
    return max(0.0, per_call) * calls_saved


def quick_trial_passes(device_type: str, backend: str = "torch") -> int:
    """Passes a quick trial (:func:`blockpred.tuning.autosize.trial_runner` with ``quick``) runs on a device of this
    type, with this backend.

    A GPU: a warm-up pass (cuDNN chooses its kernels; the first pass of a shape
    is many times slower) and a timed one.  A CPU: one pass, timed cold.  A cold
    pass faults in the memory a larger block needs (with :mod:`blockpred.pipeline.hostmem`
    ``tiny``'s 84x276x276 pass took 1.49 s cold, 0.90-0.97 s warm), so its time
    is an upper bound of the run's warm passes: a block whose cold pass beats
    the warm start block is faster, and one that loses is at worst kept out.
    The search is cautious where it errs, and costs half: on two cores the
    measured defaults' budget for ``tiny`` on 4 Mvox (0.65 s) afforded no
    two-pass trial of 64x128x128 (2 x 0.31 s, after the start block's pass),
    which runs the volume 1.6x as fast as 64^3 in channels_last.

    A converted backend (OpenVINO) on the CPU: a warm-up and a timed pass, as on a GPU.  Its first pass at a new
    shape prepares its kernels for it: a 12-feature U-Net's 128x120x120 block took 2.5-3.1 s cold and 1.8 s warm
    (2026-11-27), against a start block timed warm, and one cold pass kept every larger block out.
    """
    return 2 if device_type == "cuda" or backend != "torch" else 1


#: On the CPU with OpenVINO, a block chosen untimed reads at most this many times the input voxels of the largest
#: block timed (:func:`guessing`) ...
UNTIMED_INPUT_GROWTH = 10.0
#: ... and a block it could so choose is timed only where its trial is foreseen to cost at most this share of the
#: run at the fastest block timed.
GUESS_TRIAL_SHARE = 0.05
#: A run's first pass at a block, with OpenVINO on the CPU, counted as this many warm passes more: it faults in the
#: pass's memory and took 1.45-2x a warm pass (2-6 GiB; 2026-11-29), so that one block of 160x416x416 ran 18.9
#: Mvox in 14.6-15.2 s where four blocks of 160x224x224 ran it in 10.6 s.
COLD_PASSES = 1.0


@dataclass(frozen=True)
class Guessing:
    """How far the measured defaults' quick search takes a larger block it did not time (:func:`guessing`; see
    :func:`blockpred.tuning.autosize.pick`)."""

    #: The most input voxels of a guessed block's pass, as a multiple of the largest timed pass's (0: no guess).
    growth: float = math.inf
    #: Coarse candidates above the largest timed block among which the best estimate is taken (None: all).
    reach: int | None = 1
    #: A block that could be guessed is timed only where its trial is foreseen to cost at most this share of the
    #: run at the fastest block timed (infinite: wherever the search's budget and foreseen saving allow it).
    trial_share: float = math.inf
    #: Passes a run is foreseen to run beyond its blocks' in :func:`~blockpred.tuning.autosize.pick`: its first
    #: pass at a new shape, cold.
    cold_passes: float = 0.0

    @property
    def untimed(self) -> bool:
        return self.growth > 0


#: A GPU's guess: the next coarse candidate, at any growth, where the search did not time it.
GPU_GUESSING = Guessing()
#: No block is taken untimed.
NO_GUESSING = Guessing(growth=0.0, reach=0)


def guessing(device_type: str, backend: str = "torch") -> Guessing:
    """How far the measured defaults' quick search may take a larger block untimed on a device of this type, with
    this backend (see :func:`blockpred.tuning.autosize.pick`).

    * A GPU: the next coarse candidate, at any growth, where the search's budget ended before it was timed (a
      larger block seldom runs slower per voxel there).
    * A CPU with torch: never.  Its passes grow slower per voxel with the block (``unet12`` on two cores: 0.88
      us per input voxel at 96^3, 1.05 at 96x160x160), and a larger untimed block lost on ``tiny`` at 4 Mvox
      (64x128x128 ran its device steps in 1.84 s, 64^3 timed in 1.31 s).
    * A CPU with OpenVINO: the best estimate among the coarse candidates that read at most
      :data:`UNTIMED_INPUT_GROWTH` times the input of the largest block timed, and those are not timed where
      their trial would cost more than :data:`GUESS_TRIAL_SHARE` of the run.  Its passes cost the same per
      input voxel at every block: ``unet12`` in f32, 0.382, 0.385 and 0.397 us at 96^3, 96x160x160 and
      96x288x288 (2026-11-27); MONAI's BasicUNet 0.193, 0.202, 0.207, 0.199 and 0.204 us at 96^3,
      96x160x160, 96x288x288, 160x224x224 and 160^3 (2026-11-29, warm).  A block estimated from the start
      block's pass ran its run's passes within 0-19% of the estimate (four networks at 128x192x192, nine times
      the start block's input, bench/RESULTS.md), where timing it first cost 1.3-5.1 s of a 7-28 s first run.
      A run counts its first pass twice (:data:`COLD_PASSES`): a block that runs the region in one or two passes
      pays for its cold pass there, and loses to one that runs it in more (160x416x416 for 18.9 Mvox: 14.6 s
      in its one pass, cold, where its warm pass took 7.0-7.6 s).
      The run's own passes time the guess (:func:`blockpred.tuning.sizecache.confirm_guess`), the next run
      steps on from it or back, and the memory budget is foreseen to hold it
      (:meth:`blockpred.tuning.hostbudget.HostMeter.holds`).
    """
    if device_type != "cpu":
        return GPU_GUESSING
    if backend != "openvino":
        return NO_GUESSING
    return Guessing(UNTIMED_INPUT_GROWTH, reach=None, trial_share=GUESS_TRIAL_SHARE, cold_passes=COLD_PASSES)


def probe_block(base_block: Coord, step: Coord) -> Coord:
    """A small block for the dry run before a search: a quarter of the base per axis (the base may not fit)."""
    return (base_block // 4).maximum(step).ceil_div(step) * step


def model_key(name: str, weights_sha256: str | None, kwargs: dict | None = None) -> dict:
    """The model as the cache tells models apart."""
    return {"name": name, "weights": weights_sha256, "kwargs": json.loads(json.dumps(kwargs or {}, default=str))}
