"""``blockpred run --cluster slurm`` against a real SLURM (slurmctld + slurmd on this machine), real jobs and kills.

Run with ``python -m pytest -m slurm --slurm`` (``.ci/run`` does, after the
suite): the session fixture uses a SLURM that answers ``sinfo``, or starts
one with ``../shared/tools/slurm-local.sh`` (as root) and stops it at the
end.  Each run is a real ``python -m blockpred run`` process whose workers
are SLURM jobs of one core; the network (``tests.networks:logged``) sleeps
per pass, so a test can act while the run goes on.  The node has
``nproc`` cores: two jobs of one core fit at once on this 2-core machine.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from blockpred.io import open_volume
from tests.ci import missing
from tests.helpers import assert_resumed, child_env, done_blocks, write_test_volume

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SHAPE = (32, 64, 64)
BLOCK = 16  # 32 blocks


def _read(path: Path) -> np.ndarray:
    with open_volume(str(path)) as volume:
        return volume.read(volume.box)


@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("slurm-volume")
    data = np.random.default_rng(11).integers(0, 255, SHAPE, dtype=np.uint8)
    return Path(write_test_volume(str(root / "in.zarr"), data))


@pytest.fixture(scope="module")
def reference(volume, tmp_path_factory) -> np.ndarray:
    """The same network, block, batch and layout in this process: what every SLURM run must write."""
    import blockpred

    out = tmp_path_factory.mktemp("slurm-reference") / "ref.zarr"
    blockpred.predict(str(volume), str(out), model="tiny", block=BLOCK, batch_size=1, memory_format="contiguous",
                      local=True, progress=False, device="cpu")
    return _read(out)


class SlurmRun:
    """One ``blockpred run --cluster slurm`` process in ``folder``, and the jobs of it that ``squeue`` showed."""

    def __init__(self, folder: Path, volume: Path, *flags: str, delay_s: float = 0.3, jobs: int = 2,
                 output: str = "out.zarr"):
        self.folder, self.output = folder, folder / output
        self.log = folder / "blocks.log"
        config = folder / "run.yaml"
        config.write_text(yaml.safe_dump({"model_kwargs": {"log_path": str(self.log), "delay_s": delay_s}}))
        jobqueue = folder / "jobqueue.yaml"
        # The scheduler on loopback (the jobs run on this machine), the jobs' logs beside the run.
        jobqueue.write_text(yaml.safe_dump({"jobqueue": {"slurm": {
            "scheduler-options": {"host": "127.0.0.1"}, "log-directory": str(folder / "logs")}}}))
        self.argv = [sys.executable, "-m", "blockpred", "run", str(volume), str(self.output), "--config", str(config),
                     "--model", "tests.networks:logged", "--block", str(BLOCK), "--batch-size", "1",
                     "--memory-format", "contiguous", "--device", "cpu", "--no-progress",
                     "--cluster", "slurm", "--jobs", str(jobs), "--cores", "1", "--memory", "2GB",
                     "--jobqueue-config", str(jobqueue), *flags]
        self.seen: dict[str, set[str]] = {}  # job id -> states seen
        self._watching = threading.Event()

    def start(self) -> "SlurmRun":
        self.process = subprocess.Popen(self.argv, cwd=self.folder, env=child_env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True)
        self._watching.set()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()
        return self

    def _watch(self) -> None:
        while self._watching.is_set():
            for job_id, state in self.jobs().items():
                self.seen.setdefault(job_id, set()).add(state)
            time.sleep(0.3)

    def jobs(self) -> dict[str, str]:
        """This run's jobs in SLURM now: id -> state (PENDING, RUNNING ...)."""
        prefix = f"blockpred-{self.process.pid}-"
        out = subprocess.run(["squeue", "--noheader", "--format=%i %j %T"], capture_output=True, text=True).stdout
        return {job: state for job, name, state in (line.split() for line in out.splitlines() if line.strip())
                if name.startswith(prefix)}

    def blocks_done(self) -> int:
        return len(self.log.read_text().split()) if self.log.exists() else 0

    def wait_until(self, condition, what: str, limit_s: float = 120.0) -> None:
        """Wait for ``condition()`` (a hang fails the test, with what was awaited, instead of blocking it)."""
        end = time.monotonic() + limit_s
        while not condition():
            if self.process.poll() is not None:
                raise AssertionError(f"the run ended (exit {self.process.returncode}) before {what}: "
                                     f"{self.process.stderr.read()[-2000:]}")
            if time.monotonic() > end:
                raise AssertionError(f"no {what} after {limit_s} s")
            time.sleep(0.2)

    def finish(self, limit_s: float = 300.0) -> tuple[int, str, str]:
        try:
            out, err = self.process.communicate(timeout=limit_s)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
            self._watching.clear()
            self._watcher.join()
        self.returncode = self.process.returncode
        return self.returncode, out, err

    def no_job_left(self, limit_s: float = 120.0) -> bool:
        """No job of the run in SLURM, and no worker process of it left on the node (not even one reparented to
        init: a cancelled job's shell once died and left its worker running).  ``limit_s`` is a hang guard: a job
        left behind would run for its whole time limit."""
        end = time.monotonic() + limit_s
        while self.jobs() or self.worker_processes():
            if time.monotonic() > end:
                return False
            time.sleep(0.5)
        return True

    def worker_processes(self) -> list[str]:
        """dask workers started for this run (their command line names the run's TLS folder, in ``folder``)."""
        out = subprocess.run(["pgrep", "-af", "distributed.cli.dask_worker"], capture_output=True, text=True).stdout
        return [line for line in out.splitlines() if str(self.folder) in line]


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("blockpred: error:")]


@pytest.fixture(scope="session")
def slurm():
    """A SLURM that answers: the one running, else one started by ``slurm-local.sh`` (root) and stopped after."""
    def answers() -> bool:
        try:
            return subprocess.run(["sinfo", "--noheader"], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    started = False
    if not answers():
        script = Path(__file__).resolve().parents[3] / "shared" / "tools" / "slurm-local.sh"
        if os.geteuid() != 0 or not script.exists():
            missing(f"a SLURM that answers sinfo ({script} starts one, as root)")
        subprocess.run(["bash", str(script)], check=True, capture_output=True, timeout=900)
        started = True
    yield
    if started:
        subprocess.run(["bash", str(Path(__file__).resolve().parents[3] / "shared" / "tools" / "slurm-local.sh"),
                        "stop"], capture_output=True, timeout=120)


@pytest.fixture
def folder(tmp_path, slurm) -> Path:
    return tmp_path


def test_two_cpu_jobs_predict_what_a_local_run_does(folder, volume, reference):
    run = SlurmRun(folder, volume, delay_s=0.1).start()
    code, out, err = run.finish()
    assert code == 0, err
    assert len(run.seen) >= 2 and all("RUNNING" in states for states in run.seen.values())  # squeue saw the jobs
    assert np.abs(_read(run.output) - reference).max() <= 1e-6
    assert "worker" in out and "Traceback" not in err
    assert run.no_job_left()
    assert not list(folder.glob(".blockpred-tls-*"))  # the run's TLS credentials are gone with it


def test_a_job_cancelled_mid_run_is_replaced_and_the_output_is_right(folder, volume, reference):
    run = SlurmRun(folder, volume, delay_s=0.4).start()
    run.wait_until(lambda: sum("RUNNING" == s for s in run.jobs().values()) == 2 and run.blocks_done() >= 3,
                   "two running jobs and three blocks")
    first = sorted(run.jobs())
    subprocess.run(["scancel", first[0]], check=True)
    code, _, err = run.finish()
    assert code == 0, err
    assert set(run.seen) - set(first), "no job was submitted in place of the cancelled one"
    assert np.abs(_read(run.output) - reference).max() <= 1e-6
    assert "Traceback" not in err and run.no_job_left()


def test_with_every_job_gone_and_none_to_replace_it_the_run_ends_in_one_line_and_a_rerun_resumes(
        folder, volume, reference):
    run = SlurmRun(folder, volume, "--no-worker-timeout", "15", delay_s=0.4, jobs=1).start()
    run.wait_until(lambda: "RUNNING" in run.jobs().values() and run.blocks_done() >= 3, "a running job and 3 blocks")
    cores = os.cpu_count() or 2
    # A job that takes every core, queued before the replacement: the replacement stays pending.
    blocker = subprocess.run(["sbatch", "--parsable", "-J", f"blocker-{os.getpid()}", "-c", str(cores),
                              "--mem", "100M", "-o", "/dev/null", "--wrap", "sleep 600"], cwd=folder, check=True,
                             capture_output=True, text=True).stdout.strip().split(";")[0]
    try:
        subprocess.run(["scancel", *run.jobs()], check=True)
        code, _, err = run.finish()
    finally:
        subprocess.run(["scancel", blocker])
    assert code == 1, err
    assert "Traceback" not in err
    lines = _error_lines(err)
    assert len(lines) == 1 and "no dask worker for 15 s" in lines[0] and "run the same command again" in lines[0]
    assert run.no_job_left()
    done_before, passes_before = len(done_blocks(run.output)), run.blocks_done()
    assert done_before < 32

    again = SlurmRun(folder, volume, "--no-worker-timeout", "15", delay_s=0.4, jobs=1).start()  # the same command
    code, out, err = again.finish()
    assert code == 0, err
    assert again.blocks_done() - passes_before == 32 - done_before  # the network's own count: only the rest ran
    assert_resumed(out, again.output, reference, num_blocks=32, done_before=done_before, atol=1e-6)


def test_jobs_that_reach_their_time_limit_are_replaced_until_the_run_is_done(folder, volume, reference):
    # 32 passes of 3 s on one job: 96 s, and the job's limit is 1 min (SLURM ends it within about 30 s after).
    faulthandler.cancel_dump_traceback_later()  # this test takes 2 min by design: no thread dump at 120 s
    run = SlurmRun(folder, volume, "--walltime", "00:01:00", delay_s=3.0, jobs=1).start()
    code, _, err = run.finish(limit_s=600)
    assert code == 0, err
    assert len(run.seen) >= 2, f"one job ran the whole run: {run.seen}"
    assert np.abs(_read(run.output) - reference).max() <= 1e-6
    assert "Traceback" not in err and run.no_job_left()


def test_a_job_the_cluster_refuses_fails_the_run_at_once_quoting_sbatch_and_creates_nothing(folder, volume):
    run = SlurmRun(folder, volume, "--gpus-per-job", "1")  # this node has no GPU (gres)
    run.argv[run.argv.index("--device") + 1] = "auto"
    code, _, err = run.start().finish()
    assert code == 1
    lines = _error_lines(err)
    assert len(lines) == 1 and "sbatch" in lines[0] and "gres" in lines[0], err
    assert "Traceback" not in err
    assert not run.output.exists() and not (folder / "out.zarr.blockpred").exists()
    assert not run.seen


def test_more_jobs_than_the_node_holds_the_run_finishes_with_those_that_start(folder, volume, reference):
    cores = os.cpu_count() or 2
    run = SlurmRun(folder, volume, delay_s=0.1, jobs=cores + 1).start()
    code, out, err = run.finish()
    assert code == 0, err
    assert len(run.seen) == cores + 1  # all submitted ...
    assert sum("RUNNING" in states for states in run.seen.values()) == cores  # ... those that fit ran
    assert np.abs(_read(run.output) - reference).max() <= 1e-6
    assert run.no_job_left()  # the pending one was cancelled at the end


def test_ctrl_c_cancels_every_job_and_says_the_run_resumes(folder, volume):
    run = SlurmRun(folder, volume, delay_s=0.5).start()
    run.wait_until(lambda: "RUNNING" in run.jobs().values() and run.blocks_done() >= 2, "a running job and 2 blocks")
    os.killpg(run.process.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground process group
    code, _, err = run.finish()
    assert code == 130, err
    assert err.strip().splitlines()[-1].startswith("blockpred: interrupted") and "Traceback" not in err
    assert run.no_job_left()
