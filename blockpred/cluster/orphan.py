"""A worker process blockpred started ends when the process that started it is gone.

dask's worker process watches a pipe to its parent and exits when the parent
dies.  Once, under load, a worker of a client killed with SIGKILL (test
``test_a_killed_run_resumes_and_recomputes_only_the_blocks_in_flight``) was
still alive an hour later, reparented to init, with both ends of a pipe open
in itself: its parent's death never reached it.  As a backstop, every worker
process :class:`blockpred.cluster.nanny.SteadyNanny` starts runs :func:`dask_setup`
(dask's ``preload`` hook, in the worker process): a thread that compares the
process's parent with the pid the nanny gave it (:data:`PARENT_ENV`) and ends
the process at once when they differ.  What the worker was writing is then
as after a kill: its blocks are not marked done, and the next run computes
them again.

Imported by worker processes only (as a preload module); it imports nothing
heavy.
"""

from __future__ import annotations

import logging
import os
import threading
import time

logger = logging.getLogger(__name__)

#: The environment variable that carries the pid of the process that starts the worker (the nanny's).
PARENT_ENV = "BLOCKPRED_PARENT_PID"
#: Seconds between two looks at the parent.
POLL_S = 0.5
#: The exit status of a worker that ended because its parent was gone.
EXIT_STATUS = 75


def watch_parent(parent: int, poll_s: float = POLL_S) -> threading.Thread:
    """Start a daemon thread that ends this process (``os._exit``) once its parent is no longer ``parent``."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logger.warning("blockpred: the process that started this worker (pid %d) is gone: exiting", parent)
        os._exit(EXIT_STATUS)

    thread = threading.Thread(target=watch, name="blockpred-parent-watch", daemon=True)
    thread.start()
    return thread


def dask_setup(worker=None) -> None:
    """dask's preload hook: watch the parent named by :data:`PARENT_ENV`, if the environment names one."""
    parent = os.environ.get(PARENT_ENV)
    if parent and parent.isdigit():
        watch_parent(int(parent))
