"""The device's steps around the network give the numbers of the host-side definitions, bit for bit."""

import copy

import numpy as np
import pytest
import torch

from blockpred.models import build_preset
from blockpred.normalize import Normalization, convert_output
from blockpred.pipeline import DeviceSteps, Predictor


class Identity(torch.nn.Module):
    def forward(self, x):
        return x


def raw_block(dtype, rng):
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal((1, 6, 7, 8)) * 3).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, (1, 6, 7, 8), endpoint=True, dtype=dtype)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "int32", "float32", "float64", "uint32"])
@pytest.mark.parametrize("normalize", ["auto", "none", "minmax:10,200", "meanstd:100,25"])
def test_normalisation_on_the_device_equals_the_host_definition(dtype, normalize):
    rng = np.random.default_rng(1)
    block = raw_block(dtype, rng)
    norm = Normalization.parse(normalize)
    scale, offset = norm.scale_offset(block.dtype)
    got = Predictor(Identity(), torch.device("cpu")).submit([block], DeviceSteps(scale=scale, offset=offset)).result()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got[0], norm.apply(block))


@pytest.mark.parametrize("output_dtype", ["float32", "float16", "uint8"])
def test_crop_channels_and_output_conversion_on_the_device_equal_the_host_definition(output_dtype):
    rng = np.random.default_rng(2)
    block = (rng.standard_normal((3, 10, 12, 14)) * 0.7 + 0.5).astype(np.float32)
    crop = (slice(2, 8), slice(1, 11), slice(3, 9))
    steps = DeviceSteps(crop=crop, channels=(2, 0), output_dtype=np.dtype(output_dtype))
    got = Predictor(Identity(), torch.device("cpu")).submit([block, block[::-1].copy()], steps).result()

    for got_block, source in zip(got, (block, block[::-1])):
        expected = convert_output(source[[2, 0]][(slice(None),) + crop], np.dtype(output_dtype))
        assert got_block.dtype == expected.dtype
        np.testing.assert_array_equal(got_block, expected)


def test_bf16_weights_cast_once_give_the_numbers_of_autocast_casting_them_at_every_call():
    module = build_preset("tiny")
    reference = copy.deepcopy(module)
    predictor = Predictor(module, torch.device("cpu"), "bf16")
    convs = [m for m in predictor.module.modules() if isinstance(m, torch.nn.Conv3d)]
    assert convs and all(m.weight.dtype == torch.bfloat16 for m in convs), "the weights were not cast"

    x = np.random.default_rng(3).random((1, 1, 16, 16, 16), dtype=np.float32)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(torch.from_numpy(x)).float().numpy()
    np.testing.assert_array_equal(predictor(x), expected)
