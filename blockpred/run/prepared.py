"""A run checked and planned, with nothing written yet: :class:`Prepared`, what :func:`blockpred.run.prepare.prepare`
returns, ``blockpred plan`` reports and :func:`blockpred.run.output.create_output` creates the output from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import RunConfig
from ..io import VolumePath
from ..pipeline import PipelineSettings, Predictor
from ..pipeline.job import ModelSpec
from ..pipeline.markers import DoneMarkers
from ..tuning.defaults import Defaults
from ..tuning.memformat import FormatChoice
from ..tuning.search import SearchChoice
from .choose import Layout
from .mask import Coverage
from .plan import Work


@dataclass(frozen=True)
class Prepared:
    """A run checked and planned, with nothing written yet (what ``blockpred plan`` reports)."""

    cfg: RunConfig
    source_path: VolumePath
    target_path: VolumePath
    model: Any  # LoadedModel
    spec: ModelSpec
    predictor: Predictor
    layout: Layout
    channels: tuple[int, ...] | None
    settings: PipelineSettings
    fingerprint: dict
    #: True when the output holds markers of the same settings: its finished blocks are kept.
    resumed: bool
    previous: DoneMarkers | None
    #: For a new run with a mask: the blocks it marks (:meth:`Coverage.left_out` is the grid of those it leaves out).
    masked: Coverage | None = None
    #: What ``memory_format="auto"`` (or the measured default) chose (None when a layout was named).
    format_choice: FormatChoice | None = None
    #: What ``precision="auto"`` chose and why (the first block's check), "" when a precision was named or
    #: auto meant fp32 on the CPU.
    precision_note: str = ""
    #: What the run has left: blocks masked out and done, voxels, files (:func:`blockpred.run.plan.count_left`).
    work: Work | None = None
    #: Whether the run's passes search cuDNN's kernels, and why (:mod:`blockpred.tuning.search`); None: not chosen.
    search: SearchChoice | None = None
    #: The normalisation that runs and where it came from (:mod:`blockpred.run.normalization`).
    normalize_note: str = ""

    @property
    def memory_format(self) -> str:
        if self.format_choice is not None:
            return self.format_choice.memory_format
        if self.cfg.memory_format == "auto":  # not measured (OpenVINO lays out its own): the predictor's
            return self.predictor.memory_format
        return self.cfg.memory_format or "contiguous"

    @property
    def backend(self) -> str:
        """What runs the network: the measured choice of ``--backend auto``, else the one named (auto: torch)."""
        if self.format_choice is not None:
            return self.format_choice.backend
        return self.predictor.backend

    @property
    def defaults(self) -> Defaults | None:
        """What the run chose for the block, batch and memory format it was not given (see
        :mod:`blockpred.tuning.defaults`)."""
        return self.layout.defaults

    @property
    def out_channels(self) -> int:
        return len(self.channels) if self.channels is not None else self.layout.geometry.out_channels
