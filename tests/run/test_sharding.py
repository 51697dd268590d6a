"""Sharded zarr v3 outputs: blocks are whole shards, each written once, readable everywhere; sharded inputs read."""

import numpy as np
import ome_zarr_models.v05
import pytest
import tensorstore as ts
import zarr

import blockpred
from blockpred.errors import InvalidOptionError
from blockpred.geometry import Coord
from blockpred.io import open_volume
from blockpred.run.layout import MAX_UNSHARDED_CHUNKS, choose_layout
from tests.helpers import write_test_volume

SHAPE = (40, 70, 50)
# Batch and layout named: these tests compare runs bitwise (see tests/cluster/test_scheduler.py, PINNED).
RUN = dict(block=(16, 32, 32), halo=4, output_dtype="uint8", local=True, progress=False, batch_size=1,
           memory_format="contiguous")


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    """An input and the output of an unsharded run of it (the reference)."""
    root = tmp_path_factory.mktemp("sharding")
    data = np.random.default_rng(0).integers(0, 255, SHAPE, dtype=np.uint8)
    path = write_test_volume(str(root / "in.zarr/raw"), data, voxel_size=(40.0, 4.0, 4.0))
    blockpred.predict(path, str(root / "plain.zarr"), **RUN)
    return root, path, data, zarr.open_array(str(root / "plain.zarr/0"), mode="r")[...]


def _file_metrics() -> dict:
    return {m["name"].rsplit("/", 1)[1]: m["values"][0].get("value", 0)
            for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/")}


def test_every_shard_is_written_once_and_the_output_opens_in_zarr_and_tensorstore_as_ome_0_5(volume):
    root, path, _, reference = volume
    out = str(root / "sharded.zarr")
    before = _file_metrics()
    blockpred.predict(path, out, shards=(16, 32, 32), output_chunks=(8, 16, 16), **RUN)
    after = _file_metrics()

    shard_files = sorted(p for p in (root / "sharded.zarr/0/c").rglob("*") if p.is_file())
    assert len(shard_files) == 3 * 3 * 2  # ceil((40, 70, 50) / (16, 32, 32))
    # Writes through tensorstore in the run == shard files: each was written exactly once,
    # and the bytes written are exactly the bytes on disk (no shard rewritten, none appended to).
    assert after.get("write", 0) - before.get("write", 0) == len(shard_files)
    assert after.get("bytes_written", 0) - before.get("bytes_written", 0) == sum(p.stat().st_size for p in shard_files)

    array = zarr.open_array(out + "/0", mode="r")
    assert array.shards == (2, 16, 32, 32) and array.chunks == (2, 8, 16, 16)
    np.testing.assert_array_equal(array[...], reference)
    via_ts = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": out + "/0"}}).result()
    np.testing.assert_array_equal(via_ts.read().result(), reference)
    image = ome_zarr_models.v05.Image.from_zarr(zarr.open_group(out, mode="r"))
    assert [axis.name for axis in image.ome_attributes.multiscales[0].axes] == ["c", "z", "y", "x"]


def test_shards_block_gives_one_shard_per_block_with_default_chunks(volume):
    root, path, _, reference = volume
    out = str(root / "per-block.zarr")
    blockpred.predict(path, out, shards="block", block=(16, 64, 64), halo=4, output_dtype="uint8", local=True,
                      progress=False)
    array = zarr.open_array(out + "/0", mode="r")
    assert array.shards == (2, 16, 64, 50) and array.chunks == (2, 16, 64, 50)  # the block cut to x's 50 voxels
    assert open_volume(out).chunk_shape == (2, 16, 64, 50)  # blockpred sees the shard as its write unit


def test_a_sharded_input_reads_like_the_same_data_unsharded(volume):
    root, _, data, reference = volume
    sharded_in = zarr.create_array(str(root / "sharded-in.zarr"), shape=SHAPE, chunks=(8, 16, 16),
                                   shards=(16, 32, 32), dtype="uint8", fill_value=0)
    sharded_in[...] = data
    with open_volume(str(root / "sharded-in.zarr")) as source:
        np.testing.assert_array_equal(source.read(source.box), data)
    blockpred.predict(str(root / "sharded-in.zarr"), str(root / "from-sharded.zarr"), **RUN)
    np.testing.assert_array_equal(zarr.open_array(str(root / "from-sharded.zarr/0"))[...], reference)


def test_shards_in_a_zarr_v2_container_are_refused_before_anything_is_written(volume, tmp_path):
    _, path, _, _ = volume
    v2 = write_test_volume(str(tmp_path / "v2.zarr/raw"), np.zeros((8, 8, 8), np.uint8), zarr_format=2)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(InvalidOptionError, match="needs a zarr v3 output"):
        blockpred.predict(path, v2.replace("raw", "prediction"), shards=16, **RUN)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


PLATYNEREIS = Coord((11000, 27000, 27000))


@pytest.mark.parametrize("volume_shape, can_shard, shards, expected_shards", [
    pytest.param(PLATYNEREIS, True, "auto", (64, 256, 256), id="teravoxels-sharded-by-block"),
    pytest.param(Coord((256, 512, 512)), True, "auto", None, id="small-not-sharded"),
    pytest.param(PLATYNEREIS, False, "auto", None, id="zarr-v2-cannot-shard"),
    pytest.param(PLATYNEREIS, True, "off", None, id="off"),
    pytest.param(Coord((256, 512, 512)), True, "block", (64, 256, 256), id="block"),
    pytest.param(Coord((256, 512, 512)), True, Coord((64, 128, 128)), (64, 128, 128), id="explicit"),
])
def test_the_layout_shards_large_zarr_v3_outputs_by_block(volume_shape, can_shard, shards, expected_shards):
    block = Coord((64, 256, 256))
    layout = choose_layout(block=block, volume_shape=volume_shape, chunks=None, shards=shards,
                           can_shard=can_shard, target="out.zarr")
    assert layout.shards == (None if expected_shards is None else Coord(expected_shards))
    assert block.is_multiple_of(layout.write_unit) and layout.write_unit.is_multiple_of(layout.chunks)
    if layout.shards is not None and volume_shape == PLATYNEREIS:
        unsharded = volume_shape.ceil_div(layout.chunks).prod()
        assert unsharded > MAX_UNSHARDED_CHUNKS
        assert layout.num_files(volume_shape) == volume_shape.ceil_div(block).prod()  # one file per block
        assert layout.num_files(volume_shape) * 3 < unsharded


def test_shards_that_chunks_do_not_divide_are_refused():
    with pytest.raises(InvalidOptionError, match="not a multiple of the output chunk shape"):
        choose_layout(block=Coord((64, 64, 64)), volume_shape=Coord((64, 64, 64)), chunks=Coord((24, 24, 24)),
                      shards=Coord((32, 32, 32)), can_shard=True, target="out.zarr")
