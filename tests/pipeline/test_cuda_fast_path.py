"""The CUDA fast path (GPU only; skipped without CUDA): streams, pinned pool, device steps, fast kernels."""

import numpy as np
import pytest
import torch

import blockpred
from blockpred.io import open_volume
from blockpred.models import build_preset
from blockpred.pipeline import DeviceSteps, Predictor
from tests.helpers import write_test_volume

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def raw_blocks(n, shape=(1, 36, 52, 52), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(n)]


def test_batches_in_flight_on_three_streams_give_the_cpu_numbers():
    steps = DeviceSteps(scale=1 / 255, crop=(slice(2, 34), slice(10, 42), slice(10, 42)), channels=(1,),
                        output_dtype=np.dtype("float32"))
    cpu, gpu = Predictor(build_preset("tiny"), torch.device("cpu")), Predictor(build_preset("tiny"), torch.device("cuda"))
    batches = [raw_blocks(2, seed=s) for s in range(4)]
    pending = [gpu.submit(b, steps) for b in batches]  # all four in flight before the first is collected
    for batch, handle in zip(batches, pending):
        got = handle.result()
        assert got.shape == (2, 1, 32, 32, 32) and handle.transfer_s > 0 and handle.compute_s > 0
        np.testing.assert_allclose(got, cpu.submit(batch, steps).result(), rtol=0, atol=1e-5)


def test_uint8_output_is_converted_on_the_device():
    steps = DeviceSteps(scale=1 / 255, output_dtype=np.dtype("uint8"))
    gpu = Predictor(build_preset("tiny"), torch.device("cuda"))
    cpu = Predictor(build_preset("tiny"), torch.device("cpu"))
    blocks = raw_blocks(1)
    got = gpu.submit(blocks, steps).result()
    assert got.dtype == np.uint8
    assert np.abs(got.astype(int) - cpu.submit(blocks, steps).result().astype(int)).max() <= 1


@pytest.mark.parametrize("options", [dict(memory_format="channels_last"), dict(compile="default"),
                                     dict(compile="reduce-overhead"), dict(precision="bf16")])
def test_fast_kernel_options_keep_the_numbers(options):
    precision = options.pop("precision", "fp32")
    steps = DeviceSteps(scale=1 / 255)
    plain = Predictor(build_preset("tiny"), torch.device("cuda"))
    fast = Predictor(build_preset("tiny"), torch.device("cuda"), precision, **options)
    blocks = raw_blocks(2)
    expected = plain.submit(blocks, steps).result()
    for _ in range(3):  # compiled and graph-replayed passes after the first
        np.testing.assert_allclose(fast.submit(blocks, steps).result(), expected, rtol=0,
                                   atol=2e-2 if precision == "bf16" else 1e-4)


def test_block_auto_on_the_gpu_picks_a_block_that_runs(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, (64, 256, 256), dtype=np.uint8)
    path = write_test_volume(str(tmp_path / "in.zarr"), data)
    summary = blockpred.predict(path, str(tmp_path / "out.zarr"), block="auto", batch_size="auto", device="cuda",
                                output_dtype="uint8", progress=False, local=True)
    assert summary.sizing is not None and summary.stats.out_of_memory == 0
    out = open_volume(summary.output)
    assert out.read(out.box).any()
