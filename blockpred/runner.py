"""``blockpred.predict``: validate everything, then plan, create the output and run.

Nothing is created at the output path until every check has passed: a bad
option, a missing input, a model that does not fit the volume or an existing
output (without ``overwrite``) raises a :class:`~blockpred.errors.BlockpredError`
and leaves the disk as it was.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .blocking import Block, BlockPlan, plan_blocks
from .config import RunConfig, make_config
from .errors import InvalidOptionError, ModelLoadError, OutputExistsError
from .geometry import Coord
from .io import (
    VolumePath,
    check_input_volume,
    create_volume,
    open_volume,
    parse_volume_path,
    remove_volume,
    volume_exists,
)
from .models import load_model
from .network import NetworkGeometry, probe_network
from .pipeline import PipelineSettings, Predictor, RunStats, resolve_device, run_blocks

logger = logging.getLogger(__name__)

#: Block core when neither the options nor the model say (rounded to the downsampling).
DEFAULT_BLOCK = Coord((64, 64, 64))
#: Halo for a 'same' network that states none.
DEFAULT_HALO = Coord((8, 8, 8))
#: Output chunks are at most this long per axis unless chosen explicitly.
MAX_DEFAULT_CHUNK = 128


@dataclass(frozen=True)
class PredictionSummary:
    """What :func:`predict` did.  Mvox/s counts output voxels of the ROI per second of pipeline."""

    input: str
    output: str
    model: str
    device: str
    plan: BlockPlan
    stats: RunStats

    @property
    def mvox_per_s(self) -> float:
        return self.stats.mvox_per_s

    def __str__(self) -> str:
        s = self.stats
        return (
            f"predicted {s.num_voxels / 1e6:.1f} Mvox in {s.num_blocks} blocks in {s.seconds:.2f} s "
            f"({s.mvox_per_s:.2f} Mvox/s) with {self.model} on {self.device} -> {self.output}"
        )


def default_output_path(source: VolumePath) -> VolumePath:
    """A sibling dataset ``prediction`` inside a container, else a new container beside the input."""
    if source.dataset:
        return source.sibling("prediction")
    suffix = source.container.suffix
    return VolumePath(source.format, source.container.with_name(source.container.stem + ".prediction" + suffix), "")


def _same_container(a: VolumePath, b: VolumePath) -> bool:
    return Path(os.path.abspath(a.container)) == Path(os.path.abspath(b.container))


def check_output_path(source: VolumePath, target: VolumePath) -> None:
    """Refuse an output inside the input array, or one that would contain (and so replace) it."""
    if target.format == "hdf5" and not target.dataset:
        raise InvalidOptionError(f"HDF5 output {str(target)!r} names no dataset; use for example {target}prediction")
    if not _same_container(source, target):
        return
    inside = not source.dataset or target.dataset == source.dataset or target.dataset.startswith(source.dataset + "/")
    if inside:
        raise InvalidOptionError(
            f"output {str(target)!r} is inside the input array {str(source)!r}; "
            f"write to a sibling dataset (such as {str(source.sibling('prediction')) if source.dataset else 'another container'})"
        )
    if not target.dataset or source.dataset.startswith(target.dataset + "/"):
        raise InvalidOptionError(
            f"output {str(target)!r} contains the input {str(source)!r}; choose a sibling dataset or another container"
        )


def default_chunks(block: Coord, limit: int = MAX_DEFAULT_CHUNK) -> Coord:
    """Per axis the largest divisor of the block that is at most ``limit``."""
    return Coord(max(d for d in range(1, min(b, limit) + 1) if b % d == 0) for b in block)


def _choose_block(config: RunConfig, model_block: Coord | None, downsampling: Coord, roi_shape: Coord) -> Coord:
    """The block the options name; else the model's default (or 64^3), no larger than the ROI needs."""
    if config.block is not None:
        return config.block
    block = model_block if model_block is not None else DEFAULT_BLOCK
    step = downsampling
    if config.output_chunks is not None:
        step = Coord(math.lcm(a, b) for a, b in zip(downsampling, config.output_chunks))
    # A small volume gets one small block rather than one mostly made of padding.
    return block.minimum(roi_shape).ceil_div(step) * step


def predict(input: str | os.PathLike, output: str | os.PathLike | None = None, *,
            config: str | os.PathLike | None = None, **options: Any) -> PredictionSummary:
    """Predict ``input`` with a network, block by block, into ``output``.

    ``options`` are those of :class:`blockpred.config.RunConfig` (``model``,
    ``block``, ``halo``, ``device``, ``precision``, ``batch_size``, ``normalize``,
    ``output_dtype``, ``roi``, ``overwrite`` ...); they override the YAML file
    ``config``.  Without ``output`` the prediction goes next to the input (see
    :func:`default_output_path`).  Returns a :class:`PredictionSummary`.
    """
    cfg = make_config(config, **options)
    source_path = parse_volume_path(input)
    target_path = parse_volume_path(output) if output is not None else default_output_path(source_path)
    check_output_path(source_path, target_path)
    if target_path.format == "n5" and cfg.output_dtype.name == "float16":
        raise InvalidOptionError("N5 has no float16; use --output-dtype float32 or uint8 for an N5 output")

    with contextlib.ExitStack() as stack:
        source = open_volume(source_path)
        stack.callback(source.close)
        return _predict_opened(cfg, source, source_path, target_path, stack)


def _predict_opened(cfg: RunConfig, source, source_path: VolumePath, target_path: VolumePath,
                    stack: contextlib.ExitStack) -> PredictionSummary:
    check_input_volume(source)
    if volume_exists(target_path) and not cfg.overwrite:
        raise OutputExistsError(f"output {str(target_path)!r} exists; pass --overwrite to replace it, or choose another path")
    roi = cfg.roi if cfg.roi is not None else source.box
    if roi.empty or not source.box.contains(roi):
        raise InvalidOptionError(f"ROI {roi} must be a non-empty box inside the volume {source.box}")

    device = resolve_device(cfg.device)
    model = load_model(cfg.model, weights=cfg.weights, model_kwargs=cfg.model_kwargs, trust_pickle=cfg.trust_pickle)
    in_channels = source.num_channels or 1
    if model.in_channels is not None and model.in_channels != in_channels:
        raise ModelLoadError(
            f"network {model.name!r} takes {model.in_channels} input channel(s) but {source_path} has {in_channels}"
        )
    predictor = Predictor(model.module, device, cfg.precision)
    plan, geometry, chunks = _plan(cfg, source, roi, model, predictor)
    channels = _check_channels(cfg.channels, geometry)

    # Every check has passed: only now is anything written.
    if cfg.overwrite and volume_exists(target_path):
        remove_volume(target_path)
    sink = stack.enter_context(create_volume(
        target_path,
        spatial_shape=source.spatial_shape,
        num_channels=len(channels) if channels is not None else geometry.out_channels,
        dtype=cfg.output_dtype,
        chunk_shape=chunks,
        compression=cfg.compression,
        voxel_size=source.voxel_size,
    ))
    settings = PipelineSettings(
        batch_size=cfg.batch_size, num_readers=cfg.num_readers, num_writers=cfg.num_writers,
        prefetch=cfg.prefetch, pad_mode=cfg.pad_mode, pad_value=cfg.pad_value,
        normalization=cfg.normalize, output_dtype=cfg.output_dtype, channels=channels,
    )
    logger.info("predicting %s -> %s: %d blocks of %s (input %s, halo %s) on %s", source_path, target_path,
                plan.num_blocks, tuple(plan.block_shape), tuple(plan.input_shape), tuple(plan.halo), device)
    with _progress(plan, enabled=cfg.progress) as on_block_done:
        stats = run_blocks(plan, source=source, sink=sink, predictor=predictor, settings=settings,
                           on_block_done=on_block_done)
    return PredictionSummary(str(source_path), str(target_path), model.name, str(device), plan, stats)


def _plan(cfg: RunConfig, source, roi, model, predictor: Predictor) -> tuple[BlockPlan, NetworkGeometry, Coord]:
    """Block, halo and chunks from the options and the model's defaults, checked, then the dry run."""
    downsampling = cfg.downsampling if cfg.downsampling is not None else model.downsampling
    block = _choose_block(cfg, model.default_block, downsampling, roi.shape)
    chunks = cfg.output_chunks if cfg.output_chunks is not None else default_chunks(block)
    halo_defaulted = cfg.halo is None and model.default_halo is None
    halo = cfg.halo if cfg.halo is not None else (model.default_halo if model.default_halo is not None else DEFAULT_HALO)
    if halo_defaulted and model.padding == "valid":
        halo = Coord((0, 0, 0))  # a valid network reads its own context; no extra halo by default
    # Check block, halo, chunks and ROI before the (possibly slow) dry run.
    plan_blocks(volume_shape=source.spatial_shape, block_shape=block, halo=halo, roi=roi,
                downsampling=downsampling, chunk_shape=chunks)
    in_channels = source.num_channels or 1
    geometry = probe_network(predictor, in_channels=in_channels, block=block, halo=halo, downsampling=downsampling,
                             first_input=_valid_input_hint(model, block + halo * 2))
    if halo_defaulted and geometry.context != Coord((0, 0, 0)) and halo != Coord((0, 0, 0)):
        # The dry run showed a valid network the model did not announce: drop the default halo.
        halo = Coord((0, 0, 0))
        geometry = probe_network(predictor, in_channels=in_channels, block=block, halo=halo, downsampling=downsampling)
    plan = plan_blocks(volume_shape=source.spatial_shape, block_shape=block, halo=halo, context=geometry.context,
                       input_shape=geometry.input_shape, roi=roi, downsampling=downsampling, chunk_shape=chunks)
    return plan, geometry, chunks


def _valid_input_hint(model, output_shape: Coord) -> Coord | None:
    """For a valid network that can tell (the built-in U-Net can), an input shape it accepts."""
    shape_for = getattr(model.module, "valid_input_shape", None)
    if model.padding != "valid" or shape_for is None:
        return None
    return Coord(shape_for(output_shape))


def _check_channels(channels: tuple[int, ...] | None, geometry: NetworkGeometry) -> tuple[int, ...] | None:
    if channels is None:
        return None
    bad = [c for c in channels if not 0 <= c < geometry.out_channels]
    if bad or not channels:
        raise InvalidOptionError(
            f"channels {list(channels)} must be indices into the network's {geometry.out_channels} output channels"
        )
    return channels


class _progress:
    """A tqdm bar over blocks with Mvox/s; a no-op when disabled."""

    def __init__(self, plan: BlockPlan, enabled: bool):
        self._plan = plan
        self._enabled = enabled
        self._bar = None
        self._voxels = 0
        self._lock = threading.Lock()

    def __enter__(self):
        if not self._enabled:
            return None
        from tqdm.auto import tqdm

        self._bar = tqdm(total=self._plan.num_blocks, unit="block", desc="blockpred", dynamic_ncols=True)
        return self._update

    def _update(self, block: Block) -> None:
        with self._lock:
            self._voxels += block.write_box.size
            elapsed = max(self._bar.format_dict["elapsed"], 1e-9)
            self._bar.set_postfix_str(f"{self._voxels / elapsed / 1e6:.2f} Mvox/s", refresh=False)
            self._bar.update(1)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.close()
