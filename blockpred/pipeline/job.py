"""A job: everything a worker needs to run some blocks of one prediction.

A :class:`Job` is small and picklable (paths, the block plan, settings and how
to load the model -- never arrays, never a loaded network), so the same job
goes to the in-process runner and to every dask worker.  Blocks are run one of
two ways, both over the pipeline of :mod:`blockpred.pipeline`: :func:`run_job`
runs a list of blocks and returns (the in-process runner); a :class:`JobStream`
keeps one pipeline open and runs each task's blocks on it (a dask worker).
Either skips blocks this process already marked finished and marks each block
done only after its data is written.  Which blocks are unfinished (not done, not
masked out) is decided in bulk by the caller (:meth:`DoneMarkers.todo_ids`);
a job never looks at blocks one by one to find out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from ..io import open_volume
from ..io.base import VolumePath
from ..models import LoadedModel, load_model
from .backoff import Backoff
from .blocking import Block, BlockPlan
from .infer import Predictor, resolve_device
from .markers import DoneMarkers
from .stats import RunStats
from .stream import BlockStream
from .worker import PipelineSettings, run_blocks


@dataclass(frozen=True)
class ModelSpec:
    """How to load the network: what ``--model``, ``--weights`` ... said (or a module)."""

    model: Any
    weights: str | None = None
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    trust_pickle: bool = False
    #: The planes of a 2D network (see :mod:`blockpred.models.planes`); None: as the network is.
    plane: str | None = None

    def load(self) -> LoadedModel:
        return load_model(self.model, weights=self.weights, model_kwargs=self.model_kwargs,
                          trust_pickle=self.trust_pickle, plane=self.plane)


@dataclass(frozen=True)
class Job:
    source: VolumePath
    target: VolumePath
    markers: DoneMarkers
    plan: BlockPlan
    settings: PipelineSettings
    model: ModelSpec
    device: str = "auto"
    precision: str = "fp32"
    compile: str = "off"
    memory_format: str = "contiguous"
    #: Skip blocks whose input is all one value.
    skip_empty: bool = False
    #: Test-time augmentation (see :mod:`blockpred.models.tta`).
    tta: str = "off"
    #: What runs the network (``torch``, ``openvino``), and the network's name in the conversion cache.
    backend: str = "torch"
    backend_key: dict | None = None
    #: Whether the network's passes search cuDNN's kernels (the client's choice: :mod:`blockpred.tuning.search`).
    kernel_search: bool = False

    def make_predictor(self, device: str | None = None) -> Predictor:
        """Load the model (with its test-time augmentation) and put it on ``device`` (default: the job's)."""
        from ..models.tta import with_tta

        predictor = Predictor(with_tta(self.model.load().module, self.tta), resolve_device(device or self.device),
                              self.precision, compile=self.compile, memory_format=self.memory_format,
                              backend=self.backend, backend_key=self.backend_key)
        predictor.search = self.kernel_search
        return predictor

    def blocks(self, block_ids: Iterable[int]) -> Iterator[Block]:
        """The blocks of ``block_ids``, made one at a time as the pipeline reads them (never a list of millions)."""
        return (self.plan.block_from_id(int(i)) for i in block_ids)


def is_empty(block: Block, data: np.ndarray) -> bool:
    """True when the block's input holds a single value."""
    flat = data.reshape(-1)
    return bool(flat.size == 0 or (flat == flat[0]).all())


def run_job(job: Job, blocks: Iterable[Block], predictor: Predictor,
            on_block_done: Callable[[Block], None] | None = None, backoff: Backoff | None = None) -> RunStats:
    """Run ``blocks`` (the caller's unfinished ones), marking each done after its write.

    Blocks this process already marked are left out, so a retried task redoes
    only what it did not finish.  ``backoff`` keeps the batch and block parts
    that fit the device from one call to the next (see
    :mod:`blockpred.pipeline.backoff`).
    """
    markers = job.markers
    source = open_volume(job.source)
    sink = open_volume(job.target, mode="r+")
    failing = True
    try:
        pipeline = _pipeline(job, source, sink, predictor, backoff)
        stats = pipeline(_unmarked(job, blocks), on_block_done=_marking(markers, on_block_done),
                         on_block_skipped=markers.mark_skipped)
        failing = False
        return stats
    finally:
        source.close()
        sink.close()
        # On an object store: this job's buffered marks, written before the job reports back (a failing job's
        # own error is the one to report).
        markers.flush(quiet=failing)


class JobStream:
    """A job's pipeline that stays open between tasks (see :mod:`blockpred.pipeline.stream`).

    A dask worker keeps one per job: each task's :meth:`run` queues its blocks
    behind the previous task's, so the device does not drain between tasks.
    ``on_block_done(block)`` runs after each block's mark (a worker's progress
    reports); ``newest_first``: see :class:`BlockStream` (a server's requests).
    """

    def __init__(self, job: Job, predictor: Predictor, backoff: Backoff,
                 on_block_done: Callable[[Block], None] | None = None, newest_first: bool = False):
        self.job = job
        self._source = open_volume(job.source)
        self._sink = open_volume(job.target, mode="r+")
        self.stream = BlockStream(_pipeline(job, self._source, self._sink, predictor, backoff),
                                  max_failures=job.settings.max_failures,
                                  on_block_done=_marking(job.markers, on_block_done),
                                  on_block_skipped=job.markers.mark_skipped, newest_first=newest_first)

    def run(self, block_ids: Iterable[int]) -> RunStats:
        """Run the blocks ``block_ids``; their counts, or :class:`BlockFailedError` once all are through."""
        failing = True
        try:
            counts = self.stream.run(_unmarked(self.job, self.job.blocks(block_ids)))
            failing = False
            return counts
        finally:
            self.job.markers.flush(quiet=failing)  # on an object store: written before the task reports back

    def close(self, *, cancel: bool = False) -> None:
        """Stop the pipeline (``cancel``: after the blocks already in it) and close the volumes."""
        try:
            self.stream.close(cancel=cancel)
        finally:
            self._source.close()
            self._sink.close()


def _pipeline(job: Job, source, sink, predictor: Predictor, backoff: Backoff | None) -> Callable[..., RunStats]:
    """:func:`run_blocks` with the job's volumes, network and settings bound: it takes the blocks and callbacks."""
    return functools.partial(run_blocks, source=source, sink=sink, predictor=predictor, settings=job.settings,
                             skip=is_empty if job.skip_empty else None, backoff=backoff)


def _unmarked(job: Job, blocks: Iterable[Block]) -> Iterator[Block]:
    """``blocks`` less those this process marked (a retried task redoes only what it did not finish)."""
    return (b for b in blocks if not job.markers.marked_here(b))


def _marking(markers: DoneMarkers, then: Callable[[Block], None] | None) -> Callable[[Block], None]:
    def done(block: Block) -> None:
        markers.mark_done(block)
        if then is not None:
            then(block)

    return done
