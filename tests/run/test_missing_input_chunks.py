"""Missing input chunks are counted in the summary with one warning, or fail their blocks at once with one line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

import blockpred
from blockpred.errors import BlockFailedError
from blockpred.geometry import Box, Coord
from blockpred.io import open_volume
from tests.helpers import child_env, write_test_volume
from tests.io.test_missing_chunks import CHUNKS, SHARDS, chunk_file, written

PINNED = {"batch_size": 1, "memory_format": "contiguous", "block": 16, "halo": 4, "progress": False,
          "device": "cpu"}
#: Chunks deleted (z, y, x grid index): one inside, one on a block face, one at the far corner.
DELETED = [(0, 0, 1), (1, 2, 2), (3, 3, 3)]
#: With shards, the shard holding chunk (0, 0, 2): chunks z 0-1, y 0-1, x 2-3.
SHARD_CHUNKS = [(z, y, x) for z in (0, 1) for y in (0, 1) for x in (2, 3)]


def with_holes(tmp_path, name: str, options: dict) -> tuple[str, np.ndarray, list]:
    """A volume with chunk files deleted from disk; also its data with those chunks as zeros, and the chunks."""
    path, data = written(tmp_path, name, options)
    sharded = "shard_shape" in options
    for chunk in [(0, 0, 2)] if sharded else DELETED:
        os.remove(chunk_file(path, chunk, sharded))
    missing = SHARD_CHUNKS if sharded else DELETED
    for chunk in missing:
        data[Box.from_shape(Coord(CHUNKS), Coord(chunk) * Coord(CHUNKS)).to_slices()] = 0
    return path, data, missing


def read_all(path: str) -> np.ndarray:
    volume = open_volume(path)
    return volume.read(volume.box)


def missing_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "input chunk(s) were missing" in line]


@pytest.mark.parametrize("name, options", [
    pytest.param("in.zarr/raw", {"zarr_format": 2}, id="zarr-v2"),
    pytest.param("in.zarr/raw", {"zarr_format": 3}, id="zarr-v3"),
    pytest.param("in.zarr/raw", {"zarr_format": 3, "shard_shape": SHARDS}, id="zarr-v3-sharded"),
    pytest.param("in.n5/raw", {}, id="n5"),
])
def test_the_summary_counts_each_missing_chunk_once_and_the_output_is_that_of_zeros_there(tmp_path, caplog, name,
                                                                                         options):
    source, zeroed, missing = with_holes(tmp_path, name, options)
    with caplog.at_level(logging.WARNING, logger="blockpred"):
        summary = blockpred.predict(source, str(tmp_path / "out.zarr"), local=True, **PINNED)
    assert summary.stats.missing_chunks == {tuple(Coord(c) * Coord(CHUNKS)) for c in missing}
    assert summary.stats.num_missing_chunk_reads >= len(missing)  # a chunk in two blocks' reads counts twice
    [line] = missing_lines(str(summary))
    assert line.startswith(f"{len(missing)} input chunk(s) were missing")
    assert len(missing_lines(caplog.text)) == 1

    reference = write_test_volume(str(tmp_path / "zeros.zarr"), zeroed, chunks=CHUNKS)
    blockpred.predict(reference, str(tmp_path / "reference.zarr"), local=True, **PINNED)
    np.testing.assert_array_equal(read_all(str(tmp_path / "out.zarr")), read_all(str(tmp_path / "reference.zarr")))


def test_a_volume_with_every_chunk_reports_none(tmp_path, caplog):
    source, _ = written(tmp_path, "in.zarr/raw", {"zarr_format": 3})
    with caplog.at_level(logging.WARNING, logger="blockpred"):
        summary = blockpred.predict(source, str(tmp_path / "out.zarr"), local=True, **PINNED)
    assert summary.stats.missing_chunks == set() and summary.stats.num_missing_chunk_reads == 0
    assert "missing" not in str(summary) and "missing" not in caplog.text


def test_a_dask_worker_counts_the_same_missing_chunks(tmp_path):
    source, _, missing = with_holes(tmp_path, "in.zarr/raw", {"zarr_format": 3})
    summary = blockpred.predict(source, str(tmp_path / "out.zarr"), workers=1, **PINNED)
    assert len(summary.workers) == 1
    assert summary.stats.missing_chunks == {tuple(Coord(c) * Coord(CHUNKS)) for c in missing}
    assert len(missing_lines(str(summary))) == 1


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockpred", "run", *args, "--block", "16", "--device", "cpu",
                           "--no-progress", "--local", "--batch-size", "1", "--memory-format", "contiguous"],
                          capture_output=True, text=True, env=child_env(), timeout=300)


@pytest.mark.slow
def test_the_command_warns_once_and_prints_the_count(tmp_path):
    source, _, missing = with_holes(tmp_path, "in.zarr/raw", {"zarr_format": 3})
    done = run(source, str(tmp_path / "out.zarr"))
    assert done.returncode == 0, done.stderr
    assert len(missing_lines(done.stdout)) == 1 and len(missing_lines(done.stderr)) == 1
    assert missing_lines(done.stdout)[0].startswith(f"{len(missing)} input chunk(s)")


def test_missing_chunks_error_fails_at_once_in_one_line_naming_a_block_and_the_chunk(tmp_path):
    source, _, _ = with_holes(tmp_path, "in.zarr/raw", {"zarr_format": 3})
    done = run(source, str(tmp_path / "out.zarr"), "--missing-chunks", "error", "--retries", "2")
    assert done.returncode == 1, done.stderr
    [line] = [text for text in done.stderr.strip().splitlines() if text.startswith("blockpred: error:")]
    assert "Traceback" not in done.stderr
    assert line.startswith("blockpred: error: reading block (") and "input chunk [" in line
    assert "is missing" in line and "MissingChunkError" in line
    assert "Traceback" not in done.stderr and "retrying" not in done.stderr


def test_missing_chunks_error_through_the_api_is_a_permanent_block_failure(tmp_path):
    source, _, _ = with_holes(tmp_path, "in.n5/raw", {})
    with pytest.raises(BlockFailedError, match=r"input chunk \[.*\] of .*in\.n5/raw is missing") as raised:
        blockpred.predict(source, str(tmp_path / "out.zarr"), local=True, missing_chunks="error", **PINNED)
    assert raised.value.permanent


def test_missing_chunks_error_on_an_input_that_cannot_tell_is_refused_before_anything_is_written(tmp_path):
    source, _ = written(tmp_path, "in.h5:/raw", {})
    done = run(source, str(tmp_path / "out.zarr"), "--missing-chunks", "error")
    assert done.returncode == 2
    [line] = [text for text in done.stderr.strip().splitlines() if text.startswith("blockpred: error:")]
    assert "Traceback" not in done.stderr
    assert line.startswith("blockpred: error: --missing-chunks error needs")
    assert not (tmp_path / "out.zarr").exists()
