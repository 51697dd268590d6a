"""Path parsing and the input checks, independent of any backend."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from blockpred.errors import InvalidOptionError, InvalidVolumeError
from blockpred.io import VolumePath, check_input_volume, open_volume, parse_volume_path
from tests.helpers import write_test_volume


@pytest.mark.parametrize(
    "text, expected",
    [
        pytest.param("vol.zarr", VolumePath("zarr", Path("vol.zarr"), ""), id="zarr-root"),
        pytest.param("/data/vol.zarr/", VolumePath("zarr", Path("/data/vol.zarr"), ""), id="zarr-root-trailing-slash"),
        pytest.param("/d/vol.zarr/a/b/raw", VolumePath("zarr", Path("/d/vol.zarr"), "a/b/raw"), id="zarr-nested"),
        pytest.param("vol.n5/setup0/raw", VolumePath("n5", Path("vol.n5"), "setup0/raw"), id="n5"),
        pytest.param("/d/f.h5:/volumes/raw", VolumePath("hdf5", Path("/d/f.h5"), "volumes/raw"), id="h5-colon"),
        pytest.param("f.hdf5:raw", VolumePath("hdf5", Path("f.hdf5"), "raw"), id="hdf5-colon-no-slash"),
        pytest.param("f.HDF/raw", VolumePath("hdf5", Path("f.HDF"), "raw"), id="hdf-slash-any-case"),
        pytest.param("/d/f.h5", VolumePath("hdf5", Path("/d/f.h5"), ""), id="h5-without-dataset"),
    ],
)
def test_parse_volume_path_splits_format_container_and_dataset(text, expected):
    assert parse_volume_path(text) == expected


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(VolumePath("zarr", Path("/d/vol.zarr"), "a/raw"), id="zarr"),
        pytest.param(VolumePath("n5", Path("/d/vol.n5"), "raw"), id="n5"),
        pytest.param(VolumePath("hdf5", Path("/d/f.h5"), "a/raw"), id="hdf5"),
    ],
)
def test_a_volume_path_prints_as_the_text_it_parses_from(path):
    assert parse_volume_path(str(path)) == path


def test_a_sibling_lives_in_the_same_group():
    assert parse_volume_path("f.h5:/a/raw").sibling("pred") == VolumePath("hdf5", Path("f.h5"), "a/pred")
    assert parse_volume_path("v.zarr/raw").sibling("pred") == VolumePath("zarr", Path("v.zarr"), "pred")


def test_an_unknown_format_is_refused_with_the_formats_it_could_be(tmp_path):
    with pytest.raises(InvalidOptionError, match=r"cannot tell the format of .*zarr.*N5.*HDF5"):
        parse_volume_path(tmp_path / "volume.xyz")


def test_a_zarr_container_without_a_suffix_is_recognised_by_its_metadata(tmp_path):
    zarr.create_array(str(tmp_path / "plain"), shape=(2, 2, 2), dtype="uint8")
    assert parse_volume_path(tmp_path / "plain") == VolumePath("zarr", tmp_path / "plain", "")


def test_open_volume_refuses_an_unknown_mode(tmp_path):
    with pytest.raises(InvalidOptionError, match="mode must be 'r' or 'r\\+'"):
        open_volume(f"{tmp_path}/v.zarr", mode="w")


@pytest.mark.parametrize("dtype", ["uint8", "int16", "float16", "float64"])
def test_check_input_volume_accepts_supported_3d_and_4d_volumes(tmp_path, dtype):
    for shape in [(4, 4, 4), (2, 4, 4, 4)]:
        path = write_test_volume(f"{tmp_path}/{len(shape)}d.zarr", np.zeros(shape, dtype))
        with open_volume(path) as volume:
            check_input_volume(volume)


def test_check_input_volume_refuses_a_volume_with_five_axes(tmp_path):
    path = write_test_volume(f"{tmp_path}/five.zarr", np.zeros((1, 1, 4, 4, 4), np.uint8))
    with open_volume(path) as volume:
        with pytest.raises(InvalidVolumeError, match=r"5 axes .*needs \(y, x\), \(z, y, x\) or \(c, z, y, x\)"):
            check_input_volume(volume)


@pytest.mark.parametrize("shape, hint", [
    ((1, 1, 4, 4, 4), "axes 0, 1 have size 1; save the array without them, as (z, y, x)"),
    ((2, 1, 4, 4, 4), "axis 1 has size 1; save the array without it, as (c, z, y, x)"),
    ((1, 1, 1, 4, 4), "axes 0, 1, 2 have size 1; save the array without 2 of them, as (z, y, x)"),
    ((2, 3, 4, 4, 4), None),
])
def test_singleton_axes_beyond_four_are_named(tmp_path, shape, hint):
    path = write_test_volume(f"{tmp_path}/five.zarr", np.zeros(shape, np.uint8))
    with open_volume(path) as volume:
        with pytest.raises(InvalidVolumeError) as info:
            check_input_volume(volume)
    assert (hint in str(info.value)) if hint else "size 1" not in str(info.value)


@pytest.mark.parametrize("shape", [(0, 4, 4), (4, 4, 0), (0, 4, 4, 4)])
def test_an_empty_axis_is_refused_as_nothing_to_predict(tmp_path, shape):
    zarr.create_array(f"{tmp_path}/e.zarr", shape=shape, chunks=(1,) * len(shape), dtype="uint8")
    with open_volume(f"{tmp_path}/e.zarr") as volume:
        with pytest.raises(InvalidVolumeError, match=r"has shape \(.*\): an empty axis; there is nothing to predict"):
            check_input_volume(volume)


@pytest.mark.parametrize("text, part", [
    pytest.param("g.zarr/x/../raw", "'..'", id="zarr-dot-dot"),
    pytest.param("g.n5/../raw", "'..'", id="n5-dot-dot"),
    pytest.param("f.h5:/a/../raw", "'..'", id="hdf5-dot-dot"),
    pytest.param("f.h5:/a/./raw", "'.'", id="hdf5-dot"),
    pytest.param("f.h5:/a//raw", "empty part", id="hdf5-empty"),
    pytest.param("s3://bucket/g.zarr/x/../raw", "'..'", id="s3-dot-dot"),
])
def test_dot_parts_in_a_dataset_path_are_refused(text, part):
    with pytest.raises(InvalidOptionError, match=f"has (a|an) {part}.*without '.', '..' or empty parts"):
        parse_volume_path(text)


def test_dot_dot_before_the_container_is_an_ordinary_file_system_path():
    assert parse_volume_path("../data/g.zarr/raw") == VolumePath("zarr", Path("../data/g.zarr"), "raw")


def test_check_input_volume_refuses_an_unsupported_dtype(tmp_path):
    path = write_test_volume(f"{tmp_path}/v.zarr", np.zeros((4, 4, 4), np.int64))
    with open_volume(path) as volume:
        with pytest.raises(InvalidVolumeError, match="dtype int64; supported input dtypes: uint8"):
            check_input_volume(volume)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("in.zarr/raw", id="zarr"),
        pytest.param("in.n5/raw", id="n5"),
        pytest.param("in.h5:/raw", id="hdf5"),
    ],
)
def test_write_test_volume_writes_a_plain_volume_for_every_format(tmp_path, name):
    data = np.arange(2 * 5 * 6 * 7, dtype=np.uint16).reshape(2, 5, 6, 7)
    path = write_test_volume(f"{tmp_path}/{name}", data, chunks=(2, 3, 4))
    with open_volume(path) as volume:
        assert volume.chunk_shape == (2, 2, 3, 4)
        np.testing.assert_array_equal(volume.read(volume.box), data)
