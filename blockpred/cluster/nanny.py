"""The nanny of each worker process blockpred starts: steady when a worker dies, deaf to Ctrl-C.

* **A worker that dies while starting is started again.**  dask's nanny
  restarts a worker process that dies while running, but one that dies
  before it has connected (a kill, the OOM killer, during the seconds of its
  imports) fails the nanny's start, and with it the whole local cluster.
  :class:`SteadyNanny` starts it again, up to :data:`START_ATTEMPTS` times;
  the run goes on with the other workers meanwhile.
* **Ctrl-C, SIGTERM and SIGHUP are the client's.**  A terminal sends SIGINT
  to every process of the foreground group (a batch system or ``kill -TERM
  -PGID`` SIGTERM, a closed terminal SIGHUP): to the client and to each
  worker, which would die with a traceback in the middle of its task (and be
  restarted by its nanny while the client shuts down).  A worker process starts with all three blocked
  instead (its nanny stops it by a message, then SIGKILL): a thread's signal mask is inherited by the threads it
  starts and kept across fork and exec, and the nanny spawns its worker from
  a thread it starts in its event loop.  The client, interrupted, closes the
  cluster, and the nannies stop their workers.
* **A worker ends with the process that started it.**  Each worker process
  also watches its parent itself (:mod:`blockpred.cluster.orphan`, dask's preload):
  a worker of a killed client must not live on.

Imported only where a local cluster with worker processes starts (it
imports dask.distributed: see :func:`blockpred.cluster.distributed_setup.import_distributed`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from multiprocessing import resource_tracker

from ..errors import ClusterError
from .distributed_setup import import_distributed
from .orphan import PARENT_ENV

import_distributed()

from distributed import Nanny  # noqa: E402
from distributed.core import Status  # noqa: E402

logger = logging.getLogger(__name__)

#: Starts of a worker process before its nanny gives up, when each dies before it connects.
START_ATTEMPTS = 3


class SteadyNanny(Nanny):
    """A dask nanny whose worker process starts with SIGINT blocked, starts again if it dies while starting, and
    ends when the process of this nanny does (see the module docstring)."""

    def __init__(self, *args, env: dict | None = None, preload: list[str] | None = None, **kwargs):
        import dask

        env = {**(env or {}), PARENT_ENV: str(os.getpid())}  # nannies run in the client: the workers' parent
        if preload is None:
            preload = dask.config.get("distributed.worker.preload") or []
        preload = [preload] if isinstance(preload, str) else list(preload)
        super().__init__(*args, env=env, preload=[*preload, "blockpred.cluster.orphan"], **kwargs)

    async def instantiate(self) -> Status:
        """Start the worker process: at the nanny's start (status init) and after the process died (running)."""
        _block_interrupts()
        status = await super().instantiate()
        for attempt in range(2, START_ATTEMPTS + 1):
            # Stopped: the process ended before it connected (a worker that fails on its own raises instead).
            if status != Status.stopped or self.status not in (Status.init, Status.running):
                return status
            logger.warning("the process of dask worker %s died while starting; starting it again (%d of %d)",
                           self.name, attempt, START_ATTEMPTS)
            status = await super().instantiate()
        if status == Status.stopped and self.status == Status.init:  # the cluster's start fails, naming why
            raise ClusterError(f"the process of dask worker {self.name} died while starting, {START_ATTEMPTS} times")
        return status


def _block_interrupts() -> None:
    """Block SIGINT, SIGTERM and SIGHUP in this thread (the nanny's event loop), so the worker processes spawned
    from it start so.

    multiprocessing's resource tracker unblocks SIGINT and SIGTERM in the
    thread that starts it (its own start blocks them for a moment, and the
    tracker ignores both): it is started first, with SIGHUP blocked, which it
    keeps (a tracker a terminal's SIGHUP ended is started again by the next
    worker, and every later unregistration of the workers' semaphores prints
    a KeyError's traceback).  Blocking these signals in a thread other than
    the main thread costs nothing: Python runs its handlers in the main thread
    only, and the kernel delivers a process's signal to a thread that does not
    block it.  (In the main thread, a cluster started in an asyncio program,
    it is left alone.)
    """
    if threading.current_thread() is threading.main_thread():
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
