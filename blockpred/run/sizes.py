"""The size trials of ``--block auto`` / ``--batch-size auto`` and of the measured defaults, here or on a dask
worker (:func:`auto_size`), and what they need of the run: where its blocks run, the channels it keeps."""

from __future__ import annotations

import logging

from ..config import RunConfig
from ..errors import InvalidOptionError
from ..geometry import Coord
from ..pipeline import DeviceSteps, Predictor
from ..pipeline.job import ModelSpec
from ..tuning.autosize import SizeChoice, SizeProblem, choose_sizes
from ..tuning.hostbudget import HostBudget, keeping_outputs
from ..tuning.network import NetworkGeometry
from ..tuning.tensors import max_input_voxels
from .formats import model_key_of, worker_predictor
from .layout import block_step

logger = logging.getLogger(__name__)


def on_cuda(cfg: RunConfig, predictor: Predictor) -> bool:
    """Whether the blocks run on CUDA: this process's device, or the workers' (``--device cuda`` on a cluster)."""
    return predictor.device.type == "cuda" or str(cfg.device).startswith("cuda")


def index_limited(cfg: RunConfig, predictor: Predictor) -> bool:
    """Whether the size search keeps to CUDA's index limit: on CUDA, and wherever workers elsewhere choose
    (``--scheduler``, ``--cluster``: a GPU this process cannot see; on a CPU worker the limit is far above
    any block its memory holds)."""
    return on_cuda(cfg, predictor) or cfg.scheduler is not None or cfg.cluster is not None


def auto_size(cfg: RunConfig, source, roi, model, predictor: Predictor, block: Coord, base_block: Coord,
               halo: Coord, geometry: NetworkGeometry, downsampling: Coord, fixed_block: Coord | None,
               quick_s: float | None = None, cached_only: bool = False,
               known: tuple = (), host_budget: HostBudget | None = None, cold_s: float = 0.0) -> SizeChoice | None:
    """``--block auto`` / ``--batch-size auto``: trial passes on the device (cached).

    ``quick_s`` / ``cached_only``: the measured defaults' search (see
    :func:`blockpred.tuning.autosize.choose_sizes`); None when ``cached_only`` finds nothing.
    With ``--scheduler`` the trials run on one of the cluster's workers, whose device the blocks will run on;
    otherwise on this process's device.  ``host_budget``'s queue takes the outputs as the run keeps them.
    ``block`` is the one ``geometry`` was probed at; the search starts at ``base_block``.
    """
    check_channels(cfg.channels, geometry)  # before trials that would select them
    step = block_step(downsampling, cfg.output_chunks, cfg.shards)
    scale, offset = cfg.normalize.scale_offset(source.dtype)
    problem = SizeProblem(
        in_channels=source.num_channels or 1, raw_dtype=source.dtype, halo=halo, context=geometry.context,
        input_extra=geometry.input_shape - (block + (halo + geometry.context) * 2), step=step,
        base_block=base_block, roi=roi,
        steps=DeviceSteps(scale=scale, offset=offset, channels=cfg.channels, output_dtype=cfg.output_dtype),
        fixed_block=fixed_block, fixed_batch=None if cfg.batch_size in ("auto", None) else cfg.batch_size,
        max_input_voxels=max_input_voxels(geometry.largest_per_voxel) if index_limited(cfg, predictor) else None,
    )
    key = model_key_of(cfg, model)
    host_budget = keeping_outputs(host_budget, cfg, geometry.out_channels)
    if cfg.scheduler is None:
        choice = choose_sizes(predictor, problem, model_key=key, quick_s=quick_s, cached_only=cached_only,
                              known=known, host_budget=host_budget, cold_s=cold_s)
    else:  # the trials belong on the workers' devices, which this machine may not have
        from ..cluster.scheduler import run_on_a_worker

        spec = ModelSpec(cfg.model, cfg.weights, cfg.model_kwargs, cfg.trust_pickle, cfg.plane)
        choice = run_on_a_worker(cfg.scheduler, choose_sizes_on_worker, spec, cfg.device, predictor.precision,
                                 cfg.compile, predictor.memory_format, problem, key, quick_s, cached_only, host_budget,
                                 predictor.backend, cfg.tta)
    logger.info("sizes: %s", choice)
    return choice


def choose_sizes_on_worker(spec: ModelSpec, device: str, precision: str, compile: str, memory_format: str,
                            problem: SizeProblem, key: dict, quick_s: float | None, cached_only: bool,
                            host_budget: HostBudget | None = None, backend: str = "torch",
                            tta: str = "off") -> SizeChoice | None:
    """:func:`choose_sizes` on a dask worker's device (its cache, too, is the worker's), with the run's backend."""
    predictor = worker_predictor(spec, device, precision, tta, compile=compile, memory_format=memory_format,
                                 backend=backend, backend_key=key)
    return choose_sizes(predictor, problem, model_key=key, quick_s=quick_s, cached_only=cached_only,
                        host_budget=host_budget)  # resolved on the worker: its memory


def check_channels(channels: tuple[int, ...] | None, geometry: NetworkGeometry) -> tuple[int, ...] | None:
    if channels is None:
        return None
    bad = [c for c in channels if not 0 <= c < geometry.out_channels]
    if bad or not channels:
        raise InvalidOptionError(
            f"channels {list(channels)} must be indices into the network's {geometry.out_channels} output channels"
        )
    return channels
