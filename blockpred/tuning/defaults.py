"""The block, batch and memory format of a run whose options do not name them: measured when it pays.

A user who names no ``--block``, ``--batch-size`` or ``--memory-format``
gets what runs this network fastest on this device, found by a few short
passes (:func:`blockpred.tuning.autosize.choose_sizes` with ``quick_s``,
:func:`blockpred.tuning.memformat.choose_memory_format` with one pass per layout)
and cached per model, weights, device and precision, so only the first run
pays.  Measuring is bounded by the run it serves: one pass at the start
block (timed after the dry run), times the blocks that block needs,
estimates the run; a run estimated under :data:`MIN_RUN_S` is not measured
at all (the start block, batch 1, contiguous: there is little to gain), and
a longer one may spend :data:`BUDGET_FRACTION` of its estimate, at most
:data:`BASE_BUDGET_S` (a tenth of a longer run, up to :data:`MAX_BUDGET_S`):
a first run, which is often a user's only run, never pays more than a
quarter of its time for the runs after it, which pay nothing.  On a GPU, and
on the CPU with OpenVINO, where the budget ends before a larger block is
timed (or its trial would cost more than it saves), the next larger one is
chosen when the halo it saves makes it faster by the largest timed pass
scaled by voxels (:func:`blockpred.tuning.autosize.pick`; on the CPU the one estimated fastest of those that
read at most ten times the input, within the memory budget, and untimed where a trial would cost more than a
twentieth of the run: :func:`blockpred.tuning.sizing.guessing`).  The memory
format is measured first, at the start block: the estimate's pass is
contiguous's, so channels_last takes the passes of a quick trial (a warm-up
and a timed pass on a GPU, one cold pass on a CPU:
:func:`blockpred.tuning.sizing.quick_trial_passes`), and only when those fit the
budget; the faster layout's pass is the first size trial,
and the sizes search the rest of the budget (the search starts no trial it
foresees ending past it).  On the CPU, where OpenVINO is installed and ``--backend`` is ``auto``, its
trial comes first, on a budget of its own (three quarters of the estimate:
:data:`blockpred.run.formats.BACKEND_BUDGET_FRACTION`), since a winning
trial's conversion is what running OpenVINO costs anyway and it ran 2.2-4.7x
as fast as torch's contiguous pass at ``tiny``'s start block here; torch's other layout and the sizes
take what the quarter leaves after it, and a layout left untimed loses (the
choice is cached all the same, unless OpenVINO was left untimed).  A cached search is timed again where one
measurement may have met a busy machine (:func:`blockpred.tuning.autosize.recheck`).
A named option is never measured or changed.  Different layouts, batches and
blocks give the same values up to float rounding (and, for blocks, up to what
the halo covers).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..geometry import Coord

#: Runs estimated shorter than this (seconds, at the start block) are not measured.
MIN_RUN_S = 1.0
#: The share of the estimated run that measuring may take ...
BUDGET_FRACTION = 0.25
#: ... but no more than this many seconds, or LONG_RUN_FRACTION of a longer run, up to MAX_BUDGET_S.
BASE_BUDGET_S = 10.0
LONG_RUN_FRACTION = 0.1
MAX_BUDGET_S = 60.0


def measuring_budget(estimated_run_s: float) -> float:
    """Seconds the defaults may spend measuring for a run estimated at ``estimated_run_s``."""
    if estimated_run_s < MIN_RUN_S:
        return 0.0
    # With 10 s a 5-minute CPU run could time no block beyond the start block (unet12 on 63 Mvox: 64^3 at
    # 1.2 s a pass, the next block foreseen at 6.8 s; 307 s at 64^3, 215 s with 30 s that found 128x120x120);
    # a fifth (44-49 s of 219-248 s runs) paid no more in the first run than it cost: 172-174 s either way.
    cap = max(BASE_BUDGET_S, min(MAX_BUDGET_S, LONG_RUN_FRACTION * estimated_run_s))
    return min(cap, BUDGET_FRACTION * estimated_run_s)


@dataclass(frozen=True)
class Defaults:
    """What the run chose for the options it was not given, and how (a line of the summary)."""

    block: Coord | None
    batch_size: int | None
    memory_format: str | None
    #: The run's estimate at the start block (seconds), which bounds the measuring.
    estimated_run_s: float
    #: Seconds spent measuring (0 when cached or not measured).
    measured_s: float
    #: "measured", "cached" or why nothing was measured.
    how: str
    #: What runs the network where ``--backend auto`` measured it (None: named, or not measured on this device).
    backend: str | None = None

    def __str__(self) -> str:
        layout = "openvino" if self.backend == "openvino" else self.memory_format
        chosen = [f"block {'x'.join(map(str, self.block))}" if self.block is not None else None,
                  f"batch {self.batch_size}" if self.batch_size is not None else None,
                  layout]
        what = ", ".join(c for c in chosen if c)
        if self.how == "measured":
            how = f"measured in {self.measured_s:.1f} s for a run estimated at {self.estimated_run_s:.1f} s"
        else:
            how = self.how
        return f"{what} ({how})"
