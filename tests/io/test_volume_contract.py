"""The contract every volume backend keeps, run for each of them on real files."""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from blockpred.errors import InputNotFoundError, InvalidOptionError, OutputExistsError, os_fault
from blockpred.geometry import Box
from blockpred.io import create_volume, open_volume, remove_volume, volume_exists
from tests.helpers import child_env

SPATIAL_SHAPE = (12, 20, 18)
CHUNK_SHAPE = (4, 8, 6)


@dataclass(frozen=True)
class Backend:
    """How one backend names its paths and what it promises."""

    suffix: str
    create_options: dict = field(default_factory=dict)
    has_float16: bool = True
    parallel_writes: bool = True
    #: The voxel size read back when none was written (an OME image always has a scale).
    default_voxel_size: tuple | None = None
    #: A URL-like prefix naming the format (precomputed://), when the suffix does not.
    scheme: str = ""

    def path(self, root: Path, dataset: str = "volume", container: str = "data") -> str:
        if self.scheme:  # each volume is its own directory, here below the directory ``container``
            return f"{self.scheme}{root}/{container}{self.suffix}/{dataset}"
        if self.suffix == ".h5":
            return f"{root}/{container}.h5:/{dataset}"
        return f"{root}/{container}{self.suffix}/{dataset}"

    def container(self, root: Path, container: str = "data") -> str:
        return f"{root}/{container}{self.suffix}"

    def create(self, path: str, num_channels=None, dtype="float32", **options):
        arguments = dict(
            spatial_shape=SPATIAL_SHAPE, num_channels=num_channels, dtype=dtype, chunk_shape=CHUNK_SHAPE
        )
        return create_volume(path, **{**arguments, **self.create_options, **options})


BACKENDS = [
    pytest.param(Backend(".zarr", {"zarr_format": 2, "ome": False}), id="zarr-v2"),
    pytest.param(Backend(".zarr", {"zarr_format": 3, "ome": False}), id="zarr-v3"),
    pytest.param(
        Backend(".zarr", {"zarr_format": 3, "ome": True}, default_voxel_size=(1.0, 1.0, 1.0)), id="zarr-v3-ome"
    ),
    pytest.param(Backend(".n5", has_float16=False), id="n5"),
    pytest.param(Backend(".h5", parallel_writes=False), id="hdf5"),
    pytest.param(
        Backend("", scheme="precomputed://", has_float16=False, default_voxel_size=(1.0, 1.0, 1.0)), id="precomputed"
    ),
]


@pytest.fixture(params=BACKENDS)
def backend(request) -> Backend:
    return request.param


def random_data(shape, dtype, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(0, np.iinfo(dtype).max, size=shape, endpoint=True).astype(dtype)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float32", "float16"])
@pytest.mark.parametrize("num_channels", [pytest.param(None, id="zyx"), pytest.param(3, id="czyx")])
def test_written_chunk_aligned_boxes_read_back_in_any_box(backend, tmp_path, num_channels, dtype):
    if np.dtype(dtype) == np.float16 and not backend.has_float16:
        pytest.skip("N5 and precomputed have no float16 (refusals: test_n5_volumes, test_precomputed)")
    lead = () if num_channels is None else (num_channels,)
    reference = np.zeros(lead + SPATIAL_SHAPE, dtype=dtype)
    write_boxes = [
        Box((0, 0, 0), (4, 8, 6)),
        Box((4, 8, 6), (12, 16, 18)),
        Box((8, 16, 0), (12, 20, 12)),  # ends at the volume's edge
    ]
    with backend.create(backend.path(tmp_path), num_channels=num_channels, dtype=dtype) as volume:
        for seed, box in enumerate(write_boxes):
            data = random_data(lead + tuple(box.shape), dtype, seed)
            volume.write(box, data)
            reference[(slice(None),) * len(lead) + box.to_slices()] = data

    with open_volume(backend.path(tmp_path)) as volume:
        for box in [volume.box, Box((1, 3, 5), (11, 17, 13)), Box((3, 7, 5), (5, 9, 7)), Box((2, 2, 2), (2, 9, 9))]:
            got = volume.read(box)
            assert got.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got, reference[(slice(None),) * len(lead) + box.to_slices()])


@pytest.mark.parametrize("num_channels", [pytest.param(None, id="zyx"), pytest.param(2, id="czyx")])
def test_properties_describe_the_created_volume(backend, tmp_path, num_channels):
    with backend.create(backend.path(tmp_path), num_channels=num_channels, dtype="uint16") as created:
        pass
    lead = () if num_channels is None else (num_channels,)
    with open_volume(backend.path(tmp_path)) as volume:
        assert volume.shape == lead + SPATIAL_SHAPE
        assert volume.ndim == len(lead) + 3
        assert volume.num_channels == num_channels
        assert volume.dtype == np.dtype("uint16")
        assert volume.chunk_shape == lead + CHUNK_SHAPE
        assert volume.spatial_shape == SPATIAL_SHAPE
        assert volume.spatial_chunk_shape == CHUNK_SHAPE
        assert volume.box == Box((0, 0, 0), SPATIAL_SHAPE)
        assert volume.parallel_writes is backend.parallel_writes
        assert volume.writable is False
        assert created.writable is True
        assert str(volume.path) == backend.path(tmp_path)


def test_a_new_volume_reads_as_its_fill_value(backend, tmp_path):
    with backend.create(backend.path(tmp_path)) as volume:
        np.testing.assert_array_equal(volume.read(volume.box), np.zeros(SPATIAL_SHAPE, np.float32))


def test_read_with_missing_names_every_chunk_of_a_new_volume_when_the_backend_can_tell(backend, tmp_path):
    """Nothing is stored yet: a backend that counts names each chunk the read touched; one that cannot, none."""
    with backend.create(backend.path(tmp_path)) as volume:
        box = Box((2, 3, 4), (9, 17, 18))
        data, missing = volume.read_with_missing(box)
        np.testing.assert_array_equal(data, volume.read(box))
        chunks = {(z, y, x) for z in range(0, 9, 4) for y in range(0, 17, 8) for x in range(0, 18, 6)}
        assert {tuple(chunk.begin) for chunk in missing} == (chunks if volume.counts_missing_chunks else set())
        volume.write(volume.box, random_data(SPATIAL_SHAPE, "float32"))
        data, missing = volume.read_with_missing(box)
        np.testing.assert_array_equal(data, volume.read(box))
        assert missing == ()


@pytest.mark.parametrize(
    "box",
    [
        pytest.param(Box((0, 0, 0), (13, 20, 18)), id="past-the-end"),
        pytest.param(Box((-1, 0, 0), (4, 4, 4)), id="before-the-begin"),
        pytest.param(Box((12, 20, 18), (14, 22, 20)), id="wholly-outside"),
    ],
)
def test_reading_or_writing_outside_the_volume_raises(backend, tmp_path, box):
    with backend.create(backend.path(tmp_path)) as volume:
        with pytest.raises(ValueError, match="outside volume"):
            volume.read(box)
        with pytest.raises(ValueError, match="outside volume"):
            volume.write(box, np.zeros(tuple(box.shape), np.float32))


def test_a_box_of_the_wrong_rank_raises(backend, tmp_path):
    with backend.create(backend.path(tmp_path)) as volume:
        with pytest.raises(ValueError, match=r"has 2 axes; .* is indexed by \(z, y, x\) boxes"):
            volume.read(Box((0, 0), (4, 4)))


@pytest.mark.parametrize(
    "data_shape",
    [
        pytest.param((4, 8, 5), id="spatially-too-small"),
        pytest.param((1, 4, 8, 6), id="extra-channel-axis"),
        pytest.param((8, 4, 6), id="axes-swapped"),
    ],
)
def test_writing_data_of_the_wrong_shape_raises(backend, tmp_path, data_shape):
    with backend.create(backend.path(tmp_path)) as volume:
        with pytest.raises(ValueError, match="does not fit box"):
            volume.write(Box((0, 0, 0), (4, 8, 6)), np.ones(data_shape, np.float32))
        np.testing.assert_array_equal(volume.read(volume.box), 0)


def test_a_volume_opened_read_only_refuses_writes(backend, tmp_path):
    backend.create(backend.path(tmp_path)).close()
    with open_volume(backend.path(tmp_path), mode="r") as volume:
        with pytest.raises(PermissionError, match="read-only"):
            volume.write(Box((0, 0, 0), (4, 8, 6)), np.ones((4, 8, 6), np.float32))


def test_a_volume_reopened_r_plus_accepts_writes(backend, tmp_path):
    backend.create(backend.path(tmp_path)).close()
    with open_volume(backend.path(tmp_path), mode="r+") as volume:
        volume.write(Box((0, 0, 0), (4, 8, 6)), np.full((4, 8, 6), 7, np.float32))
    with open_volume(backend.path(tmp_path)) as volume:
        assert volume.read(Box((0, 0, 0), (4, 8, 6))).min() == 7


@pytest.mark.parametrize("num_channels", [pytest.param(None, id="zyx"), pytest.param(2, id="czyx")])
def test_voxel_size_round_trips_in_zyx_order(backend, tmp_path, num_channels):
    backend.create(backend.path(tmp_path), num_channels=num_channels, voxel_size=(40.0, 4.0, 2.0)).close()
    with open_volume(backend.path(tmp_path)) as volume:
        assert volume.voxel_size == (40.0, 4.0, 2.0)


def test_voxel_size_is_the_default_when_none_was_written(backend, tmp_path):
    backend.create(backend.path(tmp_path)).close()
    with open_volume(backend.path(tmp_path)) as volume:
        assert volume.voxel_size == backend.default_voxel_size


def test_opening_a_missing_container_names_it(backend, tmp_path):
    path = backend.path(tmp_path, container="absent")
    with pytest.raises(InputNotFoundError, match="absent") as raised:
        open_volume(path)
    assert isinstance(raised.value, FileNotFoundError)
    assert volume_exists(path) is False


def test_opening_a_missing_dataset_names_it_and_lists_what_the_container_has(backend, tmp_path):
    if backend.scheme == "precomputed://":
        pytest.skip("a precomputed volume is a directory of its own, not a dataset in a container "
                    "(a missing scale is named with the scales there: tests/io/test_precomputed.py)")
    backend.create(backend.path(tmp_path, "data")).close()
    backend.create(backend.path(tmp_path, "labels")).close()
    with pytest.raises(InputNotFoundError, match=r"no dataset 'raw' in .*it has: \['data', 'labels'\]"):
        open_volume(backend.path(tmp_path, "raw"))
    assert volume_exists(backend.path(tmp_path, "raw")) is False
    assert volume_exists(backend.path(tmp_path, "data")) is True


def test_creating_over_an_existing_volume_without_overwrite_raises_and_keeps_its_data(backend, tmp_path):
    path = backend.path(tmp_path)
    with backend.create(path) as volume:
        volume.write(volume.box, np.full(SPATIAL_SHAPE, 3, np.float32))
    with pytest.raises(OutputExistsError, match="exists") as raised:
        backend.create(path, dtype="uint8")
    assert isinstance(raised.value, FileExistsError)
    with open_volume(path) as volume:
        assert volume.dtype == np.float32
        np.testing.assert_array_equal(volume.read(volume.box), 3)


def test_creating_with_overwrite_replaces_the_volume(backend, tmp_path):
    path = backend.path(tmp_path)
    with backend.create(path) as volume:
        volume.write(volume.box, np.full(SPATIAL_SHAPE, 3, np.float32))
    with backend.create(path, num_channels=2, dtype="uint8", overwrite=True) as volume:
        assert volume.shape == (2,) + SPATIAL_SHAPE
    with open_volume(path) as volume:
        assert volume.dtype == np.uint8
        np.testing.assert_array_equal(volume.read(volume.box), 0)


def test_remove_volume_removes_only_that_dataset(backend, tmp_path):
    doomed, sibling = backend.path(tmp_path, "doomed"), backend.path(tmp_path, "sibling")
    backend.create(doomed).close()
    with backend.create(sibling) as volume:
        volume.write(volume.box, np.full(SPATIAL_SHAPE, 5, np.float32))

    remove_volume(doomed)

    assert volume_exists(doomed) is False
    with pytest.raises(InputNotFoundError, match="doomed"):
        open_volume(doomed)
    assert volume_exists(sibling) is True
    with open_volume(sibling) as volume:
        np.testing.assert_array_equal(volume.read(volume.box), 5)
    remove_volume(doomed)  # removing what is gone is a no-op


def test_a_volume_survives_pickling(backend, tmp_path):
    with backend.create(backend.path(tmp_path)) as volume:
        volume.write(volume.box, np.full(SPATIAL_SHAPE, 2, np.float32))
    with open_volume(backend.path(tmp_path)) as volume:
        with pickle.loads(pickle.dumps(volume)) as copy:
            assert copy.shape == volume.shape and copy.writable is False
            np.testing.assert_array_equal(copy.read(copy.box), 2)


def test_threads_writing_disjoint_chunks_produce_the_whole_volume(backend, tmp_path):
    reference = random_data(SPATIAL_SHAPE, "float32")
    with backend.create(backend.path(tmp_path)) as volume:
        boxes = [
            Box.from_shape(CHUNK_SHAPE, (z, y, x)).intersect(volume.box)
            for z in range(0, 12, 4)
            for y in range(0, 20, 8)
            for x in range(0, 18, 6)
        ]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda box: volume.write(box, reference[box.to_slices()]), boxes))
    with open_volume(backend.path(tmp_path)) as volume:
        np.testing.assert_array_equal(volume.read(volume.box), reference)


@pytest.mark.parametrize(
    "options, message",
    [
        pytest.param({"spatial_shape": (12, 20)}, "spatial_shape must be 3 positive ints", id="two-axes"),
        pytest.param({"chunk_shape": (4, 0, 6)}, "chunk_shape must be 3 positive ints", id="zero-chunk"),
        pytest.param({"num_channels": 0}, "num_channels must be None or an int >= 1", id="no-channels"),
        pytest.param({"compression": "lz77"}, "compression must be one of", id="unknown-compression"),
        pytest.param({"voxel_size": (1.0, -1.0, 1.0)}, "voxel_size must be 3 positive numbers", id="negative-voxel"),
    ],
)
def test_create_refuses_invalid_options_before_touching_the_disk(backend, tmp_path, options, message):
    with pytest.raises(InvalidOptionError, match=message):
        backend.create(backend.path(tmp_path), **options)
    assert not Path(backend.container(tmp_path)).exists()


@pytest.mark.parametrize("compression", ["zstd", "gzip", "blosc", "raw", None])
def test_every_compression_round_trips_or_is_refused_by_name(backend, tmp_path, compression):
    data = random_data(SPATIAL_SHAPE, "uint16")
    try:
        volume = backend.create(backend.path(tmp_path), dtype="uint16", compression=compression)
    except InvalidOptionError as error:
        assert backend.suffix == ".h5" and compression == "blosc"
        assert "blosc" in str(error)
        return
    with volume:
        volume.write(volume.box, data)
    with open_volume(backend.path(tmp_path)) as volume:
        np.testing.assert_array_equal(volume.read(volume.box), data)


# ----------------------------------------------------------------- the write contract: durable when done, or failed

#: A child that writes two slabs, one through ``write`` and one through ``write_async``, says so, and is killed
#: (SIGKILL, by itself) the moment both returned: what a mark would vouch for must be in the volume.
_WRITE_THEN_DIE = """
import json, os, signal, sys
import numpy as np
from blockpred.geometry import Box
from blockpred.io import create_volume
spec = json.loads(sys.argv[1])
volume = create_volume(spec["path"], **spec["options"])
data = np.random.default_rng(0).standard_normal(volume.shape).astype("float32")
volume.write(Box((0, 0, 0), (4, 20, 18)), data[..., 0:4, :, :])
volume.write_async(Box((4, 0, 0), (8, 20, 18)), data[..., 4:8, :, :]).result()
print("returned", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_write_that_returned_is_in_the_volume_after_a_kill_of_its_process(backend, tmp_path):
    path = backend.path(tmp_path)
    options = dict(spatial_shape=SPATIAL_SHAPE, num_channels=2, dtype="float32", chunk_shape=CHUNK_SHAPE,
                   **backend.create_options)
    child = subprocess.run([sys.executable, "-c", _WRITE_THEN_DIE, json.dumps({"path": path, "options": options})],
                           capture_output=True, text=True, env=child_env(), timeout=120)
    assert child.returncode == -signal.SIGKILL and child.stdout.strip() == "returned", child.stderr
    expected = np.random.default_rng(0).standard_normal((2, *SPATIAL_SHAPE)).astype("float32")
    with open_volume(path) as volume:  # HDF5: flagged "open for writing" by the killed writer, read as SWMR
        np.testing.assert_array_equal(volume.read(Box((0, 0, 0), (8, 20, 18))), expected[:, 0:8])
        assert not volume.read(Box((8, 0, 0), (12, 20, 18))).any()  # never written: the fill value


def test_a_write_that_returned_is_on_the_disk_after_a_crash_of_the_machine(backend, crashable_disk):
    """A kill leaves the page cache; a crash takes it: the volume's metadata and the data of every write that
    returned must be on the disk itself (the child exits without a kill, and nothing syncs after it)."""
    path = backend.path(crashable_disk.path)
    options = dict(spatial_shape=SPATIAL_SHAPE, num_channels=2, dtype="float32", chunk_shape=CHUNK_SHAPE,
                   **backend.create_options)
    child = subprocess.run([sys.executable, "-c", _WRITE_THEN_DIE, json.dumps({"path": path, "options": options})],
                           capture_output=True, text=True, env=child_env(), timeout=120)
    assert child.returncode == -signal.SIGKILL and child.stdout.strip() == "returned", child.stderr
    crashed = backend.path(crashable_disk.crash().path)
    expected = np.random.default_rng(0).standard_normal((2, *SPATIAL_SHAPE)).astype("float32")
    with open_volume(crashed) as volume:
        np.testing.assert_array_equal(volume.read(Box((0, 0, 0), (8, 20, 18))), expected[:, 0:8])
        assert not volume.read(Box((8, 0, 0), (12, 20, 18))).any()


def test_a_write_to_a_full_disk_fails_and_every_write_that_completed_reads_back(backend, tmpfs):
    disk = tmpfs("384k")
    path = backend.path(disk.path)
    shape, chunks = (64, 64, 64), (4, 64, 64)  # 16 slabs of 64 KiB, uncompressed: a few fit
    data = np.random.default_rng(1).standard_normal(shape).astype("float32")
    volume = create_volume(path, spatial_shape=shape, num_channels=None, dtype="float32", chunk_shape=chunks,
                           compression="raw", **{k: v for k, v in backend.create_options.items() if k != "compression"})
    completed, failures = [], []
    with volume:
        for z in range(0, shape[0], chunks[0]):
            box = Box((z, 0, 0), (z + chunks[0], *shape[1:]))
            try:
                volume.write_async(box, data[box.to_slices()]).result()
            except Exception as error:  # noqa: BLE001 - each failure is kept and checked below
                failures.append(error)
            else:
                completed.append(box)
    assert failures, "a disk too small for the volume took every write"
    assert all(os_fault(error) is not None and os_fault(error)[0] == "no space left on the device"
               for error in failures), failures
    disk.resize("4m")  # an operator frees space: what completed must be there, whole
    with open_volume(path) as volume:
        for box in completed:
            np.testing.assert_array_equal(volume.read(box), data[box.to_slices()])
