"""The write contract, for every output format, through the real command: a block marked done is in the output.

A run is killed (SIGKILL) at several points -- each right after its k-th block was marked done, while the
next blocks are being written (HDF5: after the 2nd, 9th and 17th mark; the other formats after the 9th) --
and run again each time.  After every kill, each marked block's region of
the output must equal a clean run's (a mark vouches for data that is there: HDF5 once marked blocks whose
data was still in its caches, and 42 of 64 read as zeros after a resume); the last run computes exactly
the blocks not marked, and the output equals the clean run's bit for bit (same batch, layout and threads).
A full disk fails its blocks without a mark; with space freed, the same command completes the output.
A crash of the machine (the disk read as it holds it, the page cache lost) in the middle of a run into a zarr,
N5 or precomputed output leaves marks that vouch for data that is there, and the same command resumes (zarr,
here); after any run finished, the same command finds it finished.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import numpy as np
import pytest

import blockpred
from blockpred.geometry import Box
from tests.helpers import (assert_resumed, child_env, done_blocks, error_line, read_volume, run_blockpred,
                           write_test_volume)

pytestmark = pytest.mark.slow

SHAPE = (32, 64, 128)
BLOCK = 16
GRID = tuple(s // BLOCK for s in SHAPE)
PINNED = ("--model", "tiny", "--device", "cpu", "--no-progress", "--block", str(BLOCK), "--batch-size", "1",
          "--memory-format", "contiguous", "--backend", "torch")
#: The same run through the API, in this process: what is not killed runs here (a command's start-up is most of
#: its time), with the same batch, layout and threads, so its output is the command's bit for bit.
OPTIONS = dict(model="tiny", device="cpu", progress=False, block=BLOCK, batch_size=1, memory_format="contiguous",
               backend="torch")

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
    blockpred.predict(source, target, **OPTIONS)
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


def assert_resumes_to_the_clean_output(source: str, target: str, clean: np.ndarray, caplog) -> list[str]:
    """The same run again computes exactly the unmarked blocks, and the output equals a clean run's; its warnings."""
    before = len(done_blocks(target))
    caplog.clear()
    with caplog.at_level("WARNING", logger="blockpred"):
        summary = blockpred.predict(source, target, **OPTIONS)
    assert_resumed(str(summary), target, clean, num_blocks=int(np.prod(GRID)), done_before=before)
    return [record.getMessage() for record in caplog.records]


@pytest.mark.parametrize("template", FORMATS)
def test_an_output_killed_at_several_points_resumes_equal_to_a_clean_run(template, source, clean, tmp_path,
                                                                         crashable_disk_or_none, caplog):
    """Killed, and read both as the killed process left it (the page cache) and as a crash of the machine at that
    moment would (the disk alone: see ``crashable_disk``; where no loop device can be mounted, only the first);
    finished, and read again as after a crash."""
    disk = crashable_disk_or_none
    place = tmp_path if disk is None else disk.path
    target = template.format(dir=place)
    hdf5 = template.endswith(":/pred")
    killed = []
    for count in (2, 9, 17) if hdf5 else (9,):
        killed.append(run_until_marked(source, target, count) == -signal.SIGKILL)
        if killed[-1]:
            assert_marked_blocks_hold_their_data(target, clean)
    assert any(killed), "no run was killed before it finished"
    if disk is not None and not hdf5:  # HDF5's writes after its last flush reach the disk in any order
        crashed = template.format(dir=disk.crash().path)
        assert_marked_blocks_hold_their_data(crashed, clean)
        if template == FORMATS[1].values[0]:  # the resume from the crash once: N5 and precomputed go the same way
            assert_resumes_to_the_clean_output(source, crashed, clean, caplog)  # before: the output was refused
    flagged = hdf5 and killed[-1]  # the killed writer left its file flagged 'open for writing' ...
    if flagged:  # ... which a SWMR reader (as blockpred's) reads
        code = "import h5py, sys; h5py.File(sys.argv[1], 'r', swmr=True)['pred'][...]"
        read = subprocess.run([sys.executable, "-c", code, str(place / "out.h5")], capture_output=True,
                              text=True)
        assert read.returncode == 0, read.stderr
    said = assert_resumes_to_the_clean_output(source, target, clean, caplog)
    if flagged:  # ... and the next writer clears them, with a warning
        assert any("flags are cleared" in line for line in said), said
    if disk is not None:
        # Finished: the output's metadata, every block and every mark on the disk itself, so after a power cut the
        # same command computes nothing (before, neither the markers nor a zarr output's metadata were).
        finished = template.format(dir=disk.crash().path)
        assert_resumes_to_the_clean_output(source, finished, clean, caplog)


@pytest.mark.parametrize("template", [FORMATS[0], FORMATS[1]])
def test_a_full_disk_fails_blocks_without_marks_and_with_space_freed_the_run_completes(template, source, clean,
                                                                                      tmpfs, caplog):
    disk = tmpfs("768k")  # the markers, the metadata and some of the 64 blocks (about 30 KiB each)
    target = template.format(dir=disk.path)
    result = run_blockpred("run", source, target, *PINNED)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no space left on the device" in error_line(result.stderr)
    assert "predicted" not in result.stdout  # no success summary
    assert 0 < len(done_blocks(target)) < np.prod(GRID)
    assert_marked_blocks_hold_their_data(target, clean)
    disk.resize("16m")
    assert_resumes_to_the_clean_output(source, target, clean, caplog)

