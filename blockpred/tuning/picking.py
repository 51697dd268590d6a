"""What the measured defaults' search chooses from its trials: :func:`pick`, the fastest trial, or a larger block
it did not time, guessed from the largest one it did (:class:`blockpred.tuning.sizing.Guessing`); and
:func:`guessed_instead`, whether a block is left to that guess rather than timed."""

from __future__ import annotations

import math
from typing import Callable

from ..geometry import Coord
from .sizing import GPU_GUESSING, Guessing, SizeChoice, SizeProblem, Trial

#: An untimed block wins only where its estimate beats the fastest timed one by this factor.
ESTIMATE_MARGIN = 1.1


def pick(problem: SizeProblem, trials: list[Trial] | tuple[Trial, ...], cached: bool = False,
         extrapolate: bool = False, guess: Guessing = GPU_GUESSING,
         holds: Callable[[Coord], bool] | None = None) -> SizeChoice:
    """The fitting trial that would predict the region fastest.

    ``extrapolate`` (the measured defaults' quick search, whose time may end
    before a larger block is timed): of the coarse candidates above the
    largest block timed that ``guess`` reaches (:func:`_guesses`), when none
    was refused for memory, the one estimated fastest wins if its pass,
    estimated as the largest timed pass scaled by the input's voxels, would
    predict the region :data:`ESTIMATE_MARGIN` faster -- that is, where it
    computes less halo.  Scaling by voxels is the cautious estimate: a device
    is seldom slower per voxel on a larger block, so the estimate counts only
    the halo saved.  A short first run so gets a block that wastes less than
    the start block without paying for the passes that would prove it.  ``holds``: whether the memory
    budget is foreseen to hold a block (a guess it does not hold is not taken).  Each run, the guess's and the
    winner's, counts ``guess.cold_passes`` passes more than it runs: its first pass at a new shape.
    """
    fitting = [t for t in trials if t.fits]
    winner = max(fitting, key=problem.roi_mvox_per_s)
    best = problem.roi_mvox_per_s(winner)
    guesses = _guesses(problem, trials, guess, holds) if extrapolate and problem.fixed_block is None else []

    def run_s(trial: Trial) -> float:
        return (problem.passes_over_region(trial) + guess.cold_passes) * trial.seconds_per_pass

    estimate = min(guesses, key=run_s, default=None)
    if estimate is not None and run_s(winner) >= ESTIMATE_MARGIN * run_s(estimate):
        return SizeChoice(estimate.block, 1, problem.roi_mvox_per_s(estimate), tuple(trials), cached, estimated=True)
    return SizeChoice(winner.block, winner.batch_size, best, tuple(trials), cached)


def _guesses(problem: SizeProblem, trials: list[Trial] | tuple[Trial, ...], guess: Guessing,
             holds: Callable[[Coord], bool] | None = None) -> list[Trial]:
    """The untried coarse candidates above the largest block timed at batch 1, the first ``guess.reach`` of them,
    each reading at most ``guess.growth`` times that block's input, and held by the memory budget (``holds``),
    their passes scaled by input voxels.

    None when a trial was refused for memory or the largest timed block is not the fastest (larger ones stopped
    paying).
    """
    if not guess.untimed or any(not t.fits for t in trials) or problem.fixed_batch not in (None, 1):
        return []
    largest = max((t for t in trials if t.batch_size == 1), key=lambda t: t.block.prod(), default=None)
    if largest is None or largest.seconds_per_pass <= 0 or largest.block != pick(problem, trials).block:
        return []
    larger = [c for c in problem.candidates(coarse=True) if c.prod() > largest.block.prod()]
    tried = {t.block for t in trials}
    guesses = []
    for block in larger[:guess.reach] if guess.reach is not None else larger:
        ratio = problem.input_shape(block).prod() / problem.input_shape(largest.block).prod()
        if block in tried or ratio > guess.growth or (holds is not None and not holds(block)):
            continue
        seconds = largest.seconds_per_pass * ratio
        guesses.append(Trial(block, 1, "ok", block.prod() / seconds / 1e6, seconds))
    return guesses


def guessed_instead(problem: SizeProblem, trials: list[Trial], block: Coord, guess: Guessing, trial_s: float,
                     holds: Callable[[Coord], bool] | None) -> bool:
    """Whether ``block`` is left untimed: :func:`pick` may take it untimed, and its trial (``trial_s``) would cost
    more than ``guess.trial_share`` of the run at the fastest block timed."""
    if not math.isfinite(guess.trial_share) or not any(e.block == block for e in _guesses(problem, trials, guess,
                                                                                          holds)):
        return False
    run_s = problem.roi.size / (max(problem.roi_mvox_per_s(t) for t in trials if t.fits) * 1e6)
    return trial_s > guess.trial_share * run_s
