"""The input is never the output, whatever names reach them: symlinks, symlinked parents, hard links, bind mounts.

Each case once replaced the input by an empty output (`--overwrite` compared
path strings).  Now each is refused in one line, with exit code 2, and the
input's files are byte for byte what they were.
"""

import os
import subprocess

import numpy as np
import pytest
import zarr

from blockpred.cli import main
from blockpred.io import parse_volume_path
from blockpred.io.identity import overlap, within
from blockpred.pipeline.markers import markers_path
from tests.helpers import error_line, run_blockpred, snapshot, write_test_volume

FAST = ("--device", "cpu", "--no-progress", "--block", "16", "--halo", "2", "--batch-size", "1",
        "--memory-format", "contiguous")


def _data(shape=(16, 32, 32)):
    return np.random.default_rng(0).integers(0, 255, shape, dtype=np.uint8)


@pytest.fixture
def zarr_input(tmp_path):
    write_test_volume(str(tmp_path / "g.zarr/raw"), _data())
    return tmp_path / "g.zarr"


def _refused(capsys, *args) -> str:
    assert main(["run", *map(str, args), *FAST]) == 2
    return error_line(capsys.readouterr().err)


def test_overwrite_through_a_symlinked_container_is_refused_and_the_input_kept(tmp_path, zarr_input):
    os.symlink(zarr_input, tmp_path / "glink.zarr")
    before = snapshot(zarr_input)
    result = run_blockpred("run", zarr_input / "raw", tmp_path / "glink.zarr/raw", "--overwrite", *FAST)
    assert result.returncode == 2
    assert "inside the input array" in error_line(result.stderr)
    assert snapshot(zarr_input) == before
    assert not (tmp_path / "glink.zarr.blockpred").exists() and not (tmp_path / "g.zarr.blockpred").exists()


def test_a_symlinked_parent_directory_is_seen_through(tmp_path, capsys):
    (tmp_path / "mnt").mkdir()
    write_test_volume(str(tmp_path / "mnt/g.zarr/raw"), _data())
    os.symlink(tmp_path / "mnt", tmp_path / "data")
    before = snapshot(tmp_path / "mnt")
    assert "inside the input" in _refused(capsys, tmp_path / "mnt/g.zarr/raw", tmp_path / "data/g.zarr/raw",
                                          "--overwrite")
    assert "contains the input" in _refused(capsys, tmp_path / "mnt/g.zarr/raw", tmp_path / "data/g.zarr",
                                            "--overwrite")
    assert snapshot(tmp_path / "mnt") == before


def test_n5_through_a_symlink_is_refused(tmp_path):
    write_test_volume(str(tmp_path / "g.n5/raw"), _data())
    os.symlink(tmp_path / "g.n5", tmp_path / "glink.n5")
    before = snapshot(tmp_path / "g.n5")
    result = run_blockpred("run", tmp_path / "g.n5/raw", tmp_path / "glink.n5/raw", "--overwrite", *FAST)
    assert result.returncode == 2 and "inside the input array" in error_line(result.stderr)
    assert snapshot(tmp_path / "g.n5") == before


def test_hdf5_through_a_symlink_or_a_hard_link_is_refused(tmp_path, capsys):
    write_test_volume(str(tmp_path / "in.h5:/raw"), _data())
    os.symlink(tmp_path / "in.h5", tmp_path / "inlink.h5")
    os.link(tmp_path / "in.h5", tmp_path / "hard.h5")
    before = (tmp_path / "in.h5").read_bytes()
    result = run_blockpred("run", f"{tmp_path}/in.h5:/raw", f"{tmp_path}/inlink.h5:/raw", "--overwrite", *FAST)
    assert result.returncode == 2 and "inside the input array" in error_line(result.stderr)
    assert "inside the input array" in _refused(capsys, f"{tmp_path}/in.h5:/raw", f"{tmp_path}/hard.h5:/raw",
                                                "--overwrite")
    assert (tmp_path / "in.h5").read_bytes() == before


def test_a_sibling_dataset_through_a_hard_link_is_predicted_into_the_one_file(tmp_path, capsys):
    """One file under two names is one file: a sibling dataset is fine, and it is opened once (HDF5 locks)."""
    write_test_volume(str(tmp_path / "in.h5:/raw"), _data())
    os.link(tmp_path / "in.h5", tmp_path / "hard.h5")
    assert main(["run", f"{tmp_path}/in.h5:/raw", f"{tmp_path}/hard.h5:/prediction", *FAST]) == 0
    import h5py

    with h5py.File(tmp_path / "in.h5", "r") as f:
        assert f["prediction"].shape[1:] == (16, 32, 32)
        np.testing.assert_array_equal(f["raw"][...], _data())


def test_a_bind_mount_of_the_input_is_seen_through(tmp_path, capsys):
    write_test_volume(str(tmp_path / "real/g.zarr/raw"), _data())
    (tmp_path / "bound").mkdir()
    mounted = subprocess.run(["mount", "--bind", str(tmp_path / "real"), str(tmp_path / "bound")],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode().strip()}")
    try:
        before = snapshot(tmp_path / "real")
        assert "inside the input" in _refused(capsys, tmp_path / "real/g.zarr/raw", tmp_path / "bound/g.zarr/raw",
                                              "--overwrite")
        assert snapshot(tmp_path / "real") == before
    finally:
        subprocess.run(["umount", str(tmp_path / "bound")], check=True)


def test_overwrite_of_a_symlink_target_is_refused_and_nothing_is_deleted(tmp_path, zarr_input, capsys):
    assert main(["run", str(zarr_input / "raw"), str(tmp_path / "real_out.zarr"), *FAST]) == 0
    capsys.readouterr()
    os.symlink(tmp_path / "real_out.zarr", tmp_path / "out.zarr")
    before = snapshot(tmp_path / "real_out.zarr")
    line = _refused(capsys, zarr_input / "raw", tmp_path / "out.zarr", "--overwrite")
    assert "symbolic link" in line and str(tmp_path / "real_out.zarr") in line
    assert snapshot(tmp_path / "real_out.zarr") == before


def test_an_output_that_holds_the_mask_is_refused(tmp_path, zarr_input, capsys):
    write_test_volume(str(tmp_path / "o.zarr/mask"), np.ones((16, 32, 32), dtype=np.uint8))
    before = snapshot(tmp_path / "o.zarr")
    line = _refused(capsys, zarr_input / "raw", tmp_path / "o.zarr", "--overwrite", "--mask", tmp_path / "o.zarr/mask")
    assert "contains the mask" in line
    assert snapshot(tmp_path / "o.zarr") == before


def test_one_output_under_two_names_has_one_set_of_markers(tmp_path, zarr_input, capsys):
    (tmp_path / "o.zarr").mkdir()
    zarr.open_group(str(tmp_path / "o.zarr"), mode="w")
    os.symlink(tmp_path / "o.zarr", tmp_path / "olink.zarr")
    assert markers_path(parse_volume_path(str(tmp_path / "olink.zarr/pred"))) == tmp_path / "o.zarr.blockpred/pred"
    assert main(["run", str(zarr_input / "raw"), str(tmp_path / "olink.zarr/pred"), *FAST]) == 0
    capsys.readouterr()
    assert main(["run", str(zarr_input / "raw"), str(tmp_path / "o.zarr/pred"), *FAST]) == 0
    assert "0 blocks" in capsys.readouterr().out and not (tmp_path / "olink.zarr.blockpred").exists()


def test_places_overlap_by_identity_not_by_name(tmp_path):
    (tmp_path / "a/b").mkdir(parents=True)
    os.symlink(tmp_path / "a", tmp_path / "link")
    assert within(tmp_path / "link/b", tmp_path / "a") and within(tmp_path / "a/b", tmp_path / "link")
    assert within(tmp_path / "link/b/not-yet", tmp_path / "a/b")  # a place still to be made
    assert not overlap(tmp_path / "a/b", tmp_path / "a/c")
    assert overlap(tmp_path / "a", tmp_path / "link/b")
