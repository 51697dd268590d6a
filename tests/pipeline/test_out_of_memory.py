"""Out of memory during a run: the batch halves, then blocks run in parts; nothing is lost or written twice.

The device's memory is injected: ``tests.networks:memory_limited`` raises
``torch.OutOfMemoryError`` on a pass over more input voxels than its budget.
"""

import numpy as np
import pytest
import zarr
from hypothesis import given, settings, strategies as st

import blockpred
from blockpred.errors import BlockFailedError
from blockpred.geometry import Box, Coord
from blockpred.pipeline.markers import DoneMarkers, markers_path
from blockpred.io import parse_volume_path
from blockpred.pipeline import Backoff, is_out_of_memory
from blockpred.pipeline.backoff import split_core
from tests.helpers import write_test_volume

import torch

SHAPE = (48, 64, 64)
BLOCK = 32  # 2 x 2 x 2 blocks; tiny's halo 10 makes each block's input 52^3 = 140,608 voxels
BLOCK_INPUT = 52**3


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    rng = np.random.default_rng(5)
    path = tmp_path_factory.mktemp("oom") / "in.zarr"
    return write_test_volume(str(path), rng.integers(0, 256, SHAPE, dtype=np.uint8))


def predict(volume, out, budget, *, batch_size=1, spare_zeros=False, transient=None, **options):
    kwargs = {"budget_voxels": budget, "spare_zeros": spare_zeros, "transient": transient}
    return blockpred.predict(volume, str(out), model="tests.networks:memory_limited", model_kwargs=kwargs,
                             block=BLOCK, halo=10, batch_size=batch_size, memory_format="contiguous", precision="fp32",
                             progress=False, local=True, **options)


def written(out) -> np.ndarray:
    return zarr.open_group(str(out), mode="r")["0"][:]


@pytest.fixture(scope="module")
def undisturbed(volume, tmp_path_factory):
    out = tmp_path_factory.mktemp("undisturbed") / "out.zarr"
    predict(volume, out, budget=10**9, batch_size=4)
    return written(out)


def test_a_batch_that_does_not_fit_is_halved_and_the_output_is_identical(volume, undisturbed, tmp_path):
    out = tmp_path / "out.zarr"
    summary = predict(volume, out, budget=2 * BLOCK_INPUT, batch_size=4)

    assert summary.stats.out_of_memory == 1 and summary.stats.batch_size == 2
    assert "recovered from 1 out-of-memory error(s): batch size 4 -> 2" in str(summary)
    assert summary.stats.num_blocks == 8
    # Batches of 2 against batches of 4: CPU kernels may round the last bit differently per batch size.
    np.testing.assert_allclose(written(out), undisturbed, rtol=0, atol=1e-5)


def test_a_block_that_does_not_fit_at_batch_1_is_predicted_in_parts_and_written_once(volume, undisturbed, tmp_path):
    out = tmp_path / "out.zarr"
    # Dry runs (zeros) fit, real blocks do not: the run learns it mid-way, as on a GPU shared with others.
    summary = predict(volume, out, budget=BLOCK_INPUT - 1, batch_size=2, spare_zeros=True)

    assert summary.stats.out_of_memory == 2  # batch 2 -> 1, then each block in 2 parts
    assert summary.stats.block_parts.prod() == 2
    assert "blocks predicted in 2x1x1 parts" in str(summary)
    assert summary.stats.num_blocks == 8 and summary.stats.num_voxels == int(np.prod(SHAPE))
    markers = DoneMarkers.open(markers_path(parse_volume_path(str(out))))
    assert len(markers.finished_indices()) == 8
    # The parts carry the block's halo, which covers tiny's receptive field: the same numbers up to
    # float32 rounding of convolutions over other shapes (CPU kernels differ in the last bit
    # between shapes, and even between batch 1 and batch 2).
    np.testing.assert_allclose(written(out), undisturbed, rtol=0, atol=1e-5)


def test_a_valid_convolution_network_is_predicted_in_equal_parts_when_its_blocks_do_not_fit(volume, tmp_path):
    # Block 30 of SHAPE (48, 64, 64): cores of 30 split into 2 parts of 16 (on the 2x pooling grid) that
    # overlap by 2; every part's input is the block's less 14, which the valid network accepts.
    common = dict(model="tests.networks:memory_limited", block=30, precision="fp32", progress=False, local=True)
    whole = blockpred.predict(volume, str(tmp_path / "whole.zarr"),
                              model_kwargs={"budget_voxels": 10**9, "valid": True}, **common)
    input_voxels = whole.plan.input_shape.prod()
    parts = blockpred.predict(volume, str(tmp_path / "parts.zarr"),
                              model_kwargs={"budget_voxels": input_voxels - 1, "valid": True, "spare_zeros": True},
                              **common)

    assert whole.plan.context != Coord((0, 0, 0)), "not a valid-convolution network"
    assert parts.stats.out_of_memory >= 1 and parts.stats.block_parts.prod() > 1
    assert parts.stats.num_blocks == whole.stats.num_blocks
    np.testing.assert_allclose(written(tmp_path / "parts.zarr"), written(tmp_path / "whole.zarr"), rtol=0, atol=1e-5)


def test_a_transient_out_of_memory_error_costs_nothing_but_a_smaller_batch(volume, undisturbed, tmp_path):
    out = tmp_path / "out.zarr"
    summary = predict(volume, out, budget=BLOCK_INPUT, batch_size=4, transient=1)

    assert summary.stats.out_of_memory == 1 and summary.stats.batch_size == 2 and summary.stats.num_blocks == 8
    np.testing.assert_allclose(written(out), undisturbed, rtol=0, atol=1e-5)  # batch 2 against batch 4, as above


def test_when_nothing_small_enough_fits_the_blocks_fail_naming_out_of_memory_and_nothing_is_written(volume, tmp_path):
    out = tmp_path / "out.zarr"
    with pytest.raises(BlockFailedError, match="out of memory") as caught:
        predict(volume, out, budget=1000, spare_zeros=True, retries=0)

    assert len(caught.value.failed) == 8
    markers = DoneMarkers.open(markers_path(parse_volume_path(str(out))))
    assert markers.finished_indices() == set() or len(markers.finished_indices()) == 0
    assert zarr.open_group(str(out), mode="r")["0"].nchunks_initialized == 0


def test_out_of_memory_errors_are_recognised_whatever_raised_them():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory"))
    assert not is_out_of_memory(RuntimeError("Given groups=1, weight of size [4, 1, 3, 3, 3], expected input"))
    assert not is_out_of_memory(ValueError("out of memory"))


@settings(max_examples=60, deadline=None)
@given(core=st.tuples(*[st.integers(1, 12)] * 3), step=st.tuples(*[st.sampled_from([1, 2, 3, 4])] * 3),
       batch=st.integers(1, 9))
def test_backoff_shrinks_until_one_step_per_part_and_equal_parts_always_cover_the_core(core, step, batch):
    core_shape, step = Coord(c * s for c, s in zip(core, step)), Coord(step)
    backoff = Backoff(batch)
    previous_voxels = None
    while True:
        parts = split_core(core_shape, backoff.parts, step)
        covered = np.zeros(tuple(core_shape), dtype=np.int8)
        for part in parts:
            assert all(b % s == 0 for b, s in zip(part.begin, step)), "a part starts off the pooling grid"
            assert part.shape == parts[0].shape, "parts of different shapes"
            assert Box.from_shape(core_shape).contains(part)
            covered[part.to_slices()] += 1
        assert (covered >= 1).all(), "the parts leave part of the core out"
        assert len(parts) <= backoff.parts.prod()
        largest = max(part.size for part in parts)
        if backoff.batch_size == 1 and previous_voxels is not None:
            assert largest < previous_voxels
        previous_voxels = largest if backoff.batch_size == 1 else None
        if not backoff.reduce(core_shape, step):
            break
    assert backoff.batch_size == 1
    assert max(part.size for part in split_core(core_shape, backoff.parts, step)) == step.prod()


def test_a_dask_worker_keeps_the_smaller_batch_from_task_to_task_and_the_summary_reports_it(volume, undisturbed,
                                                                                           tmp_path):
    # 48 blocks of 16^3 (input 36^3) in 8 tasks on one worker: the first task learns batch 2, the rest keep it.
    summary = blockpred.predict(volume, str(tmp_path / "dask.zarr"), model="tests.networks:memory_limited",
                                model_kwargs={"budget_voxels": 2 * 36**3}, block=16, halo=10, batch_size=4,
                                workers=1, precision="fp32", progress=False)

    assert summary.workers, "the run did not go through dask"
    assert summary.stats.out_of_memory == 1 and summary.stats.batch_size == 2
    assert "recovered from 1 out-of-memory error(s): batch size 4 -> 2" in str(summary)
    assert summary.stats.num_blocks == 48
    # Other blocks (16^3, not 32^3) with a halo covering the receptive field: the same numbers up to rounding.
    np.testing.assert_allclose(written(tmp_path / "dask.zarr"), undisturbed, rtol=0, atol=1e-5)
