"""Validate and plan a run, writing nothing; then create its output and markers.

:func:`prepare` runs every check (options, paths, input, mask, model, the
network's dry run, an earlier run's markers) and plans the block grid, the
output layout and the batch, returning a :class:`Prepared` run.  Nothing is
created at the output path until every check has passed: a bad option, a
missing input, a model that does not fit the volume or an existing output
(without ``overwrite``) raises a :class:`~blockpred.errors.BlockpredError`
and leaves the disk as it was.  :func:`~blockpred.run.output.create_output` then writes the
markers and the empty output (:mod:`blockpred.run.output`).  The block, halo,
batch and memory format come from :func:`blockpred.run.choose.plan_layout`.
``blockpred plan`` stops after :func:`prepare`; ``blockpred run`` goes on to
:mod:`blockpred.run.runner`.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from ..cluster.jobqueue import job_settings
from ..config import MEMORY_FORMATS, RunConfig, make_config
from ..errors import InvalidOptionError, ModelLoadError, OutputExistsError
from ..geometry import Box, Coord
from ..io import (
    VolumePath,
    check_input_volume,
    check_storage_options,
    identity,
    parse_volume_path,
    volume_exists,
)
from ..io.base import folder_format
from ..models.bioimageio import is_package
from ..models.planes import check_halo
from ..pipeline import DeviceSteps, PipelineSettings, Predictor, resolve_device
from ..pipeline.blocking import small_block_warning
from ..pipeline.job import ModelSpec
from ..pipeline.markers import DoneMarkers, as_json, describe_changes, markers_path
from ..pipeline.padding import read_padded
from ..tuning.defaults import Defaults
from ..tuning.hostbudget import named_block_warning, run_budget
from ..tuning.passmemory import remember
from ..tuning.precision import AUTO
from ..tuning.search import choose_search
from ..tuning.shapes import KnownShapes
from .choose import network_field_of, plan_layout, start_format
from .checks import CheckCache, check_auto, check_key, start_precision
from .cpu_precision import LOW, CpuPrecision, compare_with_fp32, openvino_bf16, slow_precision_warning
from .fingerprint import fingerprint as run_fingerprint
from .fingerprint import finished_layout
from .formats import choose_format, model_key_of, wants_backend
from .layout import block_step
from .mask import Mask
from .normalization import resolve_normalization
from .output import check_inodes, check_place_free
from .plan import count_left
from .prepared import Prepared
from .sizes import check_channels

logger = logging.getLogger(__name__)


def default_output_path(source: VolumePath) -> VolumePath:
    """A sibling dataset ``prediction`` inside a container, else a new container beside the input.

    A precomputed input's dataset is its scale: its output is a new volume beside it (``em`` -> ``em.prediction``).
    A TIFF input is read-only, and an HDF5 input's file is never written unasked (HDF5 has no journal: a crash
    while the output is written could leave the whole file unreadable, the input with it): their output is a
    zarr beside the file (``f.h5:/raw`` -> ``f.prediction.zarr``).
    """
    if source.format in ("tiff", "hdf5"):
        stem = source.container.name.split(".")[0] or source.container.name
        return VolumePath("zarr", source.container.with_name(stem + ".prediction.zarr"), "")
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
    if target.format == "tiff":
        raise InvalidOptionError(f"cannot write {str(target)!r}: TIFF inputs are read-only; write the output to a "
                                 f".zarr, .n5 or .h5 path")
    if target.format == "hdf5" and not target.dataset:
        raise InvalidOptionError(f"HDF5 output {str(target)!r} names no dataset; use for example {target}prediction")
    guarded = [(role, protected) for role, protected in (("input", source), ("mask", mask)) if protected is not None]
    for role, protected in guarded:
        _check_apart(protected, target, role)
    for role, protected in guarded:
        if _made_container_holds(target, protected):
            raise InvalidOptionError(
                f"output {str(target)!r} would make {target.container} (the folder {os.path.realpath(target.container)}"
                f"), which is no {target.format} container, into one, and it holds the {role} {str(protected)!r}; "
                f"write the output to a new container, or beside the {role} in its own"
            )
    markers = markers_path(target)
    for role, protected in guarded:
        if identity.overlap(identity.data_node(protected), markers):
            raise InvalidOptionError(
                f"the markers of output {str(target)!r} would be written at {markers}, which is or holds the "
                f"{role} {str(protected)!r}; choose another output"
            )
    if overwrite:
        link = identity.link_in_the_way(identity.data_node(target))
        if link is not None:
            raise InvalidOptionError(
                f"output {str(target)!r} is a symbolic link to {os.path.realpath(link)}"
                f"{'' if os.path.exists(link) else ', which does not exist'}; --overwrite does not delete "
                f"through links: name the real path, or remove the link"
            )
    for role, protected in guarded:  # accepted: said once every refusal is ruled out
        if _same_hdf5_file(protected, target):
            logger.warning("writing the output into the %s's own HDF5 file %s: HDF5 has no journal, so a crash while "
                           "it writes (a kill, a full disk, a lost node) can leave the whole file unreadable, the %s "
                           "with it; write the output to a file of its own (such as %s) to keep the %s safe", role,
                           target.container, role, default_output_path(protected), role)


def _same_hdf5_file(source: VolumePath, target: VolumePath) -> bool:
    """True when ``target`` is a dataset of ``source``'s HDF5 file, whatever names reach it."""
    return (source.format == target.format == "hdf5" and source.container.exists()
            and identity.same_file(source.container, target.container))


def _made_container_holds(target: VolumePath, source: VolumePath) -> bool:
    """True when the output's container is an existing folder, not yet a container, that holds ``source``:
    creating the output would write a container's metadata beside the input (a link to its parent folder)."""
    if target.format not in ("zarr", "n5") or not target.dataset or target.is_remote:
        return False
    container = target.container
    if not container.is_dir() or folder_format(container) == target.format:
        return False
    return identity.within(identity.data_node(source), container)


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


def resolve_paths(input, output, config, options: dict) -> tuple[RunConfig, VolumePath, VolumePath]:
    """The options as a config, and the input and output paths, checked against each other.

    With one device and neither ``workers`` nor ``scheduler``, the run is
    ``local``: a dask cluster of one worker would add its start-up, a second
    model load and (on a GPU) a second CUDA context, and give nothing back
    (issue 9 measured one H100 at 0.83 of model-only speed in this process,
    0.34 through one dask worker).  ``workers=1`` still runs through dask.
    """
    cfg = make_config(config, **options)
    job_settings(cfg, 1)  # batch-job options only with --cluster, and --cluster with no other cluster
    if not cfg.local and cfg.workers is None and cfg.scheduler is None and cfg.cluster is None:
        from ..cluster.local import local_worker_envs

        if len(local_worker_envs(cfg.device, None)) == 1:
            cfg = cfg.replace(local=True)
    source_path = parse_volume_path(input, cfg.storage_options)
    target_path = (parse_volume_path(output, cfg.storage_options) if output is not None
                   else default_output_path(source_path))
    mask_path = parse_volume_path(cfg.mask, cfg.storage_options) if cfg.mask is not None else None
    check_storage_options(cfg.storage_options, source_path, target_path, mask_path)
    check_output_path(source_path, target_path, overwrite=cfg.overwrite, mask=mask_path)
    check_written_places(cfg, [("input", source_path), ("mask", mask_path), ("output", target_path),
                               ("output's markers", markers_path(target_path).parent)])
    if target_path.format == "n5" and cfg.output_dtype.name == "float16":
        raise InvalidOptionError("N5 has no float16; use --output-dtype float32 or uint8 for an N5 output")
    if target_path.format == "precomputed":  # one scale, a data type precomputed has
        from ..io.precomputed import check_output

        check_output(target_path, cfg.output_dtype)
    return cfg, source_path, target_path


def check_written_places(cfg: RunConfig, protected: list[tuple[str, VolumePath | None]]) -> None:
    """Every place a run writes besides its output is apart from the input, the mask and the output.

    The progress events, the cache directory, and a batch cluster's TLS credentials and logs: each is
    refused in one line where it is, or lies inside, one of the ``protected`` volumes' containers
    (:func:`blockpred.io.identity.refuse_inside`), before anything is opened for writing.
    """
    from ..cache import default_cache_dir
    from ..events import check_destination

    places = [("the cache directory ($BLOCKPRED_CACHE_DIR, else $XDG_CACHE_HOME/blockpred)", default_cache_dir())]
    if isinstance(cfg.progress_json, str) and cfg.progress_json not in ("", "-"):
        places.append(("--progress-json", cfg.progress_json))
    settings = job_settings(cfg, 1)
    if settings is not None:
        from ..cluster.jobqueue import written_folders

        places += written_folders(settings)
    for what, place in places:
        identity.refuse_inside(place, what, protected)
    check_destination(cfg.progress_json)  # then: a folder, a missing folder, a file that is no progress log


def prepare(cfg: RunConfig, source, source_path: VolumePath, target_path: VolumePath,
            on_paths_checked: Callable[[DoneMarkers | None], None] | None = None, measure: bool = True,
            plan_only: bool = False) -> Prepared:
    """Every check and the plan; writes nothing (see :func:`create_output`).

    ``measure=False`` (``blockpred plan``) leaves ``memory_format="auto"`` and
    the measured defaults unmeasured (what is cached is used): the run
    measures them.  ``plan_only`` (``blockpred plan``): the network runs at a
    small block only (see :func:`~blockpred.run.choose.plan_layout`).

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
        check_place_free(target_path)
    resumed = previous is not None and not cfg.overwrite  # an earlier run of these settings goes on
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
        from ..cluster.local import check_hdf5_writers, local_worker_envs

        check_hdf5_writers(target_path, cfg.jobs or 1 if cfg.cluster is not None
                           else len(local_worker_envs(cfg.device, cfg.workers)))
    if on_paths_checked is not None:
        on_paths_checked(previous if resumed else None)
    mask = (Mask.open(parse_volume_path(cfg.mask, cfg.storage_options), source.spatial_shape)
            if cfg.mask is not None else None)
    device = _client_device(cfg)
    if is_package(cfg.model):  # bioimage.io: normalisation none, the volume's statistics for every worker
        from .package_stats import configure_run

        cfg = configure_run(cfg, source, previous if resumed else None, source_path, plan_only=not measure)
    cfg, normalize_note = resolve_normalization(cfg, source, package=is_package(cfg.model))
    spec = ModelSpec(cfg.model, cfg.weights, cfg.model_kwargs, cfg.trust_pickle, cfg.plane)
    model = spec.load()
    in_channels = source.num_channels or 1
    if model.in_channels is not None and model.in_channels != in_channels:
        raise ModelLoadError(
            f"network {model.name!r} takes {model.in_channels} input channel(s) but {source_path} has {in_channels}"
        )
    if model.plane is not None and cfg.halo is not None:
        check_halo(cfg.halo, model.plane, model.name)
    if cfg.memory_format == "auto" and cfg.compile != "off":
        raise InvalidOptionError("--memory-format auto measures both layouts uncompiled; with --compile name the "
                                 "layout: --memory-format contiguous or channels_last")
    from ..models.tta import with_tta

    module = with_tta(model.module, cfg.tta)
    jobs = job_settings(cfg, 1)
    precision, precision_note = start_precision(cfg, device, jobs)
    predictor = Predictor(module, device, precision, compile=cfg.compile, memory_format=start_format(cfg),
                          backend="torch" if cfg.backend == "auto" else cfg.backend,
                          backend_key=model_key_of(cfg, model))
    if cfg.backend == "auto" and openvino_bf16(cfg, model, predictor):  # bf16 on AMX or AVX512-BF16: unmeasured
        cfg = cfg.replace(backend="openvino")
        predictor.use_backend("openvino")
    auto = cfg.precision == AUTO
    cpu_check = None  # a named fp16 or bf16 on the CPU, against fp32 on the first block
    # What the network showed (its output at each shape it ran, the precision checks): cached once the run is accepted.
    known, checks_cache = KnownShapes(model_key_of(cfg, model), in_channels), CheckCache()

    def first_block(geometry, halo: Coord):
        """The start block at the ROI's first corner (C, Z, Y, X), and the steps that normalise it."""
        box = Box.from_shape(geometry.input_shape, roi.begin - halo - geometry.context)
        sample = read_padded(source, box, cfg.pad_mode, cfg.pad_value)
        scale, offset = cfg.normalize.scale_offset(source.dtype)
        return sample if source.num_channels else sample[None], DeviceSteps(scale=scale, offset=offset)

    def check_precision_on_first_block(geometry, halo: Coord) -> None:
        """``--precision auto`` at a low precision: the start block at the ROI's first corner, at it and at fp32;
        a named one on the CPU: the same comparison, timed, for the summary and the slow warning."""
        nonlocal precision_note, cpu_check
        if not auto:
            key = check_key(model_key_of(cfg, model), predictor, cfg.normalize, source.dtype)
            cpu_check = checks_cache.get_or_run(
                key, CpuPrecision, lambda: compare_with_fp32(predictor, module, *first_block(geometry, halo)))
            precision_note = str(cpu_check)
            return
        precision_note = check_auto(predictor, module, lambda: first_block(geometry, halo), checks_cache,
                                    lambda: check_key(model_key_of(cfg, model), predictor, cfg.normalize, source.dtype))

    resume_block = resume_halo = None
    if resumed and cfg.block in ("auto", None) and previous.fingerprint.get("block"):
        resume_block = Coord(previous.fingerprint["block"])  # a resume keeps the block it started with
    if resumed and cfg.halo is None and previous.fingerprint.get("halo"):
        resume_halo = Coord(previous.fingerprint["halo"])  # ... and the halo
    # A resume: what is finished (counted, not a value per block), so its defaults are measured for what is left
    # (nothing: not at all).
    num_blocks = previous.grid_shape.prod() if resumed else 0
    todo_share = 1.0 - previous.num_finished() / num_blocks if num_blocks else 1.0
    if jobs is not None and device.type != ("cuda" if jobs.gpus_per_job else "cpu"):
        measure = False  # this machine has not the jobs' device: timing here would choose for the wrong one
    checked = auto and precision in LOW  # auto's low precision: compared with fp32 first
    checked |= not auto and precision in LOW and device.type == "cpu" and measure and cfg.scheduler is None
    # Every block done by a run of these settings: nothing to choose, nothing to run (see .fingerprint).
    finished = (finished_layout(cfg, source, source_path, target_path, model, previous, mask, predictor.precision)
                if resumed else None)
    if finished is not None:
        cfg, layout = finished
    else:
        field = network_field_of(cfg, model, in_channels)
        host_budget = run_budget(cfg, writers=cfg.num_writers or default_io_threads(cfg))  # the CPU's trials' budget
        layout = plan_layout(cfg, source, roi, model, predictor, resume_block, target_path, measure=measure,
                             todo_share=todo_share, after_dry_run=check_precision_on_first_block if checked else None,
                             field=field, resume_halo=resume_halo, host_budget=host_budget, plan_only=plan_only,
                             known=known)
        cfg = cfg.replace(precision=predictor.precision)  # what every worker runs, what markers and caches name
        step = block_step(layout.downsampling, cfg.output_chunks, cfg.shards)
        warnings = [layout.halo.warning() if layout.halo is not None and not resumed else "",  # said at its start
                    small_block_warning(layout.plan, step),
                    cpu_check.warning() if cpu_check is not None else slow_precision_warning(cfg.precision, device,
                                                                                             predictor.backend),
                    _long_run_warning(layout.defaults, device),
                    named_block_warning(host_budget, cfg, layout.plan, layout.batch_size, layout.geometry,
                                        source.dtype, device.type)]
        for warning in filter(None, warnings):
            logger.warning("%s", warning)
    plan, geometry, output = layout.plan, layout.geometry, layout.output
    channels = check_channels(cfg.channels, geometry)
    settings = PipelineSettings(
        batch_size=layout.batch_size, num_readers=cfg.num_readers or default_io_threads(cfg),
        num_writers=cfg.num_writers or default_io_threads(cfg),
        prefetch=cfg.prefetch, pad_mode=cfg.pad_mode, pad_value=cfg.pad_value,
        normalization=cfg.normalize, output_dtype=cfg.output_dtype, channels=channels,
        downsampling=layout.downsampling,
        missing_chunks=cfg.missing_chunks,
        planes_along=getattr(model.module, "planes_along", None),  # a 2D package's per-plane statistics
    )
    fingerprint = as_json(run_fingerprint(cfg, source, source_path, model, plan, output, channels, mask))
    if resumed:
        changes = describe_changes(previous.fingerprint, fingerprint)
        if changes:
            started_at = previous.fingerprint.get("precision", cfg.precision)
            resume_at = (f"--precision {started_at} goes on at the precision it was started with, "
                         if auto and started_at != cfg.precision else "")
            raise OutputExistsError(
                f"output {str(target_path)!r} was made with other settings ({'; '.join(changes)}); "
                f"{resume_at}pass --overwrite to start again, or choose another output"
            )
    masked = mask.covered(plan) if mask is not None and not resumed else None
    work = count_left(plan, output.write_unit, masked=masked, previous=previous if resumed else None)
    check_inodes(target_path, plan, layout.output, work.files)
    format_choice = layout.format_choice
    backend_open = finished is None and layout.defaults is None and wants_backend(cfg, model, predictor)
    if format_choice is None and measure and finished is None and cfg.backend in ("auto", "torch") and (cfg.memory_format == "auto" or backend_open or (
            cfg.memory_format is None and cfg.compile == "off" and layout.defaults is None)):
        # Asked for, or left to blockpred in a run that asked for size trials (--block/--batch-size auto).
        layouts = MEMORY_FORMATS if cfg.memory_format in ("auto", None) else (cfg.memory_format,)
        format_choice = choose_format(cfg, model, predictor, (1, in_channels) + tuple(plan.input_shape),
                                      layouts=layouts, backends=("torch", "openvino") if backend_open else ("torch",))
    search = None
    if not plan_only:  # every check passed: the count the memory check made is kept for the next run
        remember(layout.pass_memory)
        known.save()
        checks_cache.save()
        workers = 1 if cfg.local else cfg.workers or cfg.jobs or _local_gpus() or 1
        batches = -(-(plan.num_blocks - work.num_masked - work.num_done) // layout.batch_size)
        search = choose_search(predictor, (layout.batch_size, in_channels) + tuple(plan.input_shape),
                               batches / workers, model_key_of(cfg, model), measure=measure and cfg.local)
        logger.info("%s", search)
    return Prepared(cfg, source_path, target_path, model, spec, predictor, layout, channels, settings, fingerprint,
                    resumed, previous, masked, format_choice, precision_note, work, search, normalize_note)


#: A run estimated longer than this (seconds) says so before it starts.
LONG_RUN_S = 600.0


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
