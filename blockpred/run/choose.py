"""A run's block, halo, batch and memory format: named by the options, else the model's, cached or measured.

:func:`plan_layout` takes what the options name and fills in the rest: the
start block (the model's default, 64^3, or a larger one for a network that
reads no halo), the halo (the model's, a valid network's none), then the
measured defaults (:mod:`blockpred.tuning.defaults`: a bounded quick search, cached)
or the full trial search of ``--block auto`` / ``--batch-size auto``
(:mod:`blockpred.tuning.autosize`), each ending in the network's dry run at the
chosen block (:mod:`blockpred.tuning.network`).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ..config import MEMORY_FORMATS, RunConfig
from ..errors import ModelLoadError
from ..geometry import Coord
from ..io import VolumePath, supports_sharding
from ..models.field import NetworkField, network_field, stated_field
from ..models.planes import stack_axis
from ..pipeline import Predictor, is_out_of_memory
from ..pipeline.blocking import BlockPlan, blocks_per_axis, plan_blocks
from ..tuning.autosize import SizeChoice, Trial, probe_block, quick_trial_passes
from ..tuning.defaults import Defaults, measuring_budget
from ..tuning.hostbudget import HostBudget
from ..tuning.memformat import FormatChoice
from ..tuning.network import NetworkGeometry, geometry_at, probe_network
from ..tuning.passmemory import PassMemory
from ..tuning.shapes import KnownShapes
from ..tuning.tensors import over_index_limit
from .formats import (
    BACKEND_BUDGET_FRACTION,
    OPENVINO_TRIAL_PASSES,
    OPENVINO_TRIAL_S,
    choose_format,
    model_key_of,
    wants_backend,
)
from .halo import HaloChoice, choose_halo, cut_to_volume, grow_start_block
from .layout import OutputLayout, block_step, choose_layout
from .memcheck import check_block, check_limit, foresee, least_block, measure_input
from .sizes import auto_size, index_limited, on_cuda

logger = logging.getLogger(__name__)

#: Block core when neither the options nor the model say (rounded to the downsampling).
DEFAULT_BLOCK = Coord((64, 64, 64))
#: Start block of a network that reads no halo and no context (pointwise: a copy, a threshold, a stand-in):
#: no block wastes any halo, so the larger block pays its per-block costs (reads, writes, markers) 16x less
#: often (the copy network's command: 64^3 ran at 0.6 of this block's Mvox/s).
ZERO_HALO_BLOCK = Coord((64, 256, 256))


def _choose_block(config: RunConfig, model_block: Coord | None, downsampling: Coord, roi_shape: Coord,
                  halo: HaloChoice | None = None, keep: bool = False, smallest: Coord | None = None) -> Coord:
    """The block the options name; else the model's default (or 64^3, grown where a measured halo would
    cost more than it writes: :func:`blockpred.run.halo.grow_start_block`); either no larger than the ROI
    needs (:func:`cut_to_roi`, ``smallest``: see there).  ``keep``: a named block stays as it is (the one the
    run being resumed started with, or the one input shape a package takes)."""
    step = block_step(downsampling, config.output_chunks, config.shards)
    if config.block is not None:
        return config.block if keep else cut_to_roi(config.block, roi_shape, step, smallest, named=True)
    block = model_block if model_block is not None else DEFAULT_BLOCK
    if model_block is None and halo is not None and halo.source == "field":
        block = grow_start_block(block, halo.halo, step, halo.plane_axis)
    return cut_to_roi(block, roi_shape, step, smallest)


def cut_to_roi(block: Coord, roi_shape: Coord, step: Coord, smallest: Coord | None = None,
               named: bool = False) -> Coord:
    """``block`` cut, on the axes where it is longer than the ROI, to the ROI rounded up to ``step`` (the network's
    downsampling, and the output's chunks and shards): a small volume gets one small block rather than one mostly
    made of padding, whose dry run alone may take minutes (--block 1024 on a 32x128x128 volume ran the
    network on 1044^3 voxels).  Never below ``smallest``, the smallest block whose input the network takes
    (:func:`smallest_block`).  ``named``: the options named it, and one line (logged at INFO) says so.
    An axis off the grid is left as it is, for :func:`blockpred.pipeline.blocking.check_block_on_grid` to refuse."""
    least = smallest if smallest is not None else Coord((1, 1, 1))
    fitted = Coord(-(-max(r, m) // s) * s for r, m, s in zip(roi_shape, least, step))
    cut = Coord(min(b, f) for b, f in zip(block, fitted))
    if named and cut != block:
        logger.info("block %s is larger than the ROI %s: cut to %s", "x".join(map(str, block)),
                    "x".join(map(str, roi_shape)), "x".join(map(str, cut)))
    return cut


def smallest_block(model, field: NetworkField | None, halo: Coord) -> Coord | None:
    """The smallest block whose input the network takes: its smallest input (found by dry runs, else stated by a
    package) less the halo and a valid network's context on each side; None where neither says."""
    if field is not None:
        low, context = field.grid.min_shape, field.grid.context
    else:
        stated = getattr(model.module, "min_shape", None)
        if stated is None or len(stated) != 3:
            return None
        low, context = Coord(stated), Coord((0, 0, 0))
    return Coord(max(1, m - 2 * (h + c)) for m, h, c in zip(low, halo, context))


def network_downsampling(cfg: RunConfig, model, field: NetworkField | None = None) -> Coord:
    """The downsampling named, else the one found (the network's field), else the one the model states."""
    if cfg.downsampling is not None:
        return cfg.downsampling
    return field.downsampling if field is not None else model.downsampling


def network_field_of(cfg: RunConfig, model, in_channels: int) -> NetworkField | None:
    """The network's grid and receptive field (:mod:`blockpred.models.field`): stated by a preset or a
    module that names its ``receptive_radius``, else found by dry runs and measured (cached per network).
    None where finding them failed (the run goes on with what the model states, as before)."""
    plane_axis = stack_axis(model.plane) if model.plane is not None else None
    if model.receptive_radius is not None:
        return stated_field(network_downsampling(cfg, model), model.receptive_radius) if model.padding != "valid" \
            else None  # a valid network's context is found by the dry run
    if any(getattr(model.module, "fixed", ()) or ()):  # a package of one input shape: its block is that shape
        return None
    named = cfg.downsampling
    hint = named if named is not None else (model.downsampling if model.downsampling != Coord((1, 1, 1)) else None)
    stated_min = getattr(model.module, "min_shape", None)  # a package's smallest input: the first shape tried
    try:
        return network_field(model.module, in_channels, model_key_of(cfg, model), hint=hint,
                             trusted=named is not None, plane_axis=plane_axis,
                             first_base=Coord(stated_min) if stated_min is not None and len(stated_min) == 3 else None)
    except ModelLoadError as err:  # the start block's dry run says what is wrong, if anything is
        logger.warning("%s; the receptive field is not measured: going on with downsampling %s", err,
                       ",".join(map(str, network_downsampling(cfg, model))))
        return None


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
    #: The halo and where it came from, with the network's receptive field (see :mod:`blockpred.run.halo`).
    halo: HaloChoice | None = None
    #: The network's downsampling: named, found, or stated by the model.
    downsampling: Coord = Coord((1, 1, 1))
    #: The memory of its pass per voxel, counted for the check before the dry run (cached once the run is
    #: accepted: :func:`blockpred.tuning.passmemory.remember`); None where not counted.
    pass_memory: PassMemory | None = None


def plan_layout(cfg: RunConfig, source, roi, model, predictor: Predictor, resume_block: Coord | None,
                target_path: VolumePath, measure: bool = True, todo_share: float = 1.0,
                after_dry_run: Callable[[NetworkGeometry, Coord], None] | None = None,
                field: NetworkField | None = None, resume_halo: Coord | None = None,
                host_budget: HostBudget | None = None, plan_only: bool = False,
                known: KnownShapes | None = None) -> Layout:
    """Block, halo, output layout and batch from the options, the model's defaults or trials; checked; dry-run.

    ``after_dry_run(geometry, halo)`` runs once the start block's dry run is done, before anything is measured
    (``--precision auto``'s check, which may change the predictor's precision).  ``field``: the network's
    grid and receptive field (:func:`network_field_of`), which give the downsampling and the default halo;
    ``resume_block`` / ``resume_halo``: what the run being resumed started with (kept where none is named).
    ``host_budget``: the host memory the CPU's size trials keep to (:mod:`blockpred.tuning.hostbudget`).
    The block's memory is checked before its dry run (:mod:`blockpred.run.memcheck`).  ``plan_only``
    (``blockpred plan``): the dry runs go at the least block (:func:`~blockpred.run.memcheck.least_block`), and
    their geometry is taken to the block (:func:`~blockpred.tuning.network.geometry_at`): the network never runs
    at a block the plan only foresees.  ``known``: the shapes the network ran at (:mod:`blockpred.tuning.shapes`):
    a dry run at one of them runs nothing (not with ``plan_only``, whose dry runs time a pass).
    """
    downsampling = network_downsampling(cfg, model, field)
    plane_axis = stack_axis(model.plane) if model.plane is not None else None
    if cfg.halo is None and resume_halo is not None:
        halo_choice = HaloChoice(resume_halo, "named", field, None if field is None else field.exact_halo,
                                 plane_axis=plane_axis)
    else:
        halo_choice = cut_to_volume(choose_halo(named=cfg.halo, model_halo=model.default_halo, field=field,
                                                downsampling=downsampling, plane_axis=plane_axis,
                                                valid=model.padding == "valid", checked=model.kind == "bioimageio"),
                                    source.spatial_shape, downsampling)
    # On the CPU, where the grid and field were just measured, the network has run in this process: its dry run
    # is warm enough to stand for the measured defaults' timed pass (see _measured_defaults), so it keeps its data.
    probe = functools.partial(probe_network, sizes=None if field is None else field.grid.sizes_taken(),
                              count=index_limited(cfg, predictor), known=None if plan_only else known,
                              keep_sample=field is not None and not field.cached and not on_cuda(cfg, predictor))
    auto_block = cfg.block == "auto"
    keeps_block = cfg.block in ("auto", None) and resume_block is not None  # a resume keeps its block
    start_block = resume_block if keeps_block else (None if auto_block else cfg.block)
    fixed = any(getattr(model.module, "fixed", ()) or ())  # a package of one input shape: its block is that shape
    smallest = smallest_block(model, field, halo_choice.halo)
    block = _choose_block(cfg.replace(block=start_block), model.default_block, downsampling, roi.shape, halo_choice,
                          keep=keeps_block or fixed, smallest=smallest)
    searching = auto_block and resume_block is None
    base_block = block
    if searching:  # the dry run on a small block: the default one may not fit the device
        block = probe_block(block, downsampling)

    def layout_for(block: Coord) -> OutputLayout:
        return choose_layout(block=block, volume_shape=source.spatial_shape, chunks=cfg.output_chunks,
                             shards=cfg.shards, can_shard=supports_sharding(target_path), target=str(target_path))

    output = None if searching else layout_for(block)
    # Nothing measured or stated: the fallback halo (none for a network that says it is valid), which the dry run
    # drops below where it shows a valid network the model did not announce.
    halo_defaulted = halo_choice.source in ("fallback", "valid") and field is None and resume_halo is None
    halo = halo_choice.halo
    # Check block, halo, chunks and ROI before the (possibly slow) dry run.
    plan_blocks(volume_shape=source.spatial_shape, block_shape=block, halo=halo, roi=roi,
                downsampling=downsampling, chunk_shape=None if output is None else output.write_unit)
    in_channels = source.num_channels or 1
    step = block_step(downsampling, cfg.output_chunks, cfg.shards)
    least = least_block(step, roi.shape, smallest)
    foresight = None if fixed else foresee(
        cfg, predictor, model_key_of(cfg, model), host_budget or HostBudget(cfg.memory_limit, prefetch=cfg.prefetch),
        measure_input=_valid_input_hint(model, measure_input(downsampling), field) or measure_input(
            downsampling, None if field is None else field.grid.min_shape),
        halo=halo, downsampling=downsampling, raw_dtype=source.dtype, in_channels=in_channels)
    batch = cfg.batch_size if isinstance(cfg.batch_size, int) else 1

    def fitted(block: Coord, origin: str) -> Coord:
        """``block``, checked against the memory before its dry run (a start block of blockpred's made smaller)."""
        if foresight is None:
            return block
        return check_block(foresight, block, batch=batch, origin=origin, step=step, least=least)

    if foresight is not None:
        check_limit(foresight, least)
    if not searching:
        block = fitted(block, "resumed" if keeps_block else "default" if start_block is None else "named")
        output = layout_for(block)

    def dry_run(block: Coord, halo: Coord) -> NetworkGeometry:
        """The network's geometry at ``block``: its dry run there, or (``plan_only``) at the least block, whose warm
        pass, timed and scaled by the input's voxels, stands for the block's (``started``: from there)."""
        nonlocal started
        at = least.minimum(block) if plan_only else block
        geometry = probe(predictor, in_channels=in_channels, block=at, halo=halo, downsampling=downsampling,
                         first_input=_valid_input_hint(model, at + halo * 2, field))
        if at == block:
            return geometry
        scaled = geometry_at(geometry, block, halo, downsampling)
        timed = time.perf_counter()
        predictor.output_shape((1, in_channels) + tuple(geometry.input_shape))
        warm_s = time.perf_counter() - timed
        started = time.perf_counter() - warm_s * scaled.input_shape.prod() / geometry.input_shape.prod()
        return scaled

    started = time.perf_counter()
    geometry = dry_run(block, halo)
    if halo_defaulted and geometry.context != Coord((0, 0, 0)) and halo != Coord((0, 0, 0)):
        # The dry run showed a valid network the model did not announce: drop the default halo.
        halo = Coord((0, 0, 0))
        halo_choice = HaloChoice(halo, "valid", field, halo, plane_axis=plane_axis)
        started = time.perf_counter()
        geometry = dry_run(block, halo)
    if (start_block is None and model.default_block is None and halo == Coord((0, 0, 0))
            and geometry.context == Coord((0, 0, 0)) and not searching):
        larger = fitted(_choose_block(cfg.replace(block=None), ZERO_HALO_BLOCK, downsampling, roi.shape,
                                      smallest=smallest_block(model, field, halo)), "default")
        if larger != block:  # nothing to waste in halos: the block that pays its per-block costs least often
            block = larger
            started = time.perf_counter()
            geometry = dry_run(block, halo)
    dry_run_s = time.perf_counter() - started if geometry.ran else None  # None: known, not run (tuning.shapes)
    dry_run_precision = predictor.precision
    if after_dry_run is not None:
        after_dry_run(dry_run(least.minimum(block), halo) if plan_only else geometry, halo)
    batch_size, sizing, defaults, format_choice = cfg.batch_size, None, None, None
    if not searching and batch_size != "auto" and (
            cfg.block is None or batch_size is None or (cfg.memory_format is None and cfg.compile == "off")):
        defaults, sizing, format_choice = _measured_defaults(
            cfg, source, roi, model, predictor, block, halo, geometry, downsampling, dry_run_s,
            block_named=cfg.block is not None or resume_block is not None, measure=measure, todo_share=todo_share,
            host_budget=host_budget, warm=predictor.precision == dry_run_precision)
        batch_size = defaults.batch_size if defaults.batch_size is not None else batch_size
        if defaults.block is not None and defaults.block != block:
            block = defaults.block
            if geometry.context == Coord((0, 0, 0)) and sizing is not None:
                # A 'same' network maps any input on its grid to itself, and its trials (in this run or the
                # cached one) ran this block or one on the same grid (an estimated block, see autosize.pick):
                # no second dry run at a block that may take seconds.
                shape = (block + halo * 2).ceil_div(downsampling) * downsampling
                geometry = replace(geometry, input_shape=shape, output_shape=shape)
            else:
                geometry = probe(predictor, in_channels=in_channels, block=block, halo=halo,
                                 downsampling=downsampling,
                                 first_input=_valid_input_hint(model, block + halo * 2, field))
    elif searching or batch_size == "auto":
        sizing = auto_size(cfg, source, roi, model, predictor, block, base_block, halo, geometry, downsampling,
                           fixed_block=None if searching else block, host_budget=host_budget)
        batch_size = sizing.batch_size
        if sizing.block != block:
            block = sizing.block
            geometry = probe(predictor, in_channels=in_channels, block=block, halo=halo,
                             downsampling=downsampling,
                             first_input=_valid_input_hint(model, block + halo * 2, field))
    if on_cuda(cfg, predictor):
        _warn_over_index_limit(geometry, int(batch_size or 1))
    geometry, output = replace(geometry, sample=None), layout_for(block)
    plan = plan_blocks(volume_shape=source.spatial_shape, block_shape=block, halo=halo, context=geometry.context,
                       input_shape=geometry.input_shape, roi=roi, downsampling=downsampling,
                       chunk_shape=output.write_unit)
    return Layout(plan, geometry, output, int(batch_size or 1), sizing, defaults, format_choice, halo_choice,
                  downsampling, None if foresight is None else foresight.memory)


def _warn_over_index_limit(geometry: NetworkGeometry, batch_size: int) -> None:
    """One line where a block (named, or the start block left unmeasured) makes a tensor CUDA cannot index."""
    elements = over_index_limit(geometry.largest_per_voxel, geometry.input_shape.prod(), batch_size)
    if elements is not None:
        logger.warning(
            "the network makes a tensor of %.2f G elements on a block of input %s at batch %d, over the 2^31 that "
            "cuDNN indexes: expect passes many times slower, or a CUDA error; use a smaller --block (or --block auto)",
            elements / 1e9, "x".join(map(str, geometry.input_shape)), batch_size)


def _measured_defaults(cfg: RunConfig, source, roi, model, predictor: Predictor, block: Coord, halo: Coord,
                       geometry: NetworkGeometry, downsampling: Coord, dry_run_s: float | None, *,
                       block_named: bool,
                       measure: bool, todo_share: float = 1.0, host_budget: HostBudget | None = None,
                       warm: bool = True) -> tuple[Defaults, SizeChoice | None, FormatChoice | None]:
    """The block, batch and memory format the options leave open, measured within the run's budget.

    ``block`` is the start block the dry run took ``dry_run_s`` on (None: its shape was known, nothing ran; a
    pass is timed where measuring needs it, else the cached choice's pass stands for it); see
    :mod:`blockpred.tuning.defaults` for when and how much is measured.  ``todo_share``:
    the share of the blocks still to run (a resume), which the estimate counts.  ``warm``: the predictor ran
    the start block at its precision already (``--precision auto``'s check can leave it at one that did not).

    On CUDA a shape's first pass is many times a warm one (cuDNN tries its kernels for the shape): the
    estimate's pass follows a warm-up where the precision is new, and a trial of a shape not yet run is
    foreseen at its passes plus that first pass's excess on the start block (``cold_s``).  An H200 spent
    11.1 s measuring a run estimated at 9.7 s where trials were foreseen at their warm passes (2026-11-26).
    """
    want_block, want_batch = not block_named, cfg.batch_size is None
    want_format = cfg.memory_format is None and cfg.compile == "off" and cfg.backend in ("auto", "torch")
    here = cfg.scheduler is None  # passes timed here stand for the run's device (else it is a worker's)
    want_backend = wants_backend(cfg, model, predictor)
    blocks = blocks_per_axis(roi, block).prod() * todo_share
    in_channels = source.num_channels or 1
    shape = (1, in_channels) + tuple(geometry.input_shape)
    started = time.perf_counter()
    spent = lambda: time.perf_counter() - started  # noqa: E731
    predictor_start_backend = predictor.backend

    def choose(budget: float, pass_s: float | None = None, backend_budget: float = 0.0, cold_s: float = 0.0,
               reference=None) -> tuple[FormatChoice | None, SizeChoice | None]:
        """What is cached, and within ``budget`` seconds (from ``started``) what is not.

        ``pass_s``: a warm pass of the start block in the predictor's layout (contiguous unless named), timed
        on random data: the layout comparison and the first size trial take it instead of running it again.
        ``backend_budget``: the seconds OpenVINO's trial may take, first (:data:`BACKEND_BUDGET_FRACTION`);
        the layouts' and sizes' trials take what ``budget`` leaves after it.  ``reference``: that pass's batch
        and output where torch ran it in fp32 (a conversion's check takes it: see :func:`choose_format`).
        """
        chosen_format = chosen_sizes = None
        known_format = {predictor.memory_format: pass_s} if pass_s is not None and here else None
        if want_format or want_backend:
            layouts = MEMORY_FORMATS if want_format else (predictor.memory_format,)
            backends = ("torch", "openvino") if want_backend else (predictor.backend,)
            skip: list[str] = []
            cost = 0.0
            if want_backend and pass_s is not None:
                backend_cost = OPENVINO_TRIAL_S + OPENVINO_TRIAL_PASSES * pass_s
                if spent() + backend_cost <= backend_budget:
                    cost = backend_cost
                else:
                    skip.append("openvino")
            if want_format and pass_s is not None:
                # The passes of a quick trial per layout not yet timed (the estimate's pass is the known one's).
                untimed = [name for name in layouts if name not in (known_format or {})]
                if spent() + cost + (quick_trial_passes(predictor.device.type) * pass_s + cold_s) * len(untimed) > budget:
                    skip += untimed
            timed = [name for name in (*layouts, *(("openvino",) if want_backend else ()))
                     if name not in skip and name not in (known_format or {})]
            chosen_format = choose_format(cfg, model, predictor, shape, quick=True, layouts=layouts, backends=backends,
                                           cached_only=pass_s is None or not timed, known=known_format,
                                           skip=tuple(skip), reference=reference)
        if want_block or want_batch:
            known: tuple[Trial, ...] = ()
            seconds = chosen_format.seconds.get(chosen_format.name) if chosen_format is not None else pass_s
            if here and seconds and (chosen_format is None or not chosen_format.cached):
                known = (Trial(block, 1, "ok", block.prod() / seconds / 1e6, seconds),)
            left = budget - spent()
            if here and seconds and chosen_format is not None and not chosen_format.cached \
                    and chosen_format.backend != predictor_start_backend:
                # A backend that won its trial started there (its conversion is its start-up, not measuring):
                # the sizes get the budget of the run it now foresees, from here.
                left = measuring_budget(blocks * seconds)
            # With a known trial the search costs nothing more where the budget is spent: it may still take
            # a larger block untimed (see autosize.pick).
            chosen_sizes = auto_size(cfg, source, roi, model, predictor, block, block, halo, geometry, downsampling,
                                     fixed_block=None if want_block else block, quick_s=max(0.0, left),
                                     cached_only=left <= 0 and not known, known=known, host_budget=host_budget,
                                     cold_s=cold_s)
        return chosen_format, chosen_sizes

    format_choice, sizing = choose(0.0)  # the cache first: a cached run times nothing
    complete = (format_choice is not None or not (want_format or want_backend)) and (
        sizing.complete if sizing is not None else not (want_block or want_batch))  # else a cut-short search goes on
    if dry_run_s is None:
        dry_run_s = _start_pass_s(sizing, format_choice, roi.shape.prod() / blocks_per_axis(roi, block).prod()) \
            if complete or not measure or todo_share <= 0 else None
    if dry_run_s is None:  # measuring needs the start block's first pass, which a known shape did not run
        timed = time.perf_counter()
        predictor.output_shape(shape)
        dry_run_s, started = time.perf_counter() - timed, time.perf_counter()
    estimated, out_of_memory = blocks * dry_run_s, False
    exact = (predictor.backend, predictor.precision, predictor.memory_format) == ("torch", "fp32", "contiguous")
    # The dry run's pass stands for a warm one only where torch ran it: a backend named (--backend openvino)
    # converted, checked and compiled the network in it, and a start block timed so looked several times slower
    # than it runs (unet12 then chose 64^3 at batch 4 over larger blocks).
    sample = geometry.sample if warm and geometry.sample is not None and geometry.sample[0].shape == shape \
        and predictor.backend == "torch" else None
    cuda = predictor.device.type == "cuda"
    # On the CPU a pass is about as long warm as its dry run was: one the budget cannot afford would be timed
    # again for nothing (a 128x512x512 volume in one block: 34 s again, after its 37 s dry run).
    unaffordable = not cuda and sample is None and dry_run_s > measuring_budget(estimated)
    if not complete and measure and measuring_budget(estimated) > 0 and not unaffordable:
        # The dry run was the process's first pass (thread pools, kernels, allocators): time a warm one, unless
        # the network ran in this process before it (the dry run then kept its data: see plan_layout).
        batch = sample[0] if sample is not None else np.random.default_rng(0).random(shape, dtype=np.float32)
        try:
            if cuda and not warm:
                predictor(batch)  # cuDNN's first pass at this precision: not the run's
            started = time.perf_counter() - (dry_run_s if sample is not None else 0.0)
            output = sample[1] if sample is not None else predictor(batch).copy()  # the predictor reuses its arrays
        except Exception as err:  # noqa: BLE001 - out of memory ends the measuring; anything else is the network's
            if not is_out_of_memory(err):
                raise
            predictor.release_memory()  # the run's own recovery (smaller batches, parts) takes over
            out_of_memory = True
        else:
            pass_s = spent()
            estimated = blocks * pass_s
            cold_s = max(0.0, dry_run_s - pass_s) if cuda else 0.0  # a CPU's quick trials time no cold excess
            format_choice, sizing = choose(measuring_budget(estimated), pass_s, BACKEND_BUDGET_FRACTION * estimated,
                                           cold_s, (batch, output) if exact and not cuda else None)
    measured = (format_choice is not None and not format_choice.cached) or (sizing is not None and not sizing.cached)
    found = format_choice is not None or sizing is not None
    if measured:
        how = "measured"
    elif found:
        how = "cached"
    elif todo_share <= 0:
        how = "not measured: every block of this output is done"
    elif not measure and cfg.cluster is not None:
        how = "not measured: this machine has not the jobs' device (name --block and --batch-size)"
    elif not measure:
        how = "not measured yet: the run measures"
    elif out_of_memory:
        how = "not measured: the start block ran out of device memory in a timed pass"
    elif unaffordable and measuring_budget(estimated) > 0:
        how = (f"not measured: a pass at the start block ({dry_run_s:.1f} s, its dry run's) is longer than the "
               f"{measuring_budget(estimated):.1f} s measuring may take of a run estimated at {estimated:.1f} s")
    else:
        how = (f"not measured: the run is estimated at {estimated:.1f} s at the start block, too short "
               f"for measuring to pay")
    defaults = Defaults(
        block=(sizing.block if sizing is not None else block) if want_block else None,
        batch_size=(sizing.batch_size if sizing is not None else 1) if want_batch else None,
        memory_format=(format_choice.memory_format if format_choice is not None else "contiguous")
        if want_format else None,
        backend=(format_choice.backend if format_choice is not None else "torch") if want_backend else None,
        estimated_run_s=estimated, measured_s=spent() if measured else 0.0, how=how)
    return defaults, sizing, format_choice


def _start_pass_s(sizing: SizeChoice | None, format_choice: FormatChoice | None, block_voxels: float) -> float:
    """A pass at the start block as the cached choices tell it (its dry run did not run): the size trials' rate
    over a block's voxels, else the layout's pass, else 0."""
    if sizing is not None and sizing.mvox_per_s > 0:
        return block_voxels / (sizing.mvox_per_s * 1e6)
    seconds = format_choice.seconds.get(format_choice.name) if format_choice is not None else None
    return float(seconds) if isinstance(seconds, (int, float)) and seconds > 0 else 0.0


def start_format(cfg: RunConfig) -> str:
    """The layout the client's predictor (and the size trials) start in: auto and unnamed start contiguous."""
    return "contiguous" if cfg.memory_format in ("auto", None) else cfg.memory_format


def _valid_input_hint(model, output_shape: Coord, field: NetworkField | None = None) -> Coord | None:
    """For a valid network, an input shape it accepts: the one that yields ``output_shape`` where its
    context was found (:mod:`blockpred.models.field`), else where the network can tell (the built-in U-Net can)."""
    if field is not None and any(field.grid.context):
        return output_shape + field.grid.context * 2
    shape_for = getattr(model.module, "valid_input_shape", None)
    if model.padding != "valid" or shape_for is None:
        return None
    return Coord(shape_for(output_shape))
