"""What the CPU backends share: a network converted from torch at its first batch, checked against torch, and
torch where it cannot be (:class:`ConvertedNetwork`; OpenVINO's in :mod:`.backends`, ONNX Runtime's in
:mod:`.onnx_backend`).

* **Until the first batch**, and for good where the conversion fails or does not match, calls go to the
  torch module: a failure is one warning line, never the run's end (``converted`` says which runs).
* **Not converted** at all: a module that takes a second input (a package's per-plane statistics), or says
  ``torch_only = True`` (its forward does what a trace cannot see).
* **Converted** with torch's autocast off (a trace under autocast records its casts, and the check's
  reference is torch at fp32), a TorchScript module traced through a plain call and frozen first
  (:func:`~blockpred.models.scriptgraph.traceable`: its branches on the input's rank become constants).
* **Checked** on a seeded random batch of the first batch's shape (or on one torch already ran at that shape,
  with its output: :attr:`ConvertedNetwork.reference`, the measured defaults' timed pass): at most
  :data:`TOLERANCE` of torch's output range at any voxel (:meth:`ConvertedNetwork.check`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["TOLERANCE", "BackendUnavailable", "ConvertedNetwork", "why"]

#: A converted network's fp32 output may differ from torch's by this share of torch's output range at any voxel.
TOLERANCE = 1e-5
#: A spatial axis of the conversion's example is shorter than the block's by a multiple of one of these, the
#: first the network takes (:meth:`ConvertedNetwork.example`).
STRIDES = (32, 64)


class BackendUnavailable(RuntimeError):
    """The backend cannot run this network here (not installed, does not convert, does not match torch).
    ``diff``: where it converted and ran, how far its output was from torch's (a share of the output range)."""

    def __init__(self, message: str, diff: float | None = None):
        super().__init__(message)
        self.diff = diff


#: A conversion at a small example that differs from torch at the block by more than this share of the output
#: range is made again at the block's own shape (a trace bound to the size it saw crops or pads wrongly
#: elsewhere: 1 of the range in the tests); one that differs by less computes the same operations in another
#: order (torch-em's UNet3d, 0.0091) and would differ as much at any shape.
SIZE_BOUND = 0.05
#: Routes that compute what direct conversion computes (the same operations through another frontend): not
#: tried where a route converted and differed from torch, for they differ as it did.
SAME_OPERATIONS = frozenset({"onnx", "passes"})


class ConvertedNetwork:
    """``module`` through another runtime, converted (or read from its cache) at the first batch.

    A subclass names the runtime (:attr:`runtime`, its option's word :attr:`backend`), makes it ready in
    :meth:`_prepare` (returning whether the cache served it) and runs a batch in :meth:`_infer`.
    """

    #: The runtime in messages, and the word of its ``--backend``.
    runtime = ""
    backend = ""
    #: What making it is called: "converted" (OpenVINO), "exported" (ONNX).
    made = "converted"

    #: The routes tried in order, by name (:meth:`routes`), and how the messages name them.
    ROUTE_NAMES = {"direct": "direct"}

    def __init__(self, module: torch.nn.Module, *, key: dict | None):
        self._module = module
        self._key = key
        self._lock = threading.Lock()
        #: None until the first batch; then True (the runtime runs) or False (torch runs, :attr:`reason` says why).
        self.converted: bool | None = None
        self.reason = ""
        #: The route that made it (:attr:`ROUTE_NAMES`), once converted.
        self.route = ""
        #: Seconds the conversion (or the cache's read) and its check took, and whether the cache served it.
        self.seconds = 0.0
        self.cached = False
        #: A batch and torch's fp32 output for it, which :meth:`check` takes at that shape instead of running
        #: torch again (given by whoever timed torch on it); dropped once converted.
        self.reference: tuple[np.ndarray, np.ndarray] | None = None

    def __call__(self, x: torch.Tensor, *extra) -> torch.Tensor:
        if extra:  # a second input (a package's per-plane statistics): not converted
            if self.converted is None:
                self._fall_back("it takes a second input (per-plane statistics)")
            return self._module(x, *extra)
        if self.converted is None and any(getattr(sub, "torch_only", False) for sub in self._module.modules()):
            self._fall_back("it says torch_only (its forward does what a trace cannot see)")
        if self.converted is None:
            with self._lock:
                if self.converted is None:
                    self._convert(x)
        if not self.converted:
            return self._module(x)
        return torch.from_numpy(self._infer(x.detach().cpu().numpy()))

    def routes(self) -> tuple[str, ...]:
        """The routes to try for this network, in order (a subclass adds the ones its runtime has)."""
        return ("direct",)

    def _cached(self, x: torch.Tensor, route: str):
        """The model converted for ``x``'s network by ``route`` from the cache, or None."""
        raise NotImplementedError

    def _make(self, route: str, example: torch.Tensor):
        """The network converted by ``route`` at ``example``."""
        raise NotImplementedError

    def _ready(self, model, check_shape: tuple | None) -> None:
        """Ready :meth:`_infer` to run ``model``, checked first at ``check_shape`` (None: it was, when cached)."""
        raise NotImplementedError

    def _save(self, model, in_channels: int, route: str) -> None:
        """``model`` into the cache (only once it passed its check)."""
        raise NotImplementedError

    def _records(self):
        """The routes file of this runtime's cache (:class:`~blockpred.cache.JsonFile`), or None."""
        return None

    def _record_key(self, in_channels: int) -> str:
        raise NotImplementedError

    def _route_record(self, route: str) -> dict:
        """What the routes file keeps of the route that worked."""
        return {"route": route}

    def _infer(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def release_memory(self) -> None:
        """Hand back what the runtime keeps for the largest input it ran (it allocates again at the next call)."""

    def _prepare(self, x: torch.Tensor) -> bool:
        """The first route that converts and passes its check at ``x``'s shape (the one the cache names first;
        none where the cache says none does), its model cached; or read from the cache.  Whether the cache
        served it.  :class:`BackendUnavailable` naming each route and why it failed, where none did."""
        records = self._records() if self._key is not None else None
        record_key = self._record_key(int(x.shape[1])) if records is not None else ""
        record = records.read().get(record_key) if records is not None else None
        if isinstance(record, dict) and isinstance(record.get("failed"), dict):
            raise BackendUnavailable(_no_route(record["failed"], self.ROUTE_NAMES) + " (remembered from an earlier "
                                     "run: clear the cache directory's routes file to try again)")
        routes = self.routes()
        if isinstance(record, dict) and record.get("route") in routes:  # the one that worked first, then the rest
            routes = (record["route"],) + tuple(route for route in routes if route != record["route"])
        failed: dict[str, str] = {}
        differed = False
        for route in routes:
            if differed and route in SAME_OPERATIONS:
                failed[route] = "not tried: it computes what the routes that differed computed"
                continue
            model = self._cached(x, route) if self._key is not None else None
            if model is not None:
                self._ready(model, None)
                self.route = route
                return True
            try:
                self._make_checked(route, x)
            except Exception as err:  # noqa: BLE001 - the next route; every failure is named in one line
                failed[route] = why(err)
                differed = differed or getattr(err, "diff", None) is not None
                logger.info("--backend %s: the %s route failed (%s)", self.backend, self.ROUTE_NAMES[route],
                            failed[route])
                continue
            self.route = route
            if records is not None and record != self._route_record(route):
                records.merge({record_key: self._route_record(route)}, f"the {self.runtime} conversion route")
            return False
        if records is not None:
            records.merge({record_key: {"failed": failed}}, f"the {self.runtime} conversion routes")
        raise BackendUnavailable(_no_route(failed, self.ROUTE_NAMES))

    def _make_checked(self, route: str, x: torch.Tensor) -> None:
        """``route``'s model made at a small example (:meth:`example`), else at ``x``'s shape, checked at ``x``'s
        shape and cached."""
        example = self.example(x)
        examples = [example] if example.shape == x.shape else [example, torch.zeros(x.shape)]
        for tried in examples:
            model = self._make(route, tried)
            try:
                self._ready(model, tuple(x.shape))
            except BackendUnavailable as err:
                if tried is examples[-1] or (err.diff is not None and err.diff <= SIZE_BOUND):
                    raise
                logger.info("--backend %s: %s at example %s (%s); at the block's own shape", self.backend,
                            self.made, tuple(tried.shape), err)
                continue
            if self._key is not None:
                self._save(model, int(x.shape[1]), route)
            return

    def _fall_back(self, reason: str) -> None:
        self.converted, self.reason, self.reference = False, reason, None
        logger.warning("--backend %s: %s; running it with torch", self.backend, reason)

    def _convert(self, x: torch.Tensor) -> None:
        started = time.perf_counter()
        try:
            with torch.autocast("cpu", enabled=False):
                self.cached = self._prepare(x)
        except BackendUnavailable as err:
            self._fall_back(str(err))
            return
        except Exception as err:  # noqa: BLE001 - a network the runtime cannot take runs with torch
            verb = "convert" if self.made == "converted" else "export"
            self._fall_back(f"the network does not {verb} ({why(err)})")
            return
        self.converted, self.reference = True, None
        self.seconds = time.perf_counter() - started
        route = "" if self.route == "direct" else f" (the {self.ROUTE_NAMES[self.route]} route)"
        logger.info("--backend %s: %s%s in %.2f s", self.backend,
                    "read from the cache" if self.cached else f"{self.made} and checked", route, self.seconds)

    def example(self, x: torch.Tensor) -> torch.Tensor:
        """Zeros to convert at: ``x``'s shape with each spatial axis shorter by a multiple of one of
        :data:`STRIDES` (on the grid of any network whose steps divide it: ``276`` -> ``52``, else ``84``), else
        halved, where torch takes it (tried on zeros); else ``x``'s own.

        The conversion traces the network once and keeps every spatial axis dynamic, so a small example gives
        the same network in a fraction of the time (OpenVINO took 41 s at ``tiny``'s 84x276x276 block, issue
        35).  The check still runs at ``x``'s shape, and a network whose trace depends on the size it saw
        (one that crops by its input's size off its grid) is converted again at ``x``'s shape
        (:meth:`_prepare`).
        """
        shape = tuple(int(n) for n in x.shape)
        shorter = [tuple(min(n, n % stride + stride) for n in shape[2:]) for stride in STRIDES]
        halved = tuple(n // 2 if n % 2 == 0 and n >= 16 else n for n in shape[2:])
        for spatial in dict.fromkeys((*shorter, halved)):
            if spatial == shape[2:]:
                continue
            try:
                with torch.inference_mode():
                    self._module(torch.zeros((1, shape[1]) + spatial))
            except Exception as err:  # noqa: BLE001 - a size the network refuses: the next, else x's own
                logger.debug("--backend %s: no example at %s (%s)", self.backend, spatial, err)
                continue
            return torch.zeros(shape[:2] + spatial)
        return torch.zeros(shape)

    def check(self, run: Callable[[np.ndarray], np.ndarray], shape) -> None:
        """``run``'s output against torch's on a seeded random batch of ``shape`` (or :attr:`reference`'s, of that
        shape): :class:`BackendUnavailable` beyond :data:`TOLERANCE` of torch's output range."""
        if self.reference is not None and tuple(self.reference[0].shape) == tuple(shape):
            sample, expected = self.reference
        else:
            batch = torch.rand(tuple(shape), generator=torch.Generator().manual_seed(0))
            with torch.inference_mode():
                expected = self._module(batch)
            sample = batch.numpy()
            expected = (expected[0] if isinstance(expected, (tuple, list)) else expected).float().numpy()
            self.reference = (sample, expected)  # the next route's check at this shape runs no torch pass again
        try:
            got = run(sample)
        except Exception as err:  # noqa: BLE001 - a copy made at another shape may fail at this one
            raise BackendUnavailable(f"its {self.runtime} network fails at {tuple(shape)} ({why(err)})") from err
        if got.shape != expected.shape:
            raise BackendUnavailable(f"its {self.runtime} output has shape {got.shape}, torch's {expected.shape}")
        diff = float(np.abs(got - expected).max()) / (float(np.ptp(expected)) or 1.0)
        if not diff <= TOLERANCE:
            raise BackendUnavailable(f"its {self.runtime} output differs from torch's by {diff:.2g} of the output "
                                     f"range (at most {TOLERANCE:g} is exact)", diff=diff)
        logger.info("--backend %s: the %s network differs from torch by %.2g of its output range", self.backend,
                    self.made, diff)


def why(err: BaseException) -> str:
    """An error in one line: its type, and its first line, or the lines of a converter's report that name the
    operations it could not convert."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if isinstance(err, BackendUnavailable):
        return lines[0] if lines else "it does not match torch"
    named = [line.lstrip("- ") for line in lines
             if line.lstrip("- ").startswith(("No conversion rule found", "Conversion is failed for"))]
    text = "; ".join(named) if named else (lines[0] if lines else "")
    return f"{type(err).__name__}: {text[:240]}" if text else type(err).__name__


def _no_route(failed: dict, names: dict) -> str:
    return "no route converts it (" + "; ".join(f"{names.get(route, route)}: {reason}"
                                                for route, reason in failed.items()) + ")"
