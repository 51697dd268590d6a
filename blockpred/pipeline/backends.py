"""Where a network runs: the device (:func:`resolve_device`) and, on the CPU, torch itself or OpenVINO's CPU
plugin (:class:`OpenVINONetwork`).

On this project's 2-core machine (AVX-512) OpenVINO ran ``tiny``'s 84x276x276
block in 0.62 s where torch took 2.27 s contiguous and 1.07 s channels_last,
equal to 1.2e-7 (``bench/RESULTS.md``).  A network is converted once:

* **Converted** from the very module the predictor would run (its TTA
  wrapper, a 2D network's planes, a package's processing included) by
  ``openvino.convert_model`` at the first batch it is given, traced (without
  torch's trace check: the conversion's own check follows) at a small example
  of it (:meth:`~.converted.ConvertedNetwork.example`; at the batch's own
  shape where that does not match), with the batch and every spatial axis
  dynamic (a TorchScript network is traced
  through and frozen first, so that OpenVINO takes F.interpolate's branches
  on the input's rank in a 3D network; a 2D TorchScript network that calls it
  does not convert and runs with torch); compiled for the CPU for each input
  shape it runs at (:mod:`.ovshapes`: 1.1-1.6x faster a pass than the dynamic
  model on the norm networks of ``tests/scripted.py``), at fp32
  (``INFERENCE_PRECISION_HINT``: ``bf16`` only for ``--precision bf16``, which
  OpenVINO computes where the CPU has AMX or AVX512-BF16: :func:`cpu_bf16`), on
  as many threads as torch has (a worker's share of the machine).  Conversion
  and check run in fp32, outside the predictor's autocast.
* **Checked** at conversion: OpenVINO's output on a seeded random batch of
  the first batch's shape must equal torch's within :data:`TOLERANCE` of
  torch's output range at fp32 (compiled at f32 for the check under bf16
  too).  Where it does not convert or match, the next routes follow (:meth:`OpenVINONetwork.routes`): a
  TorchScript network's traced copy (:mod:`.unrolled`: its lists and loops run in Python), the ONNX route
  and TorchScript's passes, each checked the same way, the one that worked cached per network
  (``routes.json``).  A network no route converts (an operation neither OpenVINO nor ONNX has, a second input
  such as a package's per-plane statistics, a module that says ``torch_only = True``) runs with torch, and one
  line names each route and why it failed.
* **Cached on disk**, once it passed its check: the converted model is saved in the cache directory
  (``openvino/<key>.xml``, keyed by the network's name, weights and options,
  its wrapper and channels, and the versions of torch and OpenVINO): a second
  run reads it and compiles it for its shapes in a fraction of a second, and
  converts nothing.
* **Without OpenVINO's telemetry**: its converter otherwise sends usage events to Google Analytics and writes a
  client id and usage counts into ``~/intel``, unless the user opted out (:func:`_no_telemetry`).

The predictor asks :func:`make_backend` for the callable its network thread
runs; what the callable gets and gives is what the torch module gets and
gives (a float32 ``(B, C, Z, Y, X)`` tensor on the CPU).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..cache import JsonFile, default_cache_dir, digest
from ..errors import InvalidOptionError
from ..models.receptive import block_normalisations
from ..models.scriptgraph import scripted, traceable
from .converted import TOLERANCE, BackendUnavailable, ConvertedNetwork, why
from .ovshapes import StaticShapes
from .sizebound import SizeBound, branches_key, shape_key
from .unrolled import UnrolledCopy, lowered_graph, unrolled_copy

logger = logging.getLogger(__name__)

__all__ = ["TOLERANCE", "BackendUnavailable", "OpenVINONetwork", "make_backend", "openvino_available",
           "resolve_device"]

#: Bumped when the cached conversions change meaning.
CACHE_VERSION = 1
#: Bumped when the traced copy records a network another way (its cached files are made again; each version
#: computes the network: 2 sums a norm by adaptive pooling, 1 did by products with a column of ones).
COPY_VERSION = 2


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


def openvino_available() -> bool:
    """Whether OpenVINO imports.  Imported here first, it is imported without ``openvino_telemetry``, as where
    that is not installed: its import and converter otherwise send usage events to Google Analytics and write a
    client id and usage counts into ``~/intel`` unless the user opted out (see also :func:`_no_telemetry`)."""
    blocked = "openvino" not in sys.modules and "openvino_telemetry" not in sys.modules
    if blocked:
        sys.modules["openvino_telemetry"] = None  # type: ignore[assignment]  # its import raises ImportError
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    finally:
        if blocked:
            del sys.modules["openvino_telemetry"]
    return True


@functools.cache
def cpu_bf16() -> str:
    """What OpenVINO computes bf16 with on this CPU: ``AMX`` or ``AVX512-BF16`` (``BF16`` where ``/proc/cpuinfo``
    cannot tell which); "" where the CPU has neither or OpenVINO is not installed."""
    if not openvino_available():
        return ""
    import openvino as ov

    try:
        if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
            return ""
    except RuntimeError:  # no CPU plugin
        return ""
    try:
        flags = set(" ".join(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                             if line.startswith("flags")).split())
    except OSError:
        return "BF16"
    return "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "" if flags else "BF16"


def make_backend(name: str, module: torch.nn.Module, *, precision: str, key: dict | None):
    """The callable that runs ``module`` on backend ``name`` (``torch``: the module itself).

    ``key``: what tells this network apart in the conversion cache (None: converted, never cached).  Raises
    :class:`InvalidOptionError` for a backend this process cannot run.
    """
    if name == "torch":
        return module
    if name == "onnxruntime":  # an optional extra, in a module of its own (see .onnx_backend)
        from .onnx_backend import make_onnxruntime

        return make_onnxruntime(module, precision=precision, key=key)
    if name != "openvino":
        raise InvalidOptionError(f"backend must be torch, openvino or onnxruntime, got {name!r}")
    if not openvino_available():
        raise InvalidOptionError("--backend openvino needs OpenVINO: pip install openvino (or --backend torch)")
    return OpenVINONetwork(module, precision=precision, key=key)


class OpenVINONetwork(ConvertedNetwork):
    """``module`` through OpenVINO, converted (or read from the cache) at its first batch (see the module docstring
    and :class:`~.converted.ConvertedNetwork`)."""

    runtime, backend = "OpenVINO", "openvino"
    ROUTE_NAMES = {"direct": "direct", "unrolled": "traced copy", "onnx": "ONNX", "passes": "TorchScript passes"}

    def __init__(self, module: torch.nn.Module, *, precision: str, key: dict | None):
        super().__init__(module, key=key)
        self._precision = precision
        self._runner: StaticShapes | None = None
        #: Where the traced copy took branches on the input's sizes: its copies per branches (:mod:`.sizebound`).
        self.size_bound: SizeBound | None = None
        self._made: UnrolledCopy | None = None  # the traced copy _make made last
        # The routes file's record of a size-bound copy read from the cache, and its input channels.
        self._bound_record: tuple[dict, int] | None = None
        self._variants: list[StaticShapes] = []  # a size-bound network's other copies

    def routes(self) -> tuple[str, ...]:
        """Direct conversion; for a TorchScript network then its traced copy, the ONNX route and TorchScript's
        passes (:mod:`.unrolled`), the traced copy first where it holds an instance or group norm (its copy sums
        their statistics as precisely as torch); for another, the ONNX route."""
        if not scripted(self._module):
            return ("direct", "onnx")
        if block_normalisations(self._module):  # OpenVINO's fused norm: 7.5e-5 (MONAI UNet) to 0.0091 (torch-em) off
            return ("unrolled", "direct", "onnx", "passes")
        return ("direct", "unrolled", "onnx", "passes")

    @property
    def inference_precision(self) -> str:
        """What OpenVINO computes in once converted (the compiled model's own inference precision): ``bf16`` for
        --precision bf16 on a CPU that has it (:func:`cpu_bf16`), else ``f32``."""
        return self._runner.inference_precision if self._runner is not None else ""

    def _infer(self, x: np.ndarray) -> np.ndarray:
        return self.size_bound(x) if self.size_bound is not None else self._runner(x)

    def release_memory(self) -> None:
        """Hand back the buffers OpenVINO keeps for the input it ran last (after a 276^3 trial, 2.04 GiB
        resident; 0.76 GiB once released and trimmed)."""
        for runner in (self._runner, *self._variants):
            if runner is not None:
                runner.release_memory()

    def _cached(self, x: torch.Tensor, route: str):
        import openvino as ov

        path = _cache_path(self._key, x.shape[1], route)
        if not path.is_file():
            return None
        try:
            model = ov.Core().read_model(str(path))
        except Exception as err:  # noqa: BLE001 - a broken cache entry is converted again
            logger.info("the cached OpenVINO model %s does not read (%s); converting again", path, err)
            return None
        record = self._records().read().get(self._record_key(x.shape[1])) if route == "unrolled" else None
        self._bound_record = (record, int(x.shape[1])) if isinstance(record, dict) and "branches" in record else None
        return model

    def _make(self, route: str, example: torch.Tensor):
        import warnings

        import openvino as ov

        dynamic = [ov.PartialShape([-1, int(example.shape[1])] + [-1] * (example.dim() - 2))]
        with warnings.catch_warnings(), _no_telemetry(), _logging_kept():
            warnings.simplefilter("ignore")  # the tracer's notes on shape checks it records as constants
            if route == "direct":
                return ov.convert_model(_unchecked_trace(traceable(self._module, example), example),
                                        example_input=example, input=dynamic)
            if route == "onnx":
                from .onnx_backend import _export

                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    exported = _export(self._module, example)  # a failed export prints the graph
                return ov.Core().read_model(exported)
            if route == "passes":
                return ov.convert_model(lowered_graph(self._module, example), example_input=example, input=dynamic)
            self._made = unrolled_copy(self._module, example)
            return ov.convert_model(self._made.module, example_input=example, input=dynamic)

    def _ready(self, model, check_shape: tuple | None) -> None:
        runner = self._checked(model, check_shape)
        self._runner = runner
        made, self._made = self._made, None
        first = None
        if made is not None and made.size_bound and check_shape is not None:  # made now, checked at check_shape
            first, in_channels = branches_key(made.taken), int(check_shape[1])
            shapes = {shape_key(check_shape): first}
        elif check_shape is None and self._bound_record is not None:  # read from the cache
            record, in_channels = self._bound_record
            first, shapes = record["branches"], dict(record.get("shapes", {}))
        self.size_bound = None if first is None else SizeBound(
            module=self._module,
            frozen=made.frozen if made is not None else lambda x: traceable(self._module, self.example(
                torch.from_numpy(x))),
            first=(first, runner), shapes=shapes, make=self._variant,
            remember=functools.partial(self._remember, in_channels))

    def _checked(self, model, check_shape: tuple | None) -> StaticShapes:
        """``model`` compiled per input shape (:class:`~.ovshapes.StaticShapes`), checked against torch at
        ``check_shape`` first (None: it was)."""
        runner = StaticShapes(model, functools.partial(_compile, precision=self._precision))
        if check_shape is not None:  # at f32 whatever it runs (the run compares bf16 with fp32 on its first block)
            # fp32: as the run computes, which the check leaves compiled and warm at the block's shape
            checked = runner if self._precision != "bf16" else StaticShapes(
                model, functools.partial(_compile, precision="fp32"))
            self.check(checked, check_shape)
        return runner

    def _variant(self, x: np.ndarray, branches: str):
        """The traced copy for the branches the network takes at ``x``'s shape: read from the cache, else made at
        that shape, checked against torch there and cached; None where it does not check."""
        import openvino as ov

        route = f"unrolled-{branches}"
        path = _cache_path(self._key, x.shape[1], route) if self._key is not None else None
        cached = path is not None and path.is_file()
        try:
            model = ov.Core().read_model(str(path)) if cached else self._make("unrolled", torch.zeros(x.shape))
            self._made = None
            runner = self._checked(model, None if cached else tuple(x.shape))
        except Exception as err:  # noqa: BLE001 - that shape runs with torch, SizeBound says so
            logger.info("--backend openvino: the traced copy for the branches at %s failed (%s)", tuple(x.shape),
                        why(err))
            return None
        finally:
            self.reference = None
        if self._key is not None and not cached:
            self._save(model, int(x.shape[1]), route)
        self._variants.append(runner)
        return runner

    def _route_record(self, route: str) -> dict:
        if route != "unrolled" or self.size_bound is None:
            return {"route": route}
        return {"route": route, "branches": self.size_bound.first, "shapes": self.size_bound.shapes}

    def _remember(self, in_channels: int, shapes: dict[str, str]) -> None:
        if self._key is None or self.size_bound is None:
            return
        record = {"route": "unrolled", "branches": self.size_bound.first, "shapes": shapes}
        self._records().merge({self._record_key(in_channels): record}, "the OpenVINO conversion route")

    def _save(self, model, in_channels: int, route: str) -> None:
        import openvino as ov

        path = _cache_path(self._key, in_channels, route)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Dask workers may convert at once: each writes its own files and renames them into place.
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.xml")
            ov.save_model(model, str(tmp), compress_to_fp16=False)
            tmp.with_suffix(".bin").replace(path.with_suffix(".bin"))
            tmp.replace(path)
        except OSError as err:  # a read-only home must not stop a run
            logger.warning("could not cache the OpenVINO model in %s: %s", path.parent, err)

    def _records(self) -> JsonFile:
        return JsonFile(default_cache_dir() / "openvino" / "routes.json")

    def _record_key(self, in_channels: int) -> str:
        return _cache_path(self._key, in_channels, "").stem


_TELEMETRY_LOCK = threading.Lock()


@contextlib.contextmanager
def _no_telemetry() -> Iterator[None]:
    """OpenVINO's converter with its telemetry stub (the one it runs where ``openvino_telemetry`` is not
    installed): no events sent, nothing written under ``~/intel``, where the caller's process imported OpenVINO
    before blockpred did (:func:`openvino_available`).  Conversions take turns while it is swapped in; an OpenVINO
    without these modules converts as it is."""
    try:
        from openvino.tools.ovc import convert_impl, telemetry_stub, telemetry_utils
    except ImportError:  # pragma: no cover - another layout of OpenVINO's converter
        yield
        return
    owners = [module for module in (convert_impl, telemetry_utils) if hasattr(module, "tm")]
    with _TELEMETRY_LOCK:
        saved = [module.tm for module in owners]
        for module in owners:
            module.tm = telemetry_stub
        try:
            yield
        finally:
            for module, tm in zip(owners, saved, strict=True):
                module.tm = tm


@contextlib.contextmanager
def _logging_kept() -> Iterator[None]:
    """The root logger's level as it was: OpenVINO's converter sets it to ERROR, which silenced every later
    warning of the run (the line that says the network runs with torch among them)."""
    root = logging.getLogger()
    level = root.level
    try:
        yield
    finally:
        root.setLevel(level)


def _unchecked_trace(module: torch.nn.Module, example: torch.Tensor):
    """``module`` as OpenVINO's own decoder traces it, without torch's trace check: the check runs the network
    three more times (0.93 s of ``tiny``'s 1.6 s conversion at 84^3), and :meth:`~.converted.ConvertedNetwork.check`
    compares the converted network with torch's at the block's shape anyway.  The module itself where this
    OpenVINO has no such decoder."""
    try:
        from openvino.frontend.pytorch.ts_decoder import TorchScriptPythonDecoder
    except ImportError:  # pragma: no cover - every OpenVINO since 2023.1 has it
        return module
    return TorchScriptPythonDecoder(module, example_input=example, trace_kwargs={"check_trace": False})


def _compile(model, precision: str):
    """``model`` compiled for the CPU.  A model whose input shape is dynamic keeps its compiled blob in the cache;
    one compiled for a static shape (:mod:`.ovshapes`: 0.1-0.3 s) does not, since a blob per shape would hold the
    weights once per shape a run met, with nothing to bound them."""
    import openvino as ov

    threads = max(1, torch.get_num_threads())
    config = {"INFERENCE_PRECISION_HINT": "bf16" if precision == "bf16" else "f32", "INFERENCE_NUM_THREADS": threads}
    if not all(axis.is_static for axis in model.inputs[0].get_partial_shape()):
        config["CACHE_DIR"] = str(default_cache_dir() / "openvino" / "compiled")
    return ov.Core().compile_model(model, "CPU", config)


def _cache_path(key: dict, in_channels: int, route: str) -> Path:
    """Where the model ``route`` made is cached; route "" names the network's entry in ``routes.json``."""
    import openvino as ov

    full = {"version": CACHE_VERSION, "network": key, "in_channels": int(in_channels), "torch": torch.__version__,
            "openvino": ov.__version__}
    if route not in ("", "direct"):  # the direct route's files keep the names they had
        full["route"] = route
    if route.startswith("unrolled"):  # a size-bound network's copies too ("unrolled-<branches>")
        full["copy"] = COPY_VERSION
    return default_cache_dir() / "openvino" / f"{digest(full)}.xml"
