"""What blockpred writes through tensorstore is what zarr-python (or N5's own byte format) reads, and back."""

import struct
import subprocess
import sys

import numcodecs
import numpy as np
import pytest
import zarr

from blockpred.geometry import Box
from blockpred.io import create_volume, open_volume
from tests.helpers import child_env

SHAPE = (3, 20, 33, 27)  # (c, z, y, x); no chunk divides y or x
CHUNKS = (8, 16, 16)


def _data(seed=0):
    return np.random.default_rng(seed).integers(0, 255, SHAPE, dtype=np.uint8)


def _write_in_blocks(volume, data):
    """Chunk-aligned boxes as blocks write them, the last ones clipped at the volume's edge."""
    for z in range(0, SHAPE[1], 8):
        for y in range(0, SHAPE[2], 16):
            for x in range(0, SHAPE[3], 16):
                box = Box((z, y, x), (min(z + 8, SHAPE[1]), min(y + 16, SHAPE[2]), min(x + 16, SHAPE[3])))
                volume.write_async(box, data[(slice(None),) + box.to_slices()]).result()


@pytest.mark.parametrize("options, array_path", [
    pytest.param({"zarr_format": 2, "ome": False}, "out", id="zarr-v2"),
    pytest.param({"zarr_format": 3, "ome": False}, "out", id="zarr-v3"),
    pytest.param({"zarr_format": 3, "ome": True}, "out/0", id="zarr-v3-ome"),
    pytest.param({"zarr_format": 3, "ome": True, "shard_shape": (8, 32, 32)}, "out/0", id="zarr-v3-sharded"),
])
def test_zarr_written_through_tensorstore_reads_the_same_in_zarr_python(tmp_path, options, array_path):
    data = _data()
    with create_volume(str(tmp_path / "c.zarr/out"), spatial_shape=SHAPE[1:], num_channels=3, dtype="uint8",
                       chunk_shape=CHUNKS, **options) as volume:
        assert volume.async_writes  # the tensorstore path, not zarr-python's
        _write_in_blocks(volume, data)
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "c.zarr" / array_path), mode="r")[...], data)


@pytest.mark.parametrize("zarr_format, compressor", [
    pytest.param(2, numcodecs.Zstd(level=3), id="zarr-v2-zstd"),
    pytest.param(2, numcodecs.Blosc(cname="lz4"), id="zarr-v2-blosc"),
    pytest.param(3, "auto", id="zarr-v3-default-codecs"),
])
def test_zarr_written_by_zarr_python_reads_the_same_through_tensorstore(tmp_path, zarr_format, compressor):
    data = _data(1)
    array = zarr.create_array(str(tmp_path / "in.zarr"), shape=SHAPE, chunks=(3,) + CHUNKS, dtype="uint8",
                              zarr_format=zarr_format, compressors=compressor)
    array[...] = data
    with open_volume(str(tmp_path / "in.zarr")) as volume:
        assert volume.async_writes  # opened through tensorstore
        np.testing.assert_array_equal(volume.read(volume.box), data)
        np.testing.assert_array_equal(volume.read(Box((3, 5, 7), (19, 30, 26))), data[:, 3:19, 5:30, 7:26])


def test_an_array_tensorstore_cannot_open_is_read_and_written_through_zarr_python(tmp_path):
    """A zarr v2 filter tensorstore lacks (delta): slower, but the same values."""
    data = _data(2)
    array = zarr.create_array(str(tmp_path / "delta.zarr"), shape=SHAPE, chunks=(3,) + CHUNKS, dtype="uint8",
                              zarr_format=2, filters=[numcodecs.Delta(dtype="uint8")], compressors=None)
    array[...] = data
    with open_volume(str(tmp_path / "delta.zarr"), mode="r+") as volume:
        assert not volume.async_writes
        np.testing.assert_array_equal(volume.read(volume.box), data)
        volume.write(Box((0, 0, 0), (8, 16, 16)), np.zeros((3, 8, 16, 16), np.uint8))
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "delta.zarr"))[:, :8, :16, :16], 0)


#: A child that writes one slab into an existing array through blockpred and exits (nothing syncs after it).
_WRITE_AND_EXIT = """
import sys
import numpy as np
from blockpred.geometry import Box
from blockpred.io import open_volume
with open_volume(sys.argv[1], mode="r+") as volume:
    assert not volume.async_writes  # zarr-python's path
    volume.write(Box((0, 0, 0), (8, 16, 16)), np.full((3, 8, 16, 16), 7, np.uint8))
"""


def test_what_zarr_python_writes_for_blockpred_is_on_the_disk_after_a_crash_of_the_machine(crashable_disk):
    """zarr-python renames a chunk into place without an fsync; blockpred's write returns once it is durable."""
    path = crashable_disk.path / "delta.zarr"
    zarr.create_array(str(path), shape=SHAPE, chunks=(3,) + CHUNKS, dtype="uint8", zarr_format=2,
                      filters=[numcodecs.Delta(dtype="uint8")], compressors=None, fill_value=0)
    subprocess.run(["sync"], check=True)  # the array made by another tool, long ago
    child = subprocess.run([sys.executable, "-c", _WRITE_AND_EXIT, str(path)], capture_output=True, text=True,
                           env=child_env(), timeout=120)
    assert child.returncode == 0, child.stderr
    found = zarr.open_array(str(crashable_disk.crash().path / "delta.zarr"), mode="r")
    assert (found[:, :8, :16, :16] == 7).all() and not found[:, 8:].any()


def _read_n5_block(path) -> np.ndarray:
    """An N5 block file (raw compression) parsed by hand: the header's sizes, x first, then x-fastest values."""
    raw = path.read_bytes()
    mode, ndim = struct.unpack(">HH", raw[:4])
    sizes = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    assert mode == 0
    values = np.frombuffer(raw[4 + 4 * ndim:], dtype=np.uint8)
    return values.reshape(sizes[::-1])  # x fastest on disk: C order over (..., z, y, x)


def test_n5_written_through_tensorstore_lies_on_disk_as_x_y_z_c_blocks(tmp_path):
    data = _data(3)
    with create_volume(str(tmp_path / "c.n5/out"), spatial_shape=SHAPE[1:], num_channels=3, dtype="uint8",
                       chunk_shape=CHUNKS, compression="raw") as volume:
        assert volume.async_writes
        _write_in_blocks(volume, data)
    # Block (x=1, y=2, z=0, c=0): x 16:27 (clipped), y 32:33 (clipped), z 0:8, all 3 channels.
    block = _read_n5_block(tmp_path / "c.n5/out/1/2/0/0")
    np.testing.assert_array_equal(block[:, :, :1, :11], data[:, 0:8, 32:33, 16:27])
    with open_volume(str(tmp_path / "c.n5/out")) as volume:
        np.testing.assert_array_equal(volume.read(volume.box), data)


@pytest.mark.parametrize("halo, cached", [pytest.param(2, True, id="reads-cut-chunks"),
                                          pytest.param(0, False, id="reads-on-the-chunk-grid")])
def test_an_input_read_across_its_chunks_keeps_them_decoded_and_one_read_on_the_grid_does_not(tmp_path, halo, cached):
    """A block's halo reaches into its neighbours' chunks: those are kept decoded for the neighbours.

    Shown by a second read of the same box after its chunk was rewritten on disk behind the reader's back
    (an input never changes during a run, so cached chunks are not checked again): the cached read
    returns the old values."""
    path = str(tmp_path / "in.zarr")
    shape, chunks = (8, 16, 48), (8, 16, 16)
    with create_volume(path, spatial_shape=shape, num_channels=None, dtype="uint8", chunk_shape=chunks,
                       ome=False) as volume:
        volume.write(volume.box, np.ones(shape, np.uint8))  # every chunk stored (not the fill value)
    block = Box((0, 0, 16 - halo), (8, 16, 32 + halo))  # the middle chunk and its halo
    with open_volume(path) as source:
        first, _ = source.read_with_missing(block)
        with open_volume(path, mode="r+") as writer:
            writer.write(Box((0, 0, 16), (8, 16, 32)), np.full((8, 16, 16), 7, np.uint8))
        second, _ = source.read_with_missing(block)
    assert (first == 1).all()
    assert (second[..., halo:16 + halo] == (1 if cached else 7)).all()
