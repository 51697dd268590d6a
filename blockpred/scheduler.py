"""Running a job on dask.distributed: every GPU of a machine or a cluster.

* **Cluster.** A local cluster or a joined one, started early (see
  :mod:`blockpred.cluster`); multi-node and SLURM through dask-jobqueue: see
  ``examples/``.
* **Model once per worker.** A :class:`PredictorPlugin`, registered with
  ``Client.register_plugin``, loads the network when a worker starts (or
  joins later) and keeps it; tasks carry only the job's key and an array of
  block ids.  Results are small dictionaries of counts.
* **Elastic feeding.** The client does not split the blocks into a task list
  up front.  It keeps about :data:`TASKS_IN_FLIGHT` tasks per worker present
  in flight and submits the next one as each finishes (:class:`TaskFeed`), so
  the scheduler holds a few tasks per worker, never millions, and workers
  that join late (``cluster.adapt()``, a SLURM job that starts an hour later),
  slow workers and lost workers balance out: whoever is free takes the next
  task.  A task is sized to take about :data:`TASK_SECONDS` on a worker at the
  throughput measured so far (a pipeline fill and drain per task stays a small
  fraction), and never so large that the last tasks leave workers idle.
* **Progress** reaches the client as a few events per second per worker, not
  one per block.
* **Chunk safety.** Blocks are whole output chunks (see :mod:`blockpred.blocking`),
  so tasks never share a chunk; an HDF5 output is refused with several workers.
* **Faults.** A task that raises is retried ``retries`` times; a retried task
  skips the blocks its worker had already marked done.  A worker process that dies has
  its tasks rescheduled by dask.  A block that keeps failing fails the run with
  a message naming it, after every other task has finished.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .cluster import Cluster, _quiet_dask, check_hdf5_writers, import_distributed

import_distributed()  # never at the same time as a cluster's start thread (see import_distributed)

from distributed.diagnostics.plugin import WorkerPlugin  # noqa: E402

from .blocking import Block  # noqa: E402
from .errors import BlockFailedError, InvalidOptionError  # noqa: E402
from .geometry import Coord  # noqa: E402
from .job import Job, run_job  # noqa: E402
from .pipeline import Backoff, RunStats

logger = logging.getLogger(__name__)

#: Tasks in flight per worker: one running, one queued behind it.
TASKS_IN_FLIGHT = 2
#: What a task should take on a worker, once a throughput has been measured.
TASK_SECONDS = 10.0
#: Blocks in a task at most (ids travel with it: 8 bytes each).
MAX_TASK_BLOCKS = 16384
#: How often the client asks the scheduler how many workers there are.
WORKER_COUNT_EVERY_S = 1.0
#: How often a worker reports progress.
PROGRESS_EVERY_S = 0.5
PROGRESS_TOPIC = "blockpred-progress"

# Per worker process: the job and the loaded predictor of each registered plugin.
_STATE: dict[str, tuple[Job, object]] = {}


@dataclass
class WorkerSummary:
    name: str
    device: str
    num_blocks: int = 0
    num_voxels: int = 0
    num_skipped: int = 0
    busy_s: float = 0.0

    @property
    def mvox_per_s(self) -> float:
        return self.num_voxels / self.busy_s / 1e6 if self.busy_s > 0 else 0.0


@dataclass
class DistributedResult:
    stats: RunStats = field(default_factory=RunStats)  # seconds: from first task to last result
    workers: dict[str, WorkerSummary] = field(default_factory=dict)
    dashboard: str | None = None


class PredictorPlugin(WorkerPlugin):
    """Loads the job's network once per worker and keeps it for every task.

    Defined at module level so workers import it by name (a class pickled by
    value would carry its own copy of ``_STATE``).
    """

    def __init__(self, key: str, job: Job, torch_threads: int | None):
        self.name = f"blockpred-{key}"
        self.key, self.job, self.torch_threads = key, job, torch_threads

    def setup(self, worker):
        import torch

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        predictor = self.job.make_predictor(worker_device(self.job.device))
        # The batch and block parts that fit this worker's device, kept from task to task.
        _STATE[self.key] = (self.job, predictor, Backoff(self.job.settings.batch_size))

    def teardown(self, worker):
        _STATE.pop(self.key, None)


def worker_device(device: str) -> str:
    """A worker's device: a GPU worker sees its own GPU first (CUDA_VISIBLE_DEVICES), so ``cuda:0``."""
    return "cuda:0" if device.startswith("cuda") else device


def _run_task(key: str, block_ids) -> dict:
    """One task on a worker: run these blocks with the worker's loaded network."""
    from distributed import get_worker

    worker = get_worker()
    job, predictor, backoff = _STATE[key]
    report = _Reporter(worker, key)
    try:
        stats = run_job(job, job.blocks(block_ids), predictor, on_block_done=report, backoff=backoff)
    finally:
        report.flush()
    return {"worker": str(worker.name), "device": str(predictor.device), "num_blocks": stats.num_blocks,
            "num_voxels": stats.num_voxels, "num_skipped": stats.num_skipped, "seconds": stats.seconds,
            "read_s": stats.read_s, "transfer_s": stats.transfer_s, "compute_s": stats.compute_s,
            "write_s": stats.write_s, "out_of_memory": stats.out_of_memory, "batch_size": stats.batch_size,
            "block_parts": tuple(stats.block_parts)}


class _Reporter:
    """Counts finished blocks on a worker and sends them as one event every :data:`PROGRESS_EVERY_S`."""

    def __init__(self, worker, key: str):
        self._worker, self._key = worker, key
        self._lock = threading.Lock()
        self._blocks = self._voxels = 0
        self._last = time.monotonic()

    def __call__(self, block: Block) -> None:
        with self._lock:
            self._blocks += 1
            self._voxels += block.write_box.size
            if time.monotonic() - self._last < PROGRESS_EVERY_S:
                return
        self.flush()

    def flush(self) -> None:
        with self._lock:
            blocks, voxels, self._blocks, self._voxels = self._blocks, self._voxels, 0, 0
            self._last = time.monotonic()
        if blocks:
            self._worker.log_event(PROGRESS_TOPIC, {"key": self._key, "blocks": blocks, "voxels": voxels})


class TaskFeed:
    """Hands out the block ids of a run a task at a time, sized by the throughput seen so far.

    Before any task has finished, tasks are small (a few batches), so the
    first measurement comes quickly; after, a task is about ``task_s`` of work
    for the fastest rate seen, capped so that the remaining blocks still make
    :data:`TASKS_IN_FLIGHT` tasks per worker (no worker idles at the end
    while another finishes a large task).
    """

    def __init__(self, block_ids, batch_size: int, task_s: float = TASK_SECONDS,
                 max_blocks: int = MAX_TASK_BLOCKS):
        self._ids, self._next = block_ids, 0
        self._batch, self._task_s, self._max = max(1, batch_size), task_s, max_blocks
        self._s_per_block: float | None = None

    @property
    def remaining(self) -> int:
        return len(self._ids) - self._next

    def observe(self, num_blocks: int, seconds: float) -> None:
        """A task's blocks and seconds: the fastest rate seen sizes the next tasks."""
        if num_blocks > 0 and seconds > 0:
            rate = seconds / num_blocks
            self._s_per_block = rate if self._s_per_block is None else min(self._s_per_block, rate)

    def size(self, num_workers: int) -> int:
        if self._s_per_block is None:
            wanted = 2 * self._batch
        else:
            wanted = int(self._task_s / self._s_per_block)
        tail = math.ceil(self.remaining / (max(1, num_workers) * TASKS_IN_FLIGHT))
        return max(self._batch, min(wanted, tail, self._max), 1)

    def take(self, num_workers: int):
        """The next task's block ids (an array slice), or None when every block has been handed out."""
        if self.remaining <= 0:
            return None
        size = self.size(num_workers)
        ids = self._ids[self._next : self._next + size]
        self._next += len(ids)
        return ids


def run_distributed(
    job: Job,
    block_ids,
    cluster: Cluster,
    *,
    retries: int,
    on_progress: Callable[[int, int], None] | None = None,
    on_dashboard: Callable[[str], None] | None = None,
) -> DistributedResult:
    """Run the blocks ``block_ids`` (an array of ids) over the workers of ``cluster``; returns per-worker counts.

    ``on_progress(blocks, voxels)`` is called as blocks finish.
    """
    client = cluster.client()
    if cluster.scheduler_address is None:
        check_hdf5_writers(job.target, len(client.scheduler_info(n_workers=-1)["workers"]))
    return _feed(client, job, block_ids, retries, cluster.torch_threads, on_progress, on_dashboard)


def _feed(client, job: Job, block_ids, retries: int, torch_threads: int | None,
          on_progress: Callable[[int, int], None] | None,
          on_dashboard: Callable[[str], None] | None) -> DistributedResult:
    """Keep the workers fed with tasks until every block is through; gather what they did."""
    from distributed import as_completed

    result = DistributedResult()
    result.dashboard = client.dashboard_link if _has_dashboard(client) else None
    if on_dashboard is not None and result.dashboard:
        on_dashboard(result.dashboard)
    count = _WorkerCount(client)
    check_hdf5_writers(job.target, count())
    key = job.markers.path.name + "-" + format(abs(hash((str(job.markers.path), os.getpid()))), "x")
    client.register_plugin(PredictorPlugin(key, job, torch_threads))
    lock = threading.Lock()

    def progress(event) -> None:
        _, message = event
        if message.get("key") == key and on_progress is not None:
            with lock:
                on_progress(int(message["blocks"]), int(message["voxels"]))

    client.subscribe_topic(PROGRESS_TOPIC, progress)
    feed = TaskFeed(block_ids, job.settings.batch_size)
    running = as_completed()

    def top_up() -> None:
        workers = count()
        while running.count() < TASKS_IN_FLIGHT * max(1, workers):
            ids = feed.take(workers)
            if ids is None:
                return
            running.add(client.submit(_run_task, key, ids, retries=retries, pure=False))

    start = time.perf_counter()
    failures: list[BlockFailedError] = []
    top_up()
    for future in running:
        if future.status == "error":
            error = future.exception()
            if not isinstance(error, BlockFailedError):
                raise error
            failures.append(error)
        else:
            summary = future.result()
            feed.observe(summary["num_blocks"], summary["seconds"])
            _add_summary(result, summary)
        top_up()
    result.stats.seconds = time.perf_counter() - start
    client.unsubscribe_topic(PROGRESS_TOPIC)
    if failures:
        first = failures[0]
        first.failed = [index for f in failures for index in f.failed]
        raise first
    return result


def _add_summary(result: DistributedResult, summary: dict) -> None:
    worker = result.workers.setdefault(summary["worker"], WorkerSummary(summary["worker"], summary["device"]))
    worker.num_blocks += summary["num_blocks"]
    worker.num_voxels += summary["num_voxels"]
    worker.num_skipped += summary["num_skipped"]
    worker.busy_s += summary["seconds"]
    for name in ("num_blocks", "num_voxels", "num_skipped", "read_s", "transfer_s", "compute_s", "write_s",
                 "out_of_memory"):
        setattr(result.stats, name, getattr(result.stats, name) + summary[name])
    _merge_sizes(result.stats, summary["batch_size"], Coord(summary["block_parts"]))


class _WorkerCount:
    """The number of workers in the cluster, asked of the scheduler at most every :data:`WORKER_COUNT_EVERY_S`."""

    def __init__(self, client):
        self._client = client
        self._count, self._when = 0, -math.inf

    def __call__(self) -> int:
        now = time.monotonic()
        if now - self._when >= WORKER_COUNT_EVERY_S:
            self._count = len(self._client.scheduler_info(n_workers=-1)["workers"])
            self._when = now
        return self._count


def run_on_a_worker(scheduler_address: str, function: Callable, *args, wait_s: float = 60.0):
    """``function(*args)`` run on one worker of the cluster at ``scheduler_address``; its result."""
    from distributed import Client

    _quiet_dask()
    with Client(scheduler_address) as client:
        try:
            client.wait_for_workers(1, timeout=wait_s)
        except TimeoutError:
            raise InvalidOptionError(
                f"no dask worker joined {scheduler_address} within {wait_s:.0f} s; start the workers first"
            ) from None
        return client.submit(function, *args, pure=False).result()


def _merge_sizes(stats: RunStats, batch_size: int, block_parts: Coord) -> None:
    """The smallest batch and the finest block parts any worker fell back to."""
    if batch_size and (not stats.batch_size or batch_size < stats.batch_size):
        stats.batch_size = batch_size
    if block_parts.prod() > stats.block_parts.prod():
        stats.block_parts = block_parts


def _has_dashboard(client) -> bool:
    try:
        return "dashboard" in client.scheduler_info().get("services", {})
    except Exception:  # noqa: BLE001 - the dashboard is a convenience
        return False
