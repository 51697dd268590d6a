"""The write contract, for every output format, through the real command: a block marked done is in the output.

A run is killed (SIGKILL) at several points -- each right after its k-th block was marked done, while the
next blocks are being written -- and run again each time.  After every kill, each marked block's region of
the output must equal a clean run's (a mark vouches for data that is there: HDF5 once marked blocks whose
data was still in its caches, and 42 of 64 read as zeros after a resume); the last run computes exactly
the blocks not marked, and the output equals the clean run's bit for bit (same batch, layout and threads).
A full disk fails its blocks without a mark; with space freed, the same command completes the output.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from blockpred.geometry import Box
from tests.helpers import (assert_resumed, child_env, done_blocks, error_line, read_volume, run_blockpred,
                           write_test_volume)

pytestmark = pytest.mark.slow

SHAPE = (64, 128, 128)
BLOCK = 32
GRID = tuple(s // BLOCK for s in SHAPE)
PINNED = ("--model", "tiny", "--device", "cpu", "--no-progress", "--block", str(BLOCK), "--batch-size", "1",
          "--memory-format", "contiguous", "--backend", "torch")

FORMATS = [
    pytest.param("{dir}/out.h5:/pred", id="hdf5"),
    pytest.param("{dir}/out.zarr", id="zarr"),
    pytest.param("{dir}/out.n5/pred", id="n5"),
    pytest.param("precomputed://{dir}/out", id="precomputed"),
]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    data = np.random.default_rng(7).integers(0, 255, SHAPE, dtype=np.uint8)
    return write_test_volume(f"{tmp_path_factory.mktemp('input')}/in.zarr/raw", data, chunks=(32, 32, 32))


@pytest.fixture(scope="module")
def clean(source, tmp_path_factory) -> np.ndarray:
    """The output of one run that nothing interrupted."""
    target = f"{tmp_path_factory.mktemp('clean')}/clean.zarr"
    result = run_blockpred("run", source, target, *PINNED)
    assert result.returncode == 0, result.stderr
    return read_volume(target)


def block_box(index) -> Box:
    return Box.from_shape((BLOCK,) * 3, tuple(int(i) * BLOCK for i in index))


def run_until_marked(source: str, target: str, count: int) -> int:
    """``blockpred run`` killed (SIGKILL) as soon as ``count`` blocks are marked; its exit code."""
    child = subprocess.Popen([sys.executable, "-m", "blockpred", "run", source, target, *PINNED], env=child_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while child.poll() is None:
            if len(done_blocks(target)) >= count:
                child.send_signal(signal.SIGKILL)
                break
            try:
                child.wait(timeout=0.01)
            except subprocess.TimeoutExpired:
                pass
        _, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode in (0, -signal.SIGKILL), stderr
    return child.returncode


def assert_marked_blocks_hold_their_data(target: str, clean: np.ndarray) -> None:
    output = read_volume(target)
    for index in sorted(done_blocks(target)):
        region = (slice(None),) + block_box(index).to_slices()
        assert np.array_equal(output[region], clean[region]), f"block {index} is marked done but not in the output"


def assert_resumes_to_the_clean_output(source: str, target: str, clean: np.ndarray) -> None:
    before = len(done_blocks(target))
    result = run_blockpred("run", source, target, *PINNED)
    assert result.returncode == 0, result.stderr
    assert_resumed(result.stdout, target, clean, num_blocks=int(np.prod(GRID)), done_before=before)


@pytest.mark.parametrize("template", FORMATS)
def test_an_output_killed_at_several_points_resumes_equal_to_a_clean_run(template, source, clean, tmp_path):
    target = template.format(dir=tmp_path)
    kills = 0
    for count in (2, 9, 17) if template.endswith(":/pred") else (5, 17):
        if run_until_marked(source, target, count) == -signal.SIGKILL:
            kills += 1
            assert_marked_blocks_hold_their_data(target, clean)
    assert kills, "no run was killed before it finished"
    assert_resumes_to_the_clean_output(source, target, clean)


@pytest.mark.parametrize("template", [FORMATS[0], FORMATS[1]])
def test_a_full_disk_fails_blocks_without_marks_and_with_space_freed_the_run_completes(template, source, clean,
                                                                                      tmpfs):
    disk = tmpfs("640k")  # the markers, the metadata and some of the 32 blocks (about 60 KiB each)
    target = template.format(dir=disk.path)
    result = run_blockpred("run", source, target, *PINNED)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no space left on the device" in error_line(result.stderr)
    assert "predicted" not in result.stdout  # no success summary
    assert 0 < len(done_blocks(target)) < np.prod(GRID)
    assert_marked_blocks_hold_their_data(target, clean)
    disk.resize("16m")
    assert_resumes_to_the_clean_output(source, target, clean)


def test_the_output_of_one_killed_hdf5_run_opens_in_another_process_while_flagged(source, clean, tmp_path):
    """A killed writer leaves its file flagged 'open for writing': h5py's plain reader refuses it, a SWMR reader
    (as blockpred reads) does not; the next run clears the flags, with a warning, and finishes."""
    target = f"{tmp_path}/out.h5:/pred"
    assert run_until_marked(source, target, 5) == -signal.SIGKILL
    read = subprocess.run([sys.executable, "-c", "import h5py, sys; h5py.File(sys.argv[1], 'r', swmr=True)['pred'][...]",
                           str(Path(tmp_path) / "out.h5")], capture_output=True, text=True)
    assert read.returncode == 0, read.stderr
    result = run_blockpred("run", source, target, *PINNED)
    assert result.returncode == 0, result.stderr
    assert "flags are cleared" in result.stderr
    np.testing.assert_array_equal(read_volume(target), clean)
