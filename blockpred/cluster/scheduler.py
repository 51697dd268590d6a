"""Running a job on dask.distributed: every GPU of a machine or a cluster.

* **Cluster.** A local cluster or a joined one, started early (see
  :mod:`blockpred.cluster.local`); multi-node and SLURM through dask-jobqueue: see
  ``examples/``.
* **Model once per worker.** A :class:`~blockpred.cluster.tasks.PredictorPlugin`, registered with
  ``Client.register_plugin``, loads the network when a worker starts (or
  joins later) and keeps it; tasks carry only the job's key and an array of
  block ids.  Results are small dictionaries of counts.  The plugin is
  removed when the run ends, which frees the worker's model and device memory.
* **One pipeline per worker.** Tasks do not run a pipeline each: a worker
  keeps one open for the run (:class:`blockpred.pipeline.job.JobStream`), and a task
  queues its blocks on it and waits for their writes.  A worker runs
  :data:`TASKS_IN_FLIGHT` tasks at once (two threads), so the next task's
  blocks are read while the current task's last batches are on the device:
  the device does not drain between tasks.
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
* **Chunk safety.** Blocks are whole output chunks (see :mod:`blockpred.pipeline.blocking`),
  so tasks never share a chunk; an HDF5 output is refused with several workers.
* **Faults.** A task that raises is retried ``retries`` times; a retried task
  skips the blocks its worker had already marked done.  A permanent failure (a
  full disk, a refused permission, a chunk that does not decode: see
  :attr:`blockpred.errors.BlockFailedError.permanent`) is not retried, and no
  new task starts after it.  A worker process may
  die at any moment: its nanny starts it again (:mod:`blockpred.cluster.nanny`), it
  receives the run's plugin as it joins, and dask reschedules its tasks.  A
  worker that dies while the plugin is sent has it sent again.  A block that
  keeps failing, or whose task's workers keep dying (dask's
  ``distributed.scheduler.allowed-failures``), fails the run with a message
  naming it, after every other task has finished.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .address import connect
from .distributed_setup import import_distributed
from .local import WORKER_THREADS, Cluster, check_hdf5_writers

import_distributed()  # never at the same time as a cluster's start thread (see import_distributed)

from ..errors import BlockFailedError, ClusterError, InvalidOptionError, NoWorkersError  # noqa: E402
from ..geometry import Coord  # noqa: E402
from ..pipeline import RunStats  # noqa: E402
from ..pipeline.job import Job  # noqa: E402
from .tasks import _PIPELINE_COUNTS, PROGRESS_TOPIC, PredictorPlugin, _run_task  # noqa: E402

logger = logging.getLogger(__name__)

#: Tasks in flight per worker: both run at once on a worker blockpred starts (two threads),
#: waiting on the worker's one pipeline, the second's blocks queued behind the first's.
TASKS_IN_FLIGHT = WORKER_THREADS
#: What a task should take on a worker, once a throughput has been measured.
TASK_SECONDS = 10.0
#: Blocks in a task at most (ids travel with it: 8 bytes each).
MAX_TASK_BLOCKS = 16384
#: How often the client asks the scheduler how many workers there are.
WORKER_COUNT_EVERY_S = 1.0
#: Sends of the run's plugin to the workers before the run gives up, when a worker dies during each.
REGISTER_ATTEMPTS = 5
#: Seconds without any worker before a run ends (``--no-worker-timeout``).
NO_WORKER_TIMEOUT_S = 300.0
#: How often the client looks for finished tasks and for workers while none finishes.
POLL_S = 0.1


@dataclass
class WorkerSummary:
    name: str
    device: str
    num_blocks: int = 0
    num_voxels: int = 0
    num_skipped: int = 0
    busy_s: float = 0.0
    #: Tasks it ran, and the pipelines they ran on (one, unless a pipeline stopped and was reopened).
    tasks: int = 0
    pipelines: int = 0

    @property
    def mvox_per_s(self) -> float:
        return self.num_voxels / self.busy_s / 1e6 if self.busy_s > 0 else 0.0


@dataclass
class DistributedResult:
    stats: RunStats = field(default_factory=RunStats)  # seconds: from first task to last result
    workers: dict[str, WorkerSummary] = field(default_factory=dict)
    dashboard: str | None = None


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
    no_worker_timeout: float = NO_WORKER_TIMEOUT_S,
    on_progress: Callable[[int, int], None] | None = None,
    on_dashboard: Callable[[str], None] | None = None,
) -> DistributedResult:
    """Run the blocks ``block_ids`` (an array of ids) over the workers of ``cluster``; returns per-worker counts.

    ``on_progress(blocks, voxels)`` is called as blocks finish.  A run that has
    no worker for ``no_worker_timeout`` seconds (none started yet, every one
    lost, the scheduler gone) ends with :class:`NoWorkersError`.
    """
    client = cluster.client()
    if cluster.scheduler_address is None:
        check_hdf5_writers(job.target, len(client.scheduler_info(n_workers=-1)["workers"]))
    return _feed(client, job, block_ids, retries, cluster.torch_threads, on_progress, on_dashboard,
                 no_worker_timeout)


def _feed(client, job: Job, block_ids, retries: int, torch_threads: int | None,
          on_progress: Callable[[int, int], None] | None,
          on_dashboard: Callable[[str], None] | None,
          no_worker_timeout: float = NO_WORKER_TIMEOUT_S) -> DistributedResult:
    """Keep the workers fed with tasks until every block is through; gather what they did."""
    result = DistributedResult()
    result.dashboard = client.dashboard_link if _has_dashboard(client) else None
    if on_dashboard is not None and result.dashboard:
        on_dashboard(result.dashboard)
    check_hdf5_writers(job.target, _WorkerCount(client)())
    key = job.markers.path.name + "-" + format(abs(hash((str(job.markers.path), os.getpid()))), "x")
    plugin = PredictorPlugin(key, job, torch_threads)
    _register_plugin(client, plugin)
    lock = threading.Lock()

    def progress(event) -> None:
        _, message = event
        if message.get("key") == key and on_progress is not None:
            with lock:
                on_progress(int(message["blocks"]), int(message["voxels"]), message.get("name"))

    client.subscribe_topic(PROGRESS_TOPIC, progress)
    try:
        _run_tasks(client, key, job, block_ids, retries, result, no_worker_timeout)
    finally:
        client.unsubscribe_topic(PROGRESS_TOPIC)
        _remove_plugin(client, plugin.name)
    return result


def _register_plugin(client, plugin: PredictorPlugin) -> None:
    """The run's plugin on every worker: sent to those present (their setups done on return), kept for later ones.

    A worker that dies while the plugin is sent to it fails the send (a
    closed or refused connection) and may leave others without it: it is
    sent again, to all (a worker that had it loads the network again).  The
    dead worker's restart receives it as it joins.
    """
    from distributed.comm import CommClosedError

    for attempt in range(1, REGISTER_ATTEMPTS + 1):
        try:
            client.register_plugin(plugin)
            return
        except (CommClosedError, OSError) as err:
            if attempt == REGISTER_ATTEMPTS:
                raise ClusterError(f"the network could not be loaded on the dask workers: a worker died during each "
                                   f"of {REGISTER_ATTEMPTS} attempts (the last: {err}); check the workers' memory, "
                                   f"or use --local") from err
            logger.warning("a dask worker died while the network was loaded on it (%s); loading it again", err)
            time.sleep(WORKER_COUNT_EVERY_S)  # the scheduler notices the dead worker meanwhile


def _run_tasks(client, key: str, job: Job, block_ids, retries: int, result: DistributedResult,
               no_worker_timeout: float = NO_WORKER_TIMEOUT_S) -> None:
    """Tasks of the elastic feed until every block is through; a failed block fails the run after all others.

    Without a worker for ``no_worker_timeout`` seconds it raises :class:`NoWorkersError`.
    """
    from distributed import KilledWorker, as_completed

    count = _WorkerCount(client)
    feed = TaskFeed(block_ids, job.settings.batch_size)
    running = as_completed()
    task_ids: dict = {}  # future key -> its block ids, while it runs

    stopping = False  # after a permanent failure: no new tasks, the ones in flight finish

    def top_up() -> None:
        if stopping:
            return
        workers = count()
        while running.count() < TASKS_IN_FLIGHT * max(1, workers):
            ids = feed.take(workers)
            if ids is None:
                return
            future = client.submit(_run_task, key, ids, retries=retries, pure=False)
            task_ids[future.key] = ids
            running.add(future)

    start = time.perf_counter()
    failures: list[BlockFailedError] = []
    pipelines: dict = {}  # (worker, pipeline id) -> its latest figures
    top_up()

    def stalled() -> NoWorkersError:
        return NoWorkersError(
            f"no dask worker for {no_worker_timeout:.0f} s (--no-worker-timeout): none started, every one was lost, "
            f"or the scheduler went away; {result.stats.num_blocks} of {len(block_ids)} blocks of this run are done "
            f"and kept: run the same command again to resume")

    for future in _as_they_finish(running, count, no_worker_timeout, stalled):
        ids = task_ids.pop(future.key)
        if future.status == "cancelled":  # the client lost its scheduler: every task is cancelled
            raise NoWorkersError(
                f"the dask scheduler went away (its connection was lost); {result.stats.num_blocks} of "
                f"{len(block_ids)} blocks of this run are done and kept: run the same command again to resume")
        if future.status == "error":
            error = future.exception()
            if isinstance(error, KilledWorker):
                error = _workers_died(job, ids, error)
            elif not isinstance(error, BlockFailedError):
                raise error
            failures.append(error)
        else:
            summary = future.result()
            if "failure" in summary:
                failures.append(summary["failure"])
                stopping = True
                continue
            feed.observe(summary["num_blocks"], summary["seconds"])
            _add_summary(result, pipelines, summary)
        top_up()
    result.stats.seconds = time.perf_counter() - start
    _add_pipelines(result, pipelines)
    if failures:
        first = failures[0]
        first.failed = [index for f in failures for index in f.failed]
        raise first


def _as_they_finish(running, count: "_WorkerCount", timeout_s: float, stalled: Callable[[], Exception]):
    """The futures of ``running`` (an ``as_completed``, topped up meanwhile) as they finish.

    Between them it looks at the workers every :data:`POLL_S`: ``stalled()``
    is raised once none has been there for ``timeout_s`` seconds, so a run
    whose workers are all gone, or whose scheduler is, ends instead of
    waiting forever.
    """
    seen = time.monotonic()
    while not running.is_empty():
        if running.has_ready():
            yield next(running)
            continue
        now = time.monotonic()
        if count() > 0:
            seen = now
        elif now - seen > timeout_s:
            raise stalled()
        time.sleep(POLL_S)


def _workers_died(job: Job, block_ids, error) -> BlockFailedError:
    """A task whose workers died more often than dask allows (``KilledWorker``): a failure of its blocks."""
    _, worker, allowed = error.args
    indices = [job.plan.block_from_id(int(i)).index for i in block_ids]
    blocks = f"block {tuple(indices[0])}" + (f" and {len(indices) - 1} more" if len(indices) > 1 else "")
    them = "them" if len(indices) > 1 else "it"
    failure = BlockFailedError(indices[0], (
        f"{blocks} failed: the dask worker running {them} died, {allowed + 1} time(s) (the last: "
        f"{getattr(worker, 'name', worker)}; distributed.scheduler.allowed-failures is {allowed}); a block that runs "
        f"a worker out of memory kills it: use a smaller --block or --batch-size, and run the same command again "
        f"to retry {them}"))
    failure.failed = indices
    failure.__cause__ = error
    return failure


def _remove_plugin(client, name: str) -> None:
    """The run's plugin off every worker: its pipeline closed, its model and device memory freed."""
    try:
        client.unregister_worker_plugin(name)
    except Exception as err:  # noqa: BLE001 - a cluster going down frees them anyway
        logger.debug("could not remove the worker plugin %s: %s", name, err)


def _add_summary(result: DistributedResult, pipelines: dict, summary: dict) -> None:
    """A task's counts, and the latest figures of its worker's pipeline."""
    worker = result.workers.setdefault(summary["worker"], WorkerSummary(summary["worker"], summary["device"]))
    worker.num_blocks += summary["num_blocks"]
    worker.num_voxels += summary["num_voxels"]
    worker.num_skipped += summary["num_skipped"]
    worker.tasks += 1
    for name in ("num_blocks", "num_voxels", "num_skipped"):
        setattr(result.stats, name, getattr(result.stats, name) + summary[name])
    pipeline = summary["pipeline"]
    latest = pipelines.setdefault((summary["worker"], pipeline["id"]), dict(pipeline))
    for name, value in pipeline.items():
        latest[name] = max(latest[name], value)  # every figure only grows while a pipeline lives
    _merge_sizes(result.stats, summary["batch_size"], Coord(summary["block_parts"]))
    # A pipeline's missing chunks so far: the union over its tasks is all of them.
    result.stats.add_missing_chunks(summary["missing_chunks"], reads=0, blocks=0)
    result.stats.missing_chunks_counted &= summary["missing_chunks_counted"]


def _add_pipelines(result: DistributedResult, pipelines: dict) -> None:
    """Stage times, busy seconds and out-of-memory events: summed over every worker's pipelines."""
    for (worker, _), figures in pipelines.items():
        result.workers[worker].busy_s += figures["busy_s"]
        result.workers[worker].pipelines += 1
        for name in ("read_s", "transfer_s", "compute_s", "write_s", "out_of_memory", *_PIPELINE_COUNTS):
            setattr(result.stats, name, getattr(result.stats, name) + figures[name])


class _WorkerCount:
    """The number of workers in the cluster, asked of the scheduler at most every :data:`WORKER_COUNT_EVERY_S`."""

    def __init__(self, client):
        self._client = client
        self._count, self._when = 0, -math.inf

    def __call__(self) -> int:
        now = time.monotonic()
        if now - self._when >= WORKER_COUNT_EVERY_S:
            try:
                self._count = len(self._client.scheduler_info(n_workers=-1)["workers"]) \
                    if self._client.status == "running" else 0
            except Exception as err:  # noqa: BLE001 - a scheduler that went away has no workers for this run
                logger.debug("no answer from the dask scheduler: %s", err)
                self._count = 0
            self._when = now
        return self._count


@contextlib.contextmanager
def client_with_workers(scheduler_address: str, wait_s: float = 60.0):
    """A client of the cluster at ``scheduler_address`` once a worker has joined it (one line after ``wait_s``,
    and one line at once for an address that is not one or where no scheduler answers: see :mod:`.address`)."""
    with connect(scheduler_address) as client:
        try:
            client.wait_for_workers(1, timeout=wait_s)
        except TimeoutError:
            raise InvalidOptionError(
                f"no dask worker joined {scheduler_address} within {wait_s:.0f} s; start the workers first"
            ) from None
        yield client


def run_on_a_worker(scheduler_address: str, function: Callable, *args, wait_s: float = 60.0):
    """``function(*args)`` run on one worker of the cluster at ``scheduler_address``; its result."""
    with client_with_workers(scheduler_address, wait_s) as client:
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
