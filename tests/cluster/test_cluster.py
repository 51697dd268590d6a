"""The local dask cluster under the faults users meet: a worker killed at any moment, Ctrl-C, who can reach it.

Each test runs the real command (``python -m blockpred run ...``) as a child process and acts on the real
processes it starts: SIGKILL of a worker process, SIGINT to the whole process group as a terminal's Ctrl-C
sends it, the TCP sockets the client and its workers listen on.  A rerun that only shows the resume (what
the fault left on disk) runs the same command in this process.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml

import blockpred
from blockpred.cli import main
from blockpred.io import open_volume
from tests.helpers import assert_resumed, child_env, write_test_volume

#: 64 x 128 x 128 in blocks of 32^3: 32 blocks, a few seconds of work for two CPU workers.  Halo 4 (input 40^3,
#: not the tiny network's 52^3): what the tests act on is the processes, the compute only keeps the run going.
SHAPE, BLOCK, HALO, NUM_BLOCKS = (64, 128, 128), 32, 4, 32
#: A named batch and layout: runs compare within float rounding (no measuring, no batch grouping blocks).
PINNED = ["--block", str(BLOCK), "--halo", str(HALO), "--batch-size", "1", "--memory-format", "contiguous",
          "--device", "cpu"]
INTERRUPTED = "blockpred: interrupted; finished blocks are kept: run the same command again to resume"


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    """The input and a clean in-process run's output, made once for this module (with a private cache)."""
    root = tmp_path_factory.mktemp("cluster")
    data = np.random.default_rng(0).integers(0, 255, SHAPE, dtype=np.uint8)
    source = write_test_volume(str(root / "in.zarr"), data, chunks=(BLOCK,) * 3)
    clean = str(root / "clean.zarr")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BLOCKPRED_CACHE_DIR", str(root / "blockpred-cache"))
        blockpred.predict(source, clean, block=BLOCK, halo=HALO, batch_size=1, memory_format="contiguous", device="cpu",
                          local=True, progress=False)
    return source, read_all(clean)


def read_all(path: str) -> np.ndarray:
    volume = open_volume(path)
    return volume.read(volume.box)


def start_run(source: str, output: str, *extra: str) -> subprocess.Popen:
    """``blockpred run`` as a child in its own process group, as a terminal's foreground job runs.

    Its SIGINT and SIGHUP are the default ones even when the tests themselves run with them ignored (a background
    job of a non-interactive shell ignores SIGINT, ``nohup`` SIGHUP: blockpred keeps an ignored signal ignored).
    """
    return subprocess.Popen([sys.executable, "-m", "blockpred", "run", source, output, *PINNED, "--no-progress",
                             *extra], env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_signals)


def _default_signals() -> None:
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def worker_processes(pid: int) -> list[psutil.Process]:
    """The dask worker processes below ``pid``: multiprocessing's spawned children (not its resource tracker)."""
    found = []
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "spawn_main" in command and "resource_tracker" not in command:
            found.append(child)
    return found


def num_done(output: str) -> int:
    """Blocks marked done: the markers' append-only logs hold 8 bytes per block (a block redone is there twice)."""
    ids = [np.zeros(0, dtype="<i8")]
    for path in Path(output + ".blockpred").glob("*/done/*.ids"):
        raw = path.read_bytes()
        ids.append(np.frombuffer(raw[: len(raw) // 8 * 8], dtype="<i8"))
    return len(np.unique(np.concatenate(ids)))


def wait_for(condition, run: subprocess.Popen, what: str, timeout_s: float = 180):
    """Poll ``condition()`` until it is truthy (returned); fails if the run ends first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if run.poll() is not None:
            stdout, stderr = run.communicate()
            pytest.fail(f"the run ended (exit {run.returncode}) before {what}:\n{stdout}\n{stderr}")
        time.sleep(0.01)
    run.kill()
    pytest.fail(f"no {what} within {timeout_s} s")


def finish(run: subprocess.Popen) -> tuple[str, str]:
    try:
        return run.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        raise


def assert_no_process_left(members: list[psutil.Process], pgid: int) -> None:
    """Every process of the run's group has ended (a zombie waiting for its reaper has ended too)."""
    _, alive = psutil.wait_procs(members, timeout=60)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [p.cmdline() for p in alive]
    left = []
    for process in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    assert not left, left


def listening_sockets(pid: int) -> list:
    """(pid, local address) of every listening TCP socket of ``pid`` and the processes below it."""
    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    listening = []
    for process in processes:
        try:
            sockets = process.net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        listening += [(process.pid, s.laddr) for s in sockets if s.status == psutil.CONN_LISTEN]
    return listening


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["start-up", "loading", "mid-run"])
def test_a_worker_killed_at_any_moment_leaves_a_complete_output_and_exit_0(tmp_path, volume, moment):
    """SIGKILL of a worker process as soon as it appears (the cluster is starting), while the run's network is
    loaded on it (a network slow to build in workers), or after blocks are done.

    Mid-run, before the kill, the run (scheduler, nannies, workers, dashboard all up once a block is done) also
    shows that a ``--workers 2`` cluster listens on 127.0.0.1 only: every listening socket of the client and of
    every process below it.
    """
    source, clean = volume
    out = str(tmp_path / "out.zarr")
    extra = []
    if moment == "loading":
        loading, hold = tmp_path / "loading", tmp_path / "hold"  # workers load the network while hold exists
        loading.mkdir()
        hold.touch()
        config = tmp_path / "slow.yaml"
        config.write_text(yaml.safe_dump({"model_kwargs": {"claim_dir": str(loading), "hold_while": str(hold)}}))
        extra = ["--config", str(config), "--model", "tests.networks:slow_to_load"]  # a factory: named here
    run = start_run(source, out, "--workers", "2", *extra)
    if moment == "start-up":
        victim = wait_for(lambda: worker_processes(run.pid), run, "a worker process")[0]
        assert num_done(out) == 0
    elif moment == "loading":
        victim = psutil.Process(int(wait_for(lambda: list(loading.iterdir()), run, "a worker loading")[0].name))
        assert num_done(out) == 0
    else:
        wait_for(lambda: num_done(out) >= 4, run, "4 blocks done")
        listening = listening_sockets(run.pid)
        victim = worker_processes(run.pid)[0]
    victim.send_signal(signal.SIGKILL)
    if moment == "loading":
        hold.unlink()
    stdout, stderr = finish(run)
    assert run.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert "dashboard at http://127.0.0.1:" in stderr
    if moment == "mid-run":
        assert {pid for pid, _ in listening} >= {run.pid}, "the client's scheduler listens"
        assert len({pid for pid, _ in listening}) >= 3, "the client and two workers listen"
        assert all(address.ip == "127.0.0.1" for _, address in listening), listening
    assert num_done(out) >= NUM_BLOCKS
    np.testing.assert_allclose(read_all(out), clean, atol=1e-6)


@pytest.mark.slow
def test_a_block_that_kills_its_worker_fails_the_run_in_one_line_and_the_rerun_computes_only_its_task(tmp_path,
                                                                                                      capsys):
    """A task whose workers keep dying (dask's allowed-failures; 0 here: at the first death) fails its blocks only."""
    data = np.full((32, 32, 48), 102, dtype=np.uint8)
    data[20, 20, 36] = 255  # in block (1, 1, 2) of 16^3 blocks, 4 voxels from its faces
    source = write_test_volume(str(tmp_path / "in.zarr"), data)
    fault = tmp_path / "fault"
    fault.touch()
    config = tmp_path / "kill.yaml"
    config.write_text(yaml.safe_dump({"block": 16, "halo": 2, "model_kwargs": {"fault_file": str(fault)}}))
    out = str(tmp_path / "out.zarr")
    command = [sys.executable, "-m", "blockpred", "run", source, out, "--config", str(config),
               "--model", "tests.networks:kills_on_marker", "--workers", "2",
               "--batch-size", "1", "--device", "cpu", "--no-progress"]
    env = dict(child_env(), DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES="0")
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    (error,) = [line for line in run.stderr.splitlines() if line.startswith("blockpred: error:")]
    assert error == run.stderr.strip().splitlines()[-1] and "died" in error and "allowed-failures" in error, error
    done = num_done(out)
    assert 0 < done < 12

    fault.unlink()
    capsys.readouterr()
    # The same command again, in this process and on one worker (no worker processes to start): what the rerun
    # computes is decided by the markers the first run left.
    rerun = command[3:]
    rerun[rerun.index("--workers") + 1] = "1"
    assert main(rerun) == 0
    stdout = capsys.readouterr().out
    clean = str(tmp_path / "clean.zarr")  # the same command on a fresh output, the fault gone
    assert main([clean if arg == out else arg for arg in rerun]) == 0
    assert_resumed(stdout, out, clean, num_blocks=12, done_before=done, atol=1e-6)


def test_a_cluster_started_in_process_has_its_scheduler_on_loopback():
    from blockpred.cluster.local import Cluster

    with Cluster("cpu", 1, None) as cluster:
        client = cluster.client()
        assert client.scheduler.address.startswith("tcp://127.0.0.1:")
        workers = client.scheduler_info(n_workers=-1)["workers"]
        assert workers and all(address.startswith("tcp://127.0.0.1:") for address in workers)
        assert client.dashboard_link.startswith("http://127.0.0.1:")


@pytest.mark.parametrize("workers", [pytest.param(["--workers", "2"], id="two-workers"),
                                     pytest.param([], id="in-process")])
@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
@pytest.mark.slow
def test_ctrl_c_or_sigterm_prints_one_line_ends_the_events_frees_the_lock_and_the_rerun_resumes(
        tmp_path, volume, workers, sent, capsys):
    """A terminal's Ctrl-C (SIGINT), what SLURM and Kubernetes send first (SIGTERM), or a closed terminal's SIGHUP
    (was: no message), to the whole process group (the client and every worker): one line, exit 128 + the signal,
    the end event, no lock and no process left."""
    source, clean = volume
    out, events = str(tmp_path / "out.zarr"), tmp_path / "progress.jsonl"
    run = start_run(source, out, *workers, "--progress-json", str(events))
    wait_for(lambda: num_done(out) >= 4, run, "4 blocks done")
    members = [psutil.Process(run.pid), *psutil.Process(run.pid).children(recursive=True)]
    os.killpg(run.pid, sent)
    stdout, stderr = finish(run)
    assert run.returncode == 128 + sent, stderr
    assert "Traceback" not in stderr, stderr
    # Halo 4 is below the tiny network's field on purpose (see HALO): its one warning says so at the start.
    lines = [line for line in stderr.strip().splitlines() if "smaller than the network's receptive field" not in line]
    said = INTERRUPTED.replace("interrupted", {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)",
                                               signal.SIGHUP: "hung up (SIGHUP)"}[sent])
    assert lines[-1] == said and stderr.count(said.split(";")[0]) == 1, stderr
    assert all(line.startswith("blockpred: ") for line in lines), stderr
    end = json.loads(events.read_text().splitlines()[-1])
    assert end["event"] == "end" and not end["ok"] and end["error"] == said.split(": ", 1)[1].split(";")[0], end
    assert not Path(out + ".blockpred", "_root.lock").exists(), "the lock was left behind"
    assert_no_process_left(members, run.pid)
    if sent != signal.SIGINT:
        return  # the rerun resumes from the markers any of the signals left: shown once, after SIGINT

    done = num_done(out)
    assert 4 <= done < NUM_BLOCKS
    capsys.readouterr()
    # The same command again, in this process and without worker processes: what the signal did to processes was
    # the first run's part, what the rerun computes is decided by the markers it left.
    assert main(["run", source, out, *PINNED, "--no-progress"]) == 0
    assert_resumed(capsys.readouterr().out, out, clean, num_blocks=NUM_BLOCKS, done_before=done, atol=1e-6)
