"""receptive_radius: exact on small stacks, tight enough to choose exact halos; field_radius in float32."""

import logging

import pytest
import torch
from torch import nn

from blockpred.geometry import Box, Coord
from blockpred.models import receptive
from blockpred.models.discover import find_grid
from blockpred.models.presets import PRESETS
from blockpred.models.receptive import field_radius, receptive_radius
from blockpred.models.unet import UNet3d


def test_one_3x3x3_convolution_has_radius_1():
    assert receptive_radius(nn.Conv3d(1, 1, 3, padding=1), 1, (7, 7, 7)) == Coord((1, 1, 1))


@pytest.mark.parametrize("padding", [pytest.param(1, id="same"), pytest.param(0, id="valid")])
def test_two_stacked_3x3x3_convolutions_have_radius_2(padding):
    net = nn.Sequential(nn.Conv3d(1, 3, 3, padding=padding), nn.ReLU(), nn.Conv3d(3, 1, 3, padding=padding))
    assert receptive_radius(net, 1, (9, 9, 9)) == Coord((2, 2, 2))


def test_anisotropic_kernels_give_anisotropic_radii():
    net = nn.Sequential(nn.Conv3d(2, 2, (1, 3, 5), padding=(0, 1, 2)), nn.Conv3d(2, 1, (3, 3, 1), padding=(1, 1, 0)))
    assert receptive_radius(net, 2, (7, 9, 9)) == Coord((1, 2, 2))


def test_max_pooling_and_relu_do_not_hide_any_of_the_field():
    # Through max pooling the true gradient reaches one voxel per window; the
    # measurement must still see the whole window.
    net = nn.Sequential(nn.MaxPool3d(2), nn.ReLU(), nn.Upsample(scale_factor=2))
    # Output voxel at an even index depends on its 2-window: [c, c+1]; odd: [c-1, c].
    assert receptive_radius(net, 1, (8, 8, 8), phases=2) == Coord((1, 1, 1))


def test_the_module_is_left_unchanged():
    net = nn.Sequential(nn.Conv3d(1, 1, 3, padding=1), nn.MaxPool3d(2))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    receptive_radius(net, 1, (8, 8, 8))
    assert isinstance(net[1], nn.MaxPool3d)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_an_input_too_small_to_hold_the_field_is_grown_until_it_does():
    net = nn.Sequential(*[nn.Conv3d(1, 1, 3, padding=1) for _ in range(4)])
    assert receptive_radius(net, 1, (7, 7, 7)) == Coord((4, 4, 4))


def test_growing_past_max_voxels_is_refused():
    net = nn.Sequential(*[nn.Conv3d(1, 1, 3, padding=1) for _ in range(4)])
    with pytest.raises(ValueError, match="reaches the border of a \\(7, 7, 7\\) input on axis z, y, x"):
        receptive_radius(net, 1, (7, 7, 7), max_voxels=1000)


def test_a_valid_unet_is_grown_to_shapes_that_fit():
    net = UNet3d(in_channels=1, out_channels=1, depth=1, initial_features=2, padding="valid")
    assert receptive_radius(net, 1, net.valid_input_shape((1, 1, 1))) == Coord((9, 9, 9))


def test_softmax_unets_are_measured_too():
    net = UNet3d(in_channels=1, out_channels=1, depth=1, initial_features=2, final_activation="softmax")
    assert receptive_radius(net, 1, (24, 24, 24)) == Coord((9, 9, 9))


def test_the_tiny_preset_records_its_measured_radius_and_its_halo_covers_it():
    preset = PRESETS["tiny"]
    assert receptive_radius(preset.build(), 1, (24, 24, 24)) == preset.receptive_radius
    assert all(h >= r for h, r in zip(preset.default_halo, preset.receptive_radius))


def _blockwise(net, volume, core, halo):
    """Predict ``volume`` block by block: cores of shape ``core`` read with ``halo`` (zero outside)."""
    shape = Coord(volume.shape[2:])
    padded = torch.nn.functional.pad(volume, [halo[2], halo[2], halo[1], halo[1], halo[0], halo[0]])
    out = torch.zeros(1, net.out_channels, *shape)
    for bz in range(0, shape[0], core[0]):
        for by in range(0, shape[1], core[1]):
            for bx in range(0, shape[2], core[2]):
                write = Box(Coord((bz, by, bx)), Coord((bz, by, bx)) + core)
                read = write.grow(halo).shift(halo)  # in the padded frame
                pred = net(padded[(slice(None), slice(None), *read.to_slices())])
                inner = Box.from_shape(core, begin=halo)
                out[(slice(None), slice(None), *write.to_slices())] = pred[(slice(None), slice(None), *inner.to_slices())]
    return out


def test_a_halo_of_the_measured_radius_makes_blocks_match_the_whole_volume_and_a_smaller_one_does_not():
    # (The radius is symmetric, the maximum over both sides and all phases; an
    # aligned block's first voxel always has phase 0, so up to one pooling step
    # less can suffice: here 8 does, 6 does not.)
    torch.manual_seed(0)
    net = UNet3d(in_channels=1, out_channels=1, depth=1, initial_features=2, final_activation="none").eval()
    radius = receptive_radius(net, 1, (24, 24, 24))
    assert radius == Coord((9, 9, 9))
    halo = Coord((10, 10, 10))  # the radius rounded up to the downsampling keeps pooling grids aligned
    # A volume with a zero margin of `halo` all round, so the whole-volume
    # prediction sees the same zeros past the data as the blocks do.
    volume = torch.zeros(1, 1, 32, 32, 32)
    volume[:, :, 10:22, 10:22, 10:22] = torch.rand(1, 1, 12, 12, 12)
    with torch.no_grad():
        whole = net(volume)
        blocks = _blockwise(net, volume, Coord((16, 16, 16)), halo)
        short = _blockwise(net, volume, Coord((16, 16, 16)), halo - 4)
    inner = (slice(None), slice(None), slice(10, 22), slice(10, 22), slice(10, 22))
    torch.testing.assert_close(blocks[inner], whole[inner], rtol=0, atol=1e-6)
    assert (short[inner] - whole[inner]).abs().max() > 1e-6


# ------------------------------------------------------------------ field_radius: float32, faint fields, TorchScript


def test_a_scripted_unets_max_pooling_is_measured_to_the_whole_field_of_the_module_it_was_scripted_from(
        caplog, monkeypatch):
    # A scripted network keeps its max pooling in its code (its gradient reaches one voxel per window).  Its graph
    # run node by node averages each pooling, as the module's copy does; where the graph does not run so, the
    # ramps along the axis reach both ends of every window.  Both give the module's field.
    net = UNet3d(in_channels=1, out_channels=2, depth=3, initial_features=2).eval()
    scripted = torch.jit.script(net)
    grid = find_grid(net, 1)
    with caplog.at_level(logging.DEBUG, logger="blockpred.models.receptive"):
        by_graph = field_radius(scripted, 1, grid)
    assert "run node by node, max pooling averaged" in caplog.text
    monkeypatch.setattr(receptive, "_graph_probe", lambda probe: None)  # as where the graph does not run
    assert by_graph == field_radius(scripted, 1, grid) == field_radius(net, 1, grid) == Coord((51, 51, 51))


def test_a_dependence_too_faint_for_float32_is_measured_in_float64(caplog):
    # 300 pointwise layers after a 3x3x3 one: each halves what passes, so the gradient falls below float32's
    # range even from the scaled start; float32 alone would see no dependence at all.
    net = nn.Sequential(nn.Conv3d(1, 1, 3, padding=1), *[nn.Conv3d(1, 1, 1) for _ in range(300)]).eval()
    with caplog.at_level(logging.DEBUG, logger="blockpred.models.receptive"):
        radius = field_radius(net, 1, find_grid(net, 1))
    assert radius == Coord((1, 1, 1))
    assert "measured in float64" in caplog.text
