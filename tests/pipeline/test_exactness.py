"""Blockwise prediction equals the network applied to the whole padded volume at once."""

import numpy as np
import pytest
import torch

import blockpred
from blockpred.geometry import Coord
from blockpred.io import open_volume
from blockpred.models.receptive import receptive_radius
from blockpred.models.unet import UNet3d
from tests.helpers import write_test_volume

TOLERANCE = 1e-5
#: In this process, at fp32 (a GPU's default, auto, would run bf16: see blockpred.tuning.precision).
EXACT = dict(precision="fp32", progress=False, local=True)


def make_unet(**kwargs) -> UNet3d:
    torch.manual_seed(0)
    options = dict(in_channels=1, out_channels=2, depth=2, initial_features=4, growth=2, pool_factors=2,
                   padding="same", activation="relu", final_activation="sigmoid")
    options.update(kwargs)
    return UNet3d(**options).eval()


def reference(module, data: np.ndarray, *, halo, downsampling=(1, 1, 1), context=(0, 0, 0), mode="reflect"):
    """The network on the whole volume, padded by halo + context (and up to the downsampling), cropped."""
    if data.ndim == 3:
        data = data[None]
    x = data.astype(np.float32) / np.float32(np.iinfo(data.dtype).max if data.dtype.kind in "ui" else 1)
    halo, context, downsampling = Coord(halo), Coord(context), Coord(downsampling)
    margin = halo + context
    shape = Coord(data.shape[1:])
    total = shape + margin * 2
    if context == Coord((0, 0, 0)):
        total = total.ceil_div(downsampling) * downsampling
    extra = total - shape - margin * 2
    padded = np.pad(x, [(0, 0)] + [(m, m + e) for m, e in zip(margin, extra)], mode=mode)
    with torch.inference_mode():
        out = module(torch.from_numpy(padded)[None])[0].numpy()
    return out[(slice(None),) + tuple(slice(h, h + s) for h, s in zip(halo, shape))]


def em_like(shape, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    data = rng.normal(128, 40, size=shape)
    return np.clip(data, 0, 255).astype(np.uint8)


def assert_exact(output_path: str, expected: np.ndarray):
    out = open_volume(output_path)
    got = out.read(out.box)
    assert got.shape == expected.shape
    diff = np.abs(got.astype(np.float64) - expected).max()
    assert diff <= TOLERANCE, f"max |diff| {diff} exceeds {TOLERANCE}"


def halo_covering(module, downsampling, in_channels=1) -> Coord:
    """A halo of at least the receptive radius: measured at one pooling phase, plus one pooling step."""
    shape = Coord((64, 64, 64)).ceil_div(downsampling) * downsampling
    radius = receptive_radius(module, in_channels, shape, phases=(1, 1, 1)) + downsampling
    return radius.ceil_div(downsampling) * downsampling


@pytest.fixture(scope="module")
def unet_halo() -> Coord:
    """:func:`halo_covering` of :func:`make_unet` (the same weights in every test): measured once, in a second."""
    return halo_covering(make_unet(), Coord((4, 4, 4)))


@pytest.mark.parametrize(
    "fmt, input_path",
    [
        pytest.param("zarr2", "in.zarr/raw", id="zarr-v2"),
        pytest.param("zarr3", "in.zarr/raw", id="zarr-v3"),
        pytest.param("n5", "in.n5/raw", id="n5"),
        pytest.param("hdf5", "in.h5:/raw", id="hdf5"),
    ],
)
def test_blockwise_output_equals_whole_volume_for_every_input_format(tmp_path, fmt, input_path, unet_halo):
    data = em_like((24, 70, 50))
    path = write_test_volume(str(tmp_path / input_path), data, chunks=(8, 16, 16), zarr_format=2 if fmt == "zarr2" else 3)
    net, halo = make_unet(), unet_halo
    summary = blockpred.predict(path, model=net, block=(16, 32, 32), halo=halo, **EXACT)
    # default: a sibling dataset in the same container; for HDF5 a zarr beside the file (never written unasked)
    assert summary.output == (str(tmp_path / "in.prediction.zarr") if fmt == "hdf5"
                              else str(tmp_path / input_path.replace("raw", "prediction")))
    assert_exact(summary.output, reference(net, data, halo=halo, downsampling=(4, 4, 4)))


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [3])  # batch 1: the format tests above, on a shape no block divides either
def test_a_shape_that_divides_by_nothing_is_predicted_exactly(tmp_path, batch_size, unet_halo):
    data = em_like((37, 75, 101), seed=1)  # no axis a multiple of the block, the chunks or the downsampling
    path = write_test_volume(str(tmp_path / "odd.zarr"), data, chunks=(32, 32, 32))
    net, halo = make_unet(), unet_halo
    out = str(tmp_path / "out.zarr")
    summary = blockpred.predict(path, out, model=net, block=(32, 64, 64), halo=halo, batch_size=batch_size,
                                output_chunks=(32, 32, 32), **EXACT)
    assert summary.stats.num_blocks == 2 * 2 * 2  # batches of 3, 3 and 2
    assert_exact(out, reference(net, data, halo=halo, downsampling=(4, 4, 4)))


@pytest.mark.slow
def test_an_anisotropic_network_is_predicted_exactly(tmp_path):
    data = em_like((20, 56, 70), seed=2)
    path = write_test_volume(str(tmp_path / "aniso.zarr"), data)
    net = make_unet(pool_factors=[(1, 2, 2), (1, 3, 3)])
    downsampling = Coord((1, 6, 6))
    halo = halo_covering(net, downsampling)
    out = str(tmp_path / "out.zarr")
    summary = blockpred.predict(path, out, model=net, block=(10, 30, 36), halo=halo, **EXACT)
    assert summary.stats.num_blocks == 2 * 2 * 2
    assert_exact(out, reference(net, data, halo=halo, downsampling=downsampling))


def test_a_valid_convolution_network_is_predicted_exactly(tmp_path):
    data = em_like((30, 50, 44), seed=3)
    path = write_test_volume(str(tmp_path / "valid.zarr"), data)
    net = make_unet(padding="valid", depth=1)
    out = str(tmp_path / "out.zarr")
    summary = blockpred.predict(path, out, model=net, block=(16, 16, 16), **EXACT)
    context = summary.plan.context
    assert context != Coord((0, 0, 0)) and summary.plan.halo == Coord((0, 0, 0))
    assert_exact(out, reference(net, data, halo=(0, 0, 0), context=context))


def test_a_multichannel_volume_with_a_roi_is_predicted_exactly_inside_the_roi(tmp_path):
    data = np.stack([em_like((24, 40, 40), seed=4), em_like((24, 40, 40), seed=5)])
    path = write_test_volume(str(tmp_path / "mc.zarr"), data)
    net = make_unet(in_channels=2, depth=1)
    halo = halo_covering(net, Coord((2, 2, 2)), in_channels=2)
    out = str(tmp_path / "out.zarr")
    blockpred.predict(path, out, model=net, block=(8, 8, 8), halo=halo, roi="4:20,8:30,0:40",
                      channels="1", **EXACT)
    expected = reference(net, data, halo=halo, downsampling=(2, 2, 2))[1:2, 4:20, 8:30, 0:40]
    vol = open_volume(out)
    assert vol.shape == (1, 24, 40, 40)
    from blockpred.geometry import Box

    got = vol.read(Box(Coord((4, 8, 0)), Coord((20, 30, 40))))
    assert np.abs(got - expected).max() <= TOLERANCE
    outside = vol.read(Box(Coord((0, 0, 0)), Coord((4, 40, 40))))
    assert not outside.any(), "voxels outside the ROI must keep the fill value"
