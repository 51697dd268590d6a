"""``blockpred.predict`` and ``blockpred.plan``: prepare a run, then execute it and summarise.

:mod:`blockpred.run.prepare` checks and plans (writing nothing until every check
has passed); this module creates the output through it, runs the blocks in
this process or on dask (:mod:`blockpred.cluster.scheduler`), shows progress
(:mod:`blockpred.progress`) and returns a :class:`PredictionSummary`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import RunConfig
from ..errors import (
    BlockFailedError,
    BlockpredError,
    InvalidOptionError,
    RunFailedError,
    is_permanent,
    one_line,
    os_reason,
    output_error,
)
from ..events import ProgressEvents
from ..io import VolumePath, open_volume
from ..io.ownership import OutputLock, check_free, lock_path
from ..models.planes import in_plane, stack_axis
from ..pipeline import Backoff, Predictor, RunStats
from ..pipeline.blocking import Block, BlockPlan
from ..pipeline.hostmem import peak_resident_bytes
from ..pipeline.job import Job, run_job
from ..pipeline.markers import DoneMarkers, markers_path
from ..progress import ProgressBar
from ..tuning.autosize import SizeChoice, confirm_guess
from ..tuning.defaults import Defaults
from ..tuning.memformat import FormatChoice
from .arrays import array_input, predict_array
from .formats import model_key_of
from .output import create_output
from .plan import MIN_RECORDED_S, RunPlan, Throughput, ThroughputLog
from .prepare import prepare, resolve_paths
from .prepared import Prepared

if TYPE_CHECKING:
    from ..cluster.local import Cluster
    from .halo import HaloChoice
    from .pyramid import PyramidSummary

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PredictionSummary:
    """What :func:`predict` did.  Mvox/s counts output voxels of the ROI per second of pipeline."""

    #: The paths read and written; an array input is described (``numpy array 16x32x32 uint8``), and a prediction
    #: returned as an array is ``numpy array``.
    input: str
    output: str
    model: str
    device: str
    plan: BlockPlan
    stats: RunStats
    #: Blocks found already finished (done or skipped) by an earlier run, so not run again.
    num_resumed: int = 0
    #: Per dask worker: name -> WorkerSummary; empty for an in-process (``local``) run.
    workers: dict = field(default_factory=dict)
    #: The batch size the run started with.
    batch_size: int = 1
    #: What ``block="auto"`` / ``batch_size="auto"`` chose (None when not asked).
    sizing: SizeChoice | None = None
    #: What ``memory_format="auto"`` (or the measured defaults) chose (None when not asked).
    memory_format: FormatChoice | None = None
    #: What the run chose for the block, batch and memory format it was not given (see :mod:`blockpred.tuning.defaults`).
    defaults: Defaults | None = None
    #: The pyramid written below the output (``pyramid=N``), else None.
    pyramid: "PyramidSummary | None" = None
    #: The output's dtype (what NaN and inf became depends on it).
    output_dtype: str = "float32"
    #: Wall-clock times (``time.time()``): the run's start (``predict`` called; the process's start for the
    #: command) and the pipeline's (its first block read).  None when not known.
    start_time: float | None = None
    pipeline_time: float | None = None
    #: The planes a 2D network ran on (``yx``, ``zy``, ``zx``), None for a 3D network.
    plane: str | None = None
    #: The precision the blocks ran at, and what ``precision="auto"`` chose it by ("" when named, or fp32 on
    #: the CPU): the first block's check against fp32 (see :mod:`blockpred.tuning.precision`).
    precision: str = ""
    precision_note: str = ""
    #: This process's peak resident memory (bytes) by the run's end: the client's, and an in-process run's
    #: blocks (dask workers' are their own processes'); None when not known.
    peak_rss_bytes: int | None = None
    #: What ran the network: ``torch``, ``openvino``, or ``torch (openvino: <why not>)`` (see
    #: :mod:`blockpred.pipeline.backends`); "" when not known.
    backend: str = ""
    #: The halo, where it came from, and the network's receptive field (see :mod:`blockpred.run.halo`).
    halo: "HaloChoice | None" = None
    #: The normalisation that ran and where it came from (see :mod:`blockpred.run.normalization`).
    normalization: str = ""

    @property
    def started_s(self) -> float | None:
        """Seconds from the run's start to its first block: start-up (imports, model, dry run, measuring)."""
        if self.start_time is None or self.pipeline_time is None:
            return None
        return max(0.0, self.pipeline_time - self.start_time)

    @property
    def mvox_per_s(self) -> float:
        return self.stats.mvox_per_s

    @property
    def planes_per_s(self) -> float | None:
        """A 2D network's whole planes of the ROI per second (None for a 3D network)."""
        if self.plane is None:
            return None
        area = math.prod(in_plane(self.plan.roi.shape, self.plane))
        return self.stats.num_voxels / area / self.stats.seconds if self.stats.seconds > 0 else 0.0

    def __str__(self) -> str:
        s = self.stats
        lines = [f"chosen: {self.defaults}"] if self.defaults is not None else []
        if self.precision_note:
            lines.append(f"precision: {self.precision_note}")
        if self.normalization:
            lines.append(f"normalization: {self.normalization}")
        if self.halo is not None:
            lines.append(self.halo.note())
        if self.backend and self.backend != "torch":
            lines.append(f"backend: {self.backend}")
        if self.sizing is not None and self.defaults is None:
            lines.append(f"auto size: {self.sizing}")
        if self.memory_format is not None and (self.defaults is None or self.defaults.memory_format is None):
            lines.append(f"memory format: {self.memory_format}")
        if self.plane is not None:
            block = self.plan.block_shape
            deep = block[stack_axis(self.plane)] * self.batch_size
            lines.append(f"2D network on {self.plane} planes: {deep} planes of "
                         f"{'x'.join(map(str, in_plane(block, self.plane)))} per pass")
        for w in self.workers.values():
            lines.append(f"  worker {w.name} on {w.device}: {w.num_blocks} blocks, {w.mvox_per_s:.2f} Mvox/s")
        extra = []
        if self.num_resumed:
            extra.append(f"{self.num_resumed} already done")
        if s.num_skipped:
            extra.append(f"{s.num_skipped} skipped")
        more = f" ({', '.join(extra)})" if extra else ""
        recovery = s.recovery_note(self.batch_size)
        if recovery:
            lines.append(recovery)
        if s.num_blocks:
            started = f"started in {self.started_s:.2f} s; " if self.started_s is not None else ""
            device = f"device {s.compute_s:.2f} s" + (f", transfer {s.transfer_s:.2f} s" if s.transfer_s else "")
            memory = (f"; peak memory {self.peak_rss_bytes / 2**30:.2f} GiB" if self.peak_rss_bytes is not None
                      else "")
            lines.append(f"time: {started}stages summed over threads: read {s.read_s:.2f} s, {device}, "
                         f"write {s.write_s:.2f} s{memory}")
        planes = f", {self.planes_per_s:.1f} {self.plane} planes/s" if self.plane is not None else ""
        lines.append(
            f"predicted {s.num_voxels / 1e6:.1f} Mvox in {s.num_blocks} blocks{more} in {s.seconds:.2f} s "
            f"({s.mvox_per_s:.2f} Mvox/s{planes}) with {self.model} on {self.device} -> {self.output}"
        )
        if self.pyramid is not None:
            lines.append(str(self.pyramid))
        # An input that cannot tell a missing chunk (TIFF, HDF5) says so in --json ("counted": false), not each run.
        missing = s.missing_chunks_note() if s.missing_chunks_counted else ""
        lines += [note for note in (s.nonfinite_note(self.output_dtype), missing) if note]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """The summary as JSON values (``blockpred run --json``, the ``end`` event of ``--progress-json``)."""
        s = self.stats
        return {
            "input": self.input, "output": self.output, "model": self.model, "device": self.device,
            "blocks": int(self.plan.num_blocks), "predicted_blocks": s.num_blocks, "resumed_blocks": self.num_resumed,
            "skipped_blocks": s.num_skipped, "voxels": s.num_voxels, "seconds": round(s.seconds, 3),
            "mvox_per_s": round(s.mvox_per_s, 3),
            "plane": self.plane,
            "planes_per_s": None if self.plane is None else round(self.planes_per_s, 3),
            "started_s": None if self.started_s is None else round(self.started_s, 3),
            "block": list(self.plan.block_shape), "halo": list(self.plan.halo), "batch_size": self.batch_size,
            **({k: v for k, v in self.halo.as_dict().items() if k != "halo"} if self.halo is not None else {}),
            "precision": self.precision or None, "precision_note": self.precision_note or None,
            "normalization": self.normalization or None,
            "backend": self.backend or None, "peak_rss_bytes": self.peak_rss_bytes,
            "output_dtype": self.output_dtype,
            "chosen": None if self.defaults is None else str(self.defaults),
            "stages_s": {name: round(getattr(s, f"{name}_s"), 3) for name in ("read", "transfer", "compute", "write")},
            "workers": {w.name: {"device": w.device, "blocks": w.num_blocks, "mvox_per_s": round(w.mvox_per_s, 3)}
                        for w in self.workers.values()},
            "nonfinite": {"values": s.num_nonfinite, "blocks": s.num_nonfinite_blocks},
            "missing_chunks": {"counted": s.missing_chunks_counted, "distinct": len(s.missing_chunks),
                               "reads": s.num_missing_chunk_reads, "blocks": s.num_missing_chunk_blocks},
            "out_of_memory": s.out_of_memory,
            "pyramid": None if self.pyramid is None else str(self.pyramid),
        }

    def warnings(self) -> list[str]:
        """Values written that may be wrong without an error: NaN or inf outputs, missing input chunks."""
        counted = self.stats.missing_chunks_counted and self.stats.num_missing_chunk_reads
        return [note for note in (self.stats.nonfinite_note(self.output_dtype),
                                  self.stats.missing_chunks_note() if counted else "") if note]


def predict(input: str | os.PathLike | Any, output: str | os.PathLike | None = None, *,
            config: str | os.PathLike | None = None, start_time: float | None = None, return_summary: bool = False,
            **options: Any) -> PredictionSummary | Any:
    """Predict ``input`` with a network, block by block, into ``output``.

    ``input`` is a path to a volume, or an array: numpy, dask or zarr (zarr-python 3), of (z, y, x) or
    (c, z, y, x), read and never written (see :mod:`blockpred.run.arrays`).  Anything else is refused in one line.

    ``options`` are those of :class:`blockpred.config.RunConfig` (``model``,
    ``block``, ``halo``, ``device``, ``precision``, ``batch_size``, ``normalize``,
    ``output_dtype``, ``roi``, ``overwrite`` ...); they override the YAML file
    ``config``.  Without ``output`` a path's prediction goes next to the input (see
    :func:`default_output_path`).  Returns a :class:`PredictionSummary`, except for an array input without
    ``output``: its prediction is returned as a numpy array, channels first as it would be stored
    (``(c, z, y, x)``), and must fit in memory (else one line says to name an output); with
    ``return_summary=True`` as ``(array, summary)`` (where the summary is returned, ``return_summary`` changes
    nothing).

    A run on dask starts its cluster (:class:`blockpred.cluster.local.Cluster`) as
    soon as the input and output paths have passed their checks, so the
    workers start while this process loads the model and does its dry run;
    the cluster is closed when ``predict`` returns or raises.

    ``start_time`` (``time.time()``) is when the summary's ``started_s`` counts from: now, unless given (the
    ``blockpred`` command gives its process's start, so that it counts the interpreter's start-up too).
    """
    start_time = time.time() if start_time is None else float(start_time)
    given = array_input(input)
    if given is not None:
        return predict_array(given, output, config, options, return_summary,
                             run=functools.partial(_run, start_time=start_time))
    cfg, source_path, target_path = resolve_paths(input, output, config, options)
    return _run(cfg, source_path, target_path, start_time=start_time)


def _run(cfg: RunConfig, source_path: VolumePath, target_path: VolumePath, *, start_time: float,
         on_prepared: Callable[[Prepared], None] | None = None,
         shown: tuple[str, str] | None = None) -> PredictionSummary:
    """The run of checked paths, with its progress events; ``on_prepared(p)`` is called once it is checked and
    planned, before anything is written; ``shown`` is what the summary calls its input and output (else their
    paths)."""
    with ProgressEvents(cfg.progress_json) as events:
        try:
            summary = _predict(cfg, source_path, target_path, start_time, events, on_prepared)
        except BaseException as err:
            failed = getattr(err, "failed", None)
            events.end(error=_event_error(err), failed_blocks=len(failed) if failed else 0)
            raise
        if shown is not None:
            summary = dataclasses.replace(summary, input=shown[0], output=shown[1])
        events.end(summary.as_dict())
    return summary


def _event_error(err: BaseException) -> str:
    if isinstance(err, KeyboardInterrupt):
        return str(err) or "interrupted"  # "terminated (SIGTERM)": see blockpred.errors.Terminated
    return one_line(err)


def _predict(cfg: RunConfig, source_path: VolumePath, target_path: VolumePath, start_time: float,
             events: ProgressEvents, on_prepared: Callable[[Prepared], None] | None = None) -> PredictionSummary:
    cluster = None
    lock_at = lock_path(markers_path(target_path))
    # The lock outlives the cluster: no worker of this run writes once it is released.
    with contextlib.ExitStack() as owned, contextlib.ExitStack() as stack:

        def start_cluster(previous: DoneMarkers | None) -> None:  # once the input and output paths have passed
            nonlocal cluster
            check_free(lock_at, str(target_path))  # another run on this output: say so now, not after the dry run
            finished = previous is not None and previous.num_finished() == previous.grid_shape.prod()  # nothing left
            if not cfg.local and not finished:
                from ..cluster.jobqueue import job_settings
                from ..cluster.local import WORKER_THREADS, Cluster

                cluster = stack.enter_context(Cluster(cfg.device, cfg.workers, cfg.scheduler,
                                                      jobs=job_settings(cfg, WORKER_THREADS)))

        with open_volume(source_path) as source:
            p = prepare(cfg, source, source_path, target_path, on_paths_checked=start_cluster)
            if on_prepared is not None:
                on_prepared(p)
            if cluster is not None:
                cluster.check()  # a cluster that cannot start (a refused sbatch) fails the run before the output
            lock = owned.enter_context(_take_lock(lock_at, str(target_path)))
            markers = create_output(p, source, owner=lock.token)
            owned.callback(markers.close)  # before the lock goes: its logs closed in this process
        job = Job(_absolute(source_path), _absolute(target_path), markers, p.layout.plan, p.settings, p.spec,
                  device=cfg.device, precision=p.cfg.precision, compile=cfg.compile, memory_format=p.memory_format,
                  skip_empty=cfg.skip_empty, tta=cfg.tta, backend=p.backend, backend_key=model_key_of(p.cfg, p.model),
                  kernel_search=p.search is not None and p.search.on)
        # Nothing is held open from here on: workers (and HDF5's file locks) need the files.
        summary = _execute(cfg, job, p.predictor, p.model.name, str(source_path), str(target_path), p.resumed,
                           cluster, events)
        pipeline_time = time.time() - summary.stats.seconds
        pyramid = _pyramid(cfg, job.target, summary, cluster) if cfg.pyramid else None
    _record_throughput(p, summary)
    _confirm_guess(p, summary)
    for warning in summary.warnings():  # one line each, after the run (the summary repeats them)
        logger.warning("%s", warning)
    return dataclasses.replace(summary, sizing=p.layout.sizing, memory_format=p.format_choice, defaults=p.defaults,
                               pyramid=pyramid, start_time=start_time, pipeline_time=pipeline_time,
                               plane=p.model.plane, precision=p.cfg.precision, precision_note=p.precision_note,
                               halo=p.layout.halo, normalization=p.normalize_note,
                               backend=p.predictor.backend_note if not summary.workers else p.backend,
                               peak_rss_bytes=peak_resident_bytes())


def plan(input: str | os.PathLike, output: str | os.PathLike | None = None, *,
         config: str | os.PathLike | None = None, assume_mvox_per_s: float | None = None,
         gpus: tuple[int, ...] = (1, 2, 4, 8), **options: Any) -> RunPlan:
    """What :func:`predict` with the same arguments would do, with nothing run or written.

    Runs every check and the dry run of the network at a small block (the
    block's memory foreseen from it: a block too large for the memory is refused,
    never run; ``block="auto"`` runs its trials), then counts blocks, masked and finished ones, voxels and output
    files in bulk.  The runtime for each count in ``gpus`` uses
    ``assume_mvox_per_s``, else the last throughput measured for this network
    and precision (see :class:`blockpred.run.plan.ThroughputLog`), else is unknown.
    """
    if assume_mvox_per_s is not None and not assume_mvox_per_s > 0:
        raise InvalidOptionError(f"--assume-mvox-per-s must be a positive number, got {assume_mvox_per_s}")
    if not gpus or any(int(n) <= 0 for n in gpus):
        raise InvalidOptionError(f"GPU counts must be positive, got {list(gpus)}")
    if not isinstance(input, (str, os.PathLike, VolumePath)):
        raise InvalidOptionError(f"blockpred.plan takes a path to a volume (a str or pathlib.Path), got a "
                                 f"{type(input).__name__}; write an array to zarr (docs/data.md) and plan on its path")
    cfg, source_path, target_path = resolve_paths(input, output, config, options)
    with open_volume(source_path) as source:
        p = prepare(cfg, source, source_path, target_path, measure=False, plan_only=True)
        volume_shape, dtype, voxel_size = source.spatial_shape, str(source.dtype), source.voxel_size
    block_plan, work = p.layout.plan, p.work  # counted by prepare with no value per block (plan.count_left)
    if assume_mvox_per_s is not None:
        throughput = Throughput(float(assume_mvox_per_s), "assumed")
    else:
        throughput = ThroughputLog().get(model_key_of(cfg, p.model), p.cfg.precision)
    pyramid: tuple = ()
    if cfg.pyramid:
        from .pyramid import plan_levels

        levels = plan_levels(volume_shape, voxel_size, cfg.pyramid, p.layout.output.chunks, p.layout.output.shards)
        pyramid = tuple(level.shape for level in levels[1:])
    return RunPlan(str(source_path), str(target_path), p.model.name, str(p.predictor.device), p.cfg.precision,
                   volume_shape, dtype, block_plan, p.settings.batch_size, p.out_channels, cfg.output_dtype.name,
                   p.layout.output.chunks, p.layout.output.shards, work.num_masked, work.num_done,
                   work.voxels, work.files, p.resumed, throughput, tuple(int(n) for n in gpus),
                   str(p.defaults) if p.defaults is not None else None, pyramid, cfg.pyramid_method,
                   p.layout.halo.note(label="") if p.layout.halo is not None else None)


def _pyramid(cfg: RunConfig, target_path: VolumePath, summary: PredictionSummary,
             cluster: "Cluster | None") -> "PyramidSummary":
    """The pyramid below the output: on the run's dask workers when it had them, else in this process.

    Levels an earlier run wrote and named stand, unless this run predicted blocks under them.
    """
    from .pyramid import build_pyramid

    # In this process the client is idle by now: its cores (up to 8; a few write units each) make the levels.
    try:
        return build_pyramid(target_path, cfg.pyramid, cfg.pyramid_method,
                             threads=max(2, min(8, os.cpu_count() or 2)), recompute=summary.stats.num_blocks > 0,
                             client=cluster.client() if cluster is not None else None)
    except BlockpredError:
        raise
    except Exception as err:
        if not (isinstance(err, OSError) or is_permanent(err)):
            raise
        reason, _ = os_reason(err)
        raise RunFailedError(
            f"writing the pyramid below {str(target_path)!r} failed: {reason}; the prediction is complete and kept "
            f"(the levels are not named in its metadata): fix that, then run the same command again to write them"
        ) from err


def _record_throughput(p: Prepared, summary: PredictionSummary) -> None:
    """A run long enough to measure leaves its end-to-end Mvox/s per worker for ``blockpred plan``."""
    stats = summary.stats
    if stats.seconds < MIN_RECORDED_S or stats.num_blocks == 0:
        return
    workers = max(1, len(summary.workers))
    ThroughputLog().put(model_key_of(p.cfg, p.model), p.cfg.precision, stats.mvox_per_s / workers,
                        f"blockpred run of {stats.num_blocks} blocks, per worker", summary.device)


def _confirm_guess(p: Prepared, summary: PredictionSummary) -> None:
    """A block the measured defaults chose untimed, timed by this run's own passes (their fastest at the run's
    batch), cached as a trial for the next run (:func:`blockpred.tuning.autosize.confirm_guess`): here, where the
    passes ran in this process at the block and batch chosen, none split by out-of-memory recovery."""
    sizing, stats = p.layout.sizing, summary.stats
    if sizing is None or sizing.guess is None or summary.workers or stats.out_of_memory:
        return
    seconds = stats.fastest_pass_s.get(p.layout.batch_size)
    if seconds:
        confirm_guess(sizing, seconds, p.layout.batch_size, passes=-(-stats.num_blocks // p.layout.batch_size))


def _execute(cfg: RunConfig, job: Job, predictor: Predictor, model_name: str, source: str, target: str,
             resumed: bool, cluster: "Cluster | None", events: ProgressEvents) -> PredictionSummary:
    plan, markers = job.plan, job.markers
    todo = markers.todo_ids()  # in bulk: one boolean per block, never a Python object per block
    # A fresh run's masked-out blocks are this run's skips; a resumed run finds them finished.
    masked = 0 if resumed else int(plan.num_blocks - len(todo))
    num_resumed = int(plan.num_blocks - len(todo)) - masked
    logger.info("predicting %s -> %s: %d blocks of %s (input %s, halo %s), %d already done, %d masked out", source,
                target, plan.num_blocks, tuple(plan.block_shape), tuple(plan.input_shape), tuple(plan.halo),
                num_resumed, masked)
    workers: dict = {}
    on_dask = cluster is not None and len(todo) > 0
    events.start(input=source, output=target, model=model_name, device=cfg.device if on_dask else str(predictor.device),
                 blocks=int(plan.num_blocks), blocks_todo=len(todo), blocks_resumed=num_resumed, blocks_masked=masked,
                 voxels=int(plan.num_output_voxels), block=list(plan.block_shape), halo=list(plan.halo),
                 batch_size=job.settings.batch_size, workers=(cfg.workers or cfg.jobs) if on_dask else None)
    bar = ProgressBar(len(todo), enabled=cfg.progress)
    with bar as bar_update:
        on_progress = _both(bar_update, events if events.enabled else None)
        if cluster is None or len(todo) == 0:
            stats = _run_local(job, todo, predictor, cfg.retries, on_progress)
            where = str(predictor.device)
        else:
            stats, workers = _run_on_dask(job, todo, cluster, cfg.retries, cfg.no_worker_timeout, on_progress,
                                          bar.write)
            where = ", ".join(sorted({w.device for w in workers.values()})) or str(predictor.device)
    stats.num_skipped += masked
    return PredictionSummary(source, target, model_name, where, plan, stats, num_resumed=num_resumed, workers=workers,
                             batch_size=job.settings.batch_size, output_dtype=job.settings.output_dtype.name)


def _both(bar, events):
    """One observer for the progress bar and the progress events: called with (blocks, voxels[, worker])."""
    if events is None:
        return bar
    if bar is None:
        return events

    def update(blocks: int, voxels: int, worker: str | None = None) -> None:
        bar(blocks, voxels, worker)
        events(blocks, voxels, worker)

    return update


def _take_lock(at, output: str) -> OutputLock:
    """This run's hold on the output (see :mod:`blockpred.io.ownership`); one line when it cannot be taken."""
    try:
        return OutputLock.acquire(at, output)
    except BlockpredError:
        raise
    except OSError as err:
        raise output_error(err, f"take the lock ({at}) of the output", output) from None


def _absolute(path: VolumePath) -> VolumePath:
    """The path as workers in other directories (or on other machines, over a shared disk) see it."""
    return path.absolute()  # a URL stays as it is


def _run_local(job: Job, todo, predictor: Predictor, retries: int, on_progress) -> RunStats:
    """The blocks ``todo`` (ids) in this process; failed blocks are retried ``retries`` times."""
    def done(block: Block) -> None:
        if on_progress is not None:
            on_progress(1, block.write_box.size)

    backoff = Backoff(job.settings.batch_size)  # what fits the device holds for the retries too
    for attempt in range(retries + 1):
        try:
            stats = run_job(job, job.blocks(todo), predictor, on_block_done=done, backoff=backoff)
            stats.out_of_memory = backoff.events
            return stats
        except BlockFailedError as err:
            if attempt == retries or err.permanent:  # a full disk or a refused permission fails again: stop now
                raise
            logger.warning("%d block(s) failed (%s); retrying them (%d of %d)", len(err.failed), err, attempt + 1, retries)
    raise AssertionError("unreachable")


def _run_on_dask(job: Job, todo, cluster: "Cluster", retries: int, no_worker_timeout: float,
                 on_progress, write=lambda line: print(line, file=sys.stderr)) -> tuple[RunStats, dict]:
    from ..cluster.scheduler import run_distributed

    def dashboard(link: str) -> None:
        write(f"blockpred: dask dashboard at {link}")  # above the progress bar, not drawn over by it

    result = run_distributed(job, todo, cluster, retries=retries, no_worker_timeout=no_worker_timeout,
                             on_progress=on_progress, on_dashboard=dashboard)
    return result.stats, result.workers
