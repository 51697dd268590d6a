"""dask.distributed, imported one thread at a time and as quiet as blockpred logs.

Every part of blockpred that needs dask.distributed imports it through :func:`import_distributed` first (a
cluster starts in a background thread while the client goes on), and takes its log level from
:func:`dask_log_level`.  Nothing here imports dask at module level.
"""

from __future__ import annotations

import logging
import threading

_IMPORTING = threading.Lock()


def import_distributed() -> None:
    """Import dask.distributed in one thread at a time.

    A cluster starts (and so imports distributed) in a background thread while
    the client goes on; a second thread importing distributed at the same
    moment can find one of its modules half imported (``ImportError: cannot
    import name ... from partially initialized module``).  Every import of it
    in blockpred goes through here first; once imported, this costs a lock.
    """
    with _IMPORTING:
        import distributed  # noqa: F401


def quiet_dask() -> None:
    """dask's own log lines in this process only when blockpred itself logs at INFO (``blockpred -v``)."""
    if logging.getLogger("blockpred").isEnabledFor(logging.INFO):
        return
    import distributed  # noqa: F401 - creates its loggers

    for name in list(logging.root.manager.loggerDict):
        if name == "distributed" or name.startswith("distributed."):
            logging.getLogger(name).setLevel(dask_log_level())


def dask_log_level() -> int:
    """The level of dask's log lines, in this process and in the workers: ERROR with ``blockpred -v``, else CRITICAL.

    What fails in dask reaches blockpred as an exception and is reported in
    one line; dask's ERROR lines would repeat it with a traceback (a failed
    task's 'Compute Failed'), or are the noise of a cluster going down (a
    worker's heartbeat cut short by Ctrl-C, a broadcast to a worker just killed).
    """
    return logging.ERROR if logging.getLogger("blockpred").isEnabledFor(logging.INFO) else logging.CRITICAL
