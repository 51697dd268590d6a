"""A worker process blockpred starts ends when the process that started it is gone (``blockpred.cluster.orphan``).

Real processes: a parent that starts a child the way a nanny starts a worker
(the parent's pid in its environment, the preload hook run in it), then the
parent killed with SIGKILL; and the worker processes of a real local cluster,
which must carry this process's pid and run the watch.  A killed client's
workers ending: ``tests/cluster/test_scheduler.py::test_a_killed_run_resumes_and_recomputes_only_the_blocks_in_flight``.
"""

import os
import signal
import subprocess
import sys
import time

import psutil

from blockpred.cluster.orphan import PARENT_ENV
from tests.helpers import child_env, wait_for

CHILD = """
import sys, time
from blockpred.cluster.orphan import dask_setup
dask_setup(None)
open(sys.argv[1], "w").close()
time.sleep(600)
"""

PARENT = """
import os, subprocess, sys, time
env = dict(os.environ, {env}=str(os.getpid()))
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env)
open(sys.argv[3], "w").write(str(child.pid))
time.sleep(600)
"""


def _wait_for(path, process: subprocess.Popen) -> None:
    wait_for(lambda: os.path.exists(path) and open(path).read(), "start of the parent and its child", process=process)


def test_a_worker_process_ends_when_the_process_that_started_it_is_killed(tmp_path):
    ready, pid_file = tmp_path / "ready", tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(env=PARENT_ENV), CHILD, str(ready), str(pid_file)],
                              env=child_env())
    try:
        _wait_for(pid_file, parent)
        child = psutil.Process(int(pid_file.read_text()))
        wait_for(lambda: ready.exists() or not child.is_running(), "the child's watch started")
        assert child.is_running(), "the child ended before it started its watch"
        time.sleep(1.5)  # three looks at a living parent
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE, "the child ended with its parent alive"
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        def ended() -> bool:
            try:
                return not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        wait_for(ended, "end of the child once its parent is gone")
    finally:
        parent.kill()
        for process in psutil.process_iter():
            try:
                if process.ppid() == 1 and str(tmp_path) in " ".join(process.cmdline()):
                    process.kill()
            except psutil.Error:
                pass


def test_each_worker_process_of_a_local_cluster_watches_this_process():
    """The nanny's part: its worker processes get this process's pid and run the watch (dask's preload)."""
    import threading

    from blockpred.cluster.local import Cluster

    def watching() -> tuple[str | None, bool]:
        return os.environ.get(PARENT_ENV), any(t.name == "blockpred-parent-watch" for t in threading.enumerate())

    with Cluster("cpu", 2, None) as cluster:
        seen = cluster.client().run(watching)
    assert len(seen) == 2 and all(tuple(v) == (str(os.getpid()), True) for v in seen.values()), seen
