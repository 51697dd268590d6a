"""Options far larger than the volume, volumes far larger than memory, and Ctrl-C in the middle of a dry run.

A block larger than the volume is cut to it, a halo longer than the volume to
what changes nothing (or refused); ``plan`` counts a petavoxel's billions of
blocks without a value per block; an interrupted command ends within seconds
even while the network is busy on a thread of its own.
"""

import json
import logging
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import zarr

import blockpred
from blockpred.cli import main
from blockpred.errors import InvalidOptionError
from blockpred.geometry import Coord
from blockpred.run.halo import HaloChoice, cut_to_volume
from tests.helpers import HANG_S, ROOT, child_env, wait_for, write_test_volume

TINY = ["--config", "tiny", "--device", "cpu", "--no-progress"]
SHAPE = (16, 32, 32)


def test_a_block_larger_than_the_volume_is_cut_to_it_in_plan_and_run(tmp_path, capsys, caplog):
    data = np.random.default_rng(0).integers(0, 255, SHAPE, dtype=np.uint8)
    source = write_test_volume(str(tmp_path / "in.zarr/raw"), data)
    args = [source, str(tmp_path / "o.zarr"), *TINY, "--block", "1024,1024,1024"]
    with caplog.at_level(logging.INFO, logger="blockpred.run.choose"):
        assert main(["plan", *args]) == 0
        assert "blocks    16x32x32 + halo 10x10x10" in capsys.readouterr().out
        assert main(["run", *args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["block"] == [16, 32, 32] and summary["blocks"] == summary["predicted_blocks"] == 1
    cuts = [r.getMessage() for r in caplog.records if "larger than the ROI" in r.getMessage()]
    assert cuts == ["block 1024x1024x1024 is larger than the ROI 16x32x32: cut to 16x32x32"] * 2


def test_a_halo_longer_than_the_volume_is_cut_to_the_field_where_that_changes_nothing(tmp_path, capsys, caplog):
    source = write_test_volume(str(tmp_path / "in.zarr/raw"), np.zeros(SHAPE, dtype=np.uint8))
    with caplog.at_level(logging.WARNING, logger="blockpred"):
        assert main(["plan", source, str(tmp_path / "o.zarr"), *TINY, "--halo", "500"]) == 0
    assert "halo 10x10x10 -> network input 36x52x52" in capsys.readouterr().out
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "using halo 10,10,10, which gives the same output" in lines[0], lines


@pytest.mark.parametrize("field_note", [None, "unbounded: the output depends on the whole input"])
def test_a_halo_longer_than_the_volume_is_refused_where_cutting_it_may_change_the_output(field_note):
    field = None
    if field_note is not None:
        from blockpred.models.discover import Grid
        from blockpred.models.field import NetworkField

        field = NetworkField(Grid(Coord((1, 1, 1)), Coord((1, 1, 1)), Coord((8, 8, 8)), Coord((0, 0, 0))), None,
                             field_note)
    named = HaloChoice(Coord((4, 500, 8)), "named", field, None)
    with pytest.raises(InvalidOptionError, match=r"on axis y: .* use --halo 4,32,8 or less$"):
        cut_to_volume(named, Coord(SHAPE), Coord((1, 1, 1)))
    assert cut_to_volume(HaloChoice(Coord((4, 32, 8)), "named", field, None), Coord(SHAPE), Coord((1, 1, 1))) \
        .halo == (4, 32, 8)  # as long as the volume: kept


def test_plan_counts_a_petavoxel_without_a_value_per_block(tmp_path):
    """100000^3 voxels in 64^3 blocks: 3.8 billion blocks (an HDF5 output: no inode check), and under a mask."""
    zarr.create_array(str(tmp_path / "big.zarr"), name="raw", shape=(100_000,) * 3, chunks=(128,) * 3, dtype="uint8")
    mask = np.zeros((10, 10, 10), dtype=np.uint8)
    mask[0, 0, 0] = 1  # voxels [0, 10000) of the volume on each axis: 157 blocks of 64 touch them
    mask_path = write_test_volume(str(tmp_path / "mask.zarr"), mask)
    options = {"config": "tiny", "device": "cpu", "progress": False}
    whole = blockpred.plan(str(tmp_path / "big.zarr/raw"), str(tmp_path / "o.h5:/pred"), **options)
    assert whole.plan.num_blocks == whole.num_todo == whole.output_files == 1563**3
    assert whole.voxels_to_predict == 10**15 and whole.num_masked == whole.num_done == 0
    masked = blockpred.plan(str(tmp_path / "big.zarr/raw"), str(tmp_path / "o.h5:/pred"), mask=mask_path, **options)
    assert masked.num_todo == masked.output_files == 157**3 and masked.num_masked == 1563**3 - 157**3
    assert masked.voxels_to_predict == (157 * 64) ** 3


def test_too_many_files_with_shards_by_block_advises_a_larger_block_not_shards_again(tmp_path, capsys):
    if os.statvfs(tmp_path).f_files == 0:
        pytest.skip("this file system reports no inode limit (btrfs): nothing is refused")
    zarr.create_array(str(tmp_path / "big.zarr"), name="raw", shape=(100_000,) * 3, chunks=(128,) * 3, dtype="uint8")
    code = main(["plan", str(tmp_path / "big.zarr/raw"), str(tmp_path / "o.zarr"), *TINY, "--shards", "block"])
    err = capsys.readouterr().err
    assert code == 2 and "3,818,360,547 files (one per shard)" in err, err
    assert "a larger --block: one shard file per block" in err and "--shards block" not in err


def test_ctrl_c_ends_plan_while_the_network_is_in_its_dry_run(tmp_path):
    """The network holds its dry run (on a worker thread) until the test opens a gate it never opens: SIGINT
    still ends the process, without waiting for the pass."""
    source = write_test_volume(str(tmp_path / "in.zarr/raw"), np.zeros(SHAPE, dtype=np.uint8))
    gate, held = tmp_path / "gate", tmp_path / "held"
    gate.touch()
    command = [sys.executable, "-m", "blockpred", "plan", source, str(tmp_path / "o.zarr"), "--device", "cpu",
               "--model", "tests.networks:gated", "--model-kwargs", f"gate_file={gate},held_file={held},every_pass=true"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT,
                               env=child_env())
    try:
        wait_for(held.exists, "the network holding its first pass", process=process)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=HANG_S)  # the pass never ends: a process that waits for it hangs here
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signal.SIGINT and "blockpred: interrupted" in err, err
