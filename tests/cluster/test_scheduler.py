"""The dask path: worker counts, killed workers, a killed client, failing blocks, resume."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml

import blockpred
from blockpred.cli import main
from blockpred.cluster.local import visible_cores
from blockpred.io import open_volume
from blockpred.pipeline.markers import DoneMarkers, markers_path
from blockpred.io.base import parse_volume_path
from tests.helpers import assert_resumed, child_env, wait_for, write_test_volume



#: These tests are about scheduling: they name the batch and the layout, so that no measuring runs
#: (it would run the instrumented networks in the client) and batches never group blocks differently
#: between runs (CPU kernels round the last bit differently per batch size).
PINNED = {"batch_size": 1, "memory_format": "contiguous"}
#: Most run blocks of 16^3 with a halo of 4 (network input 24^3), not the tiny network's halo of 10 (input 36^3,
#: 3.4 times the compute): what they check is where and how often blocks run, not the receptive field.


def read_all(path: str) -> np.ndarray:
    volume = open_volume(path)
    return volume.read(volume.box)


def random_volume(tmp_path, shape, name="in.zarr", seed=0) -> str:
    rng = np.random.default_rng(seed)
    return write_test_volume(str(tmp_path / name), rng.integers(0, 255, shape, dtype=np.uint8), chunks=(16, 16, 16))


def markers_of(output: str) -> DoneMarkers:
    return DoneMarkers.open(markers_path(parse_volume_path(output)))


@pytest.mark.slow
def test_one_two_and_three_workers_write_identical_outputs(tmp_path):
    """Also where the blocks ran: one CPU worker in this process, several in worker processes (the tiny network,
    logging the id of the process of each block).  Three where the machine has three cores (no more CPU workers
    than cores are started: see blockpred.cluster.local.local_worker_envs)."""
    source = random_volume(tmp_path, (32, 48, 48))  # 18 blocks: each run's cost is mostly its workers' start
    outputs = []
    for workers in sorted({1, 2, min(3, visible_cores())}):
        out, log = str(tmp_path / f"out{workers}.zarr"), tmp_path / f"pids{workers}.log"
        summary = blockpred.predict(source, out, block=16, halo=4, workers=workers, progress=False, **PINNED,
                                    model="tests.networks:pid_logged", model_kwargs={"log_path": str(log)})
        # Every block ran, on at most the workers started: which of them took blocks is dask's choice (on a loaded
        # 2-core CI machine one of two workers once finished all 18 tiny blocks before the other took one).
        assert 1 <= len(summary.workers) <= workers and summary.stats.num_blocks == 2 * 3 * 3
        assert sum(w.num_blocks for w in summary.workers.values()) == 2 * 3 * 3
        pids = {int(p) for p in log.read_text().split()}
        assert (pids == {os.getpid()}) if workers == 1 else (os.getpid() not in pids), pids
        outputs.append(read_all(out))
    assert outputs[0].dtype == np.float32
    assert all(output.tobytes() == outputs[0].tobytes() for output in outputs[1:])


@pytest.mark.slow
def test_a_worker_runs_all_its_tasks_on_one_pipeline_and_frees_it_when_the_run_ends(tmp_path):
    """Tasks queue their blocks on the worker's one pipeline (no drain between tasks); the run's end frees it."""
    import threading

    from blockpred.cluster import tasks

    source = random_volume(tmp_path, (32, 64, 128))
    local = str(tmp_path / "local.zarr")
    blockpred.predict(source, local, block=16, halo=4, local=True, progress=False, **PINNED)
    out = str(tmp_path / "dask.zarr")
    summary = blockpred.predict(source, out, block=16, halo=4, workers=1, progress=False, **PINNED)
    (worker,) = summary.workers.values()  # one CPU worker: in this process
    assert worker.num_blocks == 2 * 4 * 8 and worker.tasks > 2 and worker.pipelines == 1
    assert 0 < worker.busy_s <= summary.stats.seconds, "busy seconds are the pipeline's, not summed over tasks"
    assert summary.stats.compute_s > 0 and summary.stats.read_s > 0
    assert read_all(out).tobytes() == read_all(local).tobytes()
    assert not tasks._STATE, "the run's worker plugin (model, pipeline) outlived the run"
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("blockpred-stream", "blockpred-read"))]


def _config(tmp_path, **model_kwargs) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model_kwargs": model_kwargs, "block": 16, "halo": 4, **PINNED}))
    return str(path)


def _start_run(args, cwd) -> subprocess.Popen:
    env = child_env()
    return subprocess.Popen([sys.executable, "-m", "blockpred", "run", *args, "--no-progress"], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _worker_processes(pid: int) -> list[psutil.Process]:
    children = psutil.Process(pid).children(recursive=True)
    return [p for p in children if "multiprocessing" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]


def _wait_for_done(output: str, count: int, process: subprocess.Popen) -> int:
    def done() -> int:
        markers = markers_of(output)
        return len(markers.done_indices()) if markers else 0

    return wait_for(lambda: done() >= count and done(), f"{count} blocks done", process=process)


@pytest.mark.slow
def test_a_killed_run_resumes_and_recomputes_only_the_blocks_in_flight(tmp_path, capsys):
    source = random_volume(tmp_path, (32, 64, 64))
    clean = str(tmp_path / "clean.zarr")
    blockpred.predict(source, clean, block=16, halo=4, local=True, progress=False, **PINNED)
    out = str(tmp_path / "out.zarr")
    first_log, second_log = str(tmp_path / "first.log"), str(tmp_path / "second.log")
    slow = tmp_path / "slow"  # the network sleeps 0.15 s a pass while this file exists: the first run only
    slow.touch()
    args = [source, out, "--model", "tests.networks:logged", "--workers", "2"]
    args += ["--config", _config(tmp_path, log_path=first_log, delay_s=0.15, delay_while=str(slow))]
    run = _start_run(args, tmp_path)
    _wait_for_done(out, 8, run)
    workers = _worker_processes(run.pid)
    os.kill(run.pid, signal.SIGKILL)  # the client, with its scheduler
    run.wait(timeout=30)
    psutil.wait_procs(workers, timeout=60)  # workers notice their parent is gone and stop
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    done_before = len(markers_of(out).done_indices())
    assert 8 <= done_before < 32

    # The same command again (at full speed); the first run's forward log is moved aside to tell the runs apart.
    # In this process and on one worker (no worker processes to start): the kill was the first run's part, and
    # what the rerun computes is decided by the markers the first run left.
    (tmp_path / "first.log").rename(second_log)
    slow.unlink()
    capsys.readouterr()
    rerun = [a if a != "2" or args[i - 1] != "--workers" else "1" for i, a in enumerate(args)]
    assert main(["run", *rerun, "--no-progress"]) == 0
    assert f"in {32 - done_before} blocks ({done_before} already done)" in capsys.readouterr().out
    first = Path(second_log).read_text().split()
    second = Path(first_log).read_text().split()
    recomputed = set(first) & set(second)
    in_flight_bound = 2 * (1 + 2 * 2)  # workers x (batch + pending writes)
    assert len(recomputed) <= in_flight_bound, f"{len(recomputed)} blocks computed twice"
    assert len(set(first) | set(second)) == 32
    np.testing.assert_array_equal(read_all(out), read_all(clean))


@pytest.mark.slow
def test_a_block_that_keeps_failing_exits_1_naming_it_and_the_rerun_computes_only_it(tmp_path, capsys):
    data = np.full((32, 32, 48), 102, dtype=np.uint8)
    data[20, 20, 36] = 255  # inside block (1, 1, 2) of 16^3 blocks, 4 voxels from its faces
    source = write_test_volume(str(tmp_path / "in.zarr"), data)
    fault = tmp_path / "fault"
    fault.touch()
    out = str(tmp_path / "out.zarr")
    config = tmp_path / "f.yaml"
    config.write_text(yaml.safe_dump({"model": "tests.networks:fails_on_marker", "model_kwargs": {"fault_file": str(fault)},
                                      "block": 16, "halo": 2, "retries": 1}))
    # A factory runs code: it is named on the command line, never trusted from a file (issue 21).
    args = ["run", source, out, "--config", str(config), "--model", "tests.networks:fails_on_marker", "--workers", "2",
            "--no-progress"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "block (1, 1, 2)" in err and "marker voxel seen" in err
    markers = markers_of(out)
    assert len(markers.done_indices()) == 2 * 2 * 3 - 1
    values = read_all(out)[0]
    assert np.allclose(values[:16], 0.2) and not values[16:32, 16:32, 32:48].any()

    fault.unlink()
    assert main([*args[:-2], "1", "--no-progress"]) == 0  # the rerun on one worker: no worker processes to start
    said = capsys.readouterr().out
    clean = str(tmp_path / "clean.zarr")  # the same command on a fresh output, the fault gone
    assert main([clean if arg == out else arg for arg in args[:-2]] + ["1", "--no-progress"]) == 0
    assert_resumed(said, out, clean, num_blocks=12, done_before=11, atol=1e-6)


@pytest.mark.parametrize(
    "change, expected",
    [
        pytest.param({"halo": 8}, "halo (10, 10, 10) -> (8, 8, 8)", id="halo"),
        pytest.param({"model": "unet32"}, "model tiny -> unet32", id="model"),
    ],
)
@pytest.mark.slow
def test_a_resume_with_other_settings_is_refused_naming_the_change(tmp_path, capsys, change, expected):
    source = random_volume(tmp_path, (16, 32, 32))
    out = str(tmp_path / "out.zarr")
    assert main(["run", source, out, "--local", "--no-progress", "--block", "16", "--halo", "10"]) == 0
    before = read_all(out)
    flags = ["--halo", str(change.get("halo", 10))] + (["--model", change["model"]] if "model" in change else [])
    assert main(["run", source, out, "--local", "--no-progress", "--block", "16", *flags]) == 2
    err = capsys.readouterr().err
    assert expected in err and "--overwrite" in err
    np.testing.assert_array_equal(read_all(out), before)


def test_skip_empty_skips_uniform_blocks_and_predicts_the_others_exactly(tmp_path):
    rng = np.random.default_rng(3)
    data = np.zeros((48, 32, 32), dtype=np.uint8)
    data[:16] = rng.integers(0, 255, (16, 32, 32), dtype=np.uint8)
    source = write_test_volume(str(tmp_path / "in.zarr"), data)
    full = str(tmp_path / "full.zarr")
    blockpred.predict(source, full, block=16, halo=4, local=True, progress=False, **PINNED)
    out = str(tmp_path / "out.zarr")
    summary = blockpred.predict(source, out, block=16, halo=4, skip_empty=True, local=True, progress=False,
                                **PINNED)
    # Blocks with z cores 32..48 read z 28..52: all zero, so skipped (2 x 2 of them).  Those with
    # cores 16..32 read z 12..36, which reaches the data: they run.
    assert summary.stats.num_skipped == 4 and summary.stats.num_blocks == 8
    assert {tuple(i) for i in markers_of(out).skipped_indices()} == {(2, y, x) for y in (0, 1) for x in (0, 1)}
    got, want = read_all(out), read_all(full)
    np.testing.assert_array_equal(got[:, :32], want[:, :32])
    assert not got[:, 32:].any()


@pytest.mark.slow
def test_a_downsampled_mask_skips_the_right_blocks_and_a_rerun_keeps_them_skipped(tmp_path):
    source = random_volume(tmp_path, (32, 64, 64), seed=4)
    mask = np.zeros((8, 16, 16), dtype=np.uint8)  # 4x downsampled
    mask[1, 2, 3] = 1  # volume voxels z 4..8, y 8..12, x 12..16: block (0, 0, 0)
    mask[6, 13, 9] = 1  # z 24..28, y 52..56, x 36..40: block (1, 3, 2)
    mask_path = write_test_volume(str(tmp_path / "mask.zarr"), mask)
    full = str(tmp_path / "full.zarr")
    blockpred.predict(source, full, block=16, halo=4, local=True, progress=False, **PINNED)
    out = str(tmp_path / "out.zarr")
    summary = blockpred.predict(source, out, block=16, halo=4, mask=mask_path, workers=2, progress=False,
                                **PINNED)
    assert summary.stats.num_blocks == 2 and summary.stats.num_skipped == 30
    markers = markers_of(out)
    assert {tuple(i) for i in markers.done_indices()} == {(0, 0, 0), (1, 3, 2)}
    assert len(markers.skipped_indices()) == 30
    got, want = read_all(out), read_all(full)
    np.testing.assert_array_equal(got[:, :16, :16, :16], want[:, :16, :16, :16])
    np.testing.assert_array_equal(got[:, 16:, 48:, 32:48], want[:, 16:, 48:, 32:48])
    assert not got[:, 16:, :48].any()
    again = blockpred.predict(source, out, block=16, halo=4, mask=mask_path, local=True, progress=False,
                              **PINNED)
    assert again.stats.num_blocks == 0 and again.num_resumed == 32


def test_an_hdf5_output_with_two_workers_is_refused_before_anything_is_written(tmp_path, capsys):
    source = write_test_volume(str(tmp_path / "f.h5:/raw"), np.zeros((8, 8, 8), dtype=np.uint8))
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["run", source, f"{tmp_path}/f.h5:/prediction", "--workers", "2", "--no-progress"]) == 2
    assert "HDF5 has no concurrent writers" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    import h5py

    with h5py.File(tmp_path / "f.h5", "r") as f:
        assert list(f) == ["raw"]


def test_an_hdf5_output_in_the_input_file_is_written_by_one_dask_worker(tmp_path):
    data = np.random.default_rng(5).integers(0, 255, (16, 16, 16), dtype=np.uint8)
    source = write_test_volume(str(tmp_path / "f.h5:/raw"), data)
    summary = blockpred.predict(source, str(tmp_path / "f.h5:/prediction"), block=8, halo=4, workers=1,
                                progress=False, **PINNED)
    local = blockpred.predict(source, str(tmp_path / "f.h5:/local"), block=8, halo=4, local=True, progress=False,
                              **PINNED)
    np.testing.assert_array_equal(read_all(summary.output), read_all(local.output))



@pytest.mark.slow
def test_a_slow_worker_keeps_few_blocks_and_the_fast_one_takes_over_the_rest(tmp_path):
    source = random_volume(tmp_path, (32, 64, 64))  # 32 blocks of 16^3
    clean = str(tmp_path / "clean.zarr")
    blockpred.predict(source, clean, block=16, halo=4, local=True, progress=False, **PINNED)
    out = str(tmp_path / "out.zarr")
    summary = blockpred.predict(source, out, block=16, halo=4, workers=2, progress=False, **PINNED,
                                model="tests.networks:uneven",
                                model_kwargs={"claim_file": str(tmp_path / "slow"), "delay_s": 1.0})
    counts = sorted(w.num_blocks for w in summary.workers.values())
    assert len(counts) == 2 and sum(counts) == 32
    slow, fast = counts
    # The slow worker takes a second per block; handed out blocks a task at a time, it keeps
    # the few it started with while the fast one runs everything else.
    assert slow <= 8 and fast >= 24, counts
    np.testing.assert_array_equal(read_all(out), read_all(clean))


@pytest.mark.slow
def test_a_worker_that_joins_after_the_run_started_receives_blocks(tmp_path):
    import threading

    from distributed import Client, LocalCluster

    source = random_volume(tmp_path, (32, 64, 64))
    clean = str(tmp_path / "clean.zarr")
    blockpred.predict(source, clean, block=16, halo=4, local=True, progress=False, **PINNED)
    gate = tmp_path / "gate"
    gate.touch()  # every block waits until the late worker is in
    out = str(tmp_path / "out.zarr")
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        result: dict = {}

        def run() -> None:
            try:
                result["summary"] = blockpred.predict(
                    source, out, block=16, halo=4, device="cpu", scheduler=cluster.scheduler_address,
                    progress=False, model="tests.networks:gated", **PINNED,
                    model_kwargs={"gate_file": str(gate), "delay_s": 0.05})
            except BaseException as err:  # noqa: BLE001 - reported by the assertion below
                result["error"] = err

        runner = threading.Thread(target=run)
        runner.start()
        def started() -> bool:  # the run has started (or ended on an error, which the asserts below report)
            return bool(client.processing() and any(client.processing().values())) or not runner.is_alive()

        wait_for(started, "task processing")
        late = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address,
                                 "--nthreads", "1", "--name", "late", "--no-dashboard"],
                                env=child_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            client.wait_for_workers(2, timeout=120)
            gate.unlink()
            runner.join(timeout=300)
        finally:
            late.terminate()
            late.wait(timeout=60)
    assert "error" not in result, result
    summary = result["summary"]
    assert summary.workers["late"].num_blocks >= 1, summary.workers
    assert sum(w.num_blocks for w in summary.workers.values()) == 32
    np.testing.assert_array_equal(read_all(out), read_all(clean))


@pytest.mark.parametrize("workers, through_dask, in_this_process", [(None, False, True), (1, True, True)])
@pytest.mark.slow
def test_one_cpu_runs_in_the_client_process_and_several_workers_are_processes(tmp_path, workers, through_dask,
                                                                            in_this_process):
    """No --workers on a machine without a GPU: no dask at all; --workers 1: one dask worker in this process.

    Several workers run their blocks in worker processes: test_one_two_and_three_workers_write_identical_outputs.
    """
    source = random_volume(tmp_path, (16, 32, 64))  # 8 blocks of 16^3
    log = tmp_path / "pids.log"
    summary = blockpred.predict(source, str(tmp_path / "out.zarr"), block=16, halo=4, workers=workers,
                                device="cpu", progress=False, model="tests.networks:pid_logged",
                                model_kwargs={"log_path": str(log)}, **PINNED)
    pids = {int(p) for p in log.read_text().split()}
    assert len(summary.workers) == (workers if through_dask else 0) and summary.stats.num_blocks == 8
    assert (pids == {os.getpid()}) is in_this_process, pids
