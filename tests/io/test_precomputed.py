"""Neuroglancer precomputed specifics: path forms, axes and voxel offset, scales, what is written, the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

import blockpred
from blockpred.cli import main
from blockpred.errors import InputNotFoundError, InvalidOptionError
from blockpred.geometry import Box
from blockpred.io import create_volume, open_volume, parse_volume_path, remove_volume, volume_exists
from blockpred.pipeline.markers import markers_path
from blockpred.run.prepare import default_output_path
from tests.helpers import assert_resumed, done_blocks, write_test_volume

RESOLUTION_XYZ = (4.0, 6.0, 40.0)
OFFSET_XYZ = (3, 5, 7)
CHUNK_XYZ = (8, 8, 4)
SHAPE_ZYX = (10, 20, 18)


def write_precomputed(directory: Path, data: np.ndarray, *, scale_key: str = "4_6_40", resolution=RESOLUTION_XYZ,
                      voxel_offset=OFFSET_XYZ, chunk=CHUNK_XYZ, sharding=None, encoding="raw") -> str:
    """``data`` ((z, y, x) or (c, z, y, x)) as one scale of a precomputed volume, written by tensorstore alone."""
    czyx = data if data.ndim == 4 else data[None]
    xyzc = np.transpose(czyx, (3, 2, 1, 0))
    scale = {"key": scale_key, "size": list(xyzc.shape[:3]), "resolution": list(resolution),
             "voxel_offset": list(voxel_offset), "chunk_size": list(chunk), "encoding": encoding}
    if sharding is not None:
        scale["sharding"] = sharding
    store = ts.open({
        "driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(directory) + "/"},
        "multiscale_metadata": {"type": "image", "data_type": data.dtype.name, "num_channels": czyx.shape[0]},
        "scale_metadata": scale,
    }, create=True).result()
    store[...].write(xyzc).result()  # the domain starts at voxel_offset; [...] covers it whole
    return f"precomputed://{directory}"


def random_data(shape, dtype="uint8", seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(0, 255, shape, endpoint=True).astype(dtype)


BOXES = [Box((0, 0, 0), SHAPE_ZYX), Box((1, 3, 5), (9, 17, 13)), Box((3, 7, 5), (5, 9, 7)), Box((2, 2, 2), (2, 9, 9))]


# -- paths -----------------------------------------------------------------------------------------------------


def test_path_forms_name_the_directory_and_the_scale(tmp_path):
    write_precomputed(tmp_path / "em", random_data(SHAPE_ZYX))
    em = tmp_path / "em"
    for text, scale in [(f"precomputed://{em}", ""), (f"precomputed://{em}/info", ""), (f"{em}/info", ""),
                        (str(em), ""), (f"precomputed://{em}#scale=4_6_40", "4_6_40"), (f"{em}#scale=1", "1"),
                        ("precomputed://relative/em", "")]:
        path = parse_volume_path(text)
        assert (path.format, path.dataset) == ("precomputed", scale), text
        assert path.container == (Path("relative/em") if text.startswith("precomputed://relative") else em)
        assert parse_volume_path(str(path)) == path  # str() round trips


@pytest.mark.parametrize("text", ["precomputed://em#zoom=1", "precomputed://em#scale=", "precomputed://"])
def test_a_malformed_precomputed_path_is_refused_by_name(text):
    with pytest.raises(InvalidOptionError, match="precomputed"):
        parse_volume_path(text)


def test_a_directory_whose_info_is_not_a_multiscale_volume_is_no_precomputed_path(tmp_path):
    (tmp_path / "mesh").mkdir()
    (tmp_path / "mesh" / "info").write_text(json.dumps({"@type": "neuroglancer_legacy_mesh"}))
    with pytest.raises(InvalidOptionError, match="cannot tell the format"):
        parse_volume_path(tmp_path / "mesh")


def test_the_default_output_is_a_new_volume_beside_the_input_and_its_markers_beside_that(tmp_path):
    for text in (f"precomputed://{tmp_path}/em", f"precomputed://{tmp_path}/em#scale=1"):
        target = default_output_path(parse_volume_path(text))
        assert str(target) == f"precomputed://{tmp_path}/em.prediction"
        assert markers_path(target).parent == tmp_path / "em.prediction.blockpred"


# -- reading ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_channels", [pytest.param(None, id="zyx"), pytest.param(3, id="czyx")])
def test_a_volume_reads_as_zyx_from_its_voxel_offset_with_its_resolution_as_voxel_size(tmp_path, num_channels):
    lead = () if num_channels is None else (num_channels,)
    data = random_data(lead + SHAPE_ZYX, "uint16")
    path = write_precomputed(tmp_path / "em", data)
    with open_volume(path) as volume:
        assert volume.shape == lead + SHAPE_ZYX and volume.num_channels == num_channels
        assert volume.dtype == np.uint16
        assert volume.chunk_shape == lead + CHUNK_XYZ[::-1]
        assert volume.voxel_size == RESOLUTION_XYZ[::-1]
        assert volume.box == Box((0, 0, 0), SHAPE_ZYX)
        for box in BOXES:
            np.testing.assert_array_equal(volume.read(box), data[(...,) + box.to_slices()])


def test_a_voxel_is_where_its_x_y_z_coordinates_put_it(tmp_path):
    # value = 100 z + 10 y + x, so a swapped axis or an offset read in the wrong place shows
    z, y, x = np.meshgrid(np.arange(6), np.arange(5), np.arange(7), indexing="ij")
    data = (100 * z + 10 * y + x).astype(np.uint16)
    path = write_precomputed(tmp_path / "em", data, chunk=(4, 4, 4))
    on_disk = ts.open({"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": f"{tmp_path}/em/"}}
                      ).result()
    assert on_disk[OFFSET_XYZ[0] + 6, OFFSET_XYZ[1] + 4, OFFSET_XYZ[2] + 5, 0].read().result() == 546
    with open_volume(path) as volume:
        assert volume.read(Box((5, 4, 6), (6, 5, 7)))[0, 0, 0] == 546


def test_a_sharded_volume_reads_and_refuses_parallel_writes(tmp_path):
    data = random_data(SHAPE_ZYX)
    sharding = {"@type": "neuroglancer_uint64_sharded_v1", "hash": "identity", "preshift_bits": 1,
                "minishard_bits": 1, "shard_bits": 1, "minishard_index_encoding": "gzip", "data_encoding": "gzip"}
    path = write_precomputed(tmp_path / "em", data, sharding=sharding)
    with open_volume(path) as volume:
        assert volume.parallel_writes is False  # a shard file holds several chunks
        for box in BOXES:
            np.testing.assert_array_equal(volume.read(box), data[box.to_slices()])


def test_a_scale_is_picked_by_key_or_by_index_and_the_finest_by_default(tmp_path):
    fine, coarse = random_data(SHAPE_ZYX, seed=1), random_data((5, 10, 9), seed=2)
    write_precomputed(tmp_path / "em", fine, scale_key="fine")
    write_precomputed(tmp_path / "em", coarse, scale_key="coarse", resolution=(8.0, 12.0, 80.0), voxel_offset=(0, 0, 0))
    for text, expected, voxel in [("", fine, (40.0, 6.0, 4.0)), ("#scale=coarse", coarse, (80.0, 12.0, 8.0)),
                                  ("#scale=1", coarse, (80.0, 12.0, 8.0)), ("#scale=0", fine, (40.0, 6.0, 4.0))]:
        with open_volume(f"precomputed://{tmp_path}/em{text}") as volume:
            assert volume.voxel_size == voxel, text
            np.testing.assert_array_equal(volume.read(volume.box), expected)
    with pytest.raises(InputNotFoundError, match=r"no scale 'medium' .* it has: \['fine', 'coarse'\]"):
        open_volume(f"precomputed://{tmp_path}/em#scale=medium")
    assert volume_exists(f"precomputed://{tmp_path}/em#scale=coarse") is True
    assert volume_exists(f"precomputed://{tmp_path}/em#scale=2") is False


# -- writing ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compression, chunk_file", [("raw", "0-6_0-8_0-4"), ("gzip", "00.shard"),
                                                     ("zstd", "00.shard")])
def test_a_created_volume_round_trips_and_reads_in_tensorstore_as_x_y_z_channel(tmp_path, compression, chunk_file):
    data = random_data((2,) + SHAPE_ZYX, "float32")
    path = f"precomputed://{tmp_path}/out"
    with create_volume(path, spatial_shape=SHAPE_ZYX, num_channels=2, dtype="float32", chunk_shape=(4, 8, 6),
                       compression=compression, voxel_size=(40.0, 6.0, 4.0)) as volume:
        assert volume.parallel_writes is True and volume.async_writes is True
        for box in [Box((0, 0, 0), (4, 8, 6)), Box((4, 8, 6), (10, 20, 18)), Box((0, 8, 0), (4, 20, 6))]:
            volume.write_async(box, data[(...,) + box.to_slices()]).result()
        volume.write(Box((4, 0, 0), (10, 8, 6)), data[:, 4:, :8, :6])
    written = np.zeros_like(data)
    for box in [Box((0, 0, 0), (4, 8, 6)), Box((4, 8, 6), (10, 20, 18)), Box((0, 8, 0), (4, 20, 6)),
                Box((4, 0, 0), (10, 8, 6))]:
        written[(...,) + box.to_slices()] = data[(...,) + box.to_slices()]
    with open_volume(path) as volume:
        for box in BOXES:
            np.testing.assert_array_equal(volume.read(box), written[(...,) + box.to_slices()])
    info = json.loads((tmp_path / "out" / "info").read_text())
    scale = info["scales"][0]
    assert (info["@type"], info["type"], info["data_type"], info["num_channels"]) == (
        "neuroglancer_multiscale_volume", "image", "float32", 2)
    assert (scale["size"], scale["chunk_sizes"], scale["resolution"], scale["voxel_offset"], scale["encoding"]) == (
        [18, 20, 10], [[6, 8, 4]], [4.0, 6.0, 40.0], [0, 0, 0], "raw")
    assert ("sharding" in scale) is (compression != "raw")
    assert (tmp_path / "out" / scale["key"] / chunk_file).is_file()
    on_disk = ts.open({"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": f"{tmp_path}/out/"}}
                      ).result().read().result()
    np.testing.assert_array_equal(on_disk, np.transpose(written, (3, 2, 1, 0)))


def test_a_one_channel_volume_created_with_a_channel_axis_reopens_with_it(tmp_path):
    path = f"precomputed://{tmp_path}/out"
    create_volume(path, spatial_shape=SHAPE_ZYX, num_channels=1, dtype="uint8", chunk_shape=(4, 8, 6)).close()
    with open_volume(path, mode="r+") as volume:
        assert volume.shape == (1,) + SHAPE_ZYX
        volume.write(volume.box, np.full((1,) + SHAPE_ZYX, 9, np.uint8))
    with open_volume(path) as volume:
        assert volume.read(volume.box).min() == 9


@pytest.mark.parametrize("path, dtype, message", [
    pytest.param("out", "float16", "precomputed data types are", id="float16"),
    pytest.param("out#scale=s1", "float32", "drop '#scale=s1'", id="a-scale"),
])
def test_create_refuses_what_precomputed_cannot_hold_before_touching_the_disk(tmp_path, path, dtype, message):
    with pytest.raises(InvalidOptionError, match=message):
        create_volume(f"precomputed://{tmp_path}/{path}", spatial_shape=SHAPE_ZYX, num_channels=None, dtype=dtype,
                      chunk_shape=(4, 8, 6))
    assert not (tmp_path / "out").exists()


def test_remove_volume_refuses_a_single_scale_and_leaves_other_volumes(tmp_path):
    write_precomputed(tmp_path / "a", random_data(SHAPE_ZYX))
    write_precomputed(tmp_path / "b", random_data(SHAPE_ZYX))
    with pytest.raises(InvalidOptionError, match="removes whole volumes"):
        remove_volume(f"precomputed://{tmp_path}/a#scale=0")
    remove_volume(f"precomputed://{tmp_path}/a")
    assert not (tmp_path / "a").exists() and volume_exists(f"precomputed://{tmp_path}/b")


# -- running ---------------------------------------------------------------------------------------------------

RUN = dict(model="tiny", block=8, halo=4, batch_size=1, memory_format="contiguous", local=True, progress=False)


@pytest.fixture
def em(tmp_path):
    """The same uint8 data as a precomputed volume (offset, anisotropic) and as a zarr array."""
    data = random_data((12, 24, 20), seed=3)
    precomputed = write_precomputed(tmp_path / "em", data, chunk=(8, 8, 4))
    plain = write_test_volume(str(tmp_path / "em.zarr/raw"), data, voxel_size=RESOLUTION_XYZ[::-1])
    return precomputed, plain, data


def read_all(path: str) -> np.ndarray:
    with open_volume(path) as volume:
        return volume.read(volume.box)


def test_a_precomputed_input_predicts_what_the_same_data_in_zarr_predicts(tmp_path, em):
    precomputed, plain, _ = em
    blockpred.predict(precomputed, str(tmp_path / "from-precomputed.zarr"), **RUN)
    blockpred.predict(plain, str(tmp_path / "from-zarr.zarr"), **RUN)
    reference = read_all(str(tmp_path / "from-zarr.zarr"))
    np.testing.assert_array_equal(read_all(str(tmp_path / "from-precomputed.zarr")), reference)
    assert reference.any()
    with open_volume(str(tmp_path / "from-precomputed.zarr")) as volume:
        assert volume.voxel_size == RESOLUTION_XYZ[::-1]


def test_the_cli_runs_on_a_precomputed_path_and_on_its_info_and_writes_precomputed(tmp_path, em, capsys):
    precomputed, plain, _ = em
    options = ["--block", "8", "--halo", "4", "--batch-size", "1", "--memory-format", "contiguous", "--local",
               "--no-progress"]
    assert main(["run", plain, str(tmp_path / "reference.zarr"), *options]) == 0
    reference = read_all(str(tmp_path / "reference.zarr"))

    assert main(["run", f"{tmp_path}/em/info", str(tmp_path / "via-info.zarr"), *options]) == 0
    np.testing.assert_array_equal(read_all(str(tmp_path / "via-info.zarr")), reference)

    assert main(["run", precomputed, *options]) == 0  # the default output: a precomputed volume beside
    assert capsys.readouterr().out.strip().endswith(f"precomputed://{tmp_path}/em.prediction")
    default = f"precomputed://{tmp_path}/em.prediction"
    np.testing.assert_array_equal(read_all(default), reference)
    with open_volume(default) as volume:
        assert volume.voxel_size == RESOLUTION_XYZ[::-1] and volume.chunk_shape == (2, 8, 8, 8)
    assert (tmp_path / "em.prediction.blockpred").is_dir()
    num_blocks, written = len(done_blocks(default)), _snapshot(tmp_path / "em.prediction")
    assert num_blocks == 2 * 3 * 3
    assert main(["run", precomputed, *options]) == 0  # resumes: everything is done, nothing is written again
    assert_resumed(capsys.readouterr().out, default, reference, num_blocks=num_blocks, done_before=num_blocks)
    assert _snapshot(tmp_path / "em.prediction") == written

    raw = f"precomputed://{tmp_path}/raw-chunks"
    assert main(["run", plain, raw, "--compression", "raw", "--output-dtype", "uint8", *options]) == 0
    assert main(["run", plain, str(tmp_path / "raw-chunks.zarr"), "--output-dtype", "uint8", *options]) == 0
    np.testing.assert_array_equal(read_all(raw), read_all(str(tmp_path / "raw-chunks.zarr")))


def _snapshot(root) -> dict:
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns for d, _, files in os.walk(root) for f in files}


def test_each_bad_precomputed_path_gets_one_line_exit_2_and_writes_nothing(tmp_path, em, capsys):
    precomputed, plain, data = em
    (tmp_path / "no-info").mkdir()
    write_precomputed(tmp_path / "jpeg-float", random_data((2, 8, 8, 8), "float32"), encoding="raw")
    info = json.loads((tmp_path / "jpeg-float" / "info").read_text())
    info["scales"][0]["encoding"] = "jpeg"
    (tmp_path / "jpeg-float" / "info").write_text(json.dumps(info))
    (tmp_path / "odd-type").mkdir()
    (tmp_path / "odd-type" / "info").write_text(json.dumps({**info, "data_type": "complex64"}))
    (tmp_path / "not-json").mkdir()
    (tmp_path / "not-json" / "info").write_text("{")
    cases = [
        ([f"precomputed://{tmp_path}/missing"], "no info file"),
        ([f"precomputed://{tmp_path}/no-info"], "no info file"),
        ([f"{tmp_path}/missing/info"], "no info file"),
        ([f"precomputed://{tmp_path}/jpeg-float"], "jpeg"),
        ([f"precomputed://{tmp_path}/odd-type"], "complex64"),
        ([f"precomputed://{tmp_path}/not-json"], "must be JSON"),
        ([f"{precomputed}#scale=9"], "no scale '9'"),
        ([f"{precomputed}#level=0"], "#scale=KEY"),
        ([plain, f"precomputed://{tmp_path}/out", "--output-dtype", "float16"], "precomputed data types"),
        ([plain, f"precomputed://{tmp_path}/out#scale=s0"], "drop '#scale=s0'"),
        ([plain, f"precomputed://{tmp_path}/out", "--shards", "16"], "needs a zarr v3"),
        ([plain, f"precomputed://{tmp_path}/not-json"], "must be JSON"),  # an output over a foreign info
        ([precomputed, precomputed], "inside the input array"),
        ([f"{precomputed}#scale=0", precomputed], "contains the input"),
    ]
    for args, expected in cases:
        before = _snapshot(tmp_path)
        code = main(["run", *args, "--local", "--no-progress", "--block", "8"])
        err = capsys.readouterr().err
        assert code == 2, f"{args}: exit {code}, {err!r}"
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("blockpred: error: "), f"{args}: {err!r}"
        assert expected in lines[0], f"{args}: {lines[0]!r} lacks {expected!r}"
        assert _snapshot(tmp_path) == before, f"{args}: files changed"
        assert not (tmp_path / "out").exists() and not (tmp_path / "em.prediction").exists()
