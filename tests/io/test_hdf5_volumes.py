"""HDF5 specifics: one file for input and output, the shared handles, compression."""

from __future__ import annotations

import subprocess
import sys
import threading

import h5py
import numpy as np
import pytest

from blockpred.errors import InputNotFoundError, InvalidOptionError, InvalidVolumeError, OutputLockedError
from blockpred.geometry import Box
from blockpred.io import create_volume, open_volume, volume_exists
from blockpred.io.hdf5 import OPEN_FILES
from tests.helpers import child_env, write_test_volume


def create(path, **options):
    arguments = dict(spatial_shape=(6, 10, 8), num_channels=None, dtype="float32", chunk_shape=(3, 5, 4))
    return create_volume(path, **{**arguments, **options})


@pytest.fixture(autouse=True)
def no_file_stays_open():
    yield
    assert OPEN_FILES.open_keys() == [], "an HDF5 volume was left open"


def test_input_and_output_can_be_datasets_of_the_same_file_in_one_process(tmp_path):
    raw = np.arange(6 * 10 * 8, dtype=np.uint16).reshape(6, 10, 8)
    write_test_volume(f"{tmp_path}/f.h5:/raw", raw, chunks=(3, 5, 4))

    source = open_volume(f"{tmp_path}/f.h5:/raw")  # the file is open read-only now
    first = source.read(Box((0, 0, 0), (3, 5, 4)))
    with create(f"{tmp_path}/f.h5:/prediction") as target:  # upgrades the shared handle to "a"
        for box in [Box((0, 0, 0), (3, 10, 8)), Box((3, 0, 0), (6, 10, 8))]:
            target.write(box, source.read(box).astype(np.float32) / 2)
        np.testing.assert_array_equal(source.read(source.box), raw)  # no stale handle after the upgrade
    np.testing.assert_array_equal(first, raw[:3, :5, :4])
    assert OPEN_FILES.open_keys() == [str((tmp_path / "f.h5").resolve())]  # the source still holds it
    source.close()

    with h5py.File(tmp_path / "f.h5", "r") as handle:
        np.testing.assert_array_equal(handle["raw"][...], raw)
        np.testing.assert_array_equal(handle["prediction"][...], raw.astype(np.float32) / 2)


def test_readers_in_threads_keep_reading_while_a_writer_upgrades_the_file(tmp_path):
    raw = np.random.default_rng(0).integers(0, 255, (6, 10, 8), dtype=np.uint8)
    write_test_volume(f"{tmp_path}/f.h5:/raw", raw)
    errors: list[BaseException] = []
    stop = threading.Event()

    with open_volume(f"{tmp_path}/f.h5:/raw") as source:

        def read_until_stopped():
            try:
                while not stop.is_set():
                    np.testing.assert_array_equal(source.read(source.box), raw)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        readers = [threading.Thread(target=read_until_stopped) for _ in range(3)]
        for reader in readers:
            reader.start()
        try:
            for name in ("a", "b", "c"):
                with create(f"{tmp_path}/f.h5:/{name}") as target:
                    target.write(target.box, np.ones((6, 10, 8), np.float32))
        finally:
            stop.set()
            for reader in readers:
                reader.join()
    assert errors == []


def test_two_readers_of_one_file_share_one_handle(tmp_path):
    write_test_volume(f"{tmp_path}/f.h5:/a", np.zeros((4, 4, 4), np.uint8))
    write_test_volume(f"{tmp_path}/f.h5:/b", np.ones((4, 4, 4), np.uint8))
    with open_volume(f"{tmp_path}/f.h5:/a") as a, open_volume(f"{tmp_path}/f.h5:/b") as b:
        assert len(OPEN_FILES.open_keys()) == 1
        assert a.read(a.box).sum() == 0 and b.read(b.box).sum() == 64


def test_a_contiguous_dataset_reports_its_shape_as_chunk_shape(tmp_path):
    with h5py.File(tmp_path / "f.h5", "w") as handle:
        handle["raw"] = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    with open_volume(f"{tmp_path}/f.h5:/raw") as volume:
        assert volume.chunk_shape == (3, 4, 5)
        expected = np.arange(60).reshape(3, 4, 5)[1:2, 1:3, 1:4]
        np.testing.assert_array_equal(volume.read(Box((1, 1, 1), (2, 3, 4))), expected)


@pytest.mark.parametrize(
    "compression, level",
    [
        pytest.param("zstd", 1, id="zstd-as-gzip-1"),
        pytest.param("gzip", 4, id="gzip-4"),
        pytest.param("raw", None, id="raw"),
    ],
)
def test_compression_names_map_to_hdf5_filters(tmp_path, compression, level):
    create(f"{tmp_path}/f.h5:/pred", compression=compression).close()
    with h5py.File(tmp_path / "f.h5", "r") as handle:
        dataset = handle["pred"]
        assert dataset.compression == ("gzip" if level else None)
        assert dataset.compression_opts == level
        assert dataset.shuffle is bool(level)


def test_blosc_is_refused_for_hdf5(tmp_path):
    with pytest.raises(InvalidOptionError, match="HDF5 output supports compression zstd .*gzip.*raw; got 'blosc'"):
        create(f"{tmp_path}/f.h5:/pred", compression="blosc")


def test_chunks_larger_than_the_dataset_are_clipped(tmp_path):
    with create(f"{tmp_path}/f.h5:/pred", chunk_shape=(64, 64, 64)) as volume:
        assert volume.chunk_shape == (6, 10, 8)


def test_element_size_um_gives_the_voxel_size(tmp_path):
    with h5py.File(tmp_path / "f.h5", "w") as handle:
        handle.create_dataset("raw", shape=(2, 2, 2), dtype="uint8").attrs["element_size_um"] = [0.5, 0.1, 0.1]
    with open_volume(f"{tmp_path}/f.h5:/raw") as volume:
        assert volume.voxel_size == (0.5, 0.1, 0.1)


def test_a_path_without_a_dataset_asks_for_one_and_lists_them(tmp_path):
    write_test_volume(f"{tmp_path}/f.h5:/group/raw", np.zeros((2, 2, 2), np.uint8))
    with pytest.raises(InputNotFoundError, match=r"must name a dataset.*has: \['group/raw'\]"):
        open_volume(f"{tmp_path}/f.h5")
    assert volume_exists(f"{tmp_path}/f.h5") is False


def test_a_group_is_not_a_dataset(tmp_path):
    write_test_volume(f"{tmp_path}/f.h5:/group/raw", np.zeros((2, 2, 2), np.uint8))
    with pytest.raises(InputNotFoundError, match=r"no dataset 'group' in .*; it has: \['group/raw'\]"):
        open_volume(f"{tmp_path}/f.h5:/group")


def test_a_file_that_is_not_hdf5_is_an_invalid_volume(tmp_path):
    (tmp_path / "f.h5").write_text("not hdf5")
    with pytest.raises(InvalidVolumeError, match="must be an HDF5 file"):
        open_volume(f"{tmp_path}/f.h5:/raw")


def test_a_volume_nobody_closes_gives_its_file_back_when_collected(tmp_path):
    write_test_volume(f"{tmp_path}/f.h5:/raw", np.zeros((2, 2, 2), np.uint8))
    volume = open_volume(f"{tmp_path}/f.h5:/raw")
    assert len(OPEN_FILES.open_keys()) == 1
    del volume
    assert OPEN_FILES.open_keys() == []


# ----------------------------------------------------------------- one writer, SWMR, and what a killed writer left

_HOLD_FOR_WRITING = """
import sys, time
import numpy as np
from blockpred.io import create_volume
volume = create_volume(sys.argv[1], spatial_shape=(6, 10, 8), num_channels=None, dtype="float32",
                       chunk_shape=(3, 5, 4))
volume.write(volume.box, np.ones((6, 10, 8), np.float32))  # written in SWMR mode, where HDF5 holds no lock
print("writing", flush=True)
time.sleep(60)
"""


def test_a_second_process_cannot_write_a_file_another_process_writes(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_FOR_WRITING, f"{tmp_path}/f.h5:/a"], env=child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "writing", holder.stderr.read()
        with pytest.raises(OutputLockedError, match="is open in another process"):
            create(f"{tmp_path}/f.h5:/b")
    finally:
        holder.kill()
        holder.wait()
    assert OPEN_FILES.open_keys() == []
    with create(f"{tmp_path}/f.h5:/b") as volume:  # the writer is gone: its flags are cleared, the file written
        volume.write(volume.box, np.full((6, 10, 8), 2, np.float32))
    with h5py.File(tmp_path / "f.h5", "r") as handle:
        np.testing.assert_array_equal(handle["a"][...], 1)
        np.testing.assert_array_equal(handle["b"][...], 2)


def test_a_new_file_is_written_in_swmr_mode_and_a_file_of_the_older_format_without(tmp_path):
    with create(f"{tmp_path}/new.h5:/a") as volume:
        volume.write(volume.box, np.ones((6, 10, 8), np.float32))
        assert OPEN_FILES.swmr(OPEN_FILES.open_keys()[0])
    with h5py.File(tmp_path / "old.h5", "w") as handle:  # h5py's defaults: HDF5 1.8's format (superblock 0)
        handle["other"] = np.zeros(3)
    with create(f"{tmp_path}/old.h5:/a") as volume:
        volume.write(volume.box, np.ones((6, 10, 8), np.float32))
        assert not OPEN_FILES.swmr(OPEN_FILES.open_keys()[0])
    for name in ("new.h5", "old.h5"):
        with h5py.File(tmp_path / name, "r") as handle:
            np.testing.assert_array_equal(handle["a"][...], 1)


def test_bytes_past_a_files_recorded_end_are_never_overwritten_by_later_writes(tmp_path, caplog):
    """What a killed writer wrote after its last flush lies past the recorded end; new chunks go after it."""
    path = f"{tmp_path}/f.h5:/a"
    create(path, compression="raw").close()
    file = tmp_path / "f.h5"
    end = file.stat().st_size
    left = np.random.default_rng(0).integers(0, 255, 1 << 16, dtype=np.uint8).tobytes()
    with open(file, "ab") as raw:
        raw.write(left)
    with caplog.at_level("WARNING", logger="blockpred"), open_volume(path, "r+") as volume:
        volume.write(volume.box, np.full((6, 10, 8), 3, np.float32))
    assert any("past its recorded end" in r.getMessage() for r in caplog.records)
    assert file.read_bytes()[end:end + len(left)] == left
    with open_volume(path) as volume:
        np.testing.assert_array_equal(volume.read(volume.box), 3)
