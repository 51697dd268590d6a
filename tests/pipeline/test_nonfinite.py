"""NaN and inf network outputs are counted per block (only what is written) and reported once, never silently."""

import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

import blockpred
from blockpred.pipeline.blocking import plan_blocks
from blockpred.geometry import Box, Coord
from blockpred.io import open_volume
from blockpred.pipeline import Backoff, DeviceSteps, PipelineSettings, Predictor, run_blocks
from tests.helpers import child_env, write_test_volume
from tests.networks import Passthrough

#: Not a multiple of the block on any axis: the last blocks' cores reach past the volume, where the
#: reflected padding repeats voxels (and their NaN) that must not be counted twice.
SHAPE = (30, 50, 60)
BLOCK, HALO = 16, 4
PINNED = {"batch_size": 2, "memory_format": "contiguous", "block": BLOCK, "halo": HALO, "progress": False}


def poisoned(seed: int = 0) -> np.ndarray:
    """float32 values in [0, 1] with NaN, +inf and -inf voxels: inside blocks, on block faces and near the far edges."""
    data = np.random.default_rng(seed).random(SHAPE, dtype=np.float32)
    data[3, 4, 5] = data[15, 15, 15] = data[16, 16, 16] = np.nan  # inside; on both sides of a block face
    data[28, 48, 58] = data[29, 0, 0] = np.nan  # near the far edge: reflected into the padded part of the core
    data[20, 30, 40] = data[0, 49, 59] = np.inf
    data[10, 45, 2] = -np.inf
    data[5:7, 20:22, 30:33] = np.nan  # a small cluster: 12 voxels in one block
    return data


def blocks_holding(data: np.ndarray) -> int:
    bad = ~np.isfinite(data)
    grid = [range(0, n, BLOCK) for n in data.shape]
    return sum(bool(bad[z:z + BLOCK, y:y + BLOCK, x:x + BLOCK].any())
               for z in grid[0] for y in grid[1] for x in grid[2])


def nonfinite_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "NaN or inf" in line]


# ----------------------------------------------------------------------------------- the device's count


@pytest.mark.parametrize("shape", [pytest.param((1, 10, 12, 14), id="one-slab"),
                                   pytest.param((1, 60, 96, 100), id="slabs"),
                                   pytest.param((1, 8, 300, 1000), id="rows-of-planes-larger-than-a-slab")])
@pytest.mark.parametrize("output_dtype", ["float32", "uint8"])
def test_the_device_counts_nan_and_inf_per_block_only_inside_each_blocks_counted_box(shape, output_dtype):
    rng = np.random.default_rng(5)
    blocks = [rng.random(shape, dtype=np.float32) for _ in range(3)]
    for block in blocks:
        flat = block.reshape(-1)
        flat[rng.choice(flat.size, 40, replace=False)] = rng.choice([np.nan, np.inf, -np.inf], 40)
    crop = (slice(2, shape[1] - 2), slice(1, shape[2] - 3), slice(3, shape[3] - 1))
    core = tuple(s.stop - s.start for s in crop)
    whole = tuple(slice(0, n) for n in core)
    counted = (whole, (slice(0, core[0] - 3), slice(2, core[1]), slice(0, core[2] - 4)), whole)
    steps = DeviceSteps(crop=crop, output_dtype=np.dtype(output_dtype), counted=counted)

    pending = Predictor(Passthrough(), torch.device("cpu")).submit(blocks, steps)
    values = pending.result()

    expected = [int((~np.isfinite(b[0][crop][box])).sum()) for b, box in zip(blocks, counted)]
    assert list(pending.nonfinite) == expected and min(expected) > 0
    if output_dtype == "uint8":  # what the summary says they became
        kept = blocks[0][0][crop]
        assert (values[0, 0][np.isnan(kept) | (kept == -np.inf)] == 0).all()
        assert (values[0, 0][kept == np.inf] == 255).all()


def test_the_whole_batch_count_of_the_cuda_path_counts_each_blocks_box():
    """On CUDA a batch is checked at once (``_count_nonfinite``); so is it on the CPU when nothing is converted."""
    rng = np.random.default_rng(6)
    blocks = [rng.random((1, 12, 14, 16), dtype=np.float32) for _ in range(2)]
    blocks[0][0, 0, 0, 0] = blocks[0][0, 11, 13, 15] = np.nan
    blocks[1][0, 5, 5, 5] = np.inf
    blocks[1][0, 11, 0, 0] = -np.inf
    whole = (slice(0, 12), slice(0, 14), slice(0, 16))
    cases = [((whole, whole), [2, 2]),
             (((slice(1, 12),) + whole[1:], whole[:2] + (slice(0, 8),)), [1, 2]),
             ((whole, (slice(6, 12), slice(0, 14), slice(1, 16))), [2, 0])]
    for counted, expected in cases:
        pending = Predictor(Passthrough(), torch.device("cpu")).submit(blocks, DeviceSteps(counted=counted))
        pending.result()
        assert list(pending.nonfinite) == expected


def test_steps_that_count_nothing_pay_nothing_and_report_none():
    block = np.full((1, 8, 8, 8), np.nan, dtype=np.float32)
    pending = Predictor(Passthrough(), torch.device("cpu")).submit([block], DeviceSteps(output_dtype=np.dtype("uint8")))
    pending.result()
    assert pending.nonfinite is None


@pytest.mark.parametrize("parts", [None, (2, 1, 2)], ids=["whole", "in-parts"])
def test_the_pipeline_sums_the_written_non_finite_values_also_for_blocks_predicted_in_parts(tmp_path, parts):
    data = poisoned()
    source = open_volume(write_test_volume(str(tmp_path / "in.zarr"), data, chunks=(8, 16, 16)))
    empty = np.zeros((1,) + SHAPE, np.uint8)
    sink = open_volume(write_test_volume(str(tmp_path / "out.zarr"), empty, chunks=(8, 16, 16)), mode="r+")
    block = Coord((BLOCK,) * 3)
    plan = plan_blocks(volume_shape=Coord(SHAPE), block_shape=block, halo=Coord((HALO,) * 3),
                       input_shape=block + 2 * HALO, downsampling=Coord((1, 1, 1)), chunk_shape=Coord((8, 16, 16)))
    settings = PipelineSettings(batch_size=2, output_dtype=np.dtype("uint8"))
    backoff = Backoff(2, parts=Coord(parts)) if parts else None
    stats = run_blocks(plan, source=source, sink=sink, predictor=Predictor(Passthrough(), torch.device("cpu")),
                       settings=settings, backoff=backoff)
    assert stats.num_nonfinite == int((~np.isfinite(data)).sum())
    assert stats.num_nonfinite_blocks == blocks_holding(data)


# ----------------------------------------------------------------------------------- runs


@pytest.mark.parametrize("output_dtype, became", [("uint8", "0 (NaN, -inf) or 255 (+inf)"),
                                                  ("float32", "kept as NaN/inf")])
def test_predict_reports_the_written_nan_and_inf_in_the_summary_and_one_warning(tmp_path, caplog, output_dtype,
                                                                                  became):
    data = poisoned()
    source = write_test_volume(str(tmp_path / "in.zarr"), data, chunks=(8, 16, 16))
    with caplog.at_level(logging.WARNING, logger="blockpred"):
        summary = blockpred.predict(source, str(tmp_path / "out.zarr"), model=Passthrough(), local=True,
                                    output_dtype=output_dtype, **PINNED)
    expected, num_blocks = int((~np.isfinite(data)).sum()), blocks_holding(data)
    assert summary.stats.num_nonfinite == expected and summary.stats.num_nonfinite_blocks == num_blocks
    [line] = nonfinite_lines(str(summary))
    assert f"{expected} " in line and f"in {num_blocks} blocks" in line and became in line
    assert len(nonfinite_lines(caplog.text)) == 1

    written = open_volume(str(tmp_path / "out.zarr")).read(Box.from_shape(Coord(SHAPE)))[0]
    if output_dtype == "uint8":
        assert (written[np.isnan(data)] == 0).all() and (written[data == np.inf] == 255).all()
    else:
        assert int((~np.isfinite(written)).sum()) == expected


def test_a_clean_input_reports_no_nan_or_inf(tmp_path, caplog):
    source = write_test_volume(str(tmp_path / "in.zarr"), np.random.default_rng(1).random(SHAPE, dtype=np.float32),
                               chunks=(8, 16, 16))
    with caplog.at_level(logging.WARNING, logger="blockpred"):
        summary = blockpred.predict(source, str(tmp_path / "out.zarr"), model=Passthrough(), local=True,
                                    output_dtype="uint8", **PINNED)
    assert summary.stats.num_nonfinite == 0 and summary.stats.num_nonfinite_blocks == 0
    assert not nonfinite_lines(str(summary)) and not nonfinite_lines(caplog.text)


def test_the_command_prints_the_count_in_the_summary_and_one_warning_line(tmp_path):
    data = poisoned()
    source = write_test_volume(str(tmp_path / "in.zarr"), data, chunks=(8, 16, 16))
    done = subprocess.run(
        [sys.executable, "-m", "blockpred", "run", source, str(tmp_path / "out.zarr"), "--model",
         "tests.networks:passthrough", "--block", str(BLOCK), "--halo", str(HALO), "--batch-size", "2",
         "--memory-format", "contiguous", "--device", "cpu", "--local", "--no-progress", "--output-dtype", "uint8"],
        capture_output=True, text=True, env=child_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    expected = int((~np.isfinite(data)).sum())
    [summary_line] = nonfinite_lines(done.stdout)
    [warning] = nonfinite_lines(done.stderr)
    for line in (summary_line, warning):
        assert f"{expected} " in line and f"in {blocks_holding(data)} blocks" in line
    assert "Traceback" not in done.stderr


def test_a_dask_worker_reports_the_same_count(tmp_path):
    data = poisoned()
    source = write_test_volume(str(tmp_path / "in.zarr"), data, chunks=(8, 16, 16))
    summary = blockpred.predict(source, str(tmp_path / "out.zarr"), model="tests.networks:passthrough", workers=1,
                                device="cpu", output_dtype="uint8", **PINNED)
    assert len(summary.workers) == 1
    assert summary.stats.num_nonfinite == int((~np.isfinite(data)).sum())
    assert summary.stats.num_nonfinite_blocks == blocks_holding(data)
    assert len(nonfinite_lines(str(summary))) == 1


@pytest.mark.parametrize("size", [100, 4096, 3 * 4096 + 17, 262144])
def test_the_slab_check_finds_one_nan_or_inf_anywhere_also_in_the_rows_left_over(size):
    from blockpred.pipeline.cpu_steps import _finite_sum

    slab = np.random.default_rng(1).random(size, dtype=np.float32)
    assert _finite_sum(slab) and _finite_sum(slab[::2])
    for where in {0, size // 2, size - 1}:
        for value in (np.nan, np.inf, -np.inf):
            bad = slab.copy()
            bad[where] = value
            assert not _finite_sum(bad) and not _finite_sum(bad.reshape(1, -1)[:, ::1])
