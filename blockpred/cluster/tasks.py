"""What a dask worker runs for a job: the network loaded once, tasks queued on one pipeline, progress sent back.

* :class:`PredictorPlugin` (registered by the client, :mod:`blockpred.cluster.scheduler`)
  loads the job's network when a worker starts or joins, and keeps it with
  the sizes that fit the device (:class:`_WorkerJob`) until the run removes it.
* :func:`_run_task` queues a task's blocks on the worker's one pipeline
  (:class:`blockpred.pipeline.job.JobStream`) and returns small counts.
* :class:`_Reporter` sends finished blocks to the client as a few events a
  second (:data:`PROGRESS_TOPIC`), never one per block.

Module level on purpose: workers import these by name (a class pickled by
value would carry its own copy of ``_STATE``).
"""

from __future__ import annotations

import threading
import time

from ..errors import BlockFailedError
from ..pipeline import Backoff
from ..pipeline.blocking import Block
from ..pipeline.job import Job, JobStream
from .distributed_setup import import_distributed

import_distributed()  # never at the same time as a cluster's start thread (see import_distributed)

from distributed.diagnostics.plugin import WorkerPlugin  # noqa: E402

#: How often a worker reports progress.
PROGRESS_EVERY_S = 0.5
PROGRESS_TOPIC = "blockpred-progress"

#: Counts of wrong values a worker's pipeline keeps (see RunStats), reported as its stage times are.
_PIPELINE_COUNTS = ("num_nonfinite", "num_nonfinite_blocks", "num_missing_chunk_reads", "num_missing_chunk_blocks")

# Per worker process: what each registered plugin keeps (see _WorkerJob).
_STATE: dict[str, "_WorkerJob"] = {}



class _WorkerJob:
    """A job on one worker: its loaded network, the sizes that fit the device, and its open pipeline."""

    def __init__(self, job: Job, predictor, worker, key: str):
        self.job, self.predictor = job, predictor
        self.backoff = Backoff(job.settings.batch_size)  # kept from task to task
        self.report = _Reporter(worker, key)
        self._stream: JobStream | None = None
        self._lock = threading.Lock()

    def stream(self) -> JobStream:
        """The worker's pipeline for the job, opened by the first task (again if it stopped)."""
        with self._lock:
            if self._stream is None or not self._stream.stream.alive:
                if self._stream is not None:
                    self._stream.close()
                self._stream = JobStream(self.job, self.predictor, self.backoff, on_block_done=self.report)
            return self._stream

    def close(self) -> None:
        """At the run's end the pipeline is idle; after a failed run, only the blocks already in it finish."""
        with self._lock:
            if self._stream is not None:
                self._stream.close(cancel=True)
                self._stream = None
            self.job.markers.close()  # a worker outlives runs: no descriptor kept per run


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
        _STATE[self.key] = _WorkerJob(self.job, predictor, worker, self.key)

    def teardown(self, worker):
        state = _STATE.pop(self.key, None)
        if state is not None:
            state.close()


def worker_device(device: str) -> str:
    """A worker's device: a GPU worker sees its own GPU first (CUDA_VISIBLE_DEVICES), so ``cuda:0``."""
    return "cuda:0" if device.startswith("cuda") else device


def _run_task(key: str, block_ids) -> dict:
    """One task on a worker: queue these blocks on the worker's pipeline and wait for them.

    The counts are the task's; the stage times, busy seconds and out-of-memory
    events are the worker's pipeline's so far (tasks share it), tagged with
    the pipeline's id: the client keeps the latest of each.
    """
    from distributed import get_worker

    worker = get_worker()
    state = _STATE[key]
    stream = state.stream()
    try:
        counts = stream.run(block_ids)
    except BlockFailedError as err:
        if not err.permanent:
            raise  # dask retries the task
        return {"failure": err}  # a full disk, a refused permission: a retry would only fail again
    finally:
        state.report.flush()
    pipeline, backoff = stream.stream.stats, state.backoff
    return {"worker": str(worker.name), "device": str(state.predictor.device), "num_blocks": counts.num_blocks,
            "num_voxels": counts.num_voxels, "num_skipped": counts.num_skipped, "seconds": counts.seconds,
            "pipeline": {"id": stream.stream.id, "busy_s": stream.stream.busy_s, "read_s": pipeline.read_s,
                         "transfer_s": pipeline.transfer_s, "compute_s": pipeline.compute_s,
                         "write_s": pipeline.write_s, "out_of_memory": backoff.events,
                         **{name: getattr(pipeline, name) for name in _PIPELINE_COUNTS}},
            "missing_chunks": set(pipeline.missing_chunks), "missing_chunks_counted": pipeline.missing_chunks_counted,
            "batch_size": backoff.batch_size, "block_parts": tuple(backoff.parts)}


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
            # "name": the scheduler sets "worker" to the worker's address
            self._worker.log_event(PROGRESS_TOPIC, {"key": self._key, "blocks": blocks, "voxels": voxels,
                                                    "name": str(self._worker.name)})
