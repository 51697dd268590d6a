"""An ``--overwrite`` cut short never leaves markers that vouch for deleted chunks.

The old output's chunks used to go before its done-markers: a kill -9 or a
refused permission part-way through the deletion, then the same command
without ``--overwrite``, said "0 blocks (N already done)" over chunks read as
zeros.  Now the markers are invalidated first, so what is left is an output
without markers: refused without ``--overwrite``, replaced with it.

The old outputs are made in this process; the commands under test run as real ``python -m blockpred``.
"""

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from blockpred.cli import main
from blockpred.io import open_volume, parse_volume_path
from blockpred.pipeline.markers import markers_path
from tests.helpers import (assert_resumed, child_env, error_line, run_blockpred, snapshot, wait_for,
                           write_test_volume)

PINNED = ("--device", "cpu", "--no-progress", "--block", "16", "--halo", "4", "--batch-size", "1",
          "--memory-format", "contiguous")


def _read(path: str) -> np.ndarray:
    with open_volume(path) as volume:
        return volume.read(volume.box)


def _source(tmp_path) -> str:
    data = np.random.default_rng(0).integers(0, 255, (32, 32, 64), dtype=np.uint8)
    return write_test_volume(str(tmp_path / "in.zarr/raw"), data, chunks=(16, 16, 16))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["zarr", "n5"])
def test_an_overwrite_that_cannot_move_the_old_output_changes_nothing(tmp_path, fmt, immutable, capsys):
    source = _source(tmp_path)
    out = f"{tmp_path}/out.{fmt}/pred"
    assert main(["run", source, out, *PINNED]) == 0  # the old output, made in this process
    expected, before = _read(out), snapshot(tmp_path)
    immutable(tmp_path / f"out.{fmt}")  # the container: its dataset cannot be renamed or deleted
    first = run_blockpred("run", source, out, "--overwrite", "--output-dtype", "uint8", *PINNED)
    assert first.returncode == 2
    assert "cannot delete the old output" in error_line(first.stderr)
    assert snapshot(tmp_path) == before, "a refused overwrite changed the output or its markers"
    capsys.readouterr()
    assert main(["run", source, out, *PINNED]) == 0  # the first command again (here): nothing lost, nothing to do
    assert_resumed(capsys.readouterr().out, out, expected, num_blocks=16, done_before=16)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["zarr", "n5"])
def test_an_old_output_that_cannot_be_deleted_is_moved_aside_and_replaced(tmp_path, fmt, immutable):
    source = _source(tmp_path)
    out = f"{tmp_path}/out.{fmt}/pred"
    assert main(["run", source, out, *PINNED]) == 0  # the old output, made in this process
    stuck = {"zarr": "out.zarr/pred/0", "n5": "out.n5/pred/0"}[fmt]  # entries of this one cannot go
    immutable(tmp_path / stuck)
    replaced = run_blockpred("run", source, out, "--overwrite", "--output-dtype", "uint8", *PINNED)
    assert replaced.returncode == 0, replaced.stderr
    assert "could not be deleted" in replaced.stderr and "Traceback" not in replaced.stderr
    assert _read(out).dtype == np.uint8
    (aside,) = list(tmp_path.glob(f"out.{fmt}/.pred.deleting-*"))
    subprocess.run(["chattr", "-i", str(aside / stuck.split("/pred", 1)[1].lstrip("/"))], check=True)
    again = run_blockpred("run", source, out, "--overwrite", *PINNED)
    assert again.returncode == 0 and "left by an earlier deletion" in again.stderr
    assert not list(tmp_path.glob(f"out.{fmt}/.pred.deleting-*"))


@pytest.mark.slow
def test_an_hdf5_output_that_cannot_be_deleted_is_one_line_and_keeps_no_markers(tmp_path, immutable):
    source, out = _source(tmp_path), f"{tmp_path}/out.h5:/pred"
    assert main(["run", source, out, *PINNED]) == 0  # the old output, made in this process
    immutable(tmp_path / "out.h5")
    first = run_blockpred("run", source, out, "--overwrite", *PINNED)
    assert first.returncode == 2 and "out.h5" in error_line(first.stderr)
    subprocess.run(["chattr", "-i", str(tmp_path / "out.h5")], check=True)
    again = run_blockpred("run", source, out, *PINNED)
    assert again.returncode == 2 and "exists; pass --overwrite" in error_line(again.stderr)


@pytest.mark.slow
def test_a_kill_during_the_deletion_of_an_old_output_is_never_resumed_as_finished(tmp_path, capsys):
    source = _source(tmp_path)
    out = f"{tmp_path}/out.zarr/pred"
    assert main(["run", source, out, *PINNED]) == 0  # the old output, made in this process
    expected = _read(out)
    # Many files in one chunk folder make the deletion long enough to kill in the middle of it.
    crowded = tmp_path / "out.zarr/pred/0/c/0"
    for i in range(30000):
        (crowded / f"x{i}").touch()
    total = len(os.listdir(crowded))

    def left() -> int:
        """Files left in the crowded folder, in its place or moved aside with the old output."""
        places = [crowded, *tmp_path.glob("out.zarr/.pred.deleting-*/0/c/0")]
        return max((len(os.listdir(p)) for p in places if p.exists()), default=0)

    run = subprocess.Popen([sys.executable, "-m", "blockpred", "run", source, out, "--overwrite", *PINNED],
                           env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    def begun() -> tuple[int] | None:
        remaining = left()
        return (remaining,) if remaining < total else None

    (remaining,) = wait_for(begun, "start of the old output's deletion", process=run, poll_s=0)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait(timeout=30)
    assert remaining > 0, "killed only after the deletion: nothing was cut short"
    # The reruns run in this process: what they show is what the kill left on disk.
    capsys.readouterr()
    code = main(["run", source, out, *PINNED])
    again = capsys.readouterr()
    if code == 0:  # the old output was gone as a volume: a fresh run over all of it
        assert_resumed(again.out, out, expected, num_blocks=16, done_before=0)
    else:
        assert code == 2 and "exists; pass --overwrite" in error_line(again.err)
        assert main(["run", source, out, "--overwrite", *PINNED]) == 0
    np.testing.assert_array_equal(_read(out), expected)
    assert markers_path(parse_volume_path(out)).exists()
    assert not list(tmp_path.glob("out.zarr/.pred.deleting-*")), "what the killed run moved aside was left behind"


def _cut_short_during_creation(out: str) -> None:
    """What a kill between an output's markers and its first array leaves: the OME group, no array, nothing done."""
    shutil.rmtree(os.path.join(out, "0"))
    for ids in (markers_path(parse_volume_path(out)) / "done").iterdir():
        ids.unlink()


def test_an_output_left_half_created_by_a_killed_run_is_created_again_by_the_rerun(tmp_path):
    source, out = _source(tmp_path), str(tmp_path / "out.zarr")
    assert main(["run", source, out, *PINNED]) == 0  # the old output, made in this process
    expected = _read(out)
    _cut_short_during_creation(out)
    rerun = run_blockpred("run", source, out, *PINNED)
    assert rerun.returncode == 0, rerun.stderr
    assert "half-created" in rerun.stderr and "Traceback" not in rerun.stderr
    np.testing.assert_array_equal(_read(out), expected)


def test_an_output_that_cannot_be_opened_but_has_done_blocks_is_refused_and_kept(tmp_path):
    source, out = _source(tmp_path), str(tmp_path / "out.zarr")
    assert main(["run", source, out, *PINNED]) == 0  # the old output, made in this process
    shutil.rmtree(os.path.join(out, "0"))  # damaged by hand: its markers still vouch for every block
    before = snapshot(tmp_path / "out.zarr.blockpred")
    rerun = run_blockpred("run", source, out, *PINNED)
    assert rerun.returncode == 2 and "cannot be opened" in error_line(rerun.stderr), rerun.stderr
    assert snapshot(tmp_path / "out.zarr.blockpred") == before


def test_an_hdf5_output_damaged_by_a_crash_is_one_line_saying_what_to_do_and_is_never_deleted(tmp_path, capsys):
    """What HDF5 wrote after its last flush reaches the disk in any order in a crash of the machine: a file it
    cannot open may hold other datasets (the input, too), so no command deletes it; each says how to go on."""
    source, out = _source(tmp_path), f"{tmp_path}/out.h5:/pred"
    assert main(["run", source, out, "--model", "tiny", *PINNED]) == 0
    with open(tmp_path / "out.h5", "r+b") as file:  # the superblock torn, as a write-back cut short leaves it
        file.seek(8)
        file.write(b"\xff" * 200)
    before = snapshot(tmp_path)
    for extra in ((), ("--overwrite",)):
        capsys.readouterr()
        assert main(["run", source, out, "--model", "tiny", *PINNED, *extra]) == 2
        assert "restored or removed by hand" in error_line(capsys.readouterr().err)
        assert snapshot(tmp_path) == before
