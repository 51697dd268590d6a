"""The memory a pass takes per voxel, counted at a small shape before the network runs at a block, and cached."""

import pytest
import torch

from blockpred.geometry import Coord
from blockpred.models.loading import load_model
from blockpred.pipeline import Predictor
from blockpred.tuning.passmemory import HEADROOM, PassMemoryCache, count_pass, pass_memory
from blockpred.tuning.tensors import PeakFunctions, PeakTensors, weight_shapes

CPU = torch.device("cpu")


def counted(module: torch.nn.Module, channels: int, side: int = 20, mode=PeakFunctions):
    x = torch.zeros(1, channels, side, side, side)
    counter = mode(weight_shapes(module), held_bytes=x.numel() * x.element_size())
    with torch.inference_mode(), counter:
        counter.result = module(x)  # held: the live bytes end with it
    return counter


@pytest.mark.parametrize("mode", [PeakFunctions, PeakTensors])
@pytest.mark.parametrize("cin, cout, per_voxel", [
    pytest.param(1, 4, 4 + 16 + 64, id="input, output, and the output's copy padded to 16 channels"),
    pytest.param(16, 16, 64 + 64 + 64 + 64, id="an input of 16 channels is copied too"),
    pytest.param(4, 20, 16 + 80 + 128, id="20 channels pad to 32"),
])
def test_a_convolution_is_counted_with_its_input_its_output_and_their_reordered_copies(cin, cout, per_voxel, mode):
    conv = torch.nn.Sequential(torch.nn.Conv3d(cin, cout, 3, padding=1), torch.nn.ELU()).eval()
    counter = counted(conv, cin, mode=mode)
    assert counter.peak_bytes == per_voxel * 20**3
    assert counter.elements == cout * 20**3  # the largest tensor: the output (the weights left out)
    assert counter.live_bytes == (cin + cout) * 4 * 20**3  # the input and the result; the freed are not held


@pytest.mark.parametrize("mode", [PeakFunctions, PeakTensors])
def test_a_tensor_is_counted_once_however_many_views_it_has_and_no_longer_once_freed(mode):
    class Views(torch.nn.Module):
        def forward(self, x):
            y = x * 2  # 4 bytes per voxel
            return y[:, :, 1:] + y.view(-1).view(y.shape)[:, :, :-1]  # two views of y, then a new tensor

    counter = counted(Views(), 1, mode=mode)
    voxels = 20**3
    assert counter.peak_bytes == (4 + 4) * voxels + 4 * 19 * 400  # x, y, and the sum over 19 planes
    assert counter.live_bytes == 4 * voxels + 4 * 19 * 400  # y was freed with its views


def test_tinys_pass_per_voxel_is_the_same_at_every_shape_and_a_fifth_of_it_is_its_largest_tensor():
    predictor = Predictor(load_model("tiny").module, CPU)
    small, larger = (count_pass(predictor, 1, Coord((s, s, s))) for s in (32, 48))
    assert small.bytes_per_voxel == larger.bytes_per_voxel == HEADROOM * 164
    assert small.largest_per_voxel == 8.0 and small.out_channels == 2 and small.context == Coord((0, 0, 0))
    assert small.pass_bytes(Coord((532, 532, 532))) == int(HEADROOM * 164 * 532**3)


def test_a_torchscript_network_is_counted_by_the_dispatcher_where_its_functions_are_not_seen():
    scripted = torch.jit.script(load_model("tiny").module)
    assert counted(scripted, 1, 32).calls == 0  # its calls run inside TorchScript: no torch function is seen
    memory = count_pass(Predictor(scripted, CPU), 1, Coord((32, 32, 32)))
    assert memory.largest_per_voxel == 8.0 and memory.out_channels == 2
    # More than its input, its largest tensor (8 channels of float32) and that tensor's convolution copy together.
    assert memory.bytes_per_voxel > HEADROOM * (4 + 32 + 64)


def test_a_valid_networks_pass_is_counted_per_output_voxel_and_its_context_is_found():
    """Its output is smaller than its input: per output voxel, a larger block's pass is foreseen on the large side."""
    from tests.networks import _valid_unet

    module = _valid_unet()
    shape = Coord(module.valid_input_shape((24, 24, 24)))  # 40^3
    memory = count_pass(Predictor(module, CPU), 1, shape)
    assert memory.context == Coord((8, 8, 8))
    assert memory.bytes_per_voxel == HEADROOM * counted(module, 1, shape[0]).peak_bytes / 24**3


def test_the_count_is_cached_per_network_and_a_network_that_fails_is_not_counted(tmp_path):
    cache = PassMemoryCache(tmp_path / "passes.json")
    predictor = Predictor(load_model("tiny").module, CPU)
    first = pass_memory(predictor, 1, Coord((32, 32, 32)), {"name": "tiny"}, cache)
    again = pass_memory(predictor, 1, Coord((32, 32, 32)), {"name": "tiny"}, cache)
    assert not first.cached and again.cached and again.bytes_per_voxel == first.bytes_per_voxel
    assert not pass_memory(predictor, 1, Coord((32, 32, 32)), {"name": "other"}, cache).cached
    refused = pass_memory(predictor, 1, Coord((33, 33, 33)), {"name": "odd"}, cache)  # not on tiny's grid
    assert refused is None and pass_memory(predictor, 1, Coord((32, 32, 32)), {"name": "odd"}, cache).cached is False
