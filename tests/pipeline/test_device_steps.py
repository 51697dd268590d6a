"""The device's steps around the network give the numbers of the host-side definitions, bit for bit."""

import copy
import warnings

import numpy as np
import pytest
import torch

from blockpred.models import build_preset
from blockpred.normalize import Normalization, convert_output
from blockpred.pipeline import DeviceSteps, Predictor


class Identity(torch.nn.Module):
    def forward(self, x):
        return x


#: A small block, one the CPU steps cut into several slabs per channel, and one whose planes they cut into rows
#: (see blockpred.pipeline.cpu_steps.slabs).
SHAPES = [pytest.param((1, 6, 7, 8), id="one-slab"), pytest.param((1, 50, 96, 100), id="slabs"),
          pytest.param((1, 3, 300, 1000), id="rows")]


def raw_block(dtype, rng, shape=(1, 6, 7, 8)):
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal(shape) * 3).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, endpoint=True, dtype=dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "int32", "float32", "float64", "uint32"])
@pytest.mark.parametrize("normalize", ["auto", "none", "minmax:10,200", "meanstd:100,25"])
def test_normalisation_on_the_device_equals_the_host_definition(dtype, normalize, shape):
    rng = np.random.default_rng(1)
    block = raw_block(dtype, rng, shape)
    norm = Normalization.parse(normalize)
    scale, offset = norm.scale_offset(block.dtype)
    got = Predictor(Identity(), torch.device("cpu")).submit([block], DeviceSteps(scale=scale, offset=offset)).result()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got[0], norm.apply(block))


@pytest.mark.parametrize("shape, crop", [
    pytest.param((3, 10, 12, 14), (slice(2, 8), slice(1, 11), slice(3, 9)), id="one-slab"),
    pytest.param((3, 60, 96, 100), (slice(3, 57), slice(4, 92), slice(1, 99)), id="slabs"),
])
@pytest.mark.parametrize("output_dtype", ["float32", "float16", "uint8"])
def test_crop_channels_and_output_conversion_on_the_device_equal_the_host_definition(output_dtype, shape, crop):
    rng = np.random.default_rng(2)
    block = (rng.standard_normal(shape) * 0.7 + 0.5).astype(np.float32)
    steps = DeviceSteps(crop=crop, channels=(2, 0), output_dtype=np.dtype(output_dtype))
    got = Predictor(Identity(), torch.device("cpu")).submit([block, block[::-1].copy()], steps).result()

    for got_block, source in zip(got, (block, block[::-1])):
        expected = convert_output(source[[2, 0]][(slice(None),) + crop], np.dtype(output_dtype))
        assert got_block.dtype == expected.dtype
        np.testing.assert_array_equal(got_block, expected)


@pytest.mark.parametrize("output_dtype", ["float32", "uint8"])
def test_all_channels_uncropped_come_back_converted(output_dtype):
    block = np.random.default_rng(4).random((2, 40, 80, 90), dtype=np.float32)
    got = Predictor(Identity(), torch.device("cpu")).submit([block], DeviceSteps(output_dtype=np.dtype(output_dtype)))
    np.testing.assert_array_equal(got.result()[0], convert_output(block, np.dtype(output_dtype)))


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


def test_a_predictors_copy_of_a_torchscript_module_has_leaf_parameters_and_warns_of_nothing():
    net = torch.jit.script(torch.nn.Conv3d(1, 2, 3, padding=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the copy used to warn: "The .grad attribute of a Tensor that is not a leaf"
        predictor = Predictor(net, torch.device("cpu"), "bf16")
        out = predictor(np.zeros((1, 1, 4, 4, 4), dtype=np.float32))
    assert all(p.is_leaf and not p.requires_grad for p in predictor.module.parameters())
    assert out.shape == (1, 2, 4, 4, 4)


def test_a_predictor_leaves_the_callers_module_as_it_was():
    """Precision, layout and device are the predictor's own: the module passed in keeps its weights,
    dtype, layout and device (the API's ``predict(model=net)`` then ``net(x)`` on the CPU must still work)."""
    net = build_preset("tiny")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    Predictor(net, torch.device("cpu"), "bf16", memory_format="channels_last")
    after = net.state_dict()
    for key, value in before.items():
        assert after[key].dtype == value.dtype and after[key].device == value.device, key
        assert after[key].is_contiguous(), key
        assert torch.equal(after[key], value), key
