"""``--block auto`` and ``--batch-size auto``: the sizes that fit the device and predict fastest.

Short trial passes on the device decide, never a formula:

1. Block candidates grow from the model's default block by steps of 2^(1/3)
   per axis (twice the voxels every step), each rounded up to the block step
   (a multiple of the network's downsampling and of the output chunks) and
   no larger than the region to predict needs.
2. At batch 1 (or the batch given) the search climbs from the default block
   until a pass runs out of device memory, goes over the memory budget, takes
   over ``max_pass_s``, or stops paying (three larger blocks in a row more
   than 10% slower than the best), or the trials have taken a minute; if the
   default itself does not fit it steps down until one does.
3. For the largest blocks that fit (the measured defaults' coarse search: the
   fastest and the largest, while a call costs enough beyond its voxels for a
   batch to save more than its trial), the batch doubles while it fits and pays.
4. The fastest (block, batch) wins, by Mvox/s over the region to predict:
   its voxels per second of the passes that would tile it.  Larger blocks
   waste less on the halo, until the device is full or the blocks overhang
   the region.

A trial is the run's own device path (raw upload, normalisation, network,
crop, conversion, download) on seeded random data of the input's dtype (not
zeros: kernels can run faster on zeros than on real data): one warm-up pass
(cuDNN picks its kernels), then timed passes with one in flight; the measured
defaults' quick trials time one cold pass on a CPU (:func:`quick_trial_passes`).  The choice
trials are cached per model, device, precision and constraints (see
:class:`SizeCache`), so only the first run on a machine pays for them.

A measurement taken while other work loaded the machine must not decide
every later run: the measured defaults' cached choice is timed again (the
winner and the runner-up, :func:`recheck`, as far as the run's measuring
budget allows) by the next run that measures, and by up to
:data:`MAX_CHECKS` runs while the winner leads by less than
:data:`THIN_MARGIN`.  Each configuration keeps its fastest timing (load only
ever slows a pass down).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from dataclasses import replace
from typing import Callable

import numpy as np

from ..errors import InvalidOptionError
from ..geometry import Coord
from ..pipeline import Predictor, is_out_of_memory
from .hostbudget import HostBudget, HostMeter, Measured
from .picking import guessed_instead, pick
from .sizecache import CachedSizes, SizeCache, cache_key, confirm_guess, device_key, merge_trials
from .sizing import (
    FAILED,
    GPU_GUESSING,
    NO_GUESSING,
    OVER_BUDGET,
    Guessing,
    SizeChoice,
    SizeProblem,
    Trial,
    foreseen_batch_saving_s,
    foreseen_saving_s,
    guessing,
    model_key,
    probe_block,
    quick_trial_passes,
)

__all__ = ["GPU_GUESSING", "NO_GUESSING", "Guessing", "SizeCache", "SizeChoice", "SizeProblem", "Trial",
           "choose_sizes", "confirm_guess", "device_key", "foreseen_batch_saving_s", "foreseen_saving_s", "guessing",
           "model_key", "pick", "probe_block", "quick_trial_passes", "recheck", "recheck_due", "search",
           "trial_runner"]

logger = logging.getLogger(__name__)

#: Fraction of the device memory free at the start that trials may use: the rest is headroom for
#: the batch in flight, pinned staging and fragmentation.
MEMORY_FRACTION = 0.85


def trial_runner(predictor: Predictor, problem: SizeProblem, *, repeats: int = 2,
                 budget_bytes: int | None = None, quick: bool = False,
                 host: HostMeter | None = None) -> Callable[[Coord, int], Trial]:
    """One trial: the device path at ``block`` x ``batch``, timed; out of memory is an outcome.

    ``quick`` (the measured defaults; the first candidate is usually timed by
    the caller): :func:`quick_trial_passes` passes, the last one timed.
    Otherwise warm-up passes first (three, then one per trial), on a GPU for
    cuDNN's choice of kernels, on a CPU for the heap's growth, and ``repeats``
    timed passes.  ``host`` (on the CPU): the host memory budget, which a
    trial foreseen over is not run, and one measured over is refused
    (:class:`blockpred.tuning.hostbudget.HostMeter`).
    """
    import torch

    cuda = predictor.device.type == "cuda"
    host = None if cuda else host
    repeats = 1 if quick else repeats
    warmups = quick_trial_passes(predictor.device.type, predictor.backend) - 1
    first_warmups, later_warmups = (warmups, warmups) if quick else (3, 1)
    if cuda and budget_bytes is None:
        predictor.release_memory()
        free, _ = torch.cuda.mem_get_info(predictor.device)
        budget_bytes = int(free * MEMORY_FRACTION)
    baseline = torch.cuda.memory_allocated(predictor.device) if cuda else 0
    warmed = False  # the first trial also warms up threads and allocators
    probe = functools.partial(_probe, predictor, problem)

    def passes(block: Coord, batch: int) -> tuple[float, int]:
        """The trial's warm-up and timed passes: seconds per timed pass, and the bytes of a batch's output."""
        nonlocal warmed
        raw = _random_block((problem.in_channels,) + tuple(problem.input_shape(block)), problem.raw_dtype)
        steps = problem.steps.for_core(problem.halo, block)
        for _ in range(later_warmups if warmed else first_warmups):  # warm-up: kernels chosen, memory grown
            _finish(predictor.submit([raw] * batch, steps))
        warmed = True
        start = time.perf_counter()
        pending = None
        for _ in range(repeats):
            nxt = predictor.submit([raw] * batch, steps)
            if pending is not None:
                _finish(pending)
            pending = nxt
        output_bytes = _finish(pending)
        return (time.perf_counter() - start) / repeats, output_bytes

    def run(block: Coord, batch: int) -> Trial:
        if cuda:
            torch.cuda.reset_peak_memory_stats(predictor.device)
        try:
            refused = host.refuse(block, batch, probe) if host is not None else None
            if refused is not None:
                return refused
            with host.measuring(block, batch) if host is not None else contextlib.nullcontext(Measured()) as measured:
                seconds, measured.output_bytes = passes(block, batch)
        except Exception as err:  # noqa: BLE001 - out of memory and a refused shape are outcomes
            predictor.release_memory()
            if is_out_of_memory(err):
                return Trial(block, batch, "out of memory")
            # A shape the network refuses (the grid it was found on should prevent it): skipped, said in
            # --verbose; the run goes on with the blocks that ran.
            text = str(err).strip()
            logger.info("trial block %s batch %d failed, skipped: %s", "x".join(map(str, block)), batch,
                        text.splitlines()[0] if text else type(err).__name__)
            return Trial(block, batch, f"{FAILED}: {text.splitlines()[0][:200] if text else type(err).__name__}")
        peak = torch.cuda.max_memory_allocated(predictor.device) - baseline if cuda else measured.peak_bytes
        if (cuda and budget_bytes is not None and peak is not None and peak > budget_bytes) or (
                host is not None and host.over(block, batch, peak)):
            predictor.release_memory()
            return Trial(block, batch, OVER_BUDGET, peak_bytes=peak)
        mvox = block.prod() * batch / seconds / 1e6
        return Trial(block, batch, "ok", mvox, seconds, peak)

    return run


def _probe(predictor: Predictor, problem: SizeProblem) -> int:
    """One pass at the start block, whose memory foresees the larger blocks' (``HostMeter.refuse`` and ``holds``):
    its output's bytes."""
    raw = _random_block((problem.in_channels,) + tuple(problem.input_shape(problem.base_block)), problem.raw_dtype)
    return _finish(predictor.submit([raw], problem.steps.for_core(problem.halo, problem.base_block)))


def _random_block(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Seeded random data of the input's dtype: kernels may run faster on zeros than on real data."""
    rng = np.random.default_rng(0)
    dtype = np.dtype(dtype)
    if dtype.kind in "ui":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, 0), min(info.max, 255), shape, dtype=dtype, endpoint=True)
    return rng.random(shape, dtype=np.float32).astype(dtype)


def search(problem: SizeProblem, run: Callable[[Coord, int], Trial], *, max_pass_s: float = 4.0,
           max_total_s: float = 60.0, blocks_for_batch: int = 3, coarse: bool = False,
           known: tuple[Trial, ...] = (), guess: Guessing = GPU_GUESSING, trial_passes: int = 2,
           cold_s: float = 0.0, holds: Callable[[Coord], bool] | None = None,
           clock: Callable[[], float] = time.perf_counter) -> SizeChoice:
    """The search of the module docstring over ``run(block, batch) -> Trial``.

    No trial starts that would end after ``max_total_s`` (its time is
    foreseen from the last trial's, scaled by the voxels of the pass; the best
    so far wins): on a slow device the search must not cost more than it saves.
    ``coarse``: the candidates of :meth:`SizeProblem.candidates` with ``coarse``; no larger block is
    tried whose trial would cost more than it is foreseen to save over the region
    (:func:`foreseen_saving_s`): the measured defaults' search pays off in the run that measures.
    A ``coarse`` search takes a larger block untimed as ``guess`` says (:func:`pick`, ``holds`` as there), and
    times no block it could so take whose trial would cost more than ``guess.trial_share`` of the run (nor a
    batch after it: the run's own passes time the guess, :func:`blockpred.tuning.sizecache.confirm_guess`).
    ``known``: trials already run (the caller timed them, or an earlier search cut short by its
    time): taken as they are, not run again; a known pass foresees a trial of ``trial_passes``
    passes and ``cold_s`` more (on CUDA a new shape's first pass costs that much beyond a warm one).
    The choice is not ``complete`` when the time ended the search after it ran a trial: one that ran
    none could not go further at this time either.  ``clock``: the seconds the search
    reads its time from (a test's clock moves with the trials it runs, not with the machine's load).
    """
    candidates = problem.candidates(coarse)
    batch = problem.fixed_batch or 1
    trials: list[Trial] = []
    started = clock()
    last: list[tuple[float, float]] = []  # (voxels of a pass, seconds the trial took), of the last trial
    cut_short, ran, guessed = False, [], False
    already = {(t.block, t.batch_size): t for t in known}

    def foreseen_s(block: Coord, batch_size: int) -> float:
        """Seconds a trial would take: the last one's, scaled by the voxels of a pass (nothing when known)."""
        if (block, batch_size) in already or not last:
            return 0.0
        voxels, seconds = last[-1]
        return seconds * problem.input_shape(block).prod() * batch_size / voxels

    def out_of_time(block: Coord, batch_size: int = 1) -> bool:
        nonlocal cut_short
        if (block, batch_size) in already:
            return False  # known: costs nothing
        over = clock() - started + foreseen_s(block, batch_size) > max_total_s
        cut_short = cut_short or over
        return over

    def attempt(block: Coord, batch_size: int) -> Trial:
        begin = clock()
        trial = already.get((block, batch_size))
        if trial is None:
            trial = run(block, batch_size)
            ran.append(trial)
        # A known trial's time foresees a trial's passes (a warm-up and a timed one on a GPU, see trial_runner).
        took = (trial_passes * trial.seconds_per_pass + cold_s if (block, batch_size) in already
                else clock() - begin)
        last[:] = [(problem.input_shape(block).prod() * batch_size, took)]
        trials.append(trial)
        logger.info("trial block %s batch %d: %s%s", "x".join(map(str, block)), batch_size, trial.outcome,
                    f", {trial.mvox_per_s:.2f} Mvox/s" if trial.fits else "")
        return trial

    start = _index_of_base(candidates, problem.base_block)
    first = attempt(candidates[start], batch)
    score = problem.roi_mvox_per_s
    if first.fits:
        best, slower = score(first), 0
        for block in candidates[start + 1:]:
            if trials[-1].seconds_per_pass > max_pass_s or out_of_time(block, batch):
                break  # a larger block would only be slower per pass, or the time is spent: enough
            if coarse and foreseen_saving_s(problem, trials, block) < foreseen_s(block, batch):
                break  # the trial would cost more than the block may save in this run
            guessed = coarse and guessed_instead(problem, trials, block, guess, foreseen_s(block, batch), holds)
            if guessed:
                break  # taken untimed, or a larger guess: its trial would cost more than it may tell
            trial = attempt(block, batch)
            if trial.failed:
                continue  # this shape only: a larger block may run
            if not trial.fits:
                break
            slower = slower + 1 if score(trial) < 0.9 * best else 0
            best = max(best, score(trial))
            if slower == 3:
                break  # three larger blocks in a row clearly slower: the peak is behind
    else:
        for block in reversed(candidates[:start]):
            if attempt(block, batch).fits:
                break
    fitting = [t for t in trials if t.fits]
    if not fitting and all(t.failed for t in trials):
        raise InvalidOptionError(
            f"the network failed on every block tried ({', '.join('x'.join(map(str, t.block)) for t in trials)}): "
            f"{trials[-1].outcome}; name --block and --downsampling"
        )
    if not fitting:
        smallest = trials[-1]
        raise InvalidOptionError(
            f"no block fits the device's memory: even block {'x'.join(map(str, smallest.block))} at batch {batch} "
            f"was {smallest.outcome}; free device memory, use --precision bf16, or a smaller network"
            + ("; on the CPU --memory-limit sets the budget" if smallest.outcome == OVER_BUDGET else "")
        )
    if problem.fixed_batch is None and not guessed:
        for block in _blocks_to_batch(problem, fitting, blocks_for_batch, coarse):
            best = max(score(t) for t in fitting if t.block == block)
            blocks_in_region = problem.blocks_over_region(block).prod()
            batch_size = 2
            while (batch_size <= min(problem.max_batch, blocks_in_region)
                   and problem.under_index_limit(block, batch_size) and not out_of_time(block, batch_size)):
                saving = foreseen_batch_saving_s(problem, trials, block, batch_size) if coarse else math.inf
                if saving < foreseen_s(block, batch_size):
                    break  # the trial would cost more than the batch may save in this run
                trial = attempt(block, batch_size)
                if not trial.fits or score(trial) < best * 1.02:
                    break  # does not fit, or a bigger batch no longer pays
                best = score(trial)
                batch_size *= 2
    return replace(pick(problem, trials, extrapolate=coarse, guess=guess, holds=holds),
                   complete=not (cut_short and ran))


def _blocks_to_batch(problem: SizeProblem, fitting: list[Trial], count: int, coarse: bool) -> list[Coord]:
    """The blocks whose batch the search doubles: the ``count`` largest that fit; in a ``coarse`` search
    the fastest and the largest only.

    Coarse candidates are eight times apart in voxels: a batch of a block below a larger one that was
    timed and fit runs the voxels of that block in one call with more halo, and on the CPU paid for
    nothing (unet12 on 63 Mvox: 64^3 at batch 2 and 4, 0.27 and 0.29 Mvox/s against 0.47 at
    128x120x120, 10.8 s of a 22.3 s measurement).  The fastest block is still batched where larger
    blocks stopped paying.
    """
    by_size = sorted({t.block for t in fitting}, key=lambda b: b.prod(), reverse=True)
    if not coarse:
        return by_size[:count]
    fastest = max(fitting, key=problem.roi_mvox_per_s).block
    return list(dict.fromkeys((fastest, by_size[0])))


def _index_of_base(candidates: list[Coord], base: Coord) -> int:
    """The largest candidate no larger than the base block (the first if all are larger)."""
    fitting = [i for i, c in enumerate(candidates) if c.prod() <= base.prod()]
    return fitting[-1] if fitting else 0



#: Runs that measure a cached quick search, the first included, before it is taken as it is ...
CONFIRMING_CHECKS = 2
#: ... and while its winner leads the runner-up by less than THIN_MARGIN, up to MAX_CHECKS.
THIN_MARGIN, MAX_CHECKS = 1.1, 4


def contenders(problem: SizeProblem, trials: list[Trial] | tuple[Trial, ...]) -> tuple[Trial, ...]:
    """The fastest fitting trial and the runner-up, by Mvox/s over the region."""
    return tuple(sorted((t for t in trials if t.fits), key=problem.roi_mvox_per_s, reverse=True)[:2])


def recheck_due(problem: SizeProblem, cached: CachedSizes) -> bool:
    """Whether a complete cached search is to be timed again (see the module docstring)."""
    top = contenders(problem, cached.trials)
    if not cached.complete or len(top) < 2:
        return False
    if cached.checks < CONFIRMING_CHECKS:
        return True
    return cached.checks < MAX_CHECKS and problem.roi_mvox_per_s(top[0]) < THIN_MARGIN * problem.roi_mvox_per_s(top[1])


def recheck(problem: SizeProblem, run: Callable[[Coord, int], Trial], cached: CachedSizes, *, max_total_s: float,
            known: tuple[Trial, ...] = (), trial_passes: int = 2,
            clock: Callable[[], float] = time.perf_counter) -> tuple[list[Trial], bool]:
    """The cached trials with their winner and runner-up timed again by ``run`` (those not in ``known``,
    which the caller just timed), each merged with its earlier timing (:func:`.sizecache.merge_trials`).

    No trial starts that is foreseen to end after ``max_total_s``: ``trial_passes`` passes, scaled by
    input voxels from the last pass timed now (the cached timing when none is: it may be the busy one).
    Returns the trials and whether every contender was timed.  ``clock`` as in :func:`search`.
    """
    started, timings = clock(), list(known)
    timed_now = {(t.block, t.batch_size) for t in known}
    work = lambda t: problem.input_shape(t.block).prod() * t.batch_size  # noqa: E731
    finished = True
    for trial in contenders(problem, cached.trials):
        if (trial.block, trial.batch_size) in timed_now:
            continue
        base = next((t for t in reversed(timings) if t.fits), trial)
        foreseen = trial_passes * base.seconds_per_pass * work(trial) / work(base)
        if clock() - started + foreseen > max_total_s:
            finished = False
            break
        timings.append(run(trial.block, trial.batch_size))
        logger.info("re-checked block %s batch %d: %s", "x".join(map(str, trial.block)), trial.batch_size,
                    timings[-1])
    return merge_trials(cached.trials, timings), finished


def choose_sizes(predictor: Predictor, problem: SizeProblem, *, model_key: dict, cache: SizeCache | None = None,
                 budget_bytes: int | None = None, quick_s: float | None = None,
                 cached_only: bool = False, known: tuple[Trial, ...] = (),
                 host_budget: HostBudget | None = None, cold_s: float = 0.0) -> SizeChoice | None:
    """The cached choice for this model, device, precision and problem, else :func:`search` (then cached).

    ``quick_s``: the measured defaults' search (coarse candidates, one pass
    each, at most ``quick_s`` seconds), cached apart from the full one; one
    that its time cut short is cached as such, and the next run that may
    measure goes on where it stopped (its trials are not run again), so a
    short first run pays little and the runs after it converge on the whole
    quick search.  A complete one is timed again while :func:`recheck_due`
    (its choice then says ``complete=False`` to a ``cached_only`` caller).
    ``cached_only``: the cache alone; None when nothing is cached.
    ``known``: trials the caller already timed, ``cold_s`` (see :func:`search`).
    ``host_budget`` (on the CPU): the host memory the trials and the run may take, resolved here; cached
    trials are taken under it (:meth:`blockpred.tuning.hostbudget.HostMeter.review`).  The memory the trials
    used goes back before the run (:meth:`Predictor.release_memory`).
    """
    key = cache_key(model_key, predictor, problem, budget_bytes, quick=quick_s is not None)
    cache = cache if cache is not None else SizeCache()
    host = HostMeter(host_budget, problem) if host_budget is not None and predictor.device.type == "cpu" else None
    found = cache.get_entry(key, problem)
    found = host.review(found) if host is not None else found
    # How far a block may be chosen untimed (a GPU; a CPU with OpenVINO: see guessing), where the host
    # memory budget is foreseen to hold it.
    guess = guessing(predictor.device.type, predictor.backend)
    extrapolate = quick_s is not None and guess.untimed

    @functools.cache  # asked again by each step of the search and by pick: answered (and said) once
    def holds(block: Coord) -> bool:
        if host is None or host.holds(block, 1, functools.partial(_probe, predictor, problem)):
            return True
        logger.info("block %s not taken untimed: not foreseen within %s", "x".join(map(str, block)),
                    host.what or "the memory budget")
        return False

    def held(choice: SizeChoice) -> SizeChoice:
        return replace(choice, guess=(key, problem)) if choice.estimated else choice

    due = quick_s is not None and found is not None and recheck_due(problem, found)
    if found is not None and (cached_only or (found.complete and not due)):
        return held(replace(pick(problem, found.trials, cached=True, extrapolate=extrapolate, guess=guess,
                                 holds=holds), complete=found.complete and not due))
    if cached_only:
        return None
    if due:
        run = trial_runner(predictor, problem, budget_bytes=budget_bytes, quick=True, host=host)
        trials, _ = recheck(problem, run, found, max_total_s=quick_s, known=tuple(known),
                            trial_passes=quick_trial_passes(predictor.device.type, predictor.backend))
        predictor.release_memory(host=True)
        # A check counts where its time ended first too: no run after it pays again for a check it cannot afford.
        cache.put(key, problem, trials, complete=True, checks=found.checks + 1)
        return held(pick(problem, trials, extrapolate=extrapolate, guess=guess, holds=holds))
    known = (tuple(found.trials) if found is not None else ()) + tuple(known)  # a search cut short goes on
    if quick_s is None:
        choice = search(problem, trial_runner(predictor, problem, budget_bytes=budget_bytes, host=host), known=known,
                        guess=NO_GUESSING)
    else:
        choice = search(problem, trial_runner(predictor, problem, budget_bytes=budget_bytes, quick=True, host=host),
                        max_total_s=quick_s, coarse=True, known=known, guess=guess, holds=holds,
                        trial_passes=quick_trial_passes(predictor.device.type, predictor.backend), cold_s=cold_s)
    predictor.release_memory(host=True)  # the trials' larger blocks are not held through the run
    cache.put(key, problem, choice.trials, complete=choice.complete)
    return held(choice)


def _finish(pending) -> int:
    """Wait for a trial batch and give its host buffer back (as the pipeline's writers do); its output's bytes."""
    output_bytes = pending.result().nbytes
    pending.release()
    return output_bytes
