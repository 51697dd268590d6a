"""A dask run never waits forever: no worker, a scheduler gone, batch-job options checked before anything is written.

Real processes: a ``dask scheduler`` on 127.0.0.1 (with or without a ``dask
worker``), ``python -m blockpred run`` joining it, a real ``kill -9`` of the
scheduler.  The SLURM side of the same rule is in ``tests/cluster/test_slurm.py``.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from blockpred.cli import main
from tests.ci import import_or_skip
from tests.helpers import assert_refused, assert_resumed, child_env, done_blocks, wait_for, write_test_volume
from tests.s3server import _free_port


@pytest.fixture
def source(tmp_path) -> str:
    data = np.random.default_rng(4).integers(0, 255, (32, 64, 64), dtype=np.uint8)
    return write_test_volume(str(tmp_path / "in.zarr"), data)


def _blockpred(*args: str, cwd: Path, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "blockpred", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


class Scheduler:
    """``dask scheduler`` on 127.0.0.1 and a free port (and, with :meth:`add_worker`, a ``dask worker``)."""

    def __init__(self, folder: Path):
        self.address = f"tcp://127.0.0.1:{_free_port()}"
        port = self.address.rsplit(":", 1)[1]
        self.processes = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host",
                                            "127.0.0.1", "--port", port, "--no-dashboard"], cwd=folder,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]

    def wait_listening(self) -> None:
        """Until the scheduler accepts connections on its port (it imports dask first: a second or more)."""
        host, port = self.address.rsplit("/", 1)[1].rsplit(":", 1)

        def connects() -> bool:
            try:
                with socket.create_connection((host, int(port)), timeout=1):
                    return True
            except OSError:
                return False

        wait_for(connects, "scheduler listening", process=self.processes[0])

    def add_worker(self, folder: Path) -> None:
        self.processes.append(subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", self.address, "--nthreads", "2", "--host",
             "127.0.0.1", "--no-dashboard"], cwd=folder, env=child_env(), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def _settled(*flags: str) -> list[str]:
    """Options that leave nothing to measure (measuring with --scheduler would wait for a worker)."""
    return ["--block", "16", "--batch-size", "1", "--memory-format", "contiguous", "--no-progress", *flags]


@pytest.mark.slow
def test_a_scheduler_without_workers_ends_the_run_after_the_timeout_in_one_line(tmp_path, source):
    scheduler = Scheduler(tmp_path)
    try:
        scheduler.wait_listening()
        run = _blockpred("run", source, str(tmp_path / "out.zarr"), "--scheduler", scheduler.address,
                         "--device", "cpu", *_settled("--no-worker-timeout", "1"), cwd=tmp_path, env=child_env())
        _, err = run.communicate(timeout=120)
    finally:
        scheduler.stop()
    lines = [line for line in err.splitlines() if line.startswith("blockpred: error:")]
    assert run.returncode == 1 and "Traceback" not in err, err
    assert len(lines) == 1 and "no dask worker for 1 s" in lines[0] and "0 of 32 blocks" in lines[0], err
    assert "run the same command again to resume" in lines[0]


@pytest.mark.slow
def test_a_scheduler_killed_mid_run_ends_the_run_in_one_line_and_the_rerun_does_only_the_blocks_left(tmp_path, source, capsys):
    log = tmp_path / "blocks.log"
    config = tmp_path / "run.yaml"
    slow = tmp_path / "slow"  # the network sleeps 0.3 s a pass while this file exists
    slow.touch()
    config.write_text(yaml.safe_dump({"model_kwargs": {"log_path": str(log), "delay_s": 0.3,
                                                       "delay_while": str(slow)}}))
    # Halo 4 (input 24^3, not the tiny network's 36^3): the compute only keeps the run going.
    out = str(tmp_path / "out.zarr")
    command = ["run", source, out, "--config", str(config), "--model", "tests.networks:logged",
               "--halo", "4", *_settled("--no-worker-timeout", "5")]
    scheduler = Scheduler(tmp_path)
    try:
        scheduler.wait_listening()
        scheduler.add_worker(tmp_path)
        # The client gives a lost scheduler its connect timeout to come back: 2 s here (30 s by default).
        run = _blockpred(*command, "--scheduler", scheduler.address, cwd=tmp_path,
                         env=dict(child_env(), DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT="2s"))
        wait_for(lambda: len(done_blocks(out)) >= 3, "3 of 32 blocks marked done", process=run)
        scheduler.processes[0].send_signal(signal.SIGKILL)
        _, err = run.communicate(timeout=120)
    finally:
        scheduler.stop()
    lines = [line for line in err.splitlines() if line.startswith("blockpred: error:")]
    assert run.returncode == 1 and "Traceback" not in err, err
    assert len(lines) == 1 and "scheduler went away" in lines[0] and "run the same command again" in lines[0], err
    done_before = len(done_blocks(out))
    assert 3 <= done_before < 32

    slow.unlink()  # the same command again, at full speed, in this process
    passes_before = len(log.read_text().split())
    capsys.readouterr()
    assert main([*command, "--local"]) == 0  # any cluster resumes it: here none
    said = capsys.readouterr().out
    assert len(log.read_text().split()) - passes_before == 32 - done_before  # the network's own count of blocks
    clean = str(tmp_path / "clean.zarr")
    assert main([*command[:2], clean, *command[3:], "--local"]) == 0
    assert_resumed(said, out, clean, num_blocks=32, done_before=done_before, atol=1e-6)  # the first run: a worker's


@pytest.mark.parametrize("flags, expected", [
    pytest.param(["--partition", "gpu"], "--partition set(s) the jobs of a batch cluster", id="partition-alone"),
    pytest.param(["--jobs", "4", "--walltime", "1:00:00"], "--jobs, --walltime", id="jobs-and-walltime-alone"),
    pytest.param(["--cluster", "slurm", "--workers", "2"], "cannot be combined with --workers", id="with-workers"),
    pytest.param(["--cluster", "slurm", "--scheduler", "tcp://127.0.0.1:1"], "with --scheduler", id="with-scheduler"),
    pytest.param(["--cluster", "slurm", "--device", "cuda", "--gpus-per-job", "0"], "needs GPUs in the jobs",
                 id="cuda-without-gpus"),
    pytest.param(["--cluster", "pbs"], "invalid choice: 'pbs'", id="unknown-system"),
    pytest.param(["--cluster", "slurm", "--no-worker-timeout", "0"], "no_worker_timeout must be a positive",
                 id="zero-timeout"),
])
def test_batch_job_options_are_checked_in_one_line_before_anything_is_written(tmp_path, source, flags, expected,
                                                                              capsys):
    with pytest.raises(SystemExit) if "invalid choice" in expected else contextlib.nullcontext():
        code = main(["run", source, str(tmp_path / "out.zarr"), *flags])
        assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockpred: error: ") and expected in lines[0], lines
    assert not (tmp_path / "out.zarr").exists() and not (tmp_path / "out.zarr.blockpred").exists()


def test_a_slurm_cluster_without_cores_and_memory_is_refused_before_the_output_is_made(tmp_path, source, monkeypatch):
    import_or_skip("dask_jobqueue")
    jobqueue = tmp_path / "jobqueue.yaml"  # no cores, no memory: as dask-jobqueue's own defaults
    jobqueue.write_text(yaml.safe_dump({"jobqueue": {"slurm": {"scheduler-options": {"host": "127.0.0.1"}}}}))
    result = subprocess.run([sys.executable, "-m", "blockpred", "run", source, str(tmp_path / "out.zarr"),
                             "--cluster", "slurm", "--device", "cpu", "--jobqueue-config", str(jobqueue)],
                            cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120)
    assert_refused(result, "needs each job's cores and memory", "--cores N --memory 16GB")
    assert not (tmp_path / "out.zarr").exists() and not (tmp_path / "out.zarr.blockpred").exists()
    assert not list(tmp_path.glob(".blockpred-tls-*"))
