"""N5 specifics: the axis order on disk, metadata, and what tensorstore sees."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import tensorstore as ts

from blockpred.errors import InputNotFoundError, InvalidOptionError
from blockpred.io import create_volume, open_volume, remove_volume


def create(path, **options):
    arguments = dict(spatial_shape=(4, 4, 4), num_channels=None, dtype="uint8", chunk_shape=(4, 4, 4))
    return create_volume(path, **{**arguments, **options})


def write_n5_by_hand(container, dataset: str, data_xyz: np.ndarray, attributes: dict | None = None) -> None:
    """One N5 dataset of one block at ``0/0/0``, written without any N5 library.

    ``data_xyz`` is indexed [x, y, z].  The block is N5's binary format: a
    big-endian header (mode uint16 = 0, ndim uint16, each size uint32, x
    first), then the values big-endian with x varying fastest.
    """
    directory = container / dataset
    directory.mkdir(parents=True)
    (container / "attributes.json").write_text(json.dumps({"n5": "2.5.1"}))
    (directory / "attributes.json").write_text(
        json.dumps(
            {
                "dimensions": list(data_xyz.shape),
                "blockSize": list(data_xyz.shape),
                "dataType": data_xyz.dtype.name,
                "compression": {"type": "raw"},
                **(attributes or {}),
            }
        )
    )
    header = struct.pack(">HH", 0, data_xyz.ndim) + struct.pack(f">{data_xyz.ndim}I", *data_xyz.shape)
    values = data_xyz.astype(data_xyz.dtype.newbyteorder(">")).tobytes(order="F")  # x fastest
    (directory / "0" / "0").mkdir(parents=True)
    (directory / "0" / "0" / "0").write_bytes(header + values)


@pytest.mark.parametrize("dtype", [pytest.param("uint8", id="uint8"), pytest.param("uint16", id="uint16-big-endian")])
def test_a_hand_written_n5_dataset_reads_as_zyx(tmp_path, dtype):
    size_x, size_y, size_z = 5, 4, 3
    data_xyz = np.empty((size_x, size_y, size_z), dtype)
    for x in range(size_x):
        for y in range(size_y):
            for z in range(size_z):
                data_xyz[x, y, z] = 50 * x + 10 * y + z + (256 if dtype == "uint16" else 0)
    write_n5_by_hand(tmp_path / "vol.n5", "raw", data_xyz)

    with open_volume(f"{tmp_path}/vol.n5/raw") as volume:
        assert volume.shape == (size_z, size_y, size_x)
        assert volume.chunk_shape == (size_z, size_y, size_x)
        data = volume.read(volume.box)
    for x in range(size_x):
        for y in range(size_y):
            for z in range(size_z):
                assert data[z, y, x] == data_xyz[x, y, z]


def test_an_n5_resolution_is_read_as_xyz_and_returned_as_zyx(tmp_path):
    write_n5_by_hand(tmp_path / "vol.n5", "raw", np.zeros((2, 2, 2), np.uint8), {"resolution": [4, 5, 40]})
    with open_volume(f"{tmp_path}/vol.n5/raw") as volume:
        assert volume.voxel_size == (40.0, 5.0, 4.0)


def test_a_pixel_resolution_with_a_unit_gives_the_voxel_size(tmp_path):
    attributes = {"pixelResolution": {"dimensions": [1.0, 2.0, 3.0], "unit": "um"}}
    write_n5_by_hand(tmp_path / "vol.n5", "raw", np.zeros((2, 2, 2), np.uint8), attributes)
    with open_volume(f"{tmp_path}/vol.n5/raw") as volume:
        assert volume.voxel_size == (3.0, 2.0, 1.0)


def test_the_output_opens_with_plain_tensorstore_in_n5_axis_order(tmp_path):
    data = np.random.default_rng(0).standard_normal((2, 6, 10, 8)).astype(np.float32)
    with create(
        f"{tmp_path}/out.n5/pred", spatial_shape=(6, 10, 8), num_channels=2, dtype="float32", chunk_shape=(3, 5, 4)
    ) as volume:
        volume.write(volume.box, data)

    attributes = json.loads((tmp_path / "out.n5/pred/attributes.json").read_text())
    assert attributes["dimensions"] == [8, 10, 6, 2]
    assert attributes["blockSize"] == [4, 5, 3, 2]
    store = ts.open({"driver": "n5", "kvstore": {"driver": "file", "path": str(tmp_path / "out.n5/pred")}}).result()
    assert store.shape == (8, 10, 6, 2)
    np.testing.assert_array_equal(store.read().result(), data.transpose())


def test_a_new_container_gets_the_n5_version_attribute(tmp_path):
    create(f"{tmp_path}/out.n5/a/pred").close()
    assert json.loads((tmp_path / "out.n5/attributes.json").read_text()) == {"n5": "2.5.1"}


def test_zstd_is_written_as_blosc_with_zstd_inside(tmp_path):
    create(f"{tmp_path}/out.n5/pred").close()
    compression = json.loads((tmp_path / "out.n5/pred/attributes.json").read_text())["compression"]
    assert (compression["type"], compression["cname"]) == ("blosc", "zstd")


def test_float16_is_refused_with_the_alternatives(tmp_path):
    with pytest.raises(InvalidOptionError, match="N5 has no float16.*float32.*uint8"):
        create(f"{tmp_path}/out.n5/pred", dtype="float16")
    assert not (tmp_path / "out.n5").exists()


def test_an_output_needs_a_dataset_inside_the_container(tmp_path):
    with pytest.raises(InvalidOptionError, match="needs a dataset inside the container"):
        create(f"{tmp_path}/out.n5")


def test_a_missing_dataset_lists_nested_datasets_without_entering_them(tmp_path):
    write_n5_by_hand(tmp_path / "vol.n5", "setup0/s0", np.zeros((2, 2, 2), np.uint8))
    with pytest.raises(InputNotFoundError, match=r"no dataset 'raw' in '.*vol.n5'; it has: \['setup0/s0'\]"):
        open_volume(f"{tmp_path}/vol.n5/raw")


def test_remove_volume_refuses_a_group(tmp_path):
    write_n5_by_hand(tmp_path / "vol.n5", "setup0/s0", np.zeros((2, 2, 2), np.uint8))
    with pytest.raises(InvalidOptionError, match="is an N5 group, not a dataset"):
        remove_volume(f"{tmp_path}/vol.n5/setup0")
    assert (tmp_path / "vol.n5/setup0/s0/0/0/0").exists()
