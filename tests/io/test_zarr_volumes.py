"""zarr specifics: layout, OME-NGFF metadata, formats, and what other readers see."""

from __future__ import annotations

import json

import numpy as np
import ome_zarr_models
import ome_zarr_models.v04
import ome_zarr_models.v05
import pytest
import tensorstore as ts
import zarr

from blockpred.errors import InputNotFoundError, InvalidOptionError
from blockpred.geometry import Box
from blockpred.io import create_volume, open_volume, remove_volume, volume_exists
from tests.helpers import write_test_volume


def create(path, **options):
    arguments = dict(spatial_shape=(6, 10, 8), num_channels=2, dtype="float32", chunk_shape=(3, 5, 4))
    return create_volume(path, **{**arguments, **options})


def filled(volume) -> np.ndarray:
    data = np.random.default_rng(0).standard_normal(volume.shape).astype(volume.dtype)
    volume.write(volume.box, data)
    return data


@pytest.mark.parametrize(
    "zarr_format, ome, array_path, driver",
    [
        pytest.param(3, True, "out.zarr/pred/0", "zarr3", id="v3-ome"),
        pytest.param(3, False, "out.zarr/pred", "zarr3", id="v3-plain"),
        pytest.param(2, True, "out.zarr/pred/0", "zarr", id="v2-ome"),
        pytest.param(2, False, "out.zarr/pred", "zarr", id="v2-plain"),
    ],
)
def test_the_output_opens_with_plain_zarr_and_with_tensorstore(tmp_path, zarr_format, ome, array_path, driver):
    with create(f"{tmp_path}/out.zarr/pred", zarr_format=zarr_format, ome=ome) as volume:
        data = filled(volume)

    array = zarr.open_array(str(tmp_path / array_path), mode="r")
    assert array.metadata.zarr_format == zarr_format
    np.testing.assert_array_equal(array[...], data)

    store = ts.open({"driver": driver, "kvstore": {"driver": "file", "path": str(tmp_path / array_path)}}).result()
    np.testing.assert_array_equal(store.read().result(), data)


def test_an_ome_image_for_zarr_v3_validates_as_ome_ngff_0_5(tmp_path):
    with create(f"{tmp_path}/out.zarr/pred", voxel_size=(40.0, 4.0, 4.0)) as volume:
        filled(volume)
    group = zarr.open_group(str(tmp_path / "out.zarr/pred"), mode="r")

    image = ome_zarr_models.v05.Image.from_zarr(group)
    assert isinstance(ome_zarr_models.open_ome_zarr(group), ome_zarr_models.v05.Image)

    (multiscale,) = image.ome_attributes.multiscales
    assert [(axis.name, axis.type) for axis in multiscale.axes] == [
        ("c", "channel"),
        ("z", "space"),
        ("y", "space"),
        ("x", "space"),
    ]
    (dataset,) = multiscale.datasets
    assert dataset.path == "0"
    assert list(dataset.coordinateTransformations[0].scale) == [1.0, 40.0, 4.0, 4.0]
    assert group.attrs["ome"]["version"] == "0.5"
    assert group["0"].metadata.dimension_names == ("c", "z", "y", "x")


def test_an_ome_image_for_zarr_v2_validates_as_ome_ngff_0_4(tmp_path):
    create(f"{tmp_path}/out.zarr/pred", zarr_format=2, num_channels=None, voxel_size=(2.0, 1.0, 1.0)).close()
    group = zarr.open_group(str(tmp_path / "out.zarr/pred"), mode="r")

    image = ome_zarr_models.v04.Image.from_zarr(group)

    (multiscale,) = image.attributes.multiscales
    assert multiscale.version == "0.4"
    assert [axis.name for axis in multiscale.axes] == ["z", "y", "x"]
    assert list(multiscale.datasets[0].coordinateTransformations[0].scale) == [2.0, 1.0, 1.0]


def test_an_ome_output_at_the_container_root_puts_the_array_at_0(tmp_path):
    with create(f"{tmp_path}/out.zarr") as volume:
        data = filled(volume)
    assert zarr.open(str(tmp_path / "out.zarr"), mode="r").attrs["ome"]["multiscales"][0]["datasets"][0]["path"] == "0"
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "out.zarr/0"), mode="r")[...], data)
    ome_zarr_models.v05.Image.from_zarr(zarr.open_group(str(tmp_path / "out.zarr"), mode="r"))


def test_a_plain_output_at_the_container_root_is_a_root_array(tmp_path):
    create(f"{tmp_path}/out.zarr", ome=False).close()
    assert isinstance(zarr.open(str(tmp_path / "out.zarr"), mode="r"), zarr.Array)
    assert volume_exists(f"{tmp_path}/out.zarr")


def test_an_ome_0_4_image_written_elsewhere_opens_its_first_scale_with_its_voxel_size(tmp_path):
    root = zarr.open_group(str(tmp_path / "em.zarr"), mode="w", zarr_format=2)
    image = root.create_group("raw")
    image.create_array("s0", shape=(4, 6, 6), chunks=(2, 3, 3), dtype="uint8", fill_value=0)[...] = 7
    image.create_array("s1", shape=(2, 3, 3), chunks=(2, 3, 3), dtype="uint8", fill_value=0)
    image.attrs["multiscales"] = [
        {
            "version": "0.4",
            "axes": [{"name": n, "type": "space", "unit": "nanometer"} for n in "zyx"],
            "datasets": [
                {"path": "s0", "coordinateTransformations": [{"type": "scale", "scale": [8.0, 4.0, 4.0]}]},
                {"path": "s1", "coordinateTransformations": [{"type": "scale", "scale": [16.0, 8.0, 8.0]}]},
            ],
            "coordinateTransformations": [{"type": "scale", "scale": [1.0, 1.0, 0.5]}],
        }
    ]
    with open_volume(f"{tmp_path}/em.zarr/raw") as volume:
        assert volume.shape == (4, 6, 6)
        assert volume.voxel_size == (8.0, 4.0, 2.0)
        assert volume.read(volume.box).min() == 7


def test_an_ome_0_5_image_with_time_and_channel_axes_takes_the_spatial_scale(tmp_path):
    image = zarr.open_group(str(tmp_path / "lm.zarr"), mode="w", zarr_format=3)
    image.create_array("0", shape=(1, 2, 4, 4, 4), chunks=(1, 2, 4, 4, 4), dtype="uint16")
    image.attrs["ome"] = {
        "version": "0.5",
        "multiscales": [
            {
                "axes": [
                    {"name": "t", "type": "time"},
                    {"name": "c", "type": "channel"},
                    {"name": "z", "type": "space"},
                    {"name": "y", "type": "space"},
                    {"name": "x", "type": "space"},
                ],
                "datasets": [{"path": "0", "coordinateTransformations": [{"type": "scale", "scale": [1, 1, 3, 2, 1]}]}],
            }
        ],
    }
    with open_volume(f"{tmp_path}/lm.zarr") as volume:
        assert volume.shape == (1, 2, 4, 4, 4)
        assert volume.voxel_size == (3.0, 2.0, 1.0)


def test_a_plain_array_takes_its_voxel_size_from_the_resolution_attribute(tmp_path):
    data = np.zeros((4, 4, 4), np.uint8)
    path = write_test_volume(f"{tmp_path}/in.zarr/raw", data, zarr_format=2, voxel_size=(5, 6, 7))
    assert zarr.open_array(path, mode="r").attrs["resolution"] == [5.0, 6.0, 7.0]
    with open_volume(path) as volume:
        assert volume.voxel_size == (5.0, 6.0, 7.0)


def test_a_group_without_multiscales_is_not_a_volume_and_lists_its_arrays(tmp_path):
    write_test_volume(f"{tmp_path}/in.zarr/volumes/raw", np.zeros((4, 4, 4), np.uint8))
    write_test_volume(f"{tmp_path}/in.zarr/volumes/labels", np.zeros((4, 4, 4), np.uint8))
    with pytest.raises(
        InputNotFoundError,
        match=r"'.*in.zarr/volumes' is a zarr group without OME-NGFF multiscales metadata; "
        r"name one of its arrays: \['volumes/labels', 'volumes/raw'\]",
    ):
        open_volume(f"{tmp_path}/in.zarr/volumes")
    assert volume_exists(f"{tmp_path}/in.zarr/volumes") is False


def test_a_missing_dataset_lists_ome_images_by_their_group_path(tmp_path):
    create(f"{tmp_path}/out.zarr/pred").close()
    write_test_volume(f"{tmp_path}/out.zarr/inputs/raw", np.zeros((4, 4, 4), np.uint8))
    with pytest.raises(InputNotFoundError, match=r"no dataset 'nope' in .*; it has: \['inputs/raw', 'pred'\]"):
        open_volume(f"{tmp_path}/out.zarr/nope")


def test_a_directory_without_zarr_metadata_is_no_container(tmp_path):
    (tmp_path / "empty.zarr").mkdir()
    with pytest.raises(InputNotFoundError, match="no zarr container at '.*empty.zarr'"):
        open_volume(f"{tmp_path}/empty.zarr")


def test_a_new_dataset_takes_the_format_of_its_existing_container(tmp_path):
    write_test_volume(f"{tmp_path}/in.zarr/raw", np.zeros((4, 4, 4), np.uint8), zarr_format=2)
    with create(f"{tmp_path}/in.zarr/pred") as volume:
        assert volume.zarr_format == 2
    assert "multiscales" in zarr.open_group(str(tmp_path / "in.zarr/pred"), mode="r").attrs


def test_a_new_container_is_zarr_format_3_by_default(tmp_path):
    with create(f"{tmp_path}/out.zarr/pred") as volume:
        assert volume.zarr_format == 3


def test_a_zarr_format_that_contradicts_the_container_is_refused(tmp_path):
    write_test_volume(f"{tmp_path}/in.zarr/raw", np.zeros((4, 4, 4), np.uint8), zarr_format=3)
    with pytest.raises(InvalidOptionError, match="'.*in.zarr' is zarr format 3, got zarr_format=2"):
        create(f"{tmp_path}/in.zarr/pred", zarr_format=2)


def test_a_dataset_cannot_be_created_inside_a_root_array(tmp_path):
    write_test_volume(f"{tmp_path}/in.zarr", np.zeros((4, 4, 4), np.uint8))
    with pytest.raises(InvalidOptionError, match="is an array"):
        create(f"{tmp_path}/in.zarr/pred")


@pytest.mark.parametrize(
    "compression, v3_codec, v2_id",
    [
        pytest.param("zstd", "zstd", "zstd", id="zstd"),
        pytest.param("gzip", "gzip", "gzip", id="gzip"),
        pytest.param("blosc", "blosc", "blosc", id="blosc"),
        pytest.param(None, None, None, id="raw"),
    ],
)
def test_compression_names_map_to_the_zarr_codecs(tmp_path, compression, v3_codec, v2_id):
    create(f"{tmp_path}/v3.zarr", ome=False, compression=compression).close()
    codecs = json.loads((tmp_path / "v3.zarr/zarr.json").read_text())["codecs"]
    assert [c["name"] for c in codecs] == ["bytes"] + ([v3_codec] if v3_codec else [])

    create(f"{tmp_path}/v2.zarr", ome=False, compression=compression, zarr_format=2).close()
    compressor = json.loads((tmp_path / "v2.zarr/.zarray").read_text())["compressor"]
    assert (compressor or {}).get("id") == v2_id


def test_remove_volume_removes_an_ome_group_and_keeps_its_siblings(tmp_path):
    create(f"{tmp_path}/out.zarr/pred").close()
    write_test_volume(f"{tmp_path}/out.zarr/raw", np.ones((4, 4, 4), np.uint8))
    remove_volume(f"{tmp_path}/out.zarr/pred")
    assert not (tmp_path / "out.zarr/pred").exists()
    assert sorted(zarr.open_group(str(tmp_path / "out.zarr"), mode="r").keys()) == ["raw"]


def test_remove_volume_refuses_a_plain_group_holding_arrays(tmp_path):
    write_test_volume(f"{tmp_path}/in.zarr/volumes/raw", np.ones((4, 4, 4), np.uint8))
    with pytest.raises(InvalidOptionError, match=r"zarr group holding \['volumes/raw'\]"):
        remove_volume(f"{tmp_path}/in.zarr/volumes")
    assert volume_exists(f"{tmp_path}/in.zarr/volumes/raw")


def test_creating_over_a_plain_group_with_overwrite_still_refuses_to_remove_its_arrays(tmp_path):
    write_test_volume(f"{tmp_path}/in.zarr/volumes/raw", np.ones((4, 4, 4), np.uint8))
    with pytest.raises(InvalidOptionError, match="zarr group holding"):
        create(f"{tmp_path}/in.zarr/volumes", overwrite=True)
    assert volume_exists(f"{tmp_path}/in.zarr/volumes/raw")


def test_the_chunk_shape_of_a_sharded_array_is_its_shard_shape(tmp_path):
    zarr.create_array(str(tmp_path / "s.zarr"), shape=(8, 8, 8), chunks=(2, 2, 2), shards=(4, 8, 8), dtype="uint8")
    with open_volume(tmp_path / "s.zarr", mode="r+") as volume:
        assert volume.chunk_shape == (4, 8, 8)
        volume.write(Box((4, 0, 0), (8, 8, 8)), np.full((4, 8, 8), 9, np.uint8))
        assert volume.read(volume.box)[4:].min() == 9
