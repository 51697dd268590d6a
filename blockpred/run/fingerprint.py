"""A run's fingerprint (:func:`fingerprint`: what decides its output's values and layout), and a finished output
recognised by it before anything runs (:func:`finished_layout`).

A re-run of an output whose every block a run of the same settings marked
done has nothing to do: the network's field, its dry run and the measured
defaults would decide nothing (``--block 1024`` on a 128x512x512 volume, one
block: a 34 s dry run, then "0 blocks (1 already done)").  So the block, halo
and layout are taken from the markers where the options do not name others,
the fingerprint is made from them and the options, and where it equals the
markers' the run goes straight to its summary.  Anything that differs (a
named block, halo or layout the markers do not have, other settings) goes the
ordinary way, whose dry run and checks say what changed.
"""

from __future__ import annotations

import os

from ..config import RunConfig
from ..geometry import Coord
from ..io import VolumePath, identity, open_volume
from ..pipeline.blocking import BlockPlan, plan_blocks
from ..pipeline.markers import DoneMarkers, as_json, describe_changes
from ..tuning.defaults import Defaults
from ..tuning.network import NetworkGeometry
from .choose import Layout, network_downsampling
from .layout import OutputLayout
from .mask import Mask


def fingerprint(cfg: RunConfig, source, source_path: VolumePath, model, plan: BlockPlan, output: OutputLayout,
                channels, mask: Mask | None) -> dict:
    """Everything that decides the output's values and layout (see :mod:`blockpred.pipeline.markers`)."""
    return {
        "input": identity.real_name(source_path), "input_shape": source.shape, "input_dtype": str(source.dtype),
        "model": model.name if isinstance(cfg.model, (str, os.PathLike)) else model.kind,
        "model_weights": model.weights_sha256, "model_kwargs": dict(cfg.model_kwargs),
        "roi": [plan.roi.begin, plan.roi.end], "block": plan.block_shape, "halo": plan.halo,
        "network_input": plan.input_shape, "context": plan.context,
        "normalize": str(cfg.normalize), "pad_mode": cfg.pad_mode, "pad_value": cfg.pad_value,
        "precision": cfg.precision, "output_dtype": cfg.output_dtype.name, "output_chunks": output.chunks,
        "output_shards": output.shards,
        "channels": channels, "skip_empty": cfg.skip_empty,
        "mask": None if mask is None else [identity.real_name(mask.path), mask.mask_shape],
        **({"tta": cfg.tta} if cfg.tta != "off" else {}),  # absent when off: outputs of older runs still resume
        **({"plane": model.plane} if model.plane is not None else {}),
    }


def finished_layout(cfg: RunConfig, source, source_path: VolumePath, target_path: VolumePath, model,
                    previous: DoneMarkers, mask: Mask | None, precision: str) -> tuple[RunConfig, Layout] | None:
    """Where every block of the output is done by a run of these settings: the options at ``precision`` (the one
    the run starts at: ``auto``'s before any check) and the layout that run had, with nothing run; else None (see
    the module docstring)."""
    if previous.num_finished() != previous.grid_shape.prod():
        return None
    before = previous.fingerprint
    try:
        block, halo, network_input, context, chunks = (
            Coord(before[key]) for key in ("block", "halo", "network_input", "context", "output_chunks"))
        shards = None if before.get("output_shards") is None else Coord(before["output_shards"])
    except (KeyError, TypeError, ValueError):
        return None
    roi = cfg.roi if cfg.roi is not None else source.box
    named = {"block": cfg.block, "halo": cfg.halo, "chunks": cfg.output_chunks}
    had = {"block": block, "halo": halo, "chunks": chunks}
    for name, value in named.items():
        # A named block larger than the region was cut to it: the markers' block covers the region on that axis.
        if isinstance(value, Coord) and any(v != h and not (name == "block" and v > h >= r)
                                            for v, h, r in zip(value, had[name], roi.shape)):
            return None
    if shards != (cfg.shards if isinstance(cfg.shards, Coord) else block if cfg.shards == "block" else shards) or (
            cfg.shards == "off" and shards is not None):
        return None
    cfg = cfg.replace(precision=precision)
    output = OutputLayout(chunks, shards)
    try:
        plan = plan_blocks(volume_shape=source.spatial_shape, block_shape=block, halo=halo, context=context,
                           input_shape=network_input, roi=roi, chunk_shape=output.write_unit)
        with open_volume(target_path) as written:
            out_channels = written.num_channels or 1
    except Exception:  # noqa: BLE001 - whatever does not fit goes the ordinary way, which says what
        return None
    channels = cfg.channels
    if describe_changes(before, as_json(fingerprint(cfg, source, source_path, model, plan, output, channels, mask))):
        return None
    if channels is not None:
        out_channels = max(channels) + 1  # the network's, of which the output kept these
    geometry = NetworkGeometry(source.num_channels or 1, out_channels, network_input, network_input - context * 2,
                               context)
    batch = cfg.batch_size if isinstance(cfg.batch_size, int) else 1
    want_format = cfg.memory_format is None and cfg.compile == "off" and cfg.backend in ("auto", "torch")
    defaults = None if cfg.batch_size is not None and not want_format else Defaults(
        None, 1 if cfg.batch_size is None else None, "contiguous" if want_format else None, 0.0, 0.0,
        "not measured: every block of this output is done")
    return cfg, Layout(plan, geometry, output, batch, defaults=defaults, downsampling=network_downsampling(cfg, model))
