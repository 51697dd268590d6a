"""An output has one owner at a time: two real runs never both write it (blockpred.io.ownership).

Two runs started half a second apart on one output once both exited 0: the
metadata of one over the chunks of the other, unreadable, with markers that
said every block was done.  Now the second run exits 2 in one line naming the
first; a lock left by a killed run is taken over with a warning.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import yaml

from blockpred.cli import main
from blockpred.io import ownership
from blockpred.pipeline.blocking import plan_blocks
from blockpred.errors import OutputLockedError, OwnershipLostError
from blockpred.geometry import Coord
from blockpred.io import open_volume, parse_volume_path
from blockpred.pipeline.markers import DoneMarkers, markers_path
from blockpred.io.ownership import Holder, OutputLock, lock_path
from tests.helpers import assert_resumed, child_env, done_blocks, error_line, run_blockpred, wait_for, write_test_volume

PINNED = ("--device", "cpu", "--no-progress", "--block", "16", "--halo", "4", "--memory-format", "contiguous")


def _volume(tmp_path, shape=(32, 64, 64)) -> str:
    data = np.random.default_rng(0).integers(0, 255, shape, dtype=np.uint8)
    return write_test_volume(str(tmp_path / "in.zarr/raw"), data, chunks=(16, 16, 16))


def _lock_of(output: str):
    return lock_path(markers_path(parse_volume_path(output)))


def _read(path: str) -> np.ndarray:
    with open_volume(path) as volume:
        return volume.read(volume.box)


def _gated_config(tmp_path, gate) -> str:
    config = tmp_path / "gated.yaml"
    config.write_text(yaml.safe_dump({"model_kwargs": {"gate_file": str(gate), "delay_s": 0.02}}))
    return str(config)


def _start(*args, cwd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "blockpred", "run", *map(str, args)], cwd=cwd, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(condition, process: subprocess.Popen, what: str) -> None:
    wait_for(condition, what, process=process)


@pytest.mark.slow
def test_a_second_run_on_a_live_output_exits_2_naming_the_holder_and_changes_nothing(tmp_path):
    source, out = _volume(tmp_path), str(tmp_path / "out.zarr")
    gate = tmp_path / "gate"
    gate.touch()
    first = _start(source, out, "--model", "tests.networks:gated", "--config", _gated_config(tmp_path, gate),
                   "--batch-size", "1", *PINNED, cwd=tmp_path)
    try:
        _wait_for(lambda: os.path.exists(_lock_of(out)), first, "lock")
        with ThreadPoolExecutor(2) as pool:  # both at once: each meets the first run's lock on its own
            second = pool.submit(run_blockpred, "run", source, out, "--output-dtype", "uint8", "--batch-size", "2",
                                 *PINNED)
            same = pool.submit(run_blockpred, "run", source, out, "--model", "tests.networks:gated", "--config",
                               _gated_config(tmp_path, gate), "--batch-size", "1", *PINNED)
        second, same = second.result(), same.result()
    finally:
        gate.unlink()
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    for result in (second, same):  # other settings, and the very same command
        assert result.returncode == 2
        line = error_line(result.stderr)
        assert "in use by another blockpred run" in line and f"pid {first.pid}" in line
    assert not os.path.exists(_lock_of(out)), "the lock outlived its run"
    assert _read(out).dtype == np.float32 and len(DoneMarkers.open(markers_path(parse_volume_path(out))).todo_ids()) == 0


@pytest.mark.slow
def test_two_runs_started_together_leave_one_owner_and_a_readable_output(tmp_path, capsys):
    """Both runs' checks pass before either writes: a network whose every pass (the dry run too) takes 0.6 s.

    Slow until one of the runs has ended (the loser, or a winner that finished first): from then on only one
    run is left, and it goes on at full speed; so do the runs after it.
    """
    source, out = _volume(tmp_path, (32, 32, 64)), str(tmp_path / "out.zarr")
    slow = tmp_path / "slow"
    slow.touch()
    config = tmp_path / "slow.yaml"
    config.write_text(yaml.safe_dump({"model_kwargs": {"log_path": str(tmp_path / "passes.log"), "delay_s": 0.6,
                                                       "delay_while": str(slow)}}))
    common = ("--model", "tests.networks:logged", "--config", str(config), *PINNED)
    options = [("--batch-size", "1", *common), ("--output-dtype", "uint8", "--batch-size", "2", *common)]
    runs = [_start(source, out, *options[0], cwd=tmp_path)]
    time.sleep(0.3)
    runs.append(_start(source, out, *options[1], cwd=tmp_path))
    wait_for(lambda: any(run.poll() is not None for run in runs), "end of either run")
    slow.unlink()
    results = [(run.wait(timeout=300), *run.communicate()) for run in runs]
    assert sorted(code for code, _, _ in results) == [0, 2], results
    winner = 0 if results[0][0] == 0 else 1
    loser_line = error_line(results[1 - winner][2])
    assert "in use by another blockpred run" in loser_line or "appeared while this run was starting" in loser_line
    clean = str(tmp_path / "clean.zarr")  # the winner's command on a fresh output, in this process
    assert main(["run", source, clean, *options[winner]]) == 0
    np.testing.assert_array_equal(_read(out), _read(clean))
    capsys.readouterr()
    assert main(["run", source, out, *options[winner]]) == 0  # the winner's command again: nothing left to do
    assert_resumed(capsys.readouterr().out, out, clean, num_blocks=16, done_before=16)


@pytest.mark.slow
def test_the_lock_of_a_killed_run_is_taken_over_with_a_warning_and_the_run_resumes(tmp_path):
    source, out = _volume(tmp_path), str(tmp_path / "out.zarr")
    gate = tmp_path / "gate"
    gate.touch()
    args = (source, out, "--model", "tests.networks:gated", "--config", _gated_config(tmp_path, gate),
            "--batch-size", "1", *PINNED)
    first = _start(*args, cwd=tmp_path)
    _wait_for(lambda: os.path.exists(_lock_of(out)), first, "lock")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    assert os.path.exists(_lock_of(out)), "a killed run cannot remove its lock"
    done_before = len(done_blocks(out))
    gate.unlink()
    rerun = run_blockpred("run", *args)
    assert rerun.returncode == 0, rerun.stderr
    assert "taking over output" in rerun.stderr and f"process {first.pid} is no longer running" in rerun.stderr
    assert "Traceback" not in rerun.stderr and not os.path.exists(_lock_of(out))
    clean = str(tmp_path / "clean.zarr")  # the same command on a fresh output
    assert main(["run", source, clean, *args[2:]]) == 0
    assert_resumed(rerun.stdout, out, clean, num_blocks=32, done_before=done_before)


def _foreign_lock(path, age_s: float) -> None:
    holder = Holder("another-host.example", 4242, time.time() - age_s, "f" * 32, None, time.time() - age_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(holder.to_bytes())
    os.utime(path, (time.time() - age_s, time.time() - age_s))


@pytest.mark.parametrize("fmt", ["zarr", "n5", "hdf5"])
def test_a_lock_held_elsewhere_is_respected_while_its_heartbeat_is_fresh_and_taken_over_after(tmp_path, fmt, capsys,
                                                                                              caplog):
    source = _volume(tmp_path, (16, 32, 32))
    out = {"zarr": f"{tmp_path}/out.zarr/pred", "n5": f"{tmp_path}/out.n5/pred", "hdf5": f"{tmp_path}/out.h5:/pred"}[fmt]
    _foreign_lock(_lock_of(out), age_s=10)
    assert main(["run", source, out, "--batch-size", "1", *PINNED]) == 2
    line = error_line(capsys.readouterr().err)
    assert "pid 4242 on another-host.example" in line
    assert not os.path.exists(str(parse_volume_path(out).container)), "a refused run created its output"
    _foreign_lock(_lock_of(out), age_s=ownership.STALE_S + 60)
    assert main(["run", source, out, "--batch-size", "1", *PINNED]) == 0
    assert "its last heartbeat is" in caplog.text
    assert not os.path.exists(_lock_of(out))


def test_a_process_marks_blocks_only_while_its_run_holds_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(ownership, "CHECK_S", 0.0)
    plan = plan_blocks(volume_shape=Coord((8, 8, 8)), block_shape=Coord((4, 4, 4)), halo=Coord((0, 0, 0)))
    path = tmp_path / "out.zarr.blockpred" / "pred"
    markers = DoneMarkers.create(path, plan, {"run": 1})
    lock = lock_path(path)
    holder = Holder("another-host.example", 1, time.time(), "a" * 32)
    lock.write_bytes(holder.to_bytes())
    owned = DoneMarkers(markers.path, markers.grid_begin, markers.grid_shape, markers.token, owner="a" * 32)
    owned.mark_done(plan.block(Coord((0, 0, 0))))
    lock.write_bytes(Holder("third-host.example", 2, time.time(), "b" * 32).to_bytes())  # taken over
    with pytest.raises(OwnershipLostError):
        owned.mark_done(plan.block(Coord((1, 1, 1))))
    assert len(DoneMarkers.open(path).done_indices()) == 1


def test_a_lock_on_s3_is_one_conditional_put(s3, tmp_path, capsys):
    out, source = s3.url("out.zarr/pred"), _volume(tmp_path, (16, 32, 32))
    at = _lock_of(out)
    first = OutputLock.acquire(at, out)
    try:
        with pytest.raises(OutputLockedError, match=f"pid {os.getpid()} on {socket.gethostname()}"):
            OutputLock.acquire(at, out)
        assert main(["run", source, out, "--batch-size", "1", *PINNED]) == 2
        assert "in use by another blockpred run" in error_line(capsys.readouterr().err)
        assert first.check()
    finally:
        first.release()
    assert not first.check()
    assert main(["run", source, out, "--batch-size", "1", *PINNED]) == 0
    assert s3.keys() and not [key for key in s3.keys() if key.endswith(".lock")]
