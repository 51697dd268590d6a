"""UNet3d: shapes in 'same' and 'valid' mode, pooling, validation."""

import pytest
import torch

from blockpred.geometry import Coord
from blockpred.models.unet import UNet3d


def small(**overrides) -> UNet3d:
    kwargs = dict(in_channels=1, out_channels=2, depth=2, initial_features=2, growth=2)
    return UNet3d(**{**kwargs, **overrides}).eval()


@pytest.mark.parametrize(
    "pool_factors, shape",
    [
        pytest.param(2, (8, 8, 8), id="isotropic-cube"),
        pytest.param(2, (4, 12, 20), id="isotropic-box"),
        pytest.param((1, 2, 2), (3, 8, 12), id="anisotropic-same-every-level"),
        pytest.param([(1, 3, 3), 2], (2, 12, 18), id="anisotropic-per-level"),
    ],
)
def test_same_padding_keeps_the_input_shape(pool_factors, shape):
    net = small(pool_factors=pool_factors)
    with torch.no_grad():
        out = net(torch.rand(2, 1, *shape))
    assert out.shape == (2, 2, *shape)
    assert net.output_shape(shape) == Coord(shape)


def test_downsampling_is_the_product_of_the_pool_factors_per_axis():
    net = small(depth=3, pool_factors=[(1, 3, 3), (1, 3, 3), (2, 1, 3)])
    assert net.downsampling == Coord((2, 9, 27))
    assert net.pool_factors == (Coord((1, 3, 3)), Coord((1, 3, 3)), Coord((2, 1, 3)))


def test_three_plain_ints_are_one_triple_even_with_depth_three():
    assert small(depth=3, pool_factors=(1, 3, 3)).downsampling == Coord((1, 27, 27))


def test_same_padding_rejects_shapes_that_are_not_a_multiple_of_the_downsampling():
    net = small(pool_factors=(1, 2, 2))
    with pytest.raises(ValueError, match=r"multiple of the network's downsampling \[1, 4, 4\]"):
        net(torch.rand(1, 1, 3, 8, 10))
    with pytest.raises(ValueError, match="multiple"):
        net.output_shape((3, 8, 10))


@pytest.mark.parametrize("min_output", [(1, 1, 1), (5, 9, 4), (16, 16, 16)])
def test_valid_padding_fits_the_shapes_valid_input_shape_gives(min_output):
    net = small(padding="valid", pool_factors=[(1, 2, 2), 2])
    shape = net.valid_input_shape(min_output)
    expected = net.output_shape(shape)
    assert all(o >= m for o, m in zip(expected, min_output))
    for axis in range(3):  # the smallest such input: the next smaller fitting one falls short
        smaller = list(shape)
        smaller[axis] -= net.downsampling[axis]
        try:
            assert net.output_shape(smaller)[axis] < min_output[axis]
        except ValueError:
            pass  # nothing smaller fits at all
    with torch.no_grad():
        out = net(torch.rand(1, 1, *shape))
    assert out.shape[2:] == tuple(expected)
    assert all((s - o) % 2 == 0 for s, o in zip(shape, expected)), "output must be centred on the input"


def test_valid_padding_rejects_shapes_that_would_misalign_the_skip_connections():
    net = small(padding="valid")
    good = net.valid_input_shape((4, 4, 4))
    bad = good + Coord((1, 0, 0))
    with pytest.raises(ValueError, match="valid_input_shape"):
        net.output_shape(bad)
    with pytest.raises(ValueError, match="axis z"):
        net(torch.rand(1, 1, *bad))


def test_valid_output_does_not_change_when_the_input_grows_around_it():
    # A 'valid' net sees only real input (no padding), so cropping 2 voxels off
    # the input crops exactly 2 off the output.
    net = small(padding="valid", depth=1)
    shape = net.valid_input_shape((4, 4, 4))
    x = torch.rand(1, 1, *(shape + 4))
    with torch.no_grad():
        whole = net(x)
        part = net(x[:, :, 2:-2, 2:-2, 2:-2])
    torch.testing.assert_close(whole[:, :, 2:-2, 2:-2, 2:-2], part)


def test_depth_zero_is_a_plain_convolution_stack():
    net = small(depth=0)
    assert net.downsampling == Coord((1, 1, 1))
    assert net(torch.rand(1, 1, 5, 6, 7)).shape == (1, 2, 5, 6, 7)


@pytest.mark.parametrize(
    "final_activation, check",
    [
        pytest.param("sigmoid", lambda y: bool(((y > 0) & (y < 1)).all()), id="sigmoid"),
        pytest.param("softmax", lambda y: torch.allclose(y.sum(1), torch.ones(())), id="softmax-over-channels"),
        pytest.param("none", lambda y: bool((y < 0).any() or (y > 1).any()), id="none"),
    ],
)
def test_final_activation(final_activation, check):
    torch.manual_seed(0)
    net = small(final_activation=final_activation, activation="relu")
    with torch.no_grad():
        nn_out = net(10 * torch.rand(1, 1, 4, 4, 4))
    assert check(nn_out)


@pytest.mark.parametrize(
    "overrides, message",
    [
        pytest.param(dict(padding="full"), "padding must be one of", id="padding"),
        pytest.param(dict(activation="tanh"), "activation must be one of", id="activation"),
        pytest.param(dict(final_activation="relu"), "final_activation must be one of", id="final"),
        pytest.param(dict(depth=-1), "depth must be an int >= 0", id="depth"),
        pytest.param(dict(pool_factors=[2, 2, 2, 2]), "pool_factors must be", id="too-many-levels"),
        pytest.param(dict(pool_factors=0), "positive", id="zero-factor"),
    ],
)
def test_bad_arguments_raise_value_error_saying_what_must_hold(overrides, message):
    with pytest.raises(ValueError, match=message):
        small(**overrides)


def test_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        UNet3d(1, 2)  # type: ignore[misc]


def test_wrong_channel_count_is_a_value_error():
    with pytest.raises(ValueError, match="expects 1 input channels, got 2"):
        small()(torch.rand(1, 2, 4, 4, 4))


def test_reset_parameters_with_a_seeded_generator_is_reproducible_and_leaves_the_global_rng_alone():
    a, b = small(), small()
    state = torch.random.get_rng_state()
    a.reset_parameters(torch.Generator().manual_seed(3))
    b.reset_parameters(torch.Generator().manual_seed(3))
    assert torch.equal(torch.random.get_rng_state(), state)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_macs_per_voxel_counts_every_convolution_at_its_resolution():
    # tiny-like: 1->4->4 | pool 2 | 4->8->8 | up 8->4 | 8->4->4 | 4->2
    net = UNet3d(in_channels=1, out_channels=2, depth=1, initial_features=4, growth=2)
    full = 27 * (1 * 4 + 4 * 4) + 8 * 4 + 27 * (8 * 4 + 4 * 4) + 4 * 2
    half = 27 * (4 * 8 + 8 * 8) / 8
    assert net.macs_per_voxel() == pytest.approx(full + half)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_unet3d_can_be_scripted():
    net = small(pool_factors=(1, 2, 2))
    scripted = torch.jit.script(net)
    x = torch.rand(1, 1, 2, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), net(x))
    assert scripted.in_channels == 1 and tuple(scripted.downsampling) == (1, 4, 4)
