"""An OpenVINO model run compiled for the input shape it is given.

A converted network keeps its batch and spatial axes dynamic (:mod:`.backends`), so that one model serves the
check, every trial and the run's blocks.  OpenVINO's CPU plugin runs a model compiled for one static shape
faster: the sizes a traced copy reads are then constants (its ``ShapeOf`` subgraphs folded away), and each
pass plans its memory once.  On two cores at 1 x 96x160x160 (2026-11-28, four passes each, the first cold):

=================  =================  ===============
network            dynamic, warm (s)  static, warm (s)
=================  =================  ===============
MONAI BasicUNet    1.00-1.06          0.61-0.66
MONAI UNet         0.29-0.35          0.21-0.23
torch-em UNet3d    1.42-1.76          1.22-1.28
loop-list U-Net    0.95-1.03          0.93-1.03
=================  =================  ===============

The first three were as far from torch either way at 1 x 64x112x96 (the same to three digits).
:class:`StaticShapes` compiles the model for each shape it meets (0.1-0.3 s on those networks) and keeps the last
one only: a run's blocks all have one input shape, and a trial's shape is dropped when the next comes, its
buffers with it.  Where a model does not take a static shape (a reshape or compile that fails), the dynamic model
runs, compiled once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["StaticShapes"]


class StaticShapes:
    """``model`` (an ``openvino.Model`` whose input axes may be dynamic) run on float32 batches, compiled by
    ``compile(model)`` for each input shape it is given, the last shape's compiled model kept."""

    def __init__(self, model, compile: Callable):
        self._model = model
        self._compile = compile
        self._lock = threading.Lock()
        self._shape: tuple[int, ...] | None = None
        self._request = None
        self._dynamic = None  # the model compiled as it is, where a shape would not compile
        #: The compiled model's inference precision (``f32``, ``bf16``), once one was compiled.
        self.inference_precision = ""

    def __call__(self, x: np.ndarray) -> np.ndarray:
        with self._lock:
            if tuple(x.shape) != self._shape:
                self._request = None  # the last shape's buffers go before the next shape's are made
                self._request = self._compiled(tuple(x.shape)).create_infer_request()
                self._shape = tuple(x.shape)
            return next(iter(self._request.infer({0: x}, share_inputs=True).values()))

    def release_memory(self) -> None:
        """Hand back the buffers of the shape that ran last (they are allocated again at its next pass)."""
        with self._lock:
            if self._request is not None:
                self._request.get_compiled_model().release_memory()

    def _compiled(self, shape: tuple[int, ...]):
        if self._dynamic is None:
            try:
                static = self._model.clone()
                static.reshape({static.inputs[0]: list(shape)})
                compiled = self._compile(static)
            except Exception as err:  # noqa: BLE001 - the dynamic model runs every shape
                logger.info("OpenVINO: the model does not compile for input %s alone (%s); it runs with its "
                            "shapes dynamic", "x".join(map(str, shape)), str(err).strip().splitlines()[0][:200])
                self._dynamic = self._compile(self._model)
                compiled = self._dynamic
        else:
            compiled = self._dynamic
        self.inference_precision = compiled.get_property("INFERENCE_PRECISION_HINT").to_string()
        return compiled
