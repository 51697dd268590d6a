"""``--precision auto``: a low precision where the device pays for it and the network's numbers survive it.

On a CUDA device ``auto`` runs autocast at bf16 (fp16 on a GPU without bf16
arithmetic, before Ampere), the precision at which a recent GPU's tensor cores
run a 3D U-Net several times faster than fp32 (cremi2018 on an H100: 151
against 32 Mvox/s).  Before the run the first block's input goes through the
network twice, at fp32 and at that precision, on the device the blocks run
on: :func:`check_precision`.  Where the low precision's output differs from
fp32's by more than :data:`MAX_DIFF` of fp32's output range at any voxel, or
by more than :data:`MEAN_DIFF` of it on average, the run falls back to tf32
(fp32 storage, tensor-core products) with one warning line; the summary
prints the check either way.  Where the GPU computes bf16, fp16 is checked
too (:func:`auto_candidates`: cremi2018 ran 98.3 Mvox/s at fp16 with
channels_last against 79.8 at bf16 on an H200, 2026-11-27), each check
timing a warm pass, and the faster of those that pass runs
(:func:`choose_checked`); the checks are cached (:mod:`blockpred.run.checks`).  On the CPU ``auto`` is fp32: autocast there is
slower, not faster.  A machine that runs no block itself (it submits jobs or
joins a cluster, and has no CUDA device) cannot check: its GPU workers run tf32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..pipeline import DeviceSteps, Predictor, is_out_of_memory

AUTO = "auto"
#: The largest difference allowed at any voxel of the first block, as a share of fp32's output range.
MAX_DIFF = 0.1
#: The largest mean difference allowed over the first block, as a share of fp32's output range.
MEAN_DIFF = 0.01
#: What runs where the low precision fails its check, or cannot be checked on a GPU.
FALLBACK = "tf32"


def auto_precision(device: torch.device) -> str:
    """The precision ``auto`` tries first on ``device``: bf16 where CUDA computes it, else fp16; fp32 on the CPU."""
    if device.type != "cuda":
        return "fp32"
    with torch.cuda.device(device):
        try:
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # a torch without the argument: it did not count emulation
            native = torch.cuda.is_bf16_supported()
    return "bf16" if native else "fp16"


def auto_candidates(device: torch.device) -> tuple[str, ...]:
    """The low precisions ``auto`` checks on ``device``: bf16 and fp16 where CUDA computes bf16, else fp16 (before
    Ampere); fp32 alone on the CPU."""
    first = auto_precision(device)
    return (first, "fp16") if first == "bf16" else (first,)


@dataclass(frozen=True)
class PrecisionCheck:
    """The first block at ``candidate`` against fp32: the largest and the mean absolute difference, as shares
    of fp32's output range (``error``: why the comparison could not be made), and a warm pass's seconds at
    ``candidate`` (NaN where not timed)."""

    candidate: str
    max_diff: float
    mean_diff: float
    error: str = ""
    seconds: float = math.nan

    @property
    def passed(self) -> bool:
        return not self.error and self.max_diff <= MAX_DIFF and self.mean_diff <= MEAN_DIFF

    @property
    def precision(self) -> str:
        """What the run goes on at."""
        return self.candidate if self.passed else FALLBACK

    def _found(self) -> str:
        if self.error:
            return self.error
        return (f"{self.candidate} differed from fp32 by {self.max_diff:.2%} at most and {self.mean_diff:.3%} "
                f"on average of fp32's output range on the first block")

    def __str__(self) -> str:
        if self.passed:
            return f"{self.candidate} (auto: {self._found()})"
        return f"{FALLBACK} (auto: {self._found()}; allowed {MAX_DIFF:.0%} and {MEAN_DIFF:.0%})"

    def warning(self) -> str:
        """The one line a fallback logs."""
        if self.passed:
            return ""
        allowed = "" if self.error else f", more than the {MAX_DIFF:.0%} and {MEAN_DIFF:.0%} allowed"
        return (f"--precision auto: {self._found()}{allowed}; running {FALLBACK} "
                f"(--precision {self.candidate} runs {self.candidate} anyway)")


def differences(low: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """The largest and the mean absolute difference of ``low`` from ``reference``, as shares of its range.

    A value finite in one and not in the other differs infinitely; NaN and inf where both have them count
    as equal.  A constant reference is measured against its magnitude (else against 1).
    """
    low, reference = np.asarray(low, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    finite = np.isfinite(reference)
    if not np.array_equal(finite, np.isfinite(low)):
        return math.inf, math.inf
    if not finite.any():
        return 0.0, 0.0
    ref, diff = reference[finite], np.abs(low[finite] - reference[finite])
    scale = float(ref.max() - ref.min()) or float(np.abs(ref).max()) or 1.0
    return float(diff.max()) / scale, float(diff.mean()) / scale


def choose_checked(checks: list[PrecisionCheck]) -> tuple[PrecisionCheck, str]:
    """Of the candidates' checks, the one whose precision runs: the fastest of those that passed (by their timed
    pass; the first where none was timed), else the first (its fallback says why); and the line that says
    which others were checked."""
    passed = [c for c in checks if c.passed]
    chosen = min(passed, key=lambda c: (math.isnan(c.seconds), c.seconds, checks.index(c))) if passed else checks[0]
    others = [c for c in checks if c is not chosen]
    if not others:
        return chosen, str(chosen)
    said = "; ".join(f"{c.candidate} {'passed' if c.passed else 'failed'}"
                     + (f", {c.seconds:.3f} s a pass" if not math.isnan(c.seconds) else "") for c in others)
    timed = f", {chosen.seconds:.3f} s a pass" if chosen.passed and not math.isnan(chosen.seconds) else ""
    return chosen, f"{chosen}{timed}; also checked: {said}"


def check_precision(predictor: Predictor, module: torch.nn.Module, sample: np.ndarray,
                    steps: DeviceSteps) -> PrecisionCheck:
    """``sample`` (one block's raw input, (C, Z, Y, X)) through ``predictor`` at its precision and through
    ``module`` at fp32 on the same device, with ``steps`` (their output dtype float32), compared; the predictor's
    second pass is timed (its first at a new precision is not a run's pass)."""
    import time

    steps = replace(steps, output_dtype=np.dtype("float32"), counted=None)
    _output(predictor, sample, steps)
    started = time.perf_counter()
    low = _output(predictor, sample, steps)
    seconds = time.perf_counter() - started
    reference = Predictor(module, predictor.device, "fp32", memory_format=predictor.memory_format)
    try:
        exact = _output(reference, sample, steps)
    except Exception as err:
        if not is_out_of_memory(err):
            raise
        return PrecisionCheck(predictor.precision, math.inf, math.inf,
                              error="fp32 ran out of device memory on the first block, so it was not compared")
    finally:
        del reference
        if predictor.device.type == "cuda":
            torch.cuda.empty_cache()  # the reference's weights and activations: the run's memory again
    return PrecisionCheck(predictor.precision, *differences(low, exact), seconds=seconds)


def _output(predictor: Predictor, sample: np.ndarray, steps: DeviceSteps) -> np.ndarray:
    pending = predictor.submit([sample], steps)
    try:
        return np.array(pending.result(), copy=True)
    finally:
        pending.release()
