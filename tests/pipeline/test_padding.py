import numpy as np
import pytest


def numpy_pad(data, width, mode, constant):
    extra = {"constant_values": constant} if mode == "constant" else {}
    return np.pad(data, width, mode=mode, **extra)

from hypothesis import given, settings, strategies as st

from blockpred.geometry import Box, Coord
from blockpred.io import create_volume
from blockpred.pipeline.padding import read_padded, source_indices


@pytest.mark.parametrize("mode", ["reflect", "edge", "constant"])
@given(size=st.integers(1, 9), before=st.integers(0, 30), after=st.integers(0, 30))
@settings(max_examples=60, deadline=None)
def test_source_indices_match_numpy_pad_for_any_width(mode, size, before, after):
    values = np.arange(10, 10 + size)
    expected = numpy_pad(values, (before, after), mode, -1)
    indices = source_indices(-before, size + after, size, mode)
    got = np.where(indices >= 0, values[np.maximum(indices, 0)], -1)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("mode", ["reflect", "edge", "constant"])
def test_read_padded_equals_numpy_pad_of_the_whole_volume(tmp_path, mode):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 255, size=(7, 11, 5), dtype=np.uint8)
    vol = create_volume(str(tmp_path / "v.zarr"), spatial_shape=Coord(data.shape), num_channels=None,
                        dtype=np.uint8, chunk_shape=Coord((4, 4, 4)), ome=False)
    vol.write(vol.box, data)
    pad = 13  # wider than the smallest axis
    padded = numpy_pad(data, pad, mode, 3)
    for box in [Box(Coord((-13, -2, 0)), Coord((3, 20, 18))), Box(Coord((2, 3, 1)), Coord((6, 9, 4))),
                Box(Coord((-13, -13, -13)), Coord((20, 24, 18)))]:
        got = read_padded(vol, box, mode, constant=3)
        np.testing.assert_array_equal(got, padded[box.shift(pad).to_slices()])


@pytest.fixture(scope="module")
def two_channel_volume(tmp_path_factory):
    data = np.random.default_rng(1).integers(0, 255, size=(2, 7, 11, 5), dtype=np.uint8)
    vol = create_volume(str(tmp_path_factory.mktemp("pad") / "v.zarr"), spatial_shape=Coord(data.shape[1:]),
                        num_channels=2, dtype=np.uint8, chunk_shape=Coord((4, 4, 4)), ome=False)
    vol.write(vol.box, data)
    return vol, data


@pytest.mark.parametrize("mode", ["reflect", "edge"])
@given(begin=st.tuples(*[st.integers(-20, 4)] * 3), shape=st.tuples(*[st.integers(1, 20)] * 3))
@settings(max_examples=80, deadline=None)
def test_any_padded_box_of_a_channel_volume_equals_numpy_pad_per_channel(two_channel_volume, mode, begin, shape):
    vol, data = two_channel_volume
    box = Box(Coord(begin), Coord(begin) + Coord(shape))
    pad = 24  # more than four times the smallest axis: reflections of reflections
    padded = np.stack([numpy_pad(c, pad, mode, 0) for c in data])
    got = read_padded(vol, box, mode)
    np.testing.assert_array_equal(got, padded[(slice(None),) + box.shift(pad).to_slices()])
