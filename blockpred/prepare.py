"""Validate and plan a run, writing nothing; then create its output and markers.

:func:`prepare` runs every check (options, paths, input, mask, model, the
network's dry run, an earlier run's markers) and plans the block grid, the
output layout and the batch, returning a :class:`Prepared` run.  Nothing is
created at the output path until every check has passed: a bad option, a
missing input, a model that does not fit the volume or an existing output
(without ``overwrite``) raises a :class:`~blockpred.errors.BlockpredError`
and leaves the disk as it was.  :func:`create_output` then writes the
markers and the empty output.  ``blockpred plan`` stops after
:func:`prepare`; ``blockpred run`` goes on to :mod:`blockpred.runner`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .autosize import SizeChoice, SizeProblem, Trial, choose_sizes, model_key, probe_block
from .blocking import BlockPlan, blocks_per_axis, plan_blocks, small_block_warning
from .config import RunConfig, make_config
from .defaults import FORMAT_PASSES, Defaults, measuring_budget
from .errors import (BlockpredError, InvalidOptionError, ModelLoadError, OutputExistsError, is_permanent,
                     os_reason, output_error)
from .geometry import Coord
from .io import (
    VolumePath,
    check_input_volume,
    create_volume,
    identity,
    move_aside,
    moved_aside,
    open_volume,
    parse_volume_path,
    remove_volume,
    supports_sharding,
    volume_exists,
)
from .job import ModelSpec
from .io import stores
from .io.stores import ObjectUrl
from .layout import OutputLayout, block_step, choose_layout
from .markers import DoneMarkers, as_json, describe_changes, markers_path
from .mask import Mask
from .memformat import REPEATS as FORMAT_REPEATS
from .models.bioimageio import STATISTICS_KEY, is_package
from .memformat import FormatChoice, choose_memory_format
from .network import NetworkGeometry, probe_network
from .pipeline import DeviceSteps, PipelineSettings, Predictor, is_out_of_memory, resolve_device

logger = logging.getLogger(__name__)

#: Block core when neither the options nor the model say (rounded to the downsampling).
DEFAULT_BLOCK = Coord((64, 64, 64))
#: Halo for a 'same' network that states none.
DEFAULT_HALO = Coord((8, 8, 8))
#: Start block of a network that reads no halo and no context (pointwise: a copy, a threshold, a stand-in):
#: no block wastes any halo, so the larger block pays its per-block costs (reads, writes, markers) 16x less
#: often (the copy network's command: 64^3 ran at 0.6 of this block's Mvox/s).
ZERO_HALO_BLOCK = Coord((64, 256, 256))


def default_output_path(source: VolumePath) -> VolumePath:
    """A sibling dataset ``prediction`` inside a container, else a new container beside the input.

    A precomputed input's dataset is its scale: its output is a new volume beside it (``em`` -> ``em.prediction``).
    """
    if source.dataset and source.format != "precomputed":
        return source.sibling("prediction")
    suffix = source.container.suffix
    return VolumePath(source.format, source.container.with_name(source.container.stem + ".prediction" + suffix), "")


def check_output_path(source: VolumePath, target: VolumePath, *, overwrite: bool = False,
                      mask: VolumePath | None = None) -> None:
    """Refuse an output that is, holds or lies inside the input (or the mask), whatever names reach them.

    Places are compared on disk (:mod:`blockpred.io.identity`): a symbolic link,
    a symlinked parent directory, a hard link to an HDF5 file or a bind mount
    is the place it reaches.  The output's markers must not touch the input
    either, and ``overwrite`` never deletes through a symbolic link.
    """
    if target.format == "hdf5" and not target.dataset:
        raise InvalidOptionError(f"HDF5 output {str(target)!r} names no dataset; use for example {target}prediction")
    for role, protected in (("input", source), ("mask", mask)):
        if protected is not None:
            _check_apart(protected, target, role)
    markers = markers_path(target)
    for role, protected in (("input", source), ("mask", mask)):
        if protected is not None and identity.overlap(identity.data_node(protected), markers):
            raise InvalidOptionError(
                f"the markers of output {str(target)!r} would be written at {markers}, which is or holds the "
                f"{role} {str(protected)!r}; choose another output"
            )
    if overwrite:
        link = identity.link_in_the_way(identity.data_node(target))
        if link is not None:
            raise InvalidOptionError(
                f"output {str(target)!r} is a symbolic link to {os.path.realpath(link)}; --overwrite does not delete "
                f"through links: name the real path, or remove the link"
            )


def _check_apart(source: VolumePath, target: VolumePath, role: str) -> None:
    """The output neither is, nor holds, nor lies inside ``source`` (one HDF5 file may hold both, apart).

    Datasets of one HDF5 file, or scales of one precomputed volume, are told apart by name; anything else by
    the place on disk its data is in.
    """
    if (source.format == target.format and source.format in ("hdf5", "precomputed")
            and identity.same_file(source.container, target.container)):  # datasets (scales) inside one file
        inside = not source.dataset or target.dataset == source.dataset or target.dataset.startswith(
            source.dataset + "/")
        holds = not inside and (not target.dataset or source.dataset.startswith(target.dataset + "/"))
    else:
        source_node, target_node = identity.data_node(source), identity.data_node(target)
        inside = identity.within(target_node, source_node)
        holds = not inside and identity.within(source_node, target_node)
    through = _through_links(source, target)
    if inside:
        sibling = str(source.sibling("prediction")) if source.dataset else "another container"
        raise InvalidOptionError(
            f"output {str(target)!r} is inside the {role} array {str(source)!r}{through}; write to a sibling dataset "
            f"(such as {sibling})"
        )
    if holds:
        raise InvalidOptionError(
            f"output {str(target)!r} contains the {role} {str(source)!r}{through}; choose a sibling dataset or "
            f"another container"
        )


def _through_links(source: VolumePath, target: VolumePath) -> str:
    """' (both are /real/g.zarr)' when the two names differ but reach one container; else ''."""
    if source.is_remote or target.is_remote or source.container == target.container:
        return ""
    real = identity.resolved(source.container)
    if identity.same_file(source.container, target.container):
        return f" (both names reach {real})"
    return f" (reached through links or mounts: {real})"


def default_io_threads(cfg: RunConfig) -> int:
    """Reader (and writer) threads per worker: half the CPU cores each worker has, from 2 to 8.

    Decompression and compression release the GIL, so these threads run in
    parallel; the bench's stage times show when they limit.
    """
    workers = 1 if cfg.local else (cfg.workers or _local_gpus() or 1)
    return max(2, min(8, (os.cpu_count() or 2) // workers // 2))


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _choose_block(config: RunConfig, model_block: Coord | None, downsampling: Coord, roi_shape: Coord) -> Coord:
    """The block the options name; else the model's default (or 64^3), no larger than the ROI needs."""
    if config.block is not None:
        return config.block
    block = model_block if model_block is not None else DEFAULT_BLOCK
    step = block_step(downsampling, config.output_chunks, config.shards)
    # A small volume gets one small block rather than one mostly made of padding.
    return block.minimum(roi_shape).ceil_div(step) * step


def resolve_paths(input, output, config, options: dict) -> tuple[RunConfig, VolumePath, VolumePath]:
    """The options as a config, and the input and output paths, checked against each other.

    With one device and neither ``workers`` nor ``scheduler``, the run is
    ``local``: a dask cluster of one worker would add its start-up, a second
    model load and (on a GPU) a second CUDA context, and give nothing back
    (issue 9 measured one H100 at 0.83 of model-only speed in this process,
    0.34 through one dask worker).  ``workers=1`` still runs through dask.
    """
    cfg = make_config(config, **options)
    from .jobqueue import job_settings

    job_settings(cfg, 1)  # batch-job options only with --cluster, and --cluster with no other cluster
    if not cfg.local and cfg.workers is None and cfg.scheduler is None and cfg.cluster is None:
        from .cluster import local_worker_envs

        if len(local_worker_envs(cfg.device, None)) == 1:
            cfg = cfg.replace(local=True)
    source_path = parse_volume_path(input, cfg.storage_options)
    target_path = (parse_volume_path(output, cfg.storage_options) if output is not None
                   else default_output_path(source_path))
    check_output_path(source_path, target_path, overwrite=cfg.overwrite,
                      mask=parse_volume_path(cfg.mask, cfg.storage_options) if cfg.mask is not None else None)
    if target_path.format == "n5" and cfg.output_dtype.name == "float16":
        raise InvalidOptionError("N5 has no float16; use --output-dtype float32 or uint8 for an N5 output")
    if target_path.format == "precomputed":  # one scale, a data type precomputed has
        from .io.precomputed import check_output

        check_output(target_path, cfg.output_dtype)
    return cfg, source_path, target_path


def model_key_of(cfg: RunConfig, model) -> dict:
    kwargs = {k: v for k, v in cfg.model_kwargs.items() if k != STATISTICS_KEY}  # speed does not depend on them
    name = model.name if isinstance(cfg.model, (str, os.PathLike)) else model.kind
    if cfg.tta != "off":  # a pass per flip: timed and cached apart
        name = f"{name} (tta {cfg.tta})"
    return model_key(name, model.weights_sha256, kwargs)


@dataclass(frozen=True)
class Prepared:
    """A run checked and planned, with nothing written yet (what ``blockpred plan`` reports)."""

    cfg: RunConfig
    source_path: VolumePath
    target_path: VolumePath
    model: Any  # LoadedModel
    spec: ModelSpec
    predictor: Predictor
    layout: "Layout"
    channels: tuple[int, ...] | None
    settings: PipelineSettings
    fingerprint: dict
    #: True when the output holds markers of the same settings: its finished blocks are kept.
    resumed: bool
    previous: DoneMarkers | None
    #: For a new run with a mask: the boolean grid of the blocks it leaves out.
    masked: np.ndarray | None = None
    #: What ``memory_format="auto"`` (or the measured default) chose (None when a layout was named).
    format_choice: FormatChoice | None = None

    @property
    def memory_format(self) -> str:
        if self.format_choice is not None:
            return self.format_choice.memory_format
        return self.cfg.memory_format or "contiguous"

    @property
    def defaults(self) -> Defaults | None:
        """What the run chose for the block, batch and memory format it was not given (see :mod:`blockpred.defaults`)."""
        return self.layout.defaults

    @property
    def out_channels(self) -> int:
        return len(self.channels) if self.channels is not None else self.layout.geometry.out_channels


def prepare(cfg: RunConfig, source, source_path: VolumePath, target_path: VolumePath,
            on_paths_checked: Callable[[DoneMarkers | None], None] | None = None, measure: bool = True) -> Prepared:
    """Every check and the plan; writes nothing (see :func:`create_output`).

    ``measure=False`` (``blockpred plan``) leaves ``memory_format="auto"`` and
    the measured defaults unmeasured (what is cached is used): the run
    measures them.

    ``on_paths_checked(previous)`` is called once the input, the output path,
    the ROI and the worker options have passed, before the model is loaded
    (the runner starts its dask cluster there, so both go on at once);
    ``previous`` are the markers a resume would continue, else None.
    """
    check_input_volume(source)
    exists = volume_exists(target_path)
    previous = DoneMarkers.open(markers_path(target_path)) if exists else None
    if exists and not cfg.overwrite and previous is None:
        raise OutputExistsError(f"output {str(target_path)!r} exists; pass --overwrite to replace it, or choose another path")
    if not exists:
        _check_place_free(target_path)
    roi = cfg.roi if cfg.roi is not None else source.box
    if roi.empty or not source.box.contains(roi):
        raise InvalidOptionError(f"ROI {roi} must be a non-empty box inside the volume {source.box}")
    if cfg.local and (cfg.workers or cfg.scheduler):
        raise InvalidOptionError("--local runs in this process; it cannot be combined with --workers or --scheduler")
    if cfg.pyramid:
        _check_pyramid(cfg, source, target_path)
    if cfg.missing_chunks == "error" and not source.counts_missing_chunks:
        raise InvalidOptionError(
            f"--missing-chunks error needs an input whose missing chunks can be told (zarr, N5 or unsharded "
            f"precomputed read through tensorstore), but {source_path} reads them as the fill value unseen; "
            f"drop --missing-chunks error"
        )

    if not cfg.local and cfg.scheduler is None and target_path.format == "hdf5":
        from .cluster import check_hdf5_writers, local_worker_envs

        check_hdf5_writers(target_path, cfg.jobs or 1 if cfg.cluster is not None
                           else len(local_worker_envs(cfg.device, cfg.workers)))
    if on_paths_checked is not None:
        on_paths_checked(previous if previous is not None and not cfg.overwrite else None)
    mask = (Mask.open(parse_volume_path(cfg.mask, cfg.storage_options), source.spatial_shape)
            if cfg.mask is not None else None)
    device = _client_device(cfg)
    if is_package(cfg.model):  # bioimage.io: normalisation none, the volume's statistics for every worker
        from .models.bioimageio_stats import configure_run

        cfg = configure_run(cfg, source)
    spec = ModelSpec(cfg.model, cfg.weights, cfg.model_kwargs, cfg.trust_pickle)
    model = spec.load()
    in_channels = source.num_channels or 1
    if model.in_channels is not None and model.in_channels != in_channels:
        raise ModelLoadError(
            f"network {model.name!r} takes {model.in_channels} input channel(s) but {source_path} has {in_channels}"
        )
    if cfg.memory_format == "auto" and cfg.compile != "off":
        raise InvalidOptionError("--memory-format auto measures both layouts uncompiled; with --compile name the "
                                 "layout: --memory-format contiguous or channels_last")
    from .models.tta import with_tta

    predictor = Predictor(with_tta(model.module, cfg.tta), device, cfg.precision, compile=cfg.compile,
                          memory_format=_start_format(cfg))
    resume_block = None
    if previous is not None and not cfg.overwrite and cfg.block in ("auto", None) and previous.fingerprint.get("block"):
        resume_block = Coord(previous.fingerprint["block"])  # a resume keeps the block it started with
    # A resume: what is finished (read once), so its defaults are measured for what is left (nothing: not at all).
    finished = previous.finished() if previous is not None and not cfg.overwrite else None
    todo_share = 1.0 - float(finished.mean()) if finished is not None and finished.size else 1.0
    if cfg.cluster is not None and device.type != ("cpu" if cfg.gpus_per_job == 0 or cfg.device == "cpu" else "cuda"):
        measure = False  # this machine has not the jobs' device: timing here would choose for the wrong one
    layout = plan_layout(cfg, source, roi, model, predictor, resume_block, target_path, measure=measure,
                         todo_share=todo_share)
    plan, geometry, output = layout.plan, layout.geometry, layout.output
    warnings = [small_block_warning(plan, block_step(_downsampling(cfg, model), cfg.output_chunks, cfg.shards)),
                _slow_precision_warning(cfg.precision, device), _long_run_warning(layout.defaults, device)]
    for warning in filter(None, warnings):
        logger.warning("%s", warning)
    channels = _check_channels(cfg.channels, geometry)
    settings = PipelineSettings(
        batch_size=layout.batch_size, num_readers=cfg.num_readers or default_io_threads(cfg),
        num_writers=cfg.num_writers or default_io_threads(cfg),
        prefetch=cfg.prefetch, pad_mode=cfg.pad_mode, pad_value=cfg.pad_value,
        normalization=cfg.normalize, output_dtype=cfg.output_dtype, channels=channels,
        downsampling=_downsampling(cfg, model),
        missing_chunks=cfg.missing_chunks,
    )
    fingerprint = as_json(_fingerprint(cfg, source, source_path, model, plan, output, channels, mask))
    resumed = previous is not None and not cfg.overwrite
    if resumed:
        changes = describe_changes(previous.fingerprint, fingerprint)
        if changes:
            raise OutputExistsError(
                f"output {str(target_path)!r} was made with other settings ({'; '.join(changes)}); "
                f"pass --overwrite to start again, or choose another output"
            )
    masked = ~mask.coverage(plan) if mask is not None and not resumed else None
    _check_inodes(target_path, plan, layout.output, finished if resumed else masked)
    format_choice = layout.format_choice
    if format_choice is None and measure and (cfg.memory_format == "auto" or (
            cfg.memory_format is None and cfg.compile == "off" and layout.defaults is None)):
        # Asked for, or left to blockpred in a run that asked for size trials (--block/--batch-size auto).
        format_choice = _choose_format(cfg, model, predictor, (1, in_channels) + tuple(plan.input_shape))
    return Prepared(cfg, source_path, target_path, model, spec, predictor, layout, channels, settings, fingerprint,
                    resumed, previous, masked, format_choice)


def create_output(p: Prepared, source, owner: str = "") -> DoneMarkers:
    """Every check has passed and this run holds the output's lock (``owner``, its token): write.

    The state :func:`prepare` saw is checked again under the lock: a resume
    continues the same markers, and an output that appeared meanwhile (made by
    another run) is refused unless ``overwrite``.  Replacing an output goes in
    an order a kill at any moment cannot turn into a wrong resume: the old
    markers are invalidated first (see :meth:`DoneMarkers.invalidate`), then
    the old output is deleted, then the new markers are written, then the
    empty output -- so an output without markers is never one of ours
    half-made.  What this call creates is removed again if creating fails
    (a full disk, a refused permission), and the error is one line.
    """
    cfg, plan, output = p.cfg, p.layout.plan, p.layout.output
    path, target = markers_path(p.target_path), str(p.target_path)
    current = DoneMarkers.open(path)
    if p.resumed:
        if current is None or current.token != p.previous.token:
            raise OutputExistsError(f"output {target!r} changed while this run was starting (another run wrote it); "
                                    f"run the same command again")
        if not _opens(p.target_path):
            if current.finished().any():
                raise OutputExistsError(f"output {target!r} cannot be opened, but its markers say blocks of it are "
                                        f"done; repair it, or pass --overwrite to start again")
            # Killed while it was being created (markers first, then the volume): nothing of it is vouched for.
            logger.warning("output %s was left half-created by a run that was cut short; creating it again", target)
            remove_volume(p.target_path)
            _create_sink(p, source)
        return dataclasses.replace(current, owner=owner)
    exists = volume_exists(p.target_path)
    if exists and not cfg.overwrite:
        raise OutputExistsError(f"output {target!r} appeared while this run was starting (made by another run); run "
                                f"the same command again to resume it, or pass --overwrite to replace it")
    try:
        _clear(p.target_path, path, exists)
    except BlockpredError:
        raise
    except OSError as err:
        raise output_error(err, "delete the old output", target) from None
    try:
        markers = DoneMarkers.create(path, plan, p.fingerprint, p.masked)
        _create_sink(p, source)
    except Exception as err:
        _undo_create(p.target_path, path)
        if not isinstance(err, BlockpredError) and (isinstance(err, OSError) or is_permanent(err)):
            raise output_error(err, "create the output", target) from None
        raise
    return dataclasses.replace(markers, owner=owner)


def _create_sink(p: Prepared, source) -> None:
    """The empty output volume of ``p`` (its markers exist already)."""
    cfg, plan, output = p.cfg, p.layout.plan, p.layout.output
    sink = create_volume(
        p.target_path,
        spatial_shape=source.spatial_shape,
        num_channels=p.out_channels,
        dtype=cfg.output_dtype,
        chunk_shape=output.chunks,
        shard_shape=output.shards,
        compression=cfg.compression,
        voxel_size=source.voxel_size,
    )
    sink.close()
    # Blocks are whole chunks (shards, for a sharded array): no two tasks ever write one chunk.
    if not plan.block_shape.is_multiple_of(sink.spatial_chunk_shape):
        raise AssertionError(f"block {tuple(plan.block_shape)} does not tile chunks {sink.chunk_shape} of {p.target_path}")


def _opens(target: VolumePath) -> bool:
    """Whether the volume at ``target`` opens (one being created when its run was killed may not)."""
    try:
        open_volume(target).close()
    except (BlockpredError, OSError, ValueError, KeyError):
        return False
    return True


def _clear(target: VolumePath, markers: Path | ObjectUrl, exists: bool) -> None:
    """The old output and its markers gone, in an order no interruption turns into a wrong resume.

    A local directory volume is first moved aside in one rename (nothing is
    left at the path; a failed rename changes nothing), then its markers are
    invalidated, then it is deleted.  Anything else (an HDF5 dataset, an
    object store) has its markers invalidated first and is deleted in place.
    What an earlier, interrupted deletion left aside is deleted too: this run
    holds the output's lock, so nobody else is using it.
    """
    try:
        aside = move_aside(target) if exists else None
    except NotImplementedError:
        DoneMarkers.invalidate(markers)  # first: from here nothing vouches for the chunks about to go
        remove_volume(target)
        return
    DoneMarkers.invalidate(markers)
    for old in moved_aside(target):
        try:
            stores.remove_tree(old)
        except OSError as err:
            reason, _ = os_reason(err)
            logger.warning("the old output %s was moved to %s but could not be deleted (%s); delete it by hand",
                           target, old, reason)
        else:
            if old != aside:
                logger.warning("deleted %s, left by an earlier deletion of %s that was cut short", old, target)


def _undo_create(target: VolumePath, markers: Path | ObjectUrl) -> None:
    """Remove what a failed :func:`create_output` made (markers first); what cannot go stays, unvouched for."""
    for undo in (lambda: DoneMarkers.invalidate(markers), lambda: remove_volume(target)):
        try:
            undo()
        except Exception as err:  # noqa: BLE001 - the creation's own error is the one to report
            logger.debug("could not undo a failed output creation: %s", err)


def _check_place_free(target: VolumePath) -> None:
    """Nothing but a volume of ours is ever written over: files at the output's place that are no volume stay."""
    if target.is_remote or target.format == "hdf5":
        return  # an HDF5 dataset name holds a dataset or nothing here; object stores are checked by their backend
    node = identity.data_node(target)
    if node.is_file() or (node.is_dir() and any(node.iterdir())):
        raise OutputExistsError(
            f"output {str(target)!r} holds files that are not a volume blockpred can open ({node}); choose another "
            f"output, or move them away (--overwrite replaces volumes only)"
        )


def _check_inodes(target: VolumePath, plan: BlockPlan, output: OutputLayout, finished: np.ndarray | None) -> None:
    """A local output needs a file per chunk (or shard) still to write: refuse one the file system cannot hold.

    Counted in bulk over the block grid; a file system that reports no inode
    limit (``f_files`` 0, as btrfs does) is not checked.
    """
    if target.is_remote or target.format == "hdf5":
        return
    from .runplan import count_work

    todo = ~finished if finished is not None else np.ones(tuple(plan.grid_shape), dtype=bool)
    _, files = count_work(plan, todo, output.write_unit)
    place = identity.resolved(identity.data_node(target))
    while not place.exists() and place != place.parent:
        place = place.parent
    info = os.statvfs(place)
    if info.f_files > 0 and files > info.f_favail:
        raise InvalidOptionError(
            f"output {str(target)!r} needs {files:,} files (one per {'shard' if output.shards else 'chunk'}) but the "
            f"file system of {place} has {info.f_favail:,} free inodes; write fewer, larger files (--shards block for "
            f"a zarr v3 output, or larger --output-chunks), or choose another file system"
        )


#: A run estimated longer than this (seconds) says so before it starts.
LONG_RUN_S = 600.0


def _slow_precision_warning(precision: str, device) -> str:
    """fp16 and bf16 pay on GPUs; on a CPU autocast ran bf16 18x slower than fp32 (2 cores, issue 25)."""
    if device.type == "cpu" and precision in ("fp16", "bf16"):
        return (f"--precision {precision} on the CPU is usually several times slower than fp32 (autocast on a "
                f"CPU); use --precision fp32 unless you need {precision}'s numbers")
    return ""


def _long_run_warning(defaults: Defaults | None, device) -> str:
    """A run of hours says so at its start (a 3D U-Net on a CPU), not only in its progress bar."""
    if defaults is None or defaults.estimated_run_s < LONG_RUN_S:
        return ""
    hours = defaults.estimated_run_s / 3600
    length = f"{hours:.1f} h" if hours >= 1 else f"{defaults.estimated_run_s / 60:.0f} min"
    hint = "; a GPU (--device cuda) is far faster" if device.type == "cpu" else ""
    return f"this run is estimated at {length} on {device} (blocks x one pass at the start block){hint}"


def _check_pyramid(cfg: RunConfig, source, target_path: VolumePath) -> None:
    """A pyramid is an OME-NGFF multiscale image: a zarr output, and levels the volume's shape allows."""
    from .pyramid import max_levels

    if target_path.format != "zarr":
        raise InvalidOptionError(
            f"--pyramid writes an OME-NGFF multiscale image, which needs a zarr output; {str(target_path)!r} is "
            f"{target_path.format}: write to a .zarr path or drop --pyramid"
        )
    limit = max_levels(source.spatial_shape)
    if cfg.pyramid > limit:
        raise InvalidOptionError(
            f"--pyramid {cfg.pyramid} needs more levels than a volume of shape {tuple(source.spatial_shape)} has "
            f"(at most {limit}: each level halves an axis until every axis is one voxel); use --pyramid {limit} or less"
        )


def _client_device(cfg: RunConfig):
    """Where this process runs the dry run (and, with ``local``, the blocks).

    Joining a cluster, or submitting its jobs, this process need not have the workers' GPUs: without
    CUDA here, the dry run runs on the CPU and each worker checks its own device.
    """
    import torch

    joining = cfg.scheduler is not None or cfg.cluster is not None
    if joining and str(cfg.device).startswith("cuda") and not torch.cuda.is_available():
        return resolve_device("cpu")
    return resolve_device(cfg.device)


def _fingerprint(cfg: RunConfig, source, source_path: VolumePath, model, plan: BlockPlan, output: OutputLayout,
                 channels, mask: Mask | None) -> dict:
    """Everything that decides the output's values and layout (see :mod:`blockpred.markers`)."""
    return {
        "input": _real_name(source_path), "input_shape": source.shape, "input_dtype": str(source.dtype),
        "model": model.name if isinstance(cfg.model, (str, os.PathLike)) else model.kind,
        "model_weights": model.weights_sha256, "model_kwargs": dict(cfg.model_kwargs),
        "roi": [plan.roi.begin, plan.roi.end], "block": plan.block_shape, "halo": plan.halo,
        "network_input": plan.input_shape, "context": plan.context,
        "normalize": str(cfg.normalize), "pad_mode": cfg.pad_mode, "pad_value": cfg.pad_value,
        "precision": cfg.precision, "output_dtype": cfg.output_dtype.name, "output_chunks": output.chunks,
        "output_shards": output.shards,
        "channels": channels, "skip_empty": cfg.skip_empty,
        "mask": None if mask is None else [_real_name(mask.path), mask.mask_shape],
        **({"tta": cfg.tta} if cfg.tta != "off" else {}),  # absent when off: outputs of older runs still resume
    }


def _real_name(path: VolumePath) -> str:
    """The path with its links resolved: a resume through another link to the same input is the same run."""
    path = path.absolute()
    return str(VolumePath(path.format, identity.resolved(path.container), path.dataset))


def _downsampling(cfg: RunConfig, model) -> Coord:
    return cfg.downsampling if cfg.downsampling is not None else model.downsampling


@dataclass(frozen=True)
class Layout:
    plan: BlockPlan
    geometry: NetworkGeometry
    output: OutputLayout
    batch_size: int
    #: What ``--block auto`` / ``--batch-size auto`` chose, if asked.
    sizing: SizeChoice | None = None
    #: What the measured defaults chose (None when block, batch and memory format were all named).
    defaults: Defaults | None = None
    #: The memory format the measured defaults chose, if they measured or found one.
    format_choice: FormatChoice | None = None


def plan_layout(cfg: RunConfig, source, roi, model, predictor: Predictor, resume_block: Coord | None,
                target_path: VolumePath, measure: bool = True, todo_share: float = 1.0) -> Layout:
    """Block, halo, output layout and batch from the options, the model's defaults or trials; checked; dry-run."""
    downsampling = _downsampling(cfg, model)
    auto_block = cfg.block == "auto"
    start_block = resume_block if cfg.block in ("auto", None) and resume_block is not None else (
        None if auto_block else cfg.block)
    block = _choose_block(cfg.replace(block=start_block), model.default_block, downsampling, roi.shape)
    searching = auto_block and resume_block is None
    base_block = block
    if searching:  # the dry run on a small block: the default one may not fit the device
        block = probe_block(block, downsampling)

    def layout_for(block: Coord) -> OutputLayout:
        return choose_layout(block=block, volume_shape=source.spatial_shape, chunks=cfg.output_chunks,
                             shards=cfg.shards, can_shard=supports_sharding(target_path), target=str(target_path))

    output = None if searching else layout_for(block)
    halo_defaulted = cfg.halo is None and model.default_halo is None
    halo = cfg.halo if cfg.halo is not None else (model.default_halo if model.default_halo is not None else DEFAULT_HALO)
    if halo_defaulted and model.padding == "valid":
        halo = Coord((0, 0, 0))  # a valid network reads its own context; no extra halo by default
    # Check block, halo, chunks and ROI before the (possibly slow) dry run.
    plan_blocks(volume_shape=source.spatial_shape, block_shape=block, halo=halo, roi=roi,
                downsampling=downsampling, chunk_shape=None if output is None else output.write_unit)
    in_channels = source.num_channels or 1
    started = time.perf_counter()
    geometry = probe_network(predictor, in_channels=in_channels, block=block, halo=halo, downsampling=downsampling,
                             first_input=_valid_input_hint(model, block + halo * 2))
    if halo_defaulted and geometry.context != Coord((0, 0, 0)) and halo != Coord((0, 0, 0)):
        # The dry run showed a valid network the model did not announce: drop the default halo.
        halo = Coord((0, 0, 0))
        started = time.perf_counter()
        geometry = probe_network(predictor, in_channels=in_channels, block=block, halo=halo, downsampling=downsampling)
    if (start_block is None and model.default_block is None and halo == Coord((0, 0, 0))
            and geometry.context == Coord((0, 0, 0)) and not searching):
        larger = _choose_block(cfg.replace(block=ZERO_HALO_BLOCK), None, downsampling, roi.shape)
        if larger != block:  # nothing to waste in halos: the block that pays its per-block costs least often
            block = larger
            started = time.perf_counter()
            geometry = probe_network(predictor, in_channels=in_channels, block=block, halo=halo,
                                     downsampling=downsampling)
    dry_run_s = time.perf_counter() - started
    batch_size, sizing, defaults, format_choice = cfg.batch_size, None, None, None
    if not searching and batch_size != "auto" and (
            cfg.block is None or batch_size is None or (cfg.memory_format is None and cfg.compile == "off")):
        defaults, sizing, format_choice = _measured_defaults(
            cfg, source, roi, model, predictor, block, halo, geometry, downsampling, dry_run_s,
            block_named=cfg.block is not None or resume_block is not None, measure=measure, todo_share=todo_share)
        batch_size = defaults.batch_size if defaults.batch_size is not None else batch_size
        if defaults.block is not None and defaults.block != block:
            block = defaults.block
            if geometry.context == Coord((0, 0, 0)) and sizing is not None:
                # A 'same' network maps any input on its grid to itself, and its trials (in this run or the
                # cached one) ran this block or one on the same grid (an estimated block, see autosize.pick):
                # no second dry run at a block that may take seconds.
                shape = (block + halo * 2).ceil_div(downsampling) * downsampling
                geometry = NetworkGeometry(geometry.in_channels, geometry.out_channels, shape, shape, geometry.context)
            else:
                geometry = probe_network(predictor, in_channels=in_channels, block=block, halo=halo,
                                         downsampling=downsampling,
                                         first_input=_valid_input_hint(model, block + halo * 2))
    elif searching or batch_size == "auto":
        sizing = _auto_size(cfg, source, roi, model, predictor, block, base_block, halo, geometry, downsampling,
                            fixed_block=None if searching else block)
        batch_size = sizing.batch_size
        if sizing.block != block:
            block = sizing.block
            geometry = probe_network(predictor, in_channels=in_channels, block=block, halo=halo,
                                     downsampling=downsampling, first_input=_valid_input_hint(model, block + halo * 2))
    output = layout_for(block)
    plan = plan_blocks(volume_shape=source.spatial_shape, block_shape=block, halo=halo, context=geometry.context,
                       input_shape=geometry.input_shape, roi=roi, downsampling=downsampling,
                       chunk_shape=output.write_unit)
    return Layout(plan, geometry, output, int(batch_size or 1), sizing, defaults, format_choice)


def _measured_defaults(cfg: RunConfig, source, roi, model, predictor: Predictor, block: Coord, halo: Coord,
                       geometry: NetworkGeometry, downsampling: Coord, dry_run_s: float, *, block_named: bool,
                       measure: bool, todo_share: float = 1.0) -> tuple[Defaults, SizeChoice | None, FormatChoice | None]:
    """The block, batch and memory format the options leave open, measured within the run's budget.

    ``block`` is the start block the dry run took ``dry_run_s`` on; see
    :mod:`blockpred.defaults` for when and how much is measured.  ``todo_share``:
    the share of the blocks still to run (a resume), which the estimate counts.
    """
    want_block, want_batch = not block_named, cfg.batch_size is None
    want_format = cfg.memory_format is None and cfg.compile == "off"
    blocks = blocks_per_axis(roi, block).prod() * todo_share
    in_channels = source.num_channels or 1
    shape = (1, in_channels) + tuple(geometry.input_shape)
    started = time.perf_counter()
    spent = lambda: time.perf_counter() - started  # noqa: E731
    here = cfg.scheduler is None  # passes timed here stand for the run's device (else it is a worker's)

    def choose(budget: float, pass_s: float | None = None) -> tuple[FormatChoice | None, SizeChoice | None]:
        """What is cached, and within ``budget`` seconds (from ``started``) what is not.

        ``pass_s``: a warm pass of the start block in the predictor's layout (contiguous unless named), timed
        on random data: the layout comparison and the first size trial take it instead of running it again.
        """
        chosen_format = chosen_sizes = None
        known_format = {predictor.memory_format: pass_s} if pass_s is not None and here else None
        if want_format:
            cost = (FORMAT_PASSES - 2 * bool(known_format)) * (pass_s or 0.0)
            chosen_format = _choose_format(cfg, model, predictor, shape, repeats=1,
                                           cached_only=pass_s is None or spent() + cost > budget, known=known_format)
        if want_block or want_batch:
            known: tuple[Trial, ...] = ()
            seconds = chosen_format.seconds.get(predictor.memory_format) if chosen_format is not None else pass_s
            if here and seconds and (chosen_format is None or not chosen_format.cached):
                known = (Trial(block, 1, "ok", block.prod() / seconds / 1e6, seconds),)
            # With a known trial the search costs nothing more where the budget is spent: it may still take
            # a larger block untimed (see autosize.pick).
            chosen_sizes = _auto_size(cfg, source, roi, model, predictor, block, block, halo, geometry, downsampling,
                                      fixed_block=None if want_block else block, quick_s=max(0.0, budget - spent()),
                                      cached_only=budget - spent() <= 0 and not known, known=known)
        return chosen_format, chosen_sizes

    format_choice, sizing = choose(0.0)  # the cache first: a cached run times nothing
    complete = (format_choice is not None or not want_format) and (
        sizing.complete if sizing is not None else not (want_block or want_batch))  # else a cut-short search goes on
    estimated, out_of_memory = blocks * dry_run_s, False
    if not complete and measure and measuring_budget(estimated) > 0:
        # The dry run was the process's first pass (thread pools, kernels, allocators): time a warm one.
        batch = np.random.default_rng(0).random(shape, dtype=np.float32)  # kernels may run faster on zeros
        started = time.perf_counter()
        try:
            predictor(batch)
        except Exception as err:  # noqa: BLE001 - out of memory ends the measuring; anything else is the network's
            if not is_out_of_memory(err):
                raise
            predictor.release_memory()  # the run's own recovery (smaller batches, parts) takes over
            out_of_memory = True
        else:
            pass_s = spent()
            estimated = blocks * pass_s
            format_choice, sizing = choose(measuring_budget(estimated), pass_s)
    measured = (format_choice is not None and not format_choice.cached) or (sizing is not None and not sizing.cached)
    found = format_choice is not None or sizing is not None
    if measured:
        how = "measured"
    elif found:
        how = "cached"
    elif not measure and cfg.cluster is not None:
        how = "not measured: this machine has not the jobs' device (name --block and --batch-size)"
    elif not measure:
        how = "not measured yet: the run measures"
    elif out_of_memory:
        how = "not measured: the start block ran out of device memory in a timed pass"
    else:
        how = (f"not measured: the run is estimated at {estimated:.1f} s at the start block, too short "
               f"for measuring to pay")
    defaults = Defaults(
        block=(sizing.block if sizing is not None else block) if want_block else None,
        batch_size=(sizing.batch_size if sizing is not None else 1) if want_batch else None,
        memory_format=(format_choice.memory_format if format_choice is not None else "contiguous")
        if want_format else None,
        estimated_run_s=estimated, measured_s=spent() if measured else 0.0, how=how)
    return defaults, sizing, format_choice


def _auto_size(cfg: RunConfig, source, roi, model, predictor: Predictor, block: Coord, base_block: Coord,
               halo: Coord, geometry: NetworkGeometry, downsampling: Coord, fixed_block: Coord | None,
               quick_s: float | None = None, cached_only: bool = False,
               known: tuple = ()) -> SizeChoice | None:
    """``--block auto`` / ``--batch-size auto``: trial passes on the device (cached).

    ``quick_s`` / ``cached_only``: the measured defaults' search (see
    :func:`blockpred.autosize.choose_sizes`); None when ``cached_only`` finds nothing.

    With ``--scheduler`` the trials run on one of the cluster's workers, whose
    device the blocks will run on; otherwise on this process's device.

    ``block`` is the one ``geometry`` was probed at; the search starts at ``base_block``.
    """
    _check_channels(cfg.channels, geometry)  # before trials that would select them
    step = block_step(downsampling, cfg.output_chunks, cfg.shards)
    scale, offset = cfg.normalize.scale_offset(source.dtype)
    problem = SizeProblem(
        in_channels=source.num_channels or 1, raw_dtype=source.dtype, halo=halo, context=geometry.context,
        input_extra=geometry.input_shape - (block + (halo + geometry.context) * 2), step=step,
        base_block=base_block, roi=roi,
        steps=DeviceSteps(scale=scale, offset=offset, channels=cfg.channels, output_dtype=cfg.output_dtype),
        fixed_block=fixed_block, fixed_batch=None if cfg.batch_size in ("auto", None) else cfg.batch_size,
    )
    key = model_key_of(cfg, model)
    if cfg.scheduler is None:
        choice = choose_sizes(predictor, problem, model_key=key, quick_s=quick_s, cached_only=cached_only,
                              known=known)
    else:  # the trials belong on the workers' devices, which this machine may not have
        from .scheduler import run_on_a_worker

        spec = ModelSpec(cfg.model, cfg.weights, cfg.model_kwargs, cfg.trust_pickle)
        choice = run_on_a_worker(cfg.scheduler, _choose_sizes_on_worker, spec, cfg.device, cfg.precision,
                                 cfg.compile, predictor.memory_format, problem, key, quick_s, cached_only)
    logger.info("sizes: %s", choice)
    return choice


def _choose_sizes_on_worker(spec: ModelSpec, device: str, precision: str, compile: str, memory_format: str,
                            problem: SizeProblem, key: dict, quick_s: float | None,
                            cached_only: bool) -> SizeChoice | None:
    """:func:`choose_sizes` on a dask worker's device (its cache, too, is the worker's)."""
    from .scheduler import worker_device

    predictor = Predictor(spec.load().module, resolve_device(worker_device(device)), precision, compile=compile,
                          memory_format=memory_format)
    return choose_sizes(predictor, problem, model_key=key, quick_s=quick_s, cached_only=cached_only)


def _start_format(cfg: RunConfig) -> str:
    """The layout the client's predictor (and the size trials) start in: auto and unnamed start contiguous."""
    return "contiguous" if cfg.memory_format in ("auto", None) else cfg.memory_format


def _choose_format(cfg: RunConfig, model, predictor: Predictor, batch_shape: tuple[int, ...],
                   repeats: int = FORMAT_REPEATS, cached_only: bool = False,
                   known: dict | None = None) -> FormatChoice | None:
    """The faster memory format, measured on this process's device, or with ``--scheduler`` on a worker's.

    None when ``cached_only`` finds nothing cached.
    """
    key = model_key_of(cfg, model)
    if cfg.scheduler is None:
        choice = choose_memory_format(predictor, batch_shape, key, repeats=repeats, cached_only=cached_only,
                                      known=known)
    else:
        from .scheduler import run_on_a_worker

        spec = ModelSpec(cfg.model, cfg.weights, cfg.model_kwargs, cfg.trust_pickle)
        choice = run_on_a_worker(cfg.scheduler, _choose_format_on_worker, spec, cfg.device, cfg.precision,
                                 batch_shape, key, repeats, cached_only)
        if choice is not None:
            predictor.use_memory_format(choice.memory_format)
    logger.info("memory format: %s", choice)
    return choice


def _choose_format_on_worker(spec: ModelSpec, device: str, precision: str, batch_shape: tuple[int, ...],
                             key: dict, repeats: int, cached_only: bool) -> FormatChoice | None:
    """:func:`choose_memory_format` on a dask worker's device (its cache, too, is the worker's)."""
    from .scheduler import worker_device

    predictor = Predictor(spec.load().module, resolve_device(worker_device(device)), precision)
    return choose_memory_format(predictor, batch_shape, key, repeats=repeats, cached_only=cached_only)


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
