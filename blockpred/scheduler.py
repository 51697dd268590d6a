"""Running a job on dask.distributed: every GPU of a machine or a cluster.

* **Cluster.** By default a local cluster with one worker process per device:
  every visible GPU (each worker sees only its own, through
  ``CUDA_VISIBLE_DEVICES``), or ``num_workers`` CPU workers.  With
  ``scheduler_address`` the job joins an existing cluster instead (multi-node,
  SLURM through dask-jobqueue: see ``examples/``).
* **Model once per worker.** A :class:`PredictorPlugin`, registered with
  ``Client.register_plugin``, loads the network when a worker starts and keeps
  it; tasks carry only the job's key and a list of block ids.  Results are
  small dictionaries of counts.
* **Chunk safety.** Blocks are whole output chunks (see :mod:`blockpred.blocking`),
  so tasks never share a chunk; an HDF5 output is refused with several workers.
* **Faults.** A task that raises is retried ``retries`` times; a retried task
  skips the blocks it had already marked done.  A worker process that dies has
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

import dask
from distributed.diagnostics.plugin import WorkerPlugin

from .blocking import Block
from .errors import BlockFailedError, InvalidOptionError
from .geometry import Coord
from .job import Job, run_job
from .pipeline import Backoff, RunStats

logger = logging.getLogger(__name__)

#: Tasks per worker: enough to balance load, few enough that scheduling stays cheap.
TASKS_PER_WORKER = 8
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


def _run_task(key: str, block_ids: list[int]) -> dict:
    """One task on a worker: run these blocks with the worker's loaded network."""
    from distributed import get_worker

    worker = get_worker()
    job, predictor, backoff = _STATE[key]

    def progress(block: Block) -> None:
        worker.log_event(PROGRESS_TOPIC, {"key": key, "voxels": block.write_box.size})

    stats = run_job(job, job.blocks(block_ids), predictor, on_block_done=progress, backoff=backoff)
    return {"worker": str(worker.name), "device": str(predictor.device), "num_blocks": stats.num_blocks,
            "num_voxels": stats.num_voxels, "num_skipped": stats.num_skipped, "seconds": stats.seconds,
            "read_s": stats.read_s, "transfer_s": stats.transfer_s, "compute_s": stats.compute_s,
            "write_s": stats.write_s, "out_of_memory": stats.out_of_memory, "batch_size": stats.batch_size,
            "block_parts": tuple(stats.block_parts)}


def split_tasks(block_ids: list[int], num_workers: int, per_worker: int = TASKS_PER_WORKER) -> list[list[int]]:
    """Contiguous runs of block ids, about ``per_worker`` per worker."""
    if not block_ids:
        return []
    num_tasks = min(len(block_ids), max(1, num_workers * per_worker))
    size = math.ceil(len(block_ids) / num_tasks)
    return [block_ids[i : i + size] for i in range(0, len(block_ids), size)]


def local_worker_envs(device: str, num_workers: int | None) -> list[dict[str, str]]:
    """One environment per local worker: each GPU worker sees only its own GPU."""
    import torch

    wants_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if wants_cuda:
        if not torch.cuda.is_available():
            raise InvalidOptionError(f"device {device!r} asked for, but no CUDA device is available; use --device cpu")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if ":" in device:
            gpus = [gpus[int(device.split(":")[1])]]
        count = num_workers or len(gpus)
        return [{"CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]} for i in range(count)]
    return [{"CUDA_VISIBLE_DEVICES": ""} for _ in range(num_workers or 1)]


def check_hdf5_writers(target, num_workers: int) -> None:
    """HDF5 has no concurrent writers: an HDF5 output takes one worker."""
    if target.format == "hdf5" and num_workers > 1:
        raise InvalidOptionError(
            f"an HDF5 output cannot be written by {num_workers} workers at once (HDF5 has no concurrent writers); "
            f"use --workers 1 or --local, or a zarr or N5 output"
        )


def _start_local_cluster(envs: list[dict[str, str]]):
    """dask-cuda's LocalCUDACluster when installed and every worker has its own GPU, else a SpecCluster."""
    from distributed import Nanny, Scheduler, SpecCluster

    gpus = [env["CUDA_VISIBLE_DEVICES"] for env in envs]
    if all(gpus) and len(set(gpus)) == len(gpus):
        try:
            from dask_cuda import LocalCUDACluster
        except ImportError:
            pass
        else:
            return LocalCUDACluster(CUDA_VISIBLE_DEVICES=",".join(gpus), threads_per_worker=1,
                                    dashboard_address=":0", silence_logs=logging.ERROR)

    options = {"nthreads": 1, "silence_logs": logging.ERROR}
    workers = {f"blockpred-{i}": {"cls": Nanny, "options": {**options, "env": env}} for i, env in enumerate(envs)}
    with dask.config.set(_worker_environment(len(envs))):
        return SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
                           silence_logs=logging.ERROR, name="blockpred")


def _worker_environment(num_workers: int) -> dict:
    """What dask sets before it spawns a worker, adjusted for a process that runs a network.

    dask's defaults pin OpenMP/MKL to one thread and set ``MALLOC_TRIM_THRESHOLD_``,
    which turns off glibc's adaptive mmap threshold: every large tensor is then
    mapped and zeroed anew.  A worker here gets its share of the cores instead.
    """
    threads = str(max(1, (os.cpu_count() or 1) // num_workers))
    key = "distributed.nanny.pre-spawn-environ"
    return {f"{key}.MALLOC_TRIM_THRESHOLD_": None, f"{key}.OMP_NUM_THREADS": threads,
            f"{key}.MKL_NUM_THREADS": threads, f"{key}.OPENBLAS_NUM_THREADS": threads}


def run_distributed(
    job: Job,
    *,
    num_workers: int | None,
    scheduler_address: str | None,
    retries: int,
    on_voxels: Callable[[int], None] | None = None,
    on_dashboard: Callable[[str], None] | None = None,
) -> DistributedResult:
    """Run the job's unfinished blocks over dask workers; returns per-worker counts."""
    from distributed import Client, wait

    result = DistributedResult()
    _quiet_dask()
    cluster = None
    if scheduler_address is None:
        envs = local_worker_envs(job.device, num_workers)
        check_hdf5_writers(job.target, len(envs))
        cluster = _start_local_cluster(envs)
        torch_threads = max(1, (os.cpu_count() or 1) // len(envs)) if not envs[0]["CUDA_VISIBLE_DEVICES"] else None
        client = Client(cluster)
    else:
        client = Client(scheduler_address)
        torch_threads = None
    try:
        result.dashboard = client.dashboard_link if _has_dashboard(client) else None
        if on_dashboard is not None and result.dashboard:
            on_dashboard(result.dashboard)
        workers = len(client.scheduler_info(n_workers=-1)["workers"]) or 1
        check_hdf5_writers(job.target, workers)
        key = job.markers.path.name + "-" + format(abs(hash((str(job.markers.path), os.getpid()))), "x")
        client.register_plugin(PredictorPlugin(key, job, torch_threads))
        finished = job.markers.finished_indices()
        todo = [i for i in range(job.plan.num_blocks) if job.plan.block_from_id(i).index not in finished]
        lock = threading.Lock()

        def progress(event) -> None:
            _, message = event
            if message.get("key") == key and on_voxels is not None:
                with lock:
                    on_voxels(int(message["voxels"]))

        client.subscribe_topic(PROGRESS_TOPIC, progress)
        start = time.perf_counter()
        futures = [client.submit(_run_task, key, ids, retries=retries, pure=False)
                   for ids in split_tasks(todo, workers)]
        wait(futures)
        result.stats.seconds = time.perf_counter() - start
        failures: list[BlockFailedError] = []
        for future in futures:
            if future.status == "error":
                error = future.exception()
                if not isinstance(error, BlockFailedError):
                    raise error
                failures.append(error)
                continue
            summary = future.result()
            worker = result.workers.setdefault(summary["worker"], WorkerSummary(summary["worker"], summary["device"]))
            worker.num_blocks += summary["num_blocks"]
            worker.num_voxels += summary["num_voxels"]
            worker.num_skipped += summary["num_skipped"]
            worker.busy_s += summary["seconds"]
            for name in ("num_blocks", "num_voxels", "num_skipped", "read_s", "transfer_s", "compute_s", "write_s",
                         "out_of_memory"):
                setattr(result.stats, name, getattr(result.stats, name) + summary[name])
            _merge_sizes(result.stats, summary["batch_size"], Coord(summary["block_parts"]))
        client.unsubscribe_topic(PROGRESS_TOPIC)
        if failures:
            first = failures[0]
            first.failed = [index for f in failures for index in f.failed]
            raise first
        return result
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


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


def _quiet_dask() -> None:
    """dask's INFO chatter only when blockpred itself logs at INFO (``blockpred -v``)."""
    if logging.getLogger("blockpred").isEnabledFor(logging.INFO):
        return
    import distributed  # noqa: F401 - creates its loggers

    for name in list(logging.root.manager.loggerDict):
        if name == "distributed" or name.startswith("distributed."):
            logging.getLogger(name).setLevel(logging.ERROR)


def _has_dashboard(client) -> bool:
    try:
        return "dashboard" in client.scheduler_info().get("services", {})
    except Exception:  # noqa: BLE001 - the dashboard is a convenience
        return False
