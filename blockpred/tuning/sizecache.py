"""The size trials cached per model, device, precision and constraints: :class:`SizeCache`; two timings of one
configuration merged (:func:`merge_trials`), and a block chosen untimed merged in as the run timed it
(:func:`confirm_guess`).

Only the first run on a machine pays for the trials of :mod:`blockpred.tuning.autosize`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..cache import JsonFile, default_cache_dir, digest
from ..geometry import Coord
from ..pipeline import Predictor
from .sizing import SizeChoice, SizeProblem, Trial

logger = logging.getLogger(__name__)

#: Bumped when the cached entries change meaning.
CACHE_VERSION = 1


class CachedSizes(NamedTuple):
    """One cached search: its trials, whether it was complete (not cut short), and how many runs measured it."""

    trials: list[Trial]
    complete: bool
    checks: int


class SizeCache:
    """Trials by key in one JSON file: ``$BLOCKPRED_CACHE_DIR``, ``$XDG_CACHE_HOME/blockpred`` or ``~/.cache/blockpred``.

    The region is not part of the key: the trials of one search serve any
    region whose blocks they cover (each region then picks its own winner),
    unless the earlier region capped the search.
    """

    def __init__(self, path: Path | None = None):
        self.path = path if path is not None else default_cache_dir() / "sizes.json"
        self._file = JsonFile(self.path)

    def _entries(self) -> dict:
        return self._file.read()

    def get(self, key: dict, problem: SizeProblem) -> list[Trial] | None:
        """The cached trials that serve ``problem`` (see :meth:`get_entry`)."""
        found = self.get_entry(key, problem)
        return None if found is None else found.trials

    def get_entry(self, key: dict, problem: SizeProblem) -> CachedSizes | None:
        """The cached search that serves ``problem``."""
        for entry in self._entries().get(digest(key), []):
            try:
                trials = [Trial(Coord(t["block"]), int(t["batch_size"]), str(t["outcome"]),
                                float(t["mvox_per_s"]), float(t["seconds_per_pass"]),
                                None if t.get("peak_bytes") is None else int(t["peak_bytes"])) for t in entry["trials"]]
                same_cap = Coord(entry["max_block"]) == problem.max_block
                covered = not entry["capped"] and all(t.block.minimum(problem.max_block) == t.block for t in trials)
            except (KeyError, TypeError, ValueError):
                continue
            if (same_cap or covered) and any(t.fits for t in trials):
                return CachedSizes(trials, bool(entry.get("complete", True)), int(entry.get("checks", 1)))
        return None

    def put(self, key: dict, problem: SizeProblem, trials: list[Trial] | tuple[Trial, ...],
            complete: bool = True, checks: int = 1) -> None:
        """Cache a search's ``trials``; ``checks``: how many runs have measured them (see :func:`autosize.recheck`)."""
        entries = self._entries()
        capped = any(b == m for t in trials for b, m in zip(t.block, problem.max_block))
        entry = {"max_block": list(problem.max_block), "capped": capped, "key": key, "complete": complete,
                 "checks": checks, "trials": [_trial_json(t) for t in trials]}
        entries[digest(key)] = [entry] + [e for e in entries.get(digest(key), [])
                                           if e.get("max_block") != entry["max_block"]][:7]
        self._file.write(entries, "the block size trials")


def device_key(predictor: Predictor) -> dict:
    """The device as the cache tells devices apart: its name and memory (not its index), and the kernels' versions."""
    import torch

    cuda = predictor.device.type == "cuda"
    versions = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version() if cuda else None}
    if cuda:
        props = torch.cuda.get_device_properties(predictor.device)
        return {"type": "cuda", "name": props.name, "memory": props.total_memory, **versions}
    return {"type": "cpu", "threads": torch.get_num_threads(), **versions}


def cache_key(model_key: dict, predictor: Predictor, problem: SizeProblem, budget_bytes: int | None,
              quick: bool) -> dict:
    """What tells cached trials apart: model, device, precision, compile, layout, budget, problem, search."""
    key = {"version": CACHE_VERSION, "model": model_key, "device": device_key(predictor),
           "precision": predictor.precision, "compile": predictor.compile, "memory_format": predictor.memory_format,
           "budget_bytes": budget_bytes, "problem": _problem_json(problem)}
    if predictor.backend != "torch":  # (absent for torch: the trials cached before backends still serve)
        key["backend"] = predictor.backend
    if quick:
        key["search"] = "quick"
    return key


def _problem_json(problem: SizeProblem) -> dict:
    out: dict[str, Any] = {}
    for name, value in asdict(problem).items():
        if name == "roi":
            continue  # not part of the key: see SizeCache
        if name == "max_input_voxels" and value is None:
            continue  # no limit (the CPU): the key of the trials cached before the limit
        if name == "steps":
            value = {"scale": problem.steps.scale, "offset": problem.steps.offset,
                     "channels": problem.steps.channels, "output_dtype": np.dtype(problem.steps.output_dtype).name}
        out[name] = value if not isinstance(value, (np.dtype, type)) else np.dtype(value).name
    return json.loads(json.dumps(out, default=str))


def _trial_json(trial: Trial) -> dict:
    return {"block": list(trial.block), "batch_size": trial.batch_size, "outcome": trial.outcome,
            "mvox_per_s": trial.mvox_per_s, "seconds_per_pass": trial.seconds_per_pass, "peak_bytes": trial.peak_bytes}


def merge_trials(old: list[Trial] | tuple[Trial, ...], new: list[Trial] | tuple[Trial, ...]) -> list[Trial]:
    """Trials by (block, batch): of two timings of one configuration the faster; a new outcome where either
    did not fit (the device's free memory may have changed)."""
    merged = {(t.block, t.batch_size): t for t in old}
    for trial in new:
        prior = merged.get((trial.block, trial.batch_size))
        if prior is None or not (prior.fits and trial.fits) or trial.seconds_per_pass < prior.seconds_per_pass:
            merged[(trial.block, trial.batch_size)] = trial
    return list(merged.values())


def confirm_guess(choice: SizeChoice, seconds_per_pass: float, batch_size: int,
                  cache: SizeCache | None = None, passes: int = 2) -> Trial | None:
    """An estimated block (``choice.guess``) as the run's own passes timed it (their fastest at ``batch_size``),
    merged into its cached search as a trial: the next run takes it for what it measured, and from it the
    search steps on to a larger block untimed where that still pays, or keeps the block it timed fastest
    (:func:`blockpred.tuning.autosize.pick`).  Nothing is run again.  The timing counts as a check of the cached
    search (:func:`blockpred.tuning.autosize.recheck_due`): the fastest of the run's passes, not one trial's, it
    spares the next run a trial of the same block (torch-em's UNet3d over 18.9 Mvox: 8.4 s of a 24.3 s second run).
    The trial, or None where there is no guess or no pass, or the run had one ``passes`` only: the first pass at a
    shape is cold (with OpenVINO on two cores a block of 96x288x288 took 1.5-2x its warm pass: compiled for the
    shape, its memory faulted in; so timed, MONAI's UNet stepped back from one block to sixteen of 64^3)."""
    if choice.guess is None or seconds_per_pass <= 0 or passes < 2:
        return None
    key, problem = choice.guess
    cache = cache if cache is not None else SizeCache()
    found = cache.get_entry(key, problem)
    trial = Trial(choice.block, batch_size, "ok", choice.block.prod() * batch_size / seconds_per_pass / 1e6,
                  seconds_per_pass)
    cache.put(key, problem, merge_trials(found.trials if found is not None else (), [trial]),
              complete=found.complete if found is not None else True,
              checks=(found.checks if found is not None else 1) + 1)
    logger.info("block %s, chosen untimed, ran at %.3f s a pass (estimated %.3f): cached as timed",
                "x".join(map(str, choice.block)), seconds_per_pass,
                choice.block.prod() * batch_size / (choice.mvox_per_s * 1e6) if choice.mvox_per_s > 0 else 0.0)
    return trial
