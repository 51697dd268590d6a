"""``--backend onnxruntime``: a network exported to ONNX and run by ONNX Runtime's CPU provider
(:class:`ONNXRuntimeNetwork`), an optional extra (``pip install -e '.[onnx]'``: ``onnxruntime`` and ``onnx``,
which torch's exporter writes with).

It works as :class:`~.backends.OpenVINONetwork` does:

* **Exported** from the very module the predictor would run (its TTA wrapper, a 2D network's planes, a
  package's processing included) at the first batch it is given, by torch's TorchScript exporter
  (``torch.onnx.export(..., dynamo=False)``: it follows what a trace follows, TorchScript modules included,
  and needs neither ``onnxscript`` nor a ``torch.export`` constraint per spatial axis), with the batch and every
  spatial axis dynamic.  A TorchScript network is traced through and frozen first, as for OpenVINO.
* **Checked** at export: ONNX Runtime's output on a seeded random batch of the first batch's shape must equal
  torch's within :data:`.converted.TOLERANCE` of torch's output range; else the network runs with torch and one
  line says why.  So does a network that does not export, takes a second input or says ``torch_only``.
* **Cached on disk** (``onnxruntime/<key>.onnx`` in the cache directory, keyed by the network's name, weights
  and options, its wrapper and channels, the opset and the versions of torch, onnx and ONNX Runtime): a second
  run reads it and exports nothing.
* Run at fp32 only (another precision is refused in one line: ``--backend openvino`` has bf16), on as many
  intra-op threads as torch has (a worker's share of the machine).

``--backend auto`` does not measure it: in issue 35's table ONNX Runtime took 2.4x OpenVINO's time per pass
(and more than torch's channels_last_3d at full size), and OpenVINO is a default dependency, so ONNX Runtime
would cost every first run an export and passes that could not win.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from ..cache import default_cache_dir, digest
from ..errors import InvalidOptionError
from ..models.scriptgraph import traceable
from .converted import ConvertedNetwork

logger = logging.getLogger(__name__)

__all__ = ["ONNXRuntimeNetwork", "make_onnxruntime", "onnxruntime_available"]

#: The ONNX opset the network is exported at (ONNX Runtime 1.17 and later run it).
OPSET = 17
#: Bumped when the cached exports change meaning.
CACHE_VERSION = 1
#: What a missing install says (one line, exit 2).
MISSING = "--backend onnxruntime needs onnxruntime: pip install -e '.[onnx]'"


def onnxruntime_available() -> bool:
    """ONNX Runtime, and ``onnx`` for torch's exporter, are installed."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def make_onnxruntime(module: torch.nn.Module, *, precision: str, key: dict | None) -> ONNXRuntimeNetwork:
    """``module`` through ONNX Runtime; :class:`InvalidOptionError` where it is not installed or the precision
    is not fp32 (or tf32, which is fp32 on a CPU)."""
    if not onnxruntime_available():
        raise InvalidOptionError(MISSING)
    if precision not in ("fp32", "tf32"):
        raise InvalidOptionError(f"--backend onnxruntime runs at fp32, got --precision {precision}; use "
                                 f"--precision fp32, or --backend openvino for {precision}")
    return ONNXRuntimeNetwork(module, key=key)


class ONNXRuntimeNetwork(ConvertedNetwork):
    """``module`` through ONNX Runtime, exported (or read from the cache) at its first batch (see the module
    docstring and :class:`~.converted.ConvertedNetwork`)."""

    runtime, backend, made = "ONNX Runtime", "onnxruntime", "exported"

    def __init__(self, module: torch.nn.Module, *, key: dict | None):
        super().__init__(module, key=key)
        self._session = None

    def _infer(self, x: np.ndarray) -> np.ndarray:
        return _run(self._session, x)

    def _cached(self, x: torch.Tensor, route: str) -> bytes | None:
        path = _cache_path(self._key, x.shape[1])
        if not path.is_file():
            return None
        try:
            return path.read_bytes()
        except OSError as err:  # an unreadable cache entry is exported again
            logger.info("the cached ONNX model %s does not read (%s); exporting again", path, err)
            return None

    def _make(self, route: str, example: torch.Tensor) -> bytes:
        return _export(self._module, example)

    def _ready(self, model: bytes, check_shape: tuple | None) -> None:
        session = _session(model)
        if check_shape is not None:
            self.check(lambda batch: _run(session, batch), check_shape)
        self._session = session

    def _save(self, model: bytes, in_channels: int, route: str) -> None:
        path = _cache_path(self._key, in_channels)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Dask workers may export at once: each writes its own file and renames it into place.
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.onnx")
            tmp.write_bytes(model)
            tmp.replace(path)
        except OSError as err:  # a read-only home must not stop a run
            logger.warning("could not cache the ONNX model in %s: %s", path.parent, err)


def _run(session, x: np.ndarray) -> np.ndarray:
    (name,) = [i.name for i in session.get_inputs()]
    return session.run(None, {name: np.ascontiguousarray(x, dtype=np.float32)})[0]


def _export(module: torch.nn.Module, example: torch.Tensor) -> bytes:
    """``module`` as ONNX bytes, traced at ``example`` with the batch and spatial axes dynamic."""
    dims = [0] + list(range(2, example.dim()))  # the batch and the spatial axes, not the channels
    axes = {"input": {d: f"input_{d}" for d in dims}, "output": {d: f"output_{d}" for d in dims}}
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation note, the tracer's notes on shape checks
        torch.onnx.export(traceable(module, example), (example,), buffer, dynamo=False, opset_version=OPSET,
                          input_names=["input"], output_names=["output"], dynamic_axes=axes)
    return buffer.getvalue()


def _session(model: bytes):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, torch.get_num_threads())
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only: its notes on shapes it infers are not the user's
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _cache_path(key: dict, in_channels: int) -> Path:
    import onnx
    import onnxruntime as ort

    full = {"version": CACHE_VERSION, "network": key, "in_channels": int(in_channels), "opset": OPSET,
            "torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": ort.__version__}
    return default_cache_dir() / "onnxruntime" / f"{digest(full)}.onnx"
