"""Where a network runs: the device (:func:`resolve_device`) and, on the CPU, torch itself or OpenVINO's CPU
plugin (:class:`OpenVINONetwork`).

On this project's 2-core machine (AVX-512) OpenVINO ran ``tiny``'s 84x276x276
block in 0.62 s where torch took 2.27 s contiguous and 1.07 s channels_last,
equal to 1.2e-7 (``bench/RESULTS.md``).  A network is converted once:

* **Converted** from the very module the predictor would run (its TTA
  wrapper, a 2D network's planes, a package's processing included) by
  ``openvino.convert_model``, traced at the first batch it is given, with the
  batch and every spatial axis dynamic (a TorchScript network is traced
  through and frozen first, so that OpenVINO takes F.interpolate's branches
  on the input's rank in a 3D network; a 2D TorchScript network that calls it
  does not convert and runs with torch); compiled for the CPU at fp32
  (``INFERENCE_PRECISION_HINT``: ``bf16`` only for ``--precision bf16``), on
  as many threads as torch has (a worker's share of the machine).
* **Checked** at conversion: OpenVINO's output on a seeded random batch of
  the first batch's shape must equal torch's within :data:`TOLERANCE` of
  torch's output range at fp32; else the network runs with torch and one
  line says why.  A network that does not convert (control flow the tracer
  cannot follow, a second input such as a package's per-plane statistics, a
  module that says ``torch_only = True`` because its forward does what a trace
  cannot see) runs with torch, and one line says why too.
* **Cached on disk**: the converted model is saved in the cache directory
  (``openvino/<key>.xml``, keyed by the network's name, weights and options,
  its wrapper and channels, and the versions of torch and OpenVINO), and
  OpenVINO keeps its compiled blobs beside it (``CACHE_DIR``): a second run
  reads and compiles it in a fraction of a second and converts nothing.

The predictor asks :func:`make_backend` for the callable its network thread
runs; what the callable gets and gives is what the torch module gets and
gives (a float32 ``(B, C, Z, Y, X)`` tensor on the CPU).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np
import torch

from ..cache import default_cache_dir, digest
from ..errors import InvalidOptionError

logger = logging.getLogger(__name__)

__all__ = ["TOLERANCE", "BackendUnavailable", "OpenVINONetwork", "make_backend", "openvino_available",
           "resolve_device"]

#: OpenVINO's fp32 output may differ from torch's by this share of torch's output range at any voxel.
TOLERANCE = 1e-5
#: Bumped when the cached conversions change meaning.
CACHE_VERSION = 1


def resolve_device(name: str) -> torch.device:
    """``auto`` -> the first CUDA device if there is one, else the CPU; checks the rest."""
    name = str(name).strip().lower()
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InvalidOptionError(f"device must be cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidOptionError(f"device {name!r} asked for, but no CUDA device is available; use --device cpu")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise InvalidOptionError(
                f"device {name!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise InvalidOptionError(f"device must be cpu, cuda or cuda:N, got {name!r}")
    return device


class BackendUnavailable(RuntimeError):
    """The backend cannot run this network here (not installed, does not convert, does not match torch)."""


def openvino_available() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def make_backend(name: str, module: torch.nn.Module, *, precision: str, key: dict | None):
    """The callable that runs ``module`` on backend ``name`` (``torch``: the module itself).

    ``key``: what tells this network apart in the conversion cache (None: converted, never cached).  Raises
    :class:`InvalidOptionError` for a backend this process cannot run.
    """
    if name == "torch":
        return module
    if name != "openvino":
        raise InvalidOptionError(f"backend must be torch or openvino, got {name!r}")
    if not openvino_available():
        raise InvalidOptionError("--backend openvino needs OpenVINO: pip install openvino (or --backend torch)")
    return OpenVINONetwork(module, precision=precision, key=key)


class OpenVINONetwork:
    """``module`` through OpenVINO, converted (or read from the cache) at its first batch (see the module docstring).

    Until then, and for good where the conversion fails or does not match, calls go to ``module``: a
    failure is one warning line, never the run's end.  ``converted`` says which runs.
    """

    def __init__(self, module: torch.nn.Module, *, precision: str, key: dict | None):
        self._module = module
        self._precision = precision
        self._key = key
        self._request = None
        self._lock = threading.Lock()
        #: None until the first batch; then True (OpenVINO runs) or False (torch runs, :attr:`reason` says why).
        self.converted: bool | None = None
        self.reason = ""
        #: Seconds the conversion (or the cache's read) and its check took, and whether the cache served it.
        self.seconds = 0.0
        self.cached = False

    def __call__(self, x: torch.Tensor, *extra) -> torch.Tensor:
        if extra:  # a second input (a package's per-plane statistics): not converted
            if self.converted is None:
                self._fall_back("it takes a second input (per-plane statistics)")
            return self._module(x, *extra)
        if self.converted is None and _torch_only(self._module):
            self._fall_back("it says torch_only (its forward does what a trace cannot see)")
        if self.converted is None:
            with self._lock:
                if self.converted is None:
                    self._convert(x)
        if not self.converted:
            return self._module(x)
        result = self._request.infer({0: x.detach().cpu().numpy()}, share_inputs=True)
        return torch.from_numpy(next(iter(result.values())))

    def _fall_back(self, reason: str) -> None:
        self.converted, self.reason = False, reason
        logger.warning("--backend openvino: %s; running it with torch", reason)

    def _convert(self, x: torch.Tensor) -> None:
        import time

        started = time.perf_counter()
        try:
            model, self.cached = self._model(x)
            compiled = _compile(model, self._precision)
            request = compiled.create_infer_request()
            if not self.cached:  # a cached conversion was checked when it was made
                self._check(request, x.shape)
        except BackendUnavailable as err:
            self._fall_back(str(err))
            return
        except Exception as err:  # noqa: BLE001 - a network OpenVINO cannot take runs with torch
            text = str(err).strip().splitlines()
            self._fall_back(f"the network does not convert ({type(err).__name__}: {text[0][:200] if text else ''})")
            return
        self._request, self.converted = request, True
        self.seconds = time.perf_counter() - started
        logger.info("--backend openvino: %s in %.2f s",
                    "read from the cache" if self.cached else "converted and checked", self.seconds)

    def _model(self, x: torch.Tensor):
        """The converted model and whether the cache served it (saved there when the key allows)."""
        import openvino as ov

        path = _cache_path(self._key, x.shape[1]) if self._key is not None else None
        if path is not None and path.is_file():
            try:
                return ov.Core().read_model(str(path)), True
            except Exception as err:  # noqa: BLE001 - a broken cache entry is converted again
                logger.info("the cached OpenVINO model %s does not read (%s); converting again", path, err)
        import warnings

        example = torch.zeros(x.shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's notes on shape checks it records as constants
            module = self._module
            if any(isinstance(m, torch.jit.ScriptModule) for m in module.modules()):
                # TorchScript keeps its branches on the input's rank (F.interpolate's): traced through a plain
                # call and frozen, they become constants OpenVINO converts.
                module = torch.jit.freeze(torch.jit.trace(_Call(module).eval(), example, check_trace=False).eval())
            model = ov.convert_model(module, example_input=example,
                                     input=[ov.PartialShape([-1, int(x.shape[1])] + [-1] * (x.dim() - 2))])
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                # Dask workers may convert at once: each writes its own files and renames them into place.
                tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.xml")
                ov.save_model(model, str(tmp), compress_to_fp16=False)
                tmp.with_suffix(".bin").replace(path.with_suffix(".bin"))
                tmp.replace(path)
            except OSError as err:  # a read-only home must not stop a run
                logger.warning("could not cache the OpenVINO model in %s: %s", path.parent, err)
        return model, False

    def _check(self, request, shape) -> None:
        """OpenVINO's output against torch's on a seeded random batch of ``shape`` (see :data:`TOLERANCE`)."""
        sample = torch.rand(tuple(shape), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            expected = self._module(sample)
        expected = expected[0] if isinstance(expected, (tuple, list)) else expected
        got = next(iter(request.infer({0: sample.numpy()}).values()))
        expected = expected.float().numpy()
        if got.shape != expected.shape:
            raise BackendUnavailable(f"its OpenVINO output has shape {got.shape}, torch's {expected.shape}")
        scale = float(np.ptp(expected)) or 1.0
        diff = float(np.abs(got - expected).max()) / scale
        if self._precision in ("fp32", "tf32") and not diff <= TOLERANCE:
            raise BackendUnavailable(f"its OpenVINO output differs from torch's by {diff:.2g} of the output range "
                                     f"(at most {TOLERANCE:g} is exact)")
        logger.info("--backend openvino: the converted network differs from torch by %.2g of its output range", diff)


class _Call(torch.nn.Module):
    """``module(x)`` as a plain module, so that a trace goes through a TorchScript module's code."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def _torch_only(module: torch.nn.Module) -> bool:
    """A module (or one it wraps) that says it must run in torch: ``torch_only = True``."""
    return any(getattr(sub, "torch_only", False) for sub in module.modules())


def _compile(model, precision: str):
    import openvino as ov

    threads = max(1, torch.get_num_threads())
    config = {"INFERENCE_PRECISION_HINT": "bf16" if precision == "bf16" else "f32",
              "INFERENCE_NUM_THREADS": threads, "CACHE_DIR": str(default_cache_dir() / "openvino" / "compiled")}
    return ov.Core().compile_model(model, "CPU", config)


def _cache_path(key: dict, in_channels: int) -> Path:
    import openvino as ov

    full = {"version": CACHE_VERSION, "network": key, "in_channels": int(in_channels), "torch": torch.__version__,
            "openvino": ov.__version__}
    return default_cache_dir() / "openvino" / f"{digest(full)}.xml"
