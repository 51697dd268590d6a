"""A full disk, a directory that may not be written, a chunk that does not decode: one line, and no damage.

Each of these printed a raw traceback (or was retried twice, recomputing
blocks that could only fail again).  The full disk is a real, small tmpfs;
the refused permission is ``chattr +i`` (which refuses even root).
"""

import os
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import error_line, run_blockpred, write_test_volume

PINNED = ("--device", "cpu", "--no-progress", "--block", "16", "--halo", "4", "--batch-size", "1",
          "--memory-format", "contiguous")


def _source(tmp_path) -> str:
    data = np.random.default_rng(0).integers(0, 255, (32, 32, 64), dtype=np.uint8)
    return write_test_volume(str(tmp_path / "in.zarr/raw"), data, chunks=(16, 16, 16))


@pytest.fixture
def small_disk(tmpfs):
    """A real file system of 2 MiB (tmpfs), unmounted after the test; ``fill(left)`` fills it."""
    disk = tmpfs("2m")
    return disk.path, disk.fill


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != "filler")


def test_a_full_disk_at_the_start_is_one_line_and_leaves_nothing(tmp_path, small_disk):
    disk, fill = small_disk
    source = _source(tmp_path)
    fill(0)
    result = run_blockpred("run", source, disk / "out.zarr", *PINNED)
    assert result.returncode == 2
    assert "no space left on the device" in error_line(result.stderr)
    assert _leftovers(disk) == []


def test_a_disk_that_fills_while_the_output_is_made_is_one_line_and_leaves_nothing(tmp_path, small_disk):
    disk, fill = small_disk
    source = _source(tmp_path)
    fill(8192)  # the lock fits; the markers and the output's metadata do not all fit
    result = run_blockpred("run", source, disk / "out.zarr", *PINNED)
    assert result.returncode in (1, 2)
    assert "no space left on the device" in error_line(result.stderr)
    if result.returncode == 2:  # failed while creating: nothing may be left
        assert _leftovers(disk) == []


@pytest.mark.slow
def test_a_full_disk_during_the_blocks_fails_at_once_without_retries(tmp_path, small_disk):
    disk, fill = small_disk
    source = _source(tmp_path)
    fill(64 * 1024)  # room for the markers and metadata, not for 16 blocks of float32
    result = run_blockpred("run", source, disk / "out.zarr", *PINNED)
    assert result.returncode == 1
    line = error_line(result.stderr)
    assert "No space left on device" in line or "no space left" in line
    assert "retrying" not in result.stderr, "a full disk was retried"
    os.unlink(disk / "filler")
    rerun = run_blockpred("run", source, disk / "out.zarr", *PINNED)  # space again: the same command finishes
    assert rerun.returncode == 0, rerun.stderr


@pytest.mark.slow
def test_a_full_disk_while_writing_the_pyramid_keeps_the_prediction_and_says_how_to_finish(tmp_path, small_disk):
    disk, fill = small_disk
    source = _source(tmp_path)
    out = disk / "out.zarr"
    assert run_blockpred("run", source, out, *PINNED).returncode == 0
    fill(12 * 1024)  # the lock fits, the levels do not
    result = run_blockpred("run", source, out, "--pyramid", "2", *PINNED)
    assert result.returncode == 1
    line = error_line(result.stderr)
    assert "writing the pyramid" in line and "prediction is complete and kept" in line
    os.unlink(disk / "filler")
    again = run_blockpred("run", source, out, "--pyramid", "2", *PINNED)
    assert again.returncode == 0 and "pyramid" in again.stdout


def test_an_output_directory_that_may_not_be_written_is_one_line_and_leaves_nothing(tmp_path, immutable):
    source = _source(tmp_path)
    parent = tmp_path / "readonly"
    parent.mkdir()
    immutable(parent)
    result = run_blockpred("run", source, parent / "out.zarr", *PINNED)
    assert result.returncode == 2
    assert "permission denied" in error_line(result.stderr) or "not permitted" in result.stderr
    assert list(parent.iterdir()) == []


def test_a_read_only_hdf5_output_leaves_no_marker_folder(tmp_path, immutable):
    source = _source(tmp_path)
    write_test_volume(f"{tmp_path}/out.h5:/other", np.zeros((4, 4, 4), dtype=np.uint8))
    immutable(tmp_path / "out.h5")
    result = run_blockpred("run", source, f"{tmp_path}/out.h5:/pred", *PINNED)
    assert result.returncode == 2
    error_line(result.stderr)
    assert not (tmp_path / "out.h5.blockpred").exists()


def test_an_input_chunk_that_does_not_decode_fails_its_blocks_at_once(tmp_path):
    source = _source(tmp_path)
    chunk = next(p for p in (tmp_path / "in.zarr/raw/c").rglob("*") if p.is_file())
    chunk.write_bytes(b"not a zstd frame" * 10)
    result = run_blockpred("run", source, tmp_path / "out.zarr", *PINNED)
    assert result.returncode == 1
    error_line(result.stderr)
    assert "retrying" not in result.stderr, "a chunk that does not decode was read again"


@pytest.mark.slow
def test_an_output_with_more_files_than_free_inodes_is_refused_by_plan_and_run(tmp_path, tmpfs):
    disk = tmpfs("4m", nr_inodes=200).path
    source = _source(tmp_path)
    for command in ("plan", "run"):  # 1,024 chunk files of 4^3
        refused = run_blockpred(command, source, disk / "out.zarr", "--output-chunks", "4", *PINNED)
        assert refused.returncode == 2
        assert "free inodes" in error_line(refused.stderr) and "--shards block" in refused.stderr
    assert _leftovers(disk) == []
    sharded = run_blockpred("run", source, disk / "out.zarr", "--output-chunks", "4", "--shards", "block", *PINNED)
    assert sharded.returncode == 0, sharded.stderr  # 16 shard files
