"""fp16 and bf16 on the CPU: OpenVINO's bf16 where the CPU computes it, and the first block against fp32.

torch runs fp16 and bf16 on a CPU through autocast, which issue 25 measured
at 18x fp32's time on 2 cores: ``--precision auto`` stays fp32 on the CPU, on
every backend.  OpenVINO computes bf16 itself where the CPU has AMX or
AVX512-BF16 (:func:`blockpred.pipeline.backends.cpu_bf16`; issue 35 measured
its bf16 2-4x faster than its f32 with AMX), so ``--precision bf16`` with
``--backend auto`` runs OpenVINO there without a measurement
(:func:`openvino_bf16`).

A named fp16 or bf16 on the CPU is compared with fp32 on the run's first block
(:func:`compare_with_fp32`): the start block at the ROI's first corner through
the run's predictor and through torch at fp32.  The summary prints the largest
difference and, where torch's autocast ran it, the ratio of the two passes'
times (fp32's timed after an untimed pass); where that pass was slower than
fp32's, a warning says how much (:meth:`CpuPrecision.warning`): it depends on
the CPU and torch.  With torch 2.13 on this project's 2-core AMD EPYC
(AVX512-BF16, no AMX) ``tiny``'s 84x276x276 block took 1.2 s at fp32
(channels_last), 0.59 s in autocast's bf16 (its convolutions' weights cast
once; 0.026 of the output range from fp32) and 11.4 s in its fp16; OpenVINO
took 0.69 s at f32 and 0.38 s at bf16 (0.0019 from fp32).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from ..pipeline import DeviceSteps, Predictor
from ..pipeline.backends import cpu_bf16, openvino_available
from ..tuning.precision import differences
from .formats import wants_backend

#: The precisions torch runs through autocast, and OpenVINO (bf16) may run itself.
LOW = ("fp16", "bf16")


def openvino_bf16(cfg, model, predictor: Predictor) -> bool:
    """Whether ``--backend auto`` runs OpenVINO, unmeasured: at bf16, where ``auto`` would measure OpenVINO
    (:func:`blockpred.run.formats.wants_backend`) and the CPU computes bf16 (AMX or AVX512-BF16)."""
    return predictor.precision == "bf16" and wants_backend(cfg, model, predictor) and bool(cpu_bf16())


@dataclass(frozen=True)
class CpuPrecision:
    """The first block at ``precision`` against torch at fp32: the largest absolute difference as a share of
    fp32's output range, and the seconds of each pass."""

    precision: str
    #: What computed it: ``OpenVINO, AVX512-BF16`` (or ``AMX``), ``OpenVINO, in f32`` or ``torch autocast``.
    ran_on: str
    max_diff: float
    seconds: float
    fp32_seconds: float
    #: Why OpenVINO did not compute it where torch did ("" otherwise).
    why_torch: str = ""

    @property
    def slower(self) -> float:
        """How many times longer the pass took than fp32's."""
        return self.seconds / self.fp32_seconds if self.fp32_seconds > 0 else math.nan

    def __str__(self) -> str:
        text = (f"{self.precision} ({self.ran_on}): max difference from fp32 on the first block "
                f"{self.max_diff:.2g} of the output range")
        return text + (f"; its pass took {self.slower:.2f}x fp32's time" if self.ran_on == "torch autocast" else "")

    def warning(self) -> str:
        """The one line a run logs where torch's autocast ran slower than fp32, else ""."""
        if self.ran_on != "torch autocast" or not self.slower > 1.0:
            return ""
        why = f"; {self.why_torch}" if self.why_torch else ""
        return (f"--precision {self.precision} on this CPU ran {self.slower:.1f}x slower than fp32 (torch "
                f"autocast{why}); use --precision fp32 unless you need {self.precision}'s numbers")


def compare_with_fp32(predictor: Predictor, module, sample: np.ndarray, steps: DeviceSteps) -> CpuPrecision:
    """``sample`` (the first block's raw input, (C, Z, Y, X)) through ``predictor`` at its precision and through
    ``module`` with torch at fp32, with ``steps`` (their output float32), timed and compared.

    The predictor's pass follows its dry run at this shape; torch's fp32 pass, where the factor is said (torch's
    autocast ran), follows an untimed one.
    """
    steps = replace(steps, output_dtype=np.dtype("float32"), counted=None)
    low, seconds = _timed(predictor, sample, steps)
    note = predictor.backend_note
    reference = Predictor(module, predictor.device, "fp32", memory_format=predictor.memory_format)
    try:
        if note != "openvino":  # the factor is said: fp32's pass warm too (kernels chosen, memory allocated)
            _timed(reference, sample, steps)
        exact, fp32_seconds = _timed(reference, sample, steps)
    finally:
        del reference
    max_diff = differences(low, exact)[0]
    if note == "openvino":
        bf16 = predictor.precision == "bf16" and cpu_bf16()
        return CpuPrecision(predictor.precision, f"OpenVINO, {bf16}" if bf16 else "OpenVINO, in f32", max_diff,
                            seconds, fp32_seconds)
    return CpuPrecision(predictor.precision, "torch autocast", max_diff, seconds, fp32_seconds,
                        why_torch=_why_torch(predictor.precision, note))


def _why_torch(precision: str, backend_note: str) -> str:
    """Why torch's autocast, not OpenVINO, computed ``precision`` (``backend_note``: the predictor's)."""
    if precision != "bf16":
        return ""
    if backend_note.startswith("torch (openvino: "):
        return f"OpenVINO did not take this network: {backend_note[len('torch (openvino: '):-1]}"
    if not cpu_bf16():
        return ("OpenVINO's bf16 needs AMX or AVX512-BF16" + ("" if openvino_available() else
                                                                ", and OpenVINO: pip install openvino"))
    return f"--backend openvino computes bf16 with {cpu_bf16()} here"


def slow_precision_warning(precision: str, device, backend: str) -> str:
    """Before a run whose first block was not compared (``blockpred plan``, blocks on other machines): fp16 and
    bf16 pay on GPUs and, through OpenVINO, bf16 on a CPU with BF16; torch's autocast on a CPU may be many times
    slower than fp32 (see the module docstring)."""
    if device.type != "cpu" or precision not in LOW or (backend == "openvino" and precision == "bf16" and cpu_bf16()):
        return ""
    return (f"--precision {precision} on the CPU can be several times slower than fp32 (torch's autocast; a run "
            f"measures it on its first block); use --precision fp32 unless you need {precision}'s numbers")


def _timed(predictor: Predictor, sample: np.ndarray, steps: DeviceSteps) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    pending = predictor.submit([sample], steps)
    try:
        return np.array(pending.result(), copy=True), time.perf_counter() - started
    finally:
        pending.release()
