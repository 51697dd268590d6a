"""The dask cluster a run uses, started early so that its start-up overlaps the client's.

* **Local.** By default a local cluster with one worker process per device:
  every visible GPU (each worker sees only its own, through
  ``CUDA_VISIBLE_DEVICES``), or ``num_workers`` CPU workers; dask-cuda's
  ``LocalCUDACluster`` when installed.  More workers than GPUs (or, on the
  CPU, than cores) are refused before anything starts.  With
  ``scheduler_address`` the run joins an existing cluster instead, once its
  address has passed :mod:`.address`'s checks.
* **Batch jobs.** With ``jobs`` (``--cluster slurm``) the workers are jobs
  of a batch system, submitted and replaced by :mod:`blockpred.cluster.jobqueue`.
* **In this process** when there is one CPU worker (the default without a
  GPU): a dask worker on threads, so no second process imports torch again.
* **Early.** :class:`Cluster` starts connecting at once, in a background
  thread: ``predict`` starts it as soon as the paths have passed their
  checks, so the workers' start-up (spawning, their own imports of torch and
  blockpred, warmed by :func:`_warm`) runs while the client loads the model
  and does its dry run.  What can be refused is refused first, in the
  caller's thread (a malformed scheduler address, more workers than
  devices), so nothing has started when the one line comes.
  :meth:`Cluster.client` waits for the start; :meth:`Cluster.close` stops
  what was started, also when the run never used it (a later check failed).
* **Spawned cleanly.** While a local cluster lives, the caller's ``__main__``
  is hidden from multiprocessing (:func:`without_main_reimport`), so a plain
  script without a ``__main__`` guard works.
* **On loopback.** A cluster blockpred starts listens on 127.0.0.1 only
  (scheduler, nannies, workers, dashboard): dask has no authentication, and
  whoever reaches a worker can run code in it.  Joining ``scheduler_address``
  is the user's own choice of what to expose.
* **Steady.** A worker process may die at any moment, its start included:
  its nanny starts it again (:mod:`blockpred.cluster.nanny`) and the run goes on.
  Ctrl-C is the client's alone: worker processes never see it (they start
  with SIGINT blocked) and are stopped by the client's close.

Nothing here imports torch at module level, and a CPU run's start does not
import it at all (NVML tells whether there is a GPU).
"""

from __future__ import annotations

import contextlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..errors import ClusterError, InvalidOptionError
from .address import check_scheduler_address, first_connect_s, reach
from .distributed_setup import dask_log_level, import_distributed, quiet_dask  # noqa: F401

if TYPE_CHECKING:
    from .jobqueue import JobSettings

#: The one address a local cluster listens on: the scheduler, nannies, workers and dashboard.
LOOPBACK = "127.0.0.1"

#: Threads of a worker blockpred starts: two tasks at once, both waiting on the worker's one
#: pipeline, the second's blocks queued behind the first's (see blockpred.cluster.scheduler).
WORKER_THREADS = 2


class Cluster:
    """A dask cluster being started (or joined) in the background; close it when done."""

    def __init__(self, device: str, num_workers: int | None, scheduler_address: str | None,
                 jobs: "JobSettings | None" = None):
        # Refused here, before anything starts: an address that is not one or where no scheduler answers (at once
        # where nothing listens, else within the first handshake's timeout), more workers than devices.
        if scheduler_address is not None:
            check_scheduler_address(scheduler_address)
            reach(scheduler_address, first_connect_s())  # milliseconds where a scheduler answers
        envs = local_worker_envs(device, num_workers) if scheduler_address is None and jobs is None else None
        self.scheduler_address = scheduler_address
        self._hidden = contextlib.ExitStack()
        if envs is not None:
            self._hidden.enter_context(without_main_reimport())  # spawned workers do not run the caller's script
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="blockpred-cluster")
        self._started = self._pool.submit(self._connect, envs, scheduler_address, jobs)
        self._waited = jobs is not None or scheduler_address is not None

    def check(self) -> None:
        """Raise now what the start raised, before anything is written: a batch cluster's start (its settings,
        ``sbatch --test-only``, the submission; not the jobs' start) and a joined scheduler's first handshake
        (see :mod:`.address`) are waited for, a local cluster's start only if done."""
        if self._waited or self._started.done():
            self._started.result()

    @staticmethod
    def _connect(envs: list[dict[str, str]] | None, scheduler_address: str | None, jobs: "JobSettings | None"):
        import_distributed()
        from distributed import Client

        quiet_dask()
        if scheduler_address is not None:  # checked and reached by __init__ already
            return None, Client(scheduler_address), None
        if jobs is not None:
            from .jobqueue import BatchCluster

            cluster = BatchCluster(jobs, dask_log_level())
            try:
                return cluster, Client(cluster.cluster), None
            except BaseException:
                cluster.close()
                raise
        try:
            cluster = _start_local_cluster(envs)
        except Exception as err:  # a worker that kept dying while starting, or no port to listen on
            raise ClusterError(f"the local dask cluster of {len(envs)} worker(s) did not start: {_root_cause(err)}; "
                               f"check that this machine has the memory for {len(envs)} more Python processes "
                               f"that import torch, or use --local") from err
        client = Client(cluster)
        if _in_process(envs):
            return cluster, client, None  # shares this process's torch and its threads
        client.run(_warm, on_error="ignore")  # a worker that died meanwhile is started again, and warms then
        cpu = not envs[0]["CUDA_VISIBLE_DEVICES"]
        return cluster, client, max(1, (os.cpu_count() or 1) // len(envs)) if cpu else None

    def client(self):
        """The connected dask client (waits for the start); raises what the start raised."""
        return self._started.result()[1]

    @property
    def torch_threads(self) -> int | None:
        """Threads each local CPU worker gives torch (its share of the cores); None for GPU or joined workers."""
        return self._started.result()[2]

    def close(self) -> None:
        try:
            cluster, client, _ = self._started.result()
        except Exception:  # noqa: BLE001 - a start that failed has nothing to close; client() reported it
            cluster = client = None
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()
        self._pool.shutdown()
        self._hidden.close()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _root_cause(error: BaseException) -> BaseException:
    """The innermost of an exception's causes (dask wraps a worker's failure as 'Nanny failed to start')."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _warm() -> None:
    """Run on each new local worker at once: the imports its first task would otherwise wait for."""
    import torch  # noqa: F401

    from ..pipeline import job  # noqa: F401


def local_worker_envs(device: str, num_workers: int | None) -> list[dict[str, str]]:
    """One environment per local worker: each GPU worker sees only its own GPU.

    A CPU run (``cpu``, or ``auto`` where NVML finds no GPU) decides without
    importing torch, so a cluster started early does not wait for that import.
    ``num_workers`` beyond what the machine holds is refused (:class:`InvalidOptionError`):
    more than the visible GPUs for a GPU run (each worker owns one), more than
    the cores this process may use for a CPU run (each worker is a process
    that imports torch; more than one a core only share the cores).
    """
    if device == "cpu" or (device == "auto" and not _nvml_sees_a_gpu()):
        return _cpu_envs(num_workers)
    import torch

    wants_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if not wants_cuda:
        return _cpu_envs(num_workers)
    if not torch.cuda.is_available():
        raise InvalidOptionError(f"device {device!r} asked for, but no CUDA device is available; use --device cpu")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if ":" in device:
        index = device.split(":", 1)[1]
        if not index.isdigit() or int(index) >= len(gpus):
            raise InvalidOptionError(f"device {device!r} asked for, but {len(gpus)} CUDA device(s) are visible "
                                     f"(cuda:0 to cuda:{len(gpus) - 1})")
        gpus = [gpus[int(index)]]
    if num_workers is not None and num_workers > len(gpus):
        where = f"{len(gpus)} for --device {device}" if ":" in device else f"{len(gpus)} visible"
        raise InvalidOptionError(
            f"--workers {num_workers} asks for more local workers than there are GPUs: {where} (each worker owns "
            f"one GPU); use --workers {len(gpus)} or fewer, or leave --workers out for one worker per GPU")
    return [{"CUDA_VISIBLE_DEVICES": gpu} for gpu in gpus[:num_workers or len(gpus)]]


def _cpu_envs(num_workers: int | None) -> list[dict[str, str]]:
    """CPU workers: at most one per core this process may run on."""
    cores = visible_cores()
    if num_workers is not None and num_workers > cores:
        raise InvalidOptionError(
            f"--workers {num_workers} asks for more CPU workers than this machine has cores: {cores} (each worker "
            f"is a process that imports torch and takes its share of the cores); use --workers {cores} or fewer")
    return [{"CUDA_VISIBLE_DEVICES": ""} for _ in range(num_workers or 1)]


def visible_cores() -> int:
    """The CPU cores this process may run on (its affinity: fewer than the machine's under taskset or a batch
    job's allocation)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _nvml_sees_a_gpu() -> bool:
    """Whether the NVIDIA driver reports any GPU (no driver, no library: no)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML, or no driver: no GPU to run on
        return False
    try:
        return pynvml.nvmlDeviceGetCount() > 0 and os.environ.get("CUDA_VISIBLE_DEVICES", "0") != ""
    finally:
        pynvml.nvmlShutdown()


def check_hdf5_writers(target, num_workers: int) -> None:
    """HDF5 has no concurrent writers: an HDF5 output takes one worker."""
    if target.format == "hdf5" and num_workers > 1:
        raise InvalidOptionError(
            f"an HDF5 output cannot be written by {num_workers} workers at once (HDF5 has no concurrent writers); "
            f"use --workers 1 or --local, or a zarr or N5 output"
        )


def _in_process(envs: list[dict[str, str]]) -> bool:
    """One CPU worker runs in this process: a second process would only import torch again."""
    return len(envs) == 1 and not envs[0]["CUDA_VISIBLE_DEVICES"]


def _start_local_cluster(envs: list[dict[str, str]]):
    """The local cluster for ``envs``, one worker each.

    One CPU worker is a dask worker in this process (on threads; no spawn, no
    second import of torch: start-up is a fraction of a second).  Several
    workers, or GPU workers (each sees only its own GPU), are processes
    under nannies (:class:`blockpred.cluster.nanny.SteadyNanny`): dask-cuda's
    LocalCUDACluster when installed and every worker has its own GPU, else a
    SpecCluster.  Either way everything listens on :data:`LOOPBACK` only.
    """
    from distributed import Scheduler, SpecCluster, Worker

    from .nanny import SteadyNanny

    dashboard = f"{LOOPBACK}:0"
    scheduler = {"cls": Scheduler, "options": {"host": LOOPBACK, "dashboard_address": dashboard}}
    if _in_process(envs):
        workers = {"blockpred-0": {"cls": Worker, "options": {"nthreads": WORKER_THREADS, "host": LOOPBACK}}}
        return SpecCluster(workers=workers, scheduler=scheduler, silence_logs=dask_log_level(), name="blockpred")

    gpus = [env["CUDA_VISIBLE_DEVICES"] for env in envs]
    if all(gpus) and len(set(gpus)) == len(gpus):
        try:
            from dask_cuda import LocalCUDACluster
        except ImportError:
            pass
        else:
            return LocalCUDACluster(CUDA_VISIBLE_DEVICES=",".join(gpus), threads_per_worker=WORKER_THREADS,
                                    host=LOOPBACK, dashboard_address=dashboard, worker_class=SteadyNanny,
                                    silence_logs=dask_log_level())

    options = {"nthreads": WORKER_THREADS, "host": LOOPBACK, "silence_logs": dask_log_level()}
    workers = {f"blockpred-{i}": {"cls": SteadyNanny, "options": {**options, "env": env}}
               for i, env in enumerate(envs)}
    import dask

    with dask.config.set(_worker_environment(len(envs), cpu=not any(gpus))):
        return SpecCluster(workers=workers, scheduler=scheduler, silence_logs=dask_log_level(), name="blockpred")


def _worker_environment(num_workers: int, *, cpu: bool) -> dict:
    """What dask sets before it spawns a worker, adjusted for a process that runs a network.

    dask's defaults pin OpenMP/MKL to one thread and set ``MALLOC_TRIM_THRESHOLD_``,
    which turns off glibc's adaptive mmap threshold: every large tensor is then
    mapped and zeroed anew.  A worker here gets its share of the cores instead.

    A CPU worker's network runs on a thread that is not the process's main
    thread, so glibc serves its tensors from a secondary arena, and there the
    network ran at about half its main-thread speed (tiny, 148^3 input on
    2 cores: 6.5-8.0 s against 3.8 s of compute for the same 9 blocks; bench/bench_thread_arena.py).
    ``MALLOC_ARENA_MAX=1`` puts every thread on the main arena and removes the
    difference.  GPU workers keep glibc's default until measured on a GPU.
    """
    threads = str(max(1, (os.cpu_count() or 1) // num_workers))
    key = "distributed.nanny.pre-spawn-environ"
    environment = {f"{key}.MALLOC_TRIM_THRESHOLD_": None, f"{key}.OMP_NUM_THREADS": threads,
                   f"{key}.MKL_NUM_THREADS": threads, f"{key}.OPENBLAS_NUM_THREADS": threads}
    if cpu:
        environment[f"{key}.MALLOC_ARENA_MAX"] = "1"
    return environment


@contextlib.contextmanager
def without_main_reimport():
    """While workers are spawned: hide the caller's ``__main__`` from multiprocessing.

    A spawned process imports the parent's main script again (as
    ``__mp_main__``) so that pickles can refer to it.  A script that calls
    :func:`blockpred.predict` without an ``if __name__ == "__main__":`` guard
    would then start a second prediction inside every worker and die in
    multiprocessing's bootstrapping check.  blockpred's tasks and plugins are
    pickled with cloudpickle, which carries anything defined in ``__main__`` by
    value, so the workers never need the script: they are spawned as from an
    interactive session.  Workers a nanny restarts later are spawned the same
    way while the run lasts.
    """
    main = sys.modules.get("__main__")
    hidden = {name: getattr(main, name) for name in ("__file__", "__spec__") if main is not None and hasattr(main, name)}
    if "__file__" not in hidden and getattr(main, "__spec__", None) is None:
        yield  # an interactive session or a notebook: nothing to hide
        return
    for name in hidden:
        if name == "__spec__":
            main.__spec__ = None
        else:
            delattr(main, name)
    try:
        yield
    finally:
        for name, value in hidden.items():
            setattr(main, name, value)


