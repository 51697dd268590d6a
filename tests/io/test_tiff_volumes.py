"""TIFF inputs (multi-page TIFF, OME-TIFF, folders of TIFF or PNG slices) on a crop of real FIB-SEM data.

Each kind reads any box exactly as the numpy crop, touches only the pages or
files of the box's z range, says in one line what is wrong with a bad folder
or file, is never written, and predicts bitwise the output of the same crop
read from zarr.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import imagecodecs
import numpy as np
import pytest
import tifffile

import blockpred
from blockpred.cli import main
from blockpred.errors import InputNotFoundError, InvalidOptionError, InvalidVolumeError
from blockpred.geometry import Box
from blockpred.io import (
    VolumePath,
    create_volume,
    move_aside,
    moved_aside,
    open_volume,
    parse_volume_path,
    remove_volume,
    volume_exists,
)
from blockpred.run.prepare import check_output_path
from tests.ci import needs
from tests.helpers import REALDATA, write_test_volume

#: The real FIB-SEM volume (uint8 250^3), in ../shared/realdata beside the checkout (see its README).
FIBSEM = REALDATA / "fibsem_neuroproof" / "training_sample2_raw_250cube.npz"

pytestmark = needs(FIBSEM.exists(), "../shared/realdata beside the checkout")
#: z, y, x of the crop every test uses: 16 slices, so a folder has slice_2 and slice_10 (natural order matters).
CROP = (slice(100, 116), slice(40, 104), slice(120, 184))
READ_ONLY = "TIFF inputs are read-only; write the output to a .zarr, .n5 or .h5 path"
#: The same prediction for every input: small blocks, fp32, one memory format (none measured), in this process.
PREDICT = dict(model="tiny", block=(16, 32, 32), halo=(10, 10, 10), batch_size=2, precision="fp32", device="cpu",
               memory_format="contiguous", progress=False, local=True)
BOXES = [
    pytest.param(Box((0, 0, 0), (16, 64, 64)), id="whole"),
    pytest.param(Box((7, 0, 0), (8, 64, 64)), id="one-plane"),
    pytest.param(Box((2, 5, 9), (11, 61, 33)), id="inner"),
    pytest.param(Box((9, 63, 0), (16, 64, 1)), id="edge"),
]


def _slices(folder: Path, data: np.ndarray, suffix: str, name: str = "slice_{}") -> Path:
    folder.mkdir()
    for z, plane in enumerate(data):
        path = folder / (name.format(z) + suffix)
        if suffix == ".png":
            path.write_bytes(imagecodecs.png_encode(plane))
        else:
            tifffile.imwrite(path, plane)
    return folder


@pytest.fixture(scope="module")
def crop() -> np.ndarray:
    with np.load(FIBSEM) as npz:
        return np.ascontiguousarray(npz["raw"][CROP])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, crop) -> dict[str, Path]:
    """Every kind of TIFF input holding ``crop``, and the zarr input that holds it too."""
    root = tmp_path_factory.mktemp("tiff")
    tifffile.imwrite(root / "stack.tif", crop)
    tifffile.imwrite(root / "stack.ome.tif", crop, ome=True,
                     metadata={"axes": "ZYX", "PhysicalSizeZ": 0.01, "PhysicalSizeY": 0.01, "PhysicalSizeX": 0.01})
    tifffile.imwrite(root / "tiled.tif", crop, tile=(32, 32), compression="zlib")
    return {
        "multipage": root / "stack.tif",
        "ome": root / "stack.ome.tif",
        "tiled": root / "tiled.tif",
        "tif-slices": _slices(root / "slices", crop, ".tif"),
        "png-slices": _slices(root / "pngs", crop, ".png", name="em{}"),
        "zarr": Path(write_test_volume(str(root / "ref.zarr/raw"), crop, chunks=(8, 32, 32))),
    }


KINDS = ["multipage", "ome", "tiled", "tif-slices", "png-slices"]


def _all(volume) -> np.ndarray:
    return volume.read(volume.box)


# ---------------------------------------------------------------------------------------------------- paths


@pytest.mark.parametrize("name", ["a.tif", "a.TIFF", "a.ome.tif", "d/a.ome.tiff"])
def test_a_path_ending_in_tif_or_tiff_is_a_tiff(name):
    assert parse_volume_path(name) == VolumePath("tiff", Path(name), "")


def test_a_directory_of_slices_is_a_tiff_and_a_tif_inside_a_zarr_stays_zarr(inputs):
    assert parse_volume_path(str(inputs["png-slices"])) == VolumePath("tiff", inputs["png-slices"], "")
    assert parse_volume_path("v.zarr/raw.tif").format == "zarr"


def test_an_empty_directory_and_a_tif_on_an_object_store_are_refused_by_name(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidOptionError, match="a directory holding no .tif, .tiff or .png slices"):
        parse_volume_path(str(tmp_path / "empty"))
    with pytest.raises(InvalidOptionError, match="TIFF is read as a local file"):
        parse_volume_path("s3://bucket/stack.tif")


# ---------------------------------------------------------------------------------------------------- reads


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("box", BOXES)
def test_every_kind_reads_any_box_exactly_as_the_crop(inputs, crop, kind, box):
    with open_volume(inputs[kind]) as volume:
        assert (volume.shape, volume.dtype, volume.num_channels) == (crop.shape, np.uint8, None)
        got = volume.read(box)
    assert got.dtype == np.uint8 and np.array_equal(got, crop[box.to_slices()])


def test_slices_are_in_natural_order_of_their_names_and_hidden_or_other_files_are_not_slices(tmp_path, inputs, crop):
    folder = tmp_path / "slices"
    shutil.copytree(inputs["tif-slices"], folder)
    (folder / "._slice_1.tif").write_bytes(b"macOS metadata, not a TIFF")
    (folder / "notes.txt").write_text("acquired 2019")
    volume = open_volume(folder)
    assert volume.shape == (16, 64, 64)
    for z in (1, 2, 10, 11):  # slice_2 before slice_10 (in text order slice_10 would be z=2)
        assert np.array_equal(volume.read(Box((z, 0, 0), (z + 1, 64, 64))), crop[z:z + 1]), z


@pytest.mark.parametrize("kind, chunk_shape", [("multipage", (1, 64, 64)), ("tiled", (1, 32, 32)),
                                               ("tif-slices", (1, 64, 64)), ("png-slices", (1, 64, 64))])
def test_the_chunk_is_one_plane_or_one_tile(inputs, kind, chunk_shape):
    assert open_volume(inputs[kind]).chunk_shape == chunk_shape


def test_the_channels_of_an_ome_tiff_czyx_or_zcyx_are_presented_as_czyx(tmp_path, crop):
    two = np.stack([crop, 255 - crop])
    tifffile.imwrite(tmp_path / "czyx.ome.tif", two, ome=True, metadata={"axes": "CZYX"})
    tifffile.imwrite(tmp_path / "zcyx.ome.tif", np.moveaxis(two, 0, 1).copy(), ome=True, metadata={"axes": "ZCYX"})
    box = Box((3, 10, 20), (9, 50, 60))
    for name in ("czyx.ome.tif", "zcyx.ome.tif"):
        volume = open_volume(tmp_path / name)
        assert volume.shape == (2, 16, 64, 64) and volume.num_channels == 2
        assert np.array_equal(volume.read(box), two[(slice(None),) + box.to_slices()]), name


def test_an_ome_tiff_voxel_size_is_its_physical_size_in_zyx(tmp_path, crop):
    tifffile.imwrite(tmp_path / "v.ome.tif", crop, ome=True,
                     metadata={"axes": "ZYX", "PhysicalSizeZ": 0.03, "PhysicalSizeY": 0.02, "PhysicalSizeX": 0.01})
    assert open_volume(tmp_path / "v.ome.tif").voxel_size == (0.03, 0.02, 0.01)


def test_a_2d_tiff_opens_one_plane_deep(tmp_path, crop):
    tifffile.imwrite(tmp_path / "plane.tif", crop[5])
    volume = open_volume(tmp_path / "plane.tif")
    assert volume.shape == (1, 64, 64)
    assert np.array_equal(volume.read(Box((0, 3, 4), (1, 30, 40))), crop[5:6, 3:30, 4:40])


@pytest.mark.parametrize("data, axes, message", [
    pytest.param("tzyx", "TZYX", "has axes TZYX of shape (2, 16, 64, 64): a time axis", id="time"),
    pytest.param("rgb", None, "has axes YXS of shape (64, 64, 3): RGB samples", id="rgb"),
])
def test_a_time_axis_or_rgb_samples_are_refused_in_one_line(tmp_path, crop, data, axes, message):
    path = tmp_path / "bad.ome.tif"
    if data == "tzyx":
        tifffile.imwrite(path, np.stack([crop, crop]), ome=True, metadata={"axes": axes})
    else:
        tifffile.imwrite(path, np.stack([crop[0]] * 3, axis=-1), photometric="rgb")
    with pytest.raises(InvalidVolumeError, match=re.escape(message)) as refused:
        open_volume(path)
    assert "\n" not in str(refused.value)


def test_a_volume_survives_pickling(inputs, crop):
    import pickle

    for kind in ("ome", "tif-slices"):
        assert np.array_equal(_all(pickle.loads(pickle.dumps(open_volume(inputs[kind])))), crop)


# ------------------------------------------------------------------------------------------------- laziness


def test_reading_a_plane_of_a_folder_opens_only_its_file(tmp_path, inputs, crop):
    folder = tmp_path / "slices"
    shutil.copytree(inputs["tif-slices"], folder)
    volume = open_volume(folder)
    for z in range(16):  # every file but slice_7's is gone: the read of z=7 cannot have opened any of them
        if z != 7:
            os.remove(folder / f"slice_{z}.tif")
    assert np.array_equal(volume.read(Box((7, 0, 0), (8, 64, 64))), crop[7:8])
    with pytest.raises(InputNotFoundError, match=r"slice z=8 \(slice_8.tif\) of .* is gone"):
        volume.read(Box((7, 0, 0), (9, 64, 64)))


def test_reading_a_box_of_a_multipage_tiff_decodes_only_its_pages(tmp_path, crop):
    path = tmp_path / "zlib.tif"
    tifffile.imwrite(path, crop, compression="zlib")
    with tifffile.TiffFile(path) as tif:
        offset, count = tif.pages[10].dataoffsets[0], tif.pages[10].databytecounts[0]
    volume = open_volume(path)
    with open(path, "r+b") as stream:  # page 10's compressed data no longer decodes
        stream.seek(offset)
        stream.write(b"\xff" * count)
    assert np.array_equal(volume.read(Box((0, 0, 0), (10, 64, 64))), crop[:10])
    assert np.array_equal(volume.read(Box((11, 0, 0), (16, 64, 64))), crop[11:])
    with pytest.raises(InvalidVolumeError, match=r"pages z=9..10 of .*zlib.tif' cannot be read .*corrupt"):
        volume.read(Box((9, 0, 0), (11, 64, 64)))


# --------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("suffix", [".tif", ".png"])
def test_a_slice_of_another_shape_is_refused_at_open_from_the_headers_alone(tmp_path, crop, suffix, monkeypatch):
    folder = _slices(tmp_path / "mixed", crop, suffix)
    odd = crop[5, :60, :50].copy()
    if suffix == ".png":
        (folder / "slice_5.png").write_bytes(imagecodecs.png_encode(odd))
    else:
        tifffile.imwrite(folder / "slice_5.tif", odd)

    def no_decoding(*args, **kwargs):
        raise AssertionError("open decoded a slice")

    monkeypatch.setattr(tifffile.TiffPage, "asarray", no_decoding)
    monkeypatch.setattr(imagecodecs, "png_decode", no_decoding)
    with pytest.raises(InvalidVolumeError) as refused:
        open_volume(folder)
    assert str(refused.value) == (
        f"slice z=5 (slice_5{suffix}) is 60x50, the first (slice_0{suffix}) is 64x64: every slice of a folder must "
        f"have one shape and dtype; fix or remove that slice in {str(folder)!r}")


def test_a_slice_of_another_dtype_is_refused_at_open(tmp_path, crop):
    folder = _slices(tmp_path / "mixed", crop, ".tif")
    tifffile.imwrite(folder / "slice_12.tif", crop[12].astype(np.uint16))
    with pytest.raises(InvalidVolumeError, match=r"^slice z=12 \(slice_12.tif\) is uint16, the first \(slice_0.tif\) "
                                                 r"is uint8: every slice of a folder must have one shape and dtype"):
        open_volume(folder)


def test_a_corrupt_slice_is_named_at_open_or_at_the_read_that_decodes_it(tmp_path, crop):
    folder = _slices(tmp_path / "tifs", crop, ".tif")
    (folder / "slice_3.tif").write_bytes(b"not a tiff at all")
    with pytest.raises(InvalidVolumeError, match=r"^slice z=3 \(slice_3.tif\) of .* cannot be read .*corrupt"):
        open_volume(folder)
    pngs = _slices(tmp_path / "pngs", crop, ".png")
    whole = (pngs / "slice_3.png").read_bytes()
    (pngs / "slice_3.png").write_bytes(whole[:60])  # the header is whole, the image data is cut off
    volume = open_volume(pngs)
    assert np.array_equal(volume.read(Box((0, 0, 0), (3, 64, 64))), crop[:3])
    with pytest.raises(InvalidVolumeError, match=r"^slice z=3 \(slice_3.png\) of .* cannot be decoded .*corrupt"):
        volume.read(Box((2, 0, 0), (4, 64, 64)))


def test_an_empty_folder_a_missing_file_and_a_mixed_folder_are_refused_in_one_line(tmp_path, crop):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputNotFoundError, match="^no slices in .*empty': a folder of slices holds one .tif"):
        open_volume(VolumePath("tiff", tmp_path / "empty"))
    with pytest.raises(InputNotFoundError, match="^no TIFF file or folder of slices at .*missing.tif'; check the"):
        open_volume(tmp_path / "missing.tif")
    mixed = _slices(tmp_path / "mixed", crop[:3], ".tif")
    (mixed / "slice_3.png").write_bytes(imagecodecs.png_encode(crop[3]))
    with pytest.raises(InvalidVolumeError, match="holds 3 TIFF and 1 PNG files: a folder of slices holds one kind"):
        open_volume(mixed)
    (tmp_path / "junk.tif").write_bytes(b"\0" * 64)
    with pytest.raises(InvalidVolumeError, match=r"^'.*junk.tif' is not a TIFF file tifffile can read"):
        open_volume(tmp_path / "junk.tif")


# --------------------------------------------------------------------------------------------------- writes


def test_a_tiff_is_never_written_created_removed_or_moved(tmp_path, inputs):
    path = tmp_path / "stack.tif"
    shutil.copy(inputs["multipage"], path)
    before = path.read_bytes()
    volume = open_volume(path)
    for attempt in (lambda: open_volume(path, mode="r+"), lambda: volume.write(volume.box, _all(volume)),
                    lambda: volume.write_async(volume.box, _all(volume)), lambda: remove_volume(path),
                    lambda: move_aside(path),
                    lambda: create_volume(path, spatial_shape=(4, 4, 4), num_channels=None, dtype="uint8",
                                          chunk_shape=(4, 4, 4), overwrite=True)):
        with pytest.raises(InvalidOptionError, match=f"^cannot write '.*stack.tif': {READ_ONLY}$"):
            attempt()
    assert path.read_bytes() == before and moved_aside(path) == []
    assert volume_exists(path) and volume_exists(inputs["png-slices"]) and not volume_exists(tmp_path / "no.tif")


def test_a_tiff_reached_through_a_symlink_is_the_input_and_never_an_output(tmp_path, inputs):
    # Links named like a writable output (a zarr) that reach the TIFF input: refused as the input itself.
    os.symlink(inputs["multipage"], tmp_path / "link.zarr")
    os.symlink(inputs["tif-slices"], tmp_path / "slices.zarr")
    for source, target in (("multipage", "link.zarr"), ("tif-slices", "slices.zarr")):
        with pytest.raises(InvalidOptionError, match=r"(is inside|contains) the input .* \(both names reach"):
            check_output_path(parse_volume_path(str(inputs[source])), parse_volume_path(str(tmp_path / target)))
    # A TIFF name is never an output, linked or not.
    os.symlink(inputs["multipage"], tmp_path / "link.tif")
    with pytest.raises(InvalidOptionError, match=READ_ONLY):
        check_output_path(parse_volume_path(str(inputs["multipage"])), parse_volume_path(str(tmp_path / "link.tif")))
    with pytest.raises(InvalidOptionError, match=READ_ONLY):
        blockpred.predict(str(inputs["zarr"]), str(tmp_path / "out.tif"), **PREDICT)
    assert not (tmp_path / "out.tif").exists() and not (tmp_path / "out.tif.blockpred").exists()


# --------------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def reference(tmp_path_factory, inputs) -> np.ndarray:
    """The prediction of the crop read from zarr."""
    target = tmp_path_factory.mktemp("reference") / "out.zarr"
    blockpred.predict(str(inputs["zarr"]), str(target), **PREDICT)
    return _all(open_volume(target))


@pytest.mark.parametrize("kind", KINDS)
def test_predicting_from_every_kind_is_bitwise_the_prediction_from_zarr(tmp_path, inputs, reference, kind):
    target = tmp_path / "out.zarr"
    blockpred.predict(str(inputs[kind]), str(target), **PREDICT)
    assert np.array_equal(_all(open_volume(target)), reference)


def test_blockpred_run_on_a_folder_of_slices_is_bitwise_the_run_on_zarr(tmp_path, inputs, reference):
    target = tmp_path / "out.zarr"
    assert main(["run", str(inputs["png-slices"]), str(target), "--model", "tiny", "--block", "16,32,32",
                 "--halo", "10,10,10", "--batch-size", "2", "--precision", "fp32", "--memory-format", "contiguous",
                 "--device", "cpu", "--local", "--no-progress"]) == 0
    assert np.array_equal(_all(open_volume(target)), reference)


def test_a_tiff_input_writes_by_default_to_a_zarr_beside_it(inputs):
    from blockpred.run.prepare import default_output_path

    for source in ("multipage", "ome", "tif-slices"):
        target = default_output_path(parse_volume_path(str(inputs[source])))
        assert target.format == "zarr" and target.container.parent == Path(inputs[source]).parent
        assert target.container.name.endswith(".prediction.zarr") and ".tif" not in target.container.name
