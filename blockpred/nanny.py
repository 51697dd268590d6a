"""The nanny of each worker process blockpred starts: steady when a worker dies.

* **A worker that dies while starting is started again.**  dask's nanny
  restarts a worker process that dies while running, but one that dies
  before it has connected (a kill, the OOM killer, during the seconds of its
  imports) fails the nanny's start, and with it the whole local cluster.
  :class:`SteadyNanny` starts it again, up to :data:`START_ATTEMPTS` times;
  the run goes on with the other workers meanwhile.

Imported only where a local cluster with worker processes starts (it
imports dask.distributed: see :func:`blockpred.cluster.import_distributed`).
"""

from __future__ import annotations

import logging

from .cluster import import_distributed
from .errors import ClusterError

import_distributed()

from distributed import Nanny  # noqa: E402
from distributed.core import Status  # noqa: E402

logger = logging.getLogger(__name__)

#: Starts of a worker process before its nanny gives up, when each dies before it connects.
START_ATTEMPTS = 3


class SteadyNanny(Nanny):
    """A dask nanny whose worker process starts again if it dies while starting."""

    async def instantiate(self) -> Status:
        """Start the worker process: at the nanny's start (status init) and after the process died (running)."""
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

