"""The precision a run starts at, its first block's precision checks, and their cache: a run whose network, device,
precision, layout, backend, normalisation and input dtype were checked before repeats no check.

``--precision auto`` on a GPU compares the first block at bf16 (or fp16) with
fp32 (:func:`blockpred.tuning.precision.check_precision`); a low precision
named on the CPU is compared and timed (:func:`.cpu_precision.compare_with_fp32`).
Each costs two passes or more at a shape and precision the run may not keep,
which on a GPU are first passes.  The outcome (a frozen dataclass of numbers
and words) is kept in ``checks.json`` under what it depends on, and a later
run takes it from there.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Callable, TypeVar

from ..cache import JsonFile, default_cache_dir, digest
from ..config import RunConfig
from ..tuning.precision import (AUTO, FALLBACK, PrecisionCheck, auto_candidates, auto_precision, check_precision,
                                choose_checked)

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
Check = TypeVar("Check")


def check_key(model_key: dict, predictor, normalize, raw_dtype) -> dict:
    """What a check depends on: the network, the device (a GPU by its name), the precision, layout and backend it
    ran at, the normalisation and the input's dtype."""
    import torch

    cuda = predictor.device.type == "cuda"
    return {"version": CACHE_VERSION, "model": model_key, "precision": predictor.precision,
            "memory_format": predictor.memory_format, "backend": predictor.backend,
            "device": torch.cuda.get_device_name(predictor.device) if cuda else predictor.device.type,
            "torch": torch.__version__, "normalize": str(normalize), "dtype": str(raw_dtype)}


class CheckCache:
    """The checks of ``checks.json``: :meth:`get_or_run` reads one or runs it; what it ran is written by :meth:`save`,
    which the run calls once it has passed every check (a refused run writes nothing)."""

    def __init__(self, path: Path | None = None):
        self._file = JsonFile(path if path is not None else default_cache_dir() / "checks.json")
        self._new: dict[str, dict] = {}

    def get_or_run(self, key: dict, kind: type[Check], run: Callable[[], Check]) -> Check:
        """The ``kind`` check cached under ``key``, else ``run()``'s (kept for :meth:`save`)."""
        name = digest({**key, "kind": kind.__name__})
        entry = self._new.get(name) or self._file.read().get(name)
        if isinstance(entry, dict):
            try:
                found = kind(**entry["check"])
            except (KeyError, TypeError, ValueError):
                found = None
            if found is not None:
                logger.info("precision check of the first block: cached (%s)", found)
                return found
        check = run()
        self._new[name] = {"key": key, "check": dataclasses.asdict(check)}
        return check

    def save(self) -> None:
        if self._new:
            self._file.merge(self._new, "the precision check")
            self._new = {}


def start_precision(cfg: RunConfig, device, jobs) -> tuple[str, str]:
    """The precision the predictor starts at, and what the summary says of ``auto`` before any check.

    ``auto`` on a machine without CUDA whose blocks run on GPUs (jobs with GPUs, or a cluster joined with
    ``--device cuda``): the first block cannot be compared here, so tf32, which needs no check.
    """
    if cfg.precision != AUTO:
        return cfg.precision, ""
    gpu_workers = (jobs is not None and jobs.gpus_per_job) or (
        str(cfg.device).startswith("cuda") and (cfg.scheduler is not None or cfg.cluster is not None))
    if device.type == "cpu" and gpu_workers:
        return FALLBACK, (f"{FALLBACK} (auto: this machine has no CUDA device to compare bf16 with fp32 on; "
                          f"--precision bf16 runs bf16 unchecked)")
    return auto_precision(device), ""


def check_auto(predictor, module, first_block: Callable[[], tuple], cache: CheckCache,
               key: Callable[[], dict]) -> str:
    """``--precision auto`` on the first block (``first_block()``: its raw input and steps): each candidate
    (:func:`~blockpred.tuning.precision.auto_candidates`: bf16 and fp16 on a recent GPU) checked against fp32, or taken
    from ``cache`` under ``key()`` (the predictor at the candidate); the predictor left at the faster that passed, else
    at the fallback with one warning.  Returns the summary's note."""
    checks = []
    for candidate in auto_candidates(predictor.device):
        predictor.use_precision(candidate)
        checks.append(cache.get_or_run(key(), PrecisionCheck,
                                       lambda: check_precision(predictor, module, *first_block())))
    check, note = choose_checked(checks)
    if not check.passed:
        logger.warning("%s", check.warning())
    predictor.use_precision(check.precision)
    return note
