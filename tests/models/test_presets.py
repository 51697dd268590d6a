"""Presets: seeded, deterministic, sane sizes, consistent defaults."""

import pytest
import torch

from blockpred.models.presets import PRESETS, build_preset, get_preset
from blockpred.models.unet import UNet3d


def n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", ["tiny", "unet32"])
def test_two_builds_have_identical_weights(name):
    a, b = build_preset(name), build_preset(name)
    assert list(a.state_dict()) == list(b.state_dict())
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())


def test_building_a_preset_neither_uses_nor_changes_the_global_rng():
    torch.manual_seed(1)
    state = torch.random.get_rng_state()
    first = build_preset("tiny")
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.manual_seed(2)
    second = build_preset("tiny")
    assert all(torch.equal(first.state_dict()[k], v) for k, v in second.state_dict().items())


def test_presets_are_eval_mode_float32_on_cpu():
    net = build_preset("tiny")
    assert not net.training
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in net.parameters())


@pytest.mark.parametrize(
    "name, in_channels, out_channels, downsampling, params",
    [
        ("tiny", 1, 2, (2, 2, 2), 4_730),
        ("unet32", 1, 1, (16, 16, 16), 22_575_329),
        ("cremi2018", 1, 3, (1, 27, 27), 87_753_495),
    ],
)
def test_architecture_and_parameter_count(name, in_channels, out_channels, downsampling, params):
    preset = get_preset(name)
    with torch.device("meta"):  # shapes only; cremi2018 holds 350 MB of weights
        net = UNet3d(**preset.unet_kwargs)
    print(f"{name}: {n_params(net):,} parameters, {net.macs_per_voxel():,.0f} MACs per voxel")
    assert (net.in_channels, net.out_channels, tuple(net.downsampling)) == (in_channels, out_channels, downsampling)
    assert n_params(net) == params


@pytest.mark.parametrize("name", list(PRESETS))
def test_default_block_and_halo_fit_the_network(name):
    preset = PRESETS[name]
    with torch.device("meta"):
        net = UNet3d(**preset.unet_kwargs)
    assert preset.default_block.is_multiple_of(net.downsampling)
    # halos on multiples of the downsampling keep each block's pooling grid aligned with the volume's
    assert preset.default_halo.is_multiple_of(net.downsampling)


def test_tiny_is_fast_enough_for_tests_on_a_default_block():
    net = build_preset("tiny")
    block = PRESETS["tiny"].default_block + 2 * PRESETS["tiny"].default_halo
    with torch.no_grad():
        out = net(torch.rand(1, 1, *block))
    assert out.shape == (1, 2, *block)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(KeyError, match="tiny, cremi2018, unet32"):
        get_preset("huge")
