"""Every output chunk is written exactly once and never read back (no read-modify-write)."""

from collections import Counter

import numpy as np
import pytest
import zarr
from zarr.storage import LocalStore, WrapperStore

from blockpred.pipeline.blocking import plan_blocks
from blockpred.geometry import Coord
from blockpred.io import open_volume
from blockpred.io.base import Volume, VolumePath
from blockpred.models import load_model
from blockpred.pipeline import Backoff, PipelineSettings, Predictor, run_blocks
from blockpred.tuning.network import probe_network
from tests.helpers import write_test_volume

import torch


class CountingStore(WrapperStore):
    """A zarr store that counts reads and writes per key (measurement by wrapping)."""

    def __init__(self, store):
        super().__init__(store)
        self.sets: Counter = Counter()
        self.gets: Counter = Counter()

    async def set(self, key, value):
        self.sets[key] += 1
        return await self._store.set(key, value)

    async def get(self, key, prototype, byte_range=None):
        self.gets[key] += 1
        return await self._store.get(key, prototype, byte_range)


class ArrayVolume(Volume):
    """The Volume interface over a zarr array opened on any store."""

    def __init__(self, array):
        self._array = array
        self.path = VolumePath("zarr", __import__("pathlib").Path("counted.zarr"))
        self.shape, self.dtype, self.chunk_shape = array.shape, np.dtype(array.dtype), array.chunks

    def _read(self, index):
        return self._array[index]

    def _write(self, index, data):
        self._array[index] = data


@pytest.mark.parametrize("batch_size, num_writers, parts", [(1, 1, None), (3, 4, None), (1, 2, (2, 2, 1))])
def test_every_output_chunk_is_written_exactly_once(tmp_path, batch_size, num_writers, parts):
    """Also when blocks are predicted in parts (as after an out-of-memory error)."""
    rng = np.random.default_rng(0)
    shape = (40, 70, 53)
    source = open_volume(write_test_volume(str(tmp_path / "in.zarr"), rng.integers(0, 255, shape, dtype=np.uint8)))
    store = CountingStore(LocalStore(str(tmp_path / "out.zarr")))
    chunks = (8, 16, 16)
    array = zarr.create_array(store=store, shape=(2,) + shape, chunks=(2,) + chunks, dtype="float32", fill_value=0)
    sink = ArrayVolume(array)
    store.sets.clear()
    store.gets.clear()

    model = load_model("tiny")
    predictor = Predictor(model.module, torch.device("cpu"))
    block, halo = Coord((16, 32, 32)), Coord((4, 4, 4))
    geometry = probe_network(predictor, in_channels=1, block=block, halo=halo, downsampling=model.downsampling)
    plan = plan_blocks(volume_shape=Coord(shape), block_shape=block, halo=halo, input_shape=geometry.input_shape,
                       downsampling=model.downsampling, chunk_shape=Coord(chunks))
    backoff = Backoff(batch_size, parts=Coord(parts)) if parts else None
    settings = PipelineSettings(batch_size=batch_size, num_writers=num_writers, downsampling=model.downsampling)
    stats = run_blocks(plan, source=source, sink=sink, predictor=predictor, settings=settings, backoff=backoff)

    expected_chunks = {f"c/0/{z}/{y}/{x}" for z in range(5) for y in range(5) for x in range(4)}
    chunk_sets = {k: n for k, n in store.sets.items() if k.startswith("c/")}
    assert set(chunk_sets) == expected_chunks
    assert set(chunk_sets.values()) == {1}, "a chunk was written more than once"
    assert not [k for k in store.gets if k.startswith("c/")], "a chunk was read back (read-modify-write)"
    assert stats.num_blocks == plan.num_blocks and stats.num_voxels == int(np.prod(shape))


class RaisesOnMarker(torch.nn.Module):
    """Identity-like network that raises when its input holds the marker value 1.0 (uint8 255)."""

    in_channels = 1

    def forward(self, x):
        if bool((x == 1.0).any()):
            raise RuntimeError("marker voxel seen")
        return x * 0.5


def test_a_failing_block_is_named_and_the_blocks_before_it_are_written(tmp_path):
    import blockpred
    from blockpred.errors import BlockFailedError

    data = np.full((32, 32, 32), 102, dtype=np.uint8)
    data[20, 20, 20] = 255  # inside block (1, 1, 1) of 16^3 blocks, 4 voxels from its edges
    path = write_test_volume(str(tmp_path / "in.zarr"), data)
    out = str(tmp_path / "out.zarr")
    with pytest.raises(BlockFailedError, match=r"block \(1, 1, 1\) \(writes \[16:32, 16:32, 16:32\]\): marker voxel seen") as info:
        blockpred.predict(path, out, model=RaisesOnMarker(), block=16, halo=2, progress=False, local=True, num_writers=1)
    assert tuple(info.value.block_index) == (1, 1, 1)
    assert isinstance(info.value.__cause__, RuntimeError)
    written = open_volume(out)
    values = written.read(written.box)[0]
    assert np.allclose(values[:16, :16, :16], 0.2) and np.allclose(values[:16, 16:, 16:], 0.2)
    assert not values[16:, 16:, 16:].any(), "the failed block must leave its chunk unwritten"


class ReleaseCounting(Predictor):
    """The CPU predictor, its batches' results handed over as a GPU's pinned buffers are: released once written."""

    def __init__(self, *args, done: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.done, self.batch_sizes, self.released = done, [], []
        self._lock = __import__("threading").Lock()

    def submit(self, blocks, steps=None):
        pending = super().submit(blocks, steps) if steps is not None else super().submit(blocks)
        batch = len(self.batch_sizes)
        self.batch_sizes.append(len(blocks))

        def release():
            with self._lock:
                self.released.append((batch, len(self.done)))

        pending._release = release
        return pending


@pytest.mark.parametrize("batch_size", [1, 3])
def test_each_batch_buffer_is_released_once_after_its_blocks_are_written(tmp_path, batch_size):
    rng = np.random.default_rng(5)
    shape = (32, 40, 40)
    source = open_volume(write_test_volume(str(tmp_path / "in.zarr"), rng.integers(0, 255, shape, dtype=np.uint8)))
    from blockpred.io import create_volume

    sink = create_volume(str(tmp_path / "out.zarr"), spatial_shape=shape, num_channels=2, dtype="float32",
                         chunk_shape=(16, 16, 16), ome=False)
    done: list = []
    model = load_model("tiny")
    predictor = ReleaseCounting(model.module, torch.device("cpu"), done=done)
    plan = plan_blocks(volume_shape=Coord(shape), block_shape=Coord((16, 16, 16)), halo=Coord((4, 4, 4)),
                       downsampling=model.downsampling, chunk_shape=Coord((16, 16, 16)))
    predictor.batch_sizes.clear()
    run_blocks(plan, source=source, sink=sink, predictor=predictor, on_block_done=done.append,
               settings=PipelineSettings(batch_size=batch_size, num_writers=3, downsampling=model.downsampling))

    assert len(done) == plan.num_blocks
    assert sorted(batch for batch, _ in predictor.released) == list(range(len(predictor.batch_sizes)))
    # When a batch's buffer comes back, its blocks (and those of every batch released before) are written.
    released_blocks = 0
    for batch, num_done in sorted(predictor.released, key=lambda item: item[1]):
        released_blocks += predictor.batch_sizes[batch]
        assert num_done >= released_blocks
