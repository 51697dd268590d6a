"""A run's memory format and CPU backend: what ``--memory-format auto`` and ``--backend auto`` measure, and the
key a network is cached under (:func:`model_key_of`)."""

from __future__ import annotations

import logging
import os

from ..config import MEMORY_FORMATS, RunConfig
from ..models.bioimageio import STATISTICS_KEY
from ..pipeline import Predictor, resolve_device
from ..pipeline.backends import openvino_available
from ..pipeline.job import ModelSpec
from ..tuning.autosize import model_key
from ..tuning.memformat import REPEATS as FORMAT_REPEATS
from ..tuning.memformat import FormatChoice, choose_memory_format

logger = logging.getLogger(__name__)

#: Seconds foreseen for OpenVINO's conversion (or its read from the cache) beyond its passes: ``tiny`` and a
#: 12-feature U-Net converted and compiled in 0.2-0.3 s on 2 cores (without OpenVINO's telemetry), and read from
#: the cache in 0.03-0.06 s.
OPENVINO_TRIAL_S = 0.3
#: Passes of the start block foreseen in OpenVINO's trial: the trace at a smaller example, torch's pass of the
#: check (none where the known pass's output is given), and OpenVINO's two (the check's, then the timed one, warm
#: after it), each shorter than torch's contiguous one.
OPENVINO_TRIAL_PASSES = 2
#: Share of the run's estimate (at torch's contiguous start block) that OpenVINO's trial may cost.  Where it wins
#: (its conversion and check are then the price of running it at all) by 2x or more, as it did for ``tiny``
#: (2.2-4.7x) and a 12-feature U-Net (2.3x) at their start blocks here (bench/RESULTS.md), a first run that gave
#: it three quarters of the estimate ends at most a quarter later than unmeasured, and every later run is faster.
BACKEND_BUDGET_FRACTION = 0.75
def model_key_of(cfg: RunConfig, model) -> dict:
    kwargs = {k: v for k, v in cfg.model_kwargs.items() if k != STATISTICS_KEY}  # speed does not depend on them
    name = model.name if isinstance(cfg.model, (str, os.PathLike)) else model.kind
    if cfg.tta != "off":  # a pass per flip: timed and cached apart
        name = f"{name} (tta {cfg.tta})"
    if model.plane not in (None, "yx"):
        name = f"{name} ({model.plane} planes)"
    return model_key(name, model.weights_sha256, kwargs)


def wants_backend(cfg: RunConfig, model, predictor: Predictor) -> bool:
    """Whether ``--backend auto`` measures OpenVINO against torch: with the memory format (left to blockpred:
    a named layout is a torch layout), on this process's CPU (where the run's blocks run), uncompiled, where
    OpenVINO is installed, the network takes one input (a package's per-plane statistics are a second) and does
    not say ``torch_only`` (a module whose forward has side effects, or ops a tracer cannot see)."""
    return (cfg.backend == "auto" and cfg.memory_format in (None, "auto") and cfg.compile == "off"
            and cfg.scheduler is None and cfg.cluster is None and predictor.device.type == "cpu"
            and openvino_available() and getattr(model.module, "planes_along", None) is None
            and not getattr(model.module, "torch_only", False))


def choose_format(cfg: RunConfig, model, predictor: Predictor, batch_shape: tuple[int, ...],
                   repeats: int = FORMAT_REPEATS, cached_only: bool = False,
                   known: dict | None = None, quick: bool = False, layouts: tuple[str, ...] = MEMORY_FORMATS,
                   backends: tuple[str, ...] = ("torch",), skip: tuple[str, ...] = (),
                   reference=None) -> FormatChoice | None:
    """The faster memory format (and, with ``openvino`` among ``backends``, backend), measured on this process's
    device, or with ``--scheduler`` on a worker's (torch's layouts only).

    None when ``cached_only`` finds nothing cached.  ``quick``, ``skip``, ``reference``: see
    :func:`choose_memory_format`.
    """
    key = model_key_of(cfg, model)
    if cfg.scheduler is None:
        choice = choose_memory_format(predictor, batch_shape, key, repeats=repeats, cached_only=cached_only,
                                      known=known, quick=quick, layouts=layouts, backends=backends, skip=skip,
                                      reference=reference)
    else:
        from ..cluster.scheduler import run_on_a_worker

        spec = ModelSpec(cfg.model, cfg.weights, cfg.model_kwargs, cfg.trust_pickle, cfg.plane)
        choice = run_on_a_worker(cfg.scheduler, _choose_format_on_worker, spec, cfg.device, predictor.precision,
                                 batch_shape, key, repeats, cached_only, quick, cfg.tta)
        if choice is not None:
            predictor.use_memory_format(choice.memory_format)
    logger.info("memory format: %s", choice)
    return choice


def _choose_format_on_worker(spec: ModelSpec, device: str, precision: str, batch_shape: tuple[int, ...],
                             key: dict, repeats: int, cached_only: bool, quick: bool = False,
                             tta: str = "off") -> FormatChoice | None:
    """:func:`choose_memory_format` on a dask worker's device (its cache, too, is the worker's)."""
    predictor = worker_predictor(spec, device, precision, tta)
    return choose_memory_format(predictor, batch_shape, key, repeats=repeats, cached_only=cached_only, quick=quick)


def worker_predictor(spec: ModelSpec, device: str, precision: str, tta: str = "off", **settings) -> Predictor:
    """The run's network on a dask worker, for trials there: on the device as the worker sees it, with the run's
    test-time augmentation (a pass per flip, as its blocks run), and ``settings`` (layout, backend ...)."""
    from ..cluster.tasks import worker_device
    from ..models.tta import with_tta

    return Predictor(with_tta(spec.load().module, tta), resolve_device(worker_device(device)), precision, **settings)
