"""Missing input chunks (files deleted from disk) are named by the read that met them, and read as the fill value."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from blockpred.geometry import Box, Coord
from blockpred.io import create_volume, open_volume, parse_volume_path

SHAPE = (32, 64, 64)
CHUNKS = (8, 16, 16)
SHARDS = (16, 32, 32)


def chunk_file(path: str, chunk: tuple[int, int, int], shards: bool = False) -> Path:
    """The file that stores chunk (grid index z, y, x), or the shard holding it, of the volume at ``path``."""
    vpath = parse_volume_path(path)
    if vpath.format == "precomputed":  # raw chunks: x0-x1_y0-y1_z0-z1, below the scale key
        begin = [i * c for i, c in zip(chunk, CHUNKS)]
        z, y, x = (f"{b}-{b + c}" for b, c in zip(begin, CHUNKS))
        return Path(vpath.container) / "s0" / f"{x}_{y}_{z}"
    directory = Path(vpath.container) / vpath.dataset
    if vpath.format == "n5":
        return directory.joinpath(*(str(i) for i in chunk[::-1]))
    if (directory / ".zarray").exists():
        return directory / ".".join(str(i) for i in chunk)
    if shards:
        chunk = tuple(i * c // s for i, c, s in zip(chunk, CHUNKS, SHARDS))
    return directory.joinpath("c", *(str(i) for i in chunk))


FORMATS = [
    pytest.param("in.zarr/raw", {"zarr_format": 2}, id="zarr-v2"),
    pytest.param("in.zarr/raw", {"zarr_format": 3}, id="zarr-v3"),
    pytest.param("in.zarr/raw", {"zarr_format": 3, "shard_shape": SHARDS}, id="zarr-v3-sharded"),
    pytest.param("in.n5/raw", {}, id="n5"),
    pytest.param("precomputed://{root}/pc", {"compression": "raw"}, id="precomputed-unsharded"),
]


def written(tmp_path, name: str, options: dict) -> tuple[str, np.ndarray]:
    """A uint8 volume of values 1-255 (no chunk is all fill value), every chunk stored."""
    path = name.format(root=tmp_path) if "{root}" in name else str(tmp_path / name)
    data = np.random.default_rng(0).integers(1, 256, SHAPE, dtype=np.uint8)
    with create_volume(path, spatial_shape=SHAPE, num_channels=None, dtype=np.dtype("uint8"), chunk_shape=CHUNKS,
                       ome=False, **options) as volume:
        volume.write(volume.box, data)
    return path, data


@pytest.mark.parametrize("name, options", FORMATS)
def test_a_read_names_exactly_the_missing_chunks_it_met_and_fills_them(tmp_path, name, options):
    path, data = written(tmp_path, name, options)
    sharded = "shard_shape" in options
    deleted = [(0, 0, 2)] if sharded else [(0, 0, 1), (1, 2, 2), (3, 3, 3)]
    for chunk in deleted:
        os.remove(chunk_file(path, chunk, sharded))
    if sharded:  # the whole shard (2 x 2 x 2 chunks: z 0-1, y 0-1, x 2-3) is gone
        deleted = [(z, y, x) for z in (0, 1) for y in (0, 1) for x in (2, 3)]
    expected = data.copy()
    for chunk in deleted:
        expected[Box.from_shape(Coord(CHUNKS), Coord(chunk) * Coord(CHUNKS)).to_slices()] = 0

    volume = open_volume(path)
    assert volume.counts_missing_chunks
    box = Box((4, 8, 20), (30, 60, 60))  # meets every deleted chunk, partly
    got, missing = volume.read_with_missing(box)
    np.testing.assert_array_equal(got, expected[box.to_slices()])
    np.testing.assert_array_equal(got, volume.read(box))
    assert sorted(tuple(chunk.begin) for chunk in missing) == sorted(tuple(Coord(c) * Coord(CHUNKS)) for c in deleted)
    assert all(chunk.shape == Coord(CHUNKS) for chunk in missing)

    apart = Box((16, 0, 0), (24, 16, 16))  # meets none of them
    got, missing = volume.read_with_missing(apart)
    assert missing == () and np.array_equal(got, data[apart.to_slices()])


def test_formats_that_cannot_tell_say_so(tmp_path):
    hdf5, _ = written(tmp_path, "in.h5:/raw", {})
    sharded_precomputed, _ = written(tmp_path, "precomputed://{root}/pc", {"compression": "gzip"})
    for path in (hdf5, sharded_precomputed):
        volume = open_volume(path)
        assert not volume.counts_missing_chunks
        assert volume.read_with_missing(volume.box)[1] == ()


def test_a_missing_chunk_object_on_s3_is_named_as_on_a_local_disk(s3):
    """The second, non-filling handle reaches the store with the same endpoint and credentials."""
    from blockpred.io import stores

    data = np.random.default_rng(1).integers(1, 256, SHAPE, dtype=np.uint8)
    path = s3.url("in.zarr/raw")
    with create_volume(path, spatial_shape=SHAPE, num_channels=None, dtype=np.dtype("uint8"), chunk_shape=CHUNKS,
                       ome=False) as volume:
        volume.write(volume.box, data)
    stores.delete_prefix(stores.parse_url(s3.url("in.zarr/raw/c/1/2/3")))
    got, missing = open_volume(path).read_with_missing(Box((0, 0, 0), SHAPE))
    assert [tuple(chunk.begin) for chunk in missing] == [(8, 32, 48)]
    assert not got[8:16, 32:48, 48:64].any() and np.array_equal(got[:8], data[:8])
