"""Workers as batch jobs: ``--cluster slurm``, one dask worker per job, used as they start, replaced when lost.

``blockpred run IN OUT --cluster slurm --jobs 8`` starts a dask scheduler in
this process and submits up to ``jobs`` SLURM jobs through dask-jobqueue
(``pip install -e ".[slurm]"``), each one dask worker:

* **Settings.** dask-jobqueue's own configuration first (a site's
  ``~/.config/dask/jobqueue.yaml``, then ``--jobqueue-config FILE``), then
  blockpred's flags on top (:data:`JOB_KEYS`: ``--partition`` is its
  ``queue``, and so on), then what a blockpred worker needs: one process
  with two task threads (the worker's one pipeline is fed by two tasks),
  ``--gres=gpu:N`` for ``--gpus-per-job N`` (none for CPU jobs), and its
  environment: every math library's threads = the job's cores (dask's nanny
  would pin them to 1), ``MALLOC_TRIM_THRESHOLD_`` unset and, for CPU jobs,
  ``MALLOC_ARENA_MAX=1`` (see :mod:`blockpred.cluster.local`).  Workers run without
  a nanny, so that environment is the job's own; a worker that dies ends its
  job, which is replaced.  The workers use this process's Python.
* **Checked before submitting.** ``sbatch --test-only`` is given the job
  script first: a job the cluster refuses (a partition, a GPU it lacks, more
  cores than a node has) fails the run at once, in one line that quotes
  sbatch.
* **Started as granted.** The run does not wait for every job: its tasks go
  to whichever workers have joined (see :mod:`blockpred.cluster.scheduler`).
* **Replaced.** Every :data:`SUPERVISE_EVERY_S` the jobs this run submitted
  are looked up in ``squeue``; one that is gone (``scancel``, its walltime,
  a lost node) is replaced by a new job, with a warning line.  Jobs still
  pending stay pending.
* **Cancelled.** Closing the cluster (the end of the run, an error, Ctrl-C)
  cancels every job this run submitted, by its job name
  (``blockpred-<pid>-<n>``): none is left behind.
* **TLS.** The scheduler listens where the compute nodes can reach it, so
  the cluster uses TLS with credentials made for this run (dask-jobqueue's
  ``security=True``), written to a folder of the run's own in
  ``shared-temp-directory`` (this process's working directory unless the
  configuration names one; it must be on the file system the jobs share) and
  removed when the run ends.  dask has no authentication of its own.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..choices import BATCH_SYSTEMS  # noqa: F401 - the batch systems --cluster takes
from ..errors import ClusterError, InvalidOptionError

logger = logging.getLogger(__name__)

#: blockpred's job option -> dask-jobqueue's key (``jobqueue.slurm.<key>``, a ``SLURMCluster`` argument).
JOB_KEYS = {"partition": "queue", "account": "account", "walltime": "walltime", "cores": "cores",
            "memory": "memory"}
#: The options only a batch cluster takes (refused without ``--cluster``).
CLUSTER_OPTIONS = ("jobs", *JOB_KEYS, "gpus_per_job", "jobqueue_config")
#: How often the jobs are looked up in the batch system (lost ones are replaced).
SUPERVISE_EVERY_S = 2.0
#: Seconds a call of sbatch, squeue or scancel may take.
COMMAND_TIMEOUT_S = 60.0

_RUNS = itertools.count()
_IMPORTING = threading.Lock()


@dataclass(frozen=True, kw_only=True)
class JobSettings:
    """What the run's jobs are: the batch system, how many, the options given, and the worker's threads."""

    system: str
    jobs: int
    #: dask-jobqueue arguments from blockpred's options (only those given).
    options: dict = field(default_factory=dict)
    gpus_per_job: int = 0
    config_file: str | None = None
    worker_threads: int = 2


def job_settings(cfg, worker_threads: int) -> JobSettings | None:
    """The run's :class:`JobSettings` (None without ``cluster``); options that need a cluster are refused without."""
    if cfg.cluster is None:
        given = [name for name in CLUSTER_OPTIONS if getattr(cfg, name) is not None]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise InvalidOptionError(f"{flags} set(s) the jobs of a batch cluster: add --cluster slurm, or drop it")
        return None
    for other, flag in (("scheduler", "--scheduler"), ("workers", "--workers"), ("local", "--local")):
        if getattr(cfg, other):
            raise InvalidOptionError(f"--cluster {cfg.cluster} starts its own workers as jobs; it cannot be combined "
                                     f"with {flag}")
    gpus = cfg.gpus_per_job if cfg.gpus_per_job is not None else (0 if str(cfg.device) == "cpu" else 1)
    if gpus == 0 and str(cfg.device).startswith("cuda"):
        raise InvalidOptionError(f"--device {cfg.device} needs GPUs in the jobs: drop --gpus-per-job 0, "
                                 f"or use --device cpu")
    options = {JOB_KEYS[name]: getattr(cfg, name) for name in JOB_KEYS if getattr(cfg, name) is not None}
    return JobSettings(system=cfg.cluster, jobs=cfg.jobs or 1, options=options, gpus_per_job=gpus,
                       config_file=cfg.jobqueue_config, worker_threads=worker_threads)


class BatchCluster:
    """A dask-jobqueue cluster of up to ``settings.jobs`` jobs, lost jobs replaced; :meth:`close` cancels them all."""

    def __init__(self, settings: JobSettings, silence_logs: int):
        self.settings = settings
        self.job_name = f"blockpred-{os.getpid()}-{next(_RUNS)}"
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._credentials: str | None = None
        self.cluster = _make_cluster(settings, self.job_name, silence_logs, self._credentials_in)
        try:
            _check_submission(self.cluster.job_script())
            self.cluster.scale(jobs=settings.jobs)
        except BaseException:
            self.close()
            raise
        self._supervisor = threading.Thread(target=self._supervise, name="blockpred-jobs", daemon=True)
        self._supervisor.start()

    def _credentials_in(self, shared: str) -> str:
        """A folder of its own in ``shared`` for the run's TLS credentials, removed by :meth:`close`."""
        try:
            self._credentials = tempfile.mkdtemp(prefix=".blockpred-tls-", dir=shared)
        except OSError as err:
            raise InvalidOptionError(
                f"the TLS credentials of the jobs' workers go to {shared!r}, where they cannot be written "
                f"({err.strerror}); run from a folder the jobs share, or set "
                f"jobqueue.{self.settings.system}.shared-temp-directory") from None
        return self._credentials

    def _supervise(self) -> None:
        while not self._stop.wait(SUPERVISE_EVERY_S):
            try:
                self.replace_lost()
            except Exception as err:  # noqa: BLE001 - the batch system busy or down: look again later
                logger.debug("could not look up the jobs of %s: %s", self.job_name, err)

    def replace_lost(self) -> list[str]:
        """Submit a new job for each of this run's jobs that the batch system no longer has; their ids."""
        known = self.cluster.sync(_job_ids, self.cluster)  # before squeue: a job submitted later is not judged
        if not known:
            return []
        alive = _squeue(self.job_name)
        lost = [job_id for job_id in known.values() if job_id not in alive]
        if lost:
            logger.warning("SLURM job(s) %s of this run ended (time limit, scancel or a lost node); submitting "
                           "new ones", ", ".join(lost))
            self.cluster.sync(_replace, self.cluster, set(lost), self.settings.jobs)
        return lost

    @property
    def scheduler_address(self) -> str:
        return self.cluster.scheduler_address

    def close(self) -> None:
        """Stop replacing jobs, close the cluster and cancel every job this run submitted."""
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=COMMAND_TIMEOUT_S)
        try:
            if getattr(self, "cluster", None) is not None:
                self.cluster.close()
        finally:
            _scancel(self.job_name)  # also a job submitted while the cluster closed, or one it lost track of
            if self._credentials is not None:
                shutil.rmtree(self._credentials, ignore_errors=True)


def _make_cluster(settings: JobSettings, job_name: str, silence_logs: int, credentials_in: Callable[[str], str]):
    """The dask-jobqueue cluster: its configuration, the config file, the options given, then blockpred's needs.

    Every setting is passed explicitly, so the jobs submitted later (replacements) are made the same way
    whatever dask's global configuration is by then.
    """
    SLURMCluster = import_jobqueue(settings.system).SLURMCluster
    key = f"jobqueue.{settings.system}"
    kwargs = _configured(settings)
    if kwargs.get("cores") is None or kwargs.get("memory") is None:
        raise InvalidOptionError(
            f"--cluster {settings.system} needs each job's cores and memory: pass --cores N --memory 16GB, or set "
            f"{key}.cores and {key}.memory in ~/.config/dask/jobqueue.yaml (or a --jobqueue-config file)")
    cores = int(kwargs["cores"])
    environment = [f"export OMP_NUM_THREADS={cores} MKL_NUM_THREADS={cores} OPENBLAS_NUM_THREADS={cores}",
                   "unset MALLOC_TRIM_THRESHOLD_"]
    if settings.gpus_per_job == 0:
        environment.append("export MALLOC_ARENA_MAX=1")
    kwargs.update(
        job_name=job_name,
        # exec: the worker replaces the job's shell, so SLURM's signals reach it. Under a shell, a cancelled
        # job's shell could die first and its worker live on, reparented to init (proctrack/linuxproc loses it).
        python=f"exec {kwargs.get('python') or sys.executable}",
        processes=1,
        nanny=False,
        security=True,
        shared_temp_directory=credentials_in(kwargs.get("shared_temp_directory") or os.getcwd()),
        worker_extra_args=[*kwargs.get("worker_extra_args", []), "--nthreads", str(settings.worker_threads)],
        job_extra_directives=[*kwargs.get("job_extra_directives", []),
                              *([f"--gres=gpu:{settings.gpus_per_job}"] if settings.gpus_per_job else [])],
        job_script_prologue=[*kwargs.get("job_script_prologue", []), *environment],
        silence_logs=silence_logs,
    )
    try:
        return SLURMCluster(**kwargs)
    except (ValueError, TypeError) as err:
        raise InvalidOptionError(f"the SLURM job settings are not valid: {err}") from None
    except OSError as err:
        raise ClusterError(f"the SLURM cluster's scheduler did not start: {err}") from None


def import_jobqueue(system: str = "slurm"):
    """dask_jobqueue, imported from any thread without touching the process's Ctrl-C.

    Its import sets a SIGINT handler that exits (``dask_jobqueue.runner``),
    which fails off the main thread and, on it, would turn Ctrl-C into a plain
    exit that skips blockpred's cleanup (cancelling the jobs): the handler is
    not installed.
    """
    import signal
    import sys

    with _IMPORTING:
        if "dask_jobqueue" not in sys.modules:
            install = signal.signal
            signal.signal = lambda signalnum, handler: signal.getsignal(signalnum)  # the import's only call
            try:
                import dask_jobqueue  # noqa: F401
            except ImportError:
                raise InvalidOptionError(
                    f"--cluster {system} needs dask-jobqueue: pip install -e \".[slurm]\" in blockpred's checkout "
                    f"(or pip install dask-jobqueue)") from None
            finally:
                signal.signal = install
    return sys.modules["dask_jobqueue"]


def _configured(settings: JobSettings) -> dict:
    """The cluster's arguments from dask-jobqueue's configuration, the config file and the options given."""
    import dask

    configured = dict(dask.config.get(f"jobqueue.{settings.system}", {}) or {})
    if settings.config_file is not None:
        configured = dask.config.merge(configured, _config_file(settings.config_file, settings.system))
    kwargs = {name.replace("-", "_"): value for name, value in configured.items()
              if value is not None and name != "name"}  # the job name is the run's own
    kwargs.update(settings.options)
    return kwargs


def written_folders(settings: JobSettings) -> list[tuple[str, str]]:
    """The folders a batch cluster writes in, named as the user sets them: its TLS credentials' and its logs'.

    Checked against the input and the output before anything starts (:func:`blockpred.io.identity.refuse_inside`).
    """
    kwargs = _configured(settings)
    folders = [(f"jobqueue.{settings.system}.shared-temp-directory (the TLS credentials' folder)",
                str(kwargs.get("shared_temp_directory") or os.getcwd()))]
    if kwargs.get("log_directory"):
        folders.append((f"jobqueue.{settings.system}.log-directory (the jobs' logs)", str(kwargs["log_directory"])))
    return folders


def _config_file(path: str, system: str) -> dict:
    """The ``jobqueue: <system>:`` settings of a dask-jobqueue YAML file."""
    import yaml

    try:
        with open(path) as file:
            loaded = yaml.safe_load(file) or {}
    except OSError as err:
        raise InvalidOptionError(f"--jobqueue-config {path!r} cannot be read: {err.strerror}") from None
    except yaml.YAMLError:
        raise InvalidOptionError(f"--jobqueue-config {path!r} is not valid YAML") from None
    jobqueue = loaded.get("jobqueue", {}) if isinstance(loaded, dict) else None
    section = jobqueue.get(system, {}) if isinstance(jobqueue, dict) else None
    if not isinstance(section, dict):
        raise InvalidOptionError(f"--jobqueue-config {path!r} must hold dask-jobqueue settings as "
                                 f"jobqueue: {system}: {{cores: ..., memory: ...}}")
    return section


def _check_submission(job_script: str) -> None:
    """``sbatch --test-only`` of the job script: the batch system's own word on the job, before any is submitted."""
    result = _command(["sbatch", "--test-only"], job_script)
    if result.returncode != 0:
        said = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        raise ClusterError(f"sbatch refused the worker job: {said[-1] if said else 'exit ' + str(result.returncode)}; "
                           f"check --partition, --account, --gpus-per-job, --cores, --memory and --walltime "
                           f"against the cluster (sinfo)")


def _squeue(job_name: str) -> set[str]:
    """Ids of this user's jobs named ``job_name`` that SLURM still has (pending, running, completing ...)."""
    result = _command(["squeue", "--noheader", "--format=%i", f"--name={job_name}", "--user", _user()])
    if result.returncode != 0:
        raise ClusterError(f"squeue failed: {result.stderr.strip()}")
    return {line.strip() for line in result.stdout.splitlines() if line.strip()}


def _scancel(job_name: str) -> None:
    try:
        _command(["scancel", f"--name={job_name}", "--user", _user()])
    except ClusterError as err:
        logger.warning("could not cancel the SLURM jobs named %s: %s; cancel them with scancel --name=%s",
                       job_name, err, job_name)


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _command(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except FileNotFoundError:
        raise ClusterError(f"{argv[0]} was not found: --cluster slurm runs where SLURM's commands are (a login "
                           f"node)") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{argv[0]} did not answer in {COMMAND_TIMEOUT_S:.0f} s") from None


async def _job_ids(cluster) -> dict[str, str]:
    """Worker name -> SLURM job id of the jobs submitted so far (on the cluster's event loop)."""
    return {name: job.job_id for name, job in cluster.workers.items() if getattr(job, "job_id", None)}


async def _replace(cluster, lost: set[str], jobs: int) -> None:
    """Forget the jobs in ``lost`` and ask for ``jobs`` again: new jobs, new worker names (on the cluster's loop)."""
    for name, job in list(cluster.workers.items()):
        if getattr(job, "job_id", None) in lost:
            del cluster.workers[name]
            cluster.worker_spec.pop(name, None)
    cluster.scale(jobs=jobs)
