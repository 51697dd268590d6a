"""Arrays in, arrays out: blockpred.predict on a numpy, dask or zarr array returns the prediction as a numpy array,
bitwise the run of the same data written to zarr, and leaves no temporary file; anything else is one line."""

import tempfile

import dask.array as da
import numpy as np
import pytest
import zarr

import blockpred
from blockpred.errors import InvalidOptionError, MemoryBudgetError
from tests.helpers import read_volume, write_test_volume

#: Named so that runs compare bitwise: same block, batch and layout (nothing measured).
PINNED = {"model": "tests.networks:smooth", "block": (16, 32, 32), "halo": (1, 1, 1), "batch_size": 1,
          "memory_format": "contiguous", "device": "cpu", "local": True, "progress": False}
DATA = np.random.default_rng(0).integers(0, 256, (16, 32, 32), dtype=np.uint8)


@pytest.fixture(autouse=True)
def scratch(tmp_path, monkeypatch):
    """Python's temporary folder (where an array's copy and a returned prediction go) is the test's own, and the
    test runs in a folder of its own: what a run leaves behind is seen there."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.chdir(tmp_path)
    return folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The prediction of DATA run from a zarr path, as stored: (c, z, y, x)."""
    folder = tmp_path_factory.mktemp("reference")
    path = write_test_volume(str(folder / "in.zarr"), DATA)
    summary = blockpred.predict(path, str(folder / "out.zarr"), **PINNED)
    return read_volume(summary.output)


def leftovers(tmp_path) -> list[str]:
    """What is in the test's folder and its temporary folder, but the test's own cache (see tests/conftest.py)."""
    kept = (tmp_path / "tmp", tmp_path / "blockpred-cache")
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
                  if p not in kept and kept[1] not in p.parents)


def test_a_numpy_array_is_returned_predicted_bitwise_as_the_run_of_its_zarr_and_leaves_nothing(reference, tmp_path):
    given = DATA.copy()
    prediction = blockpred.predict(given, **PINNED)
    assert type(prediction) is np.ndarray and prediction.shape == (2, 16, 32, 32) and prediction.dtype == np.float32
    assert np.array_equal(prediction, reference)
    assert np.array_equal(given, DATA)  # the input is never written
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("make", [
    pytest.param(lambda folder: da.from_array(DATA, chunks=(8, 16, 16)), id="dask"),
    pytest.param(lambda folder: zarr.create_array(zarr.storage.MemoryStore(), data=DATA, chunks=(8, 16, 16)),
                 id="zarr-in-memory"),
    pytest.param(lambda folder: DATA[None], id="numpy-with-a-channel-axis"),
])
def test_a_dask_array_a_zarr_array_in_memory_and_a_channel_axis_give_the_numpy_arrays_prediction(
        make, reference, tmp_path):
    assert np.array_equal(blockpred.predict(make(tmp_path), **PINNED), reference)
    assert leftovers(tmp_path) == []


def test_a_zarr_array_on_disk_is_read_in_place_and_the_summary_comes_with_the_array_when_asked(reference, tmp_path):
    on_disk = zarr.create_array(str(tmp_path / "raw.zarr"), data=DATA, chunks=(8, 16, 16))
    before = leftovers(tmp_path)
    prediction, summary = blockpred.predict(zarr.open_array(str(tmp_path / "raw.zarr"), mode="r"),
                                            return_summary=True, **PINNED)
    assert np.array_equal(prediction, reference) and np.array_equal(on_disk[:], DATA)
    assert summary.input == f"zarr array 16x32x32 uint8 at {str(tmp_path / 'raw.zarr')!r}"  # its own path: no copy
    assert summary.output == "numpy array" and str(summary).endswith("-> numpy array")
    assert leftovers(tmp_path) == before


def test_an_array_with_an_output_named_writes_it_and_returns_the_summary(reference, tmp_path):
    summary = blockpred.predict(DATA, "out.zarr", **PINNED)
    assert summary.output == "out.zarr" and summary.input == "numpy array 16x32x32 uint8"
    assert np.array_equal(read_volume(tmp_path / "out.zarr"), reference)
    assert not list((tmp_path / "tmp").iterdir())  # the input's copy is gone


@pytest.mark.parametrize("given, said", [
    pytest.param([[1, 2], [3, 4]], "got [[1, 2], [3, 4]] (of type list)", id="list"),
    pytest.param(7, "got 7 (of type int)", id="int"),
    pytest.param("no volume here", "cannot tell the format of 'no volume here'", id="string-not-a-path"),
    pytest.param(np.zeros((4, 4), np.uint8), "has 2 axes (4, 4); blockpred needs (z, y, x) or (c, z, y, x)",
                 id="two-axes"),
])
def test_anything_else_is_refused_in_one_line_that_names_what_is_taken_and_nothing_is_written(given, said, tmp_path):
    with pytest.raises(InvalidOptionError) as caught:
        blockpred.predict(given, **PINNED)
    message = str(caught.value)
    assert "\n" not in message and said in message
    assert any(taken in message for taken in ("numpy, dask or zarr array", "zarr (vol.zarr[/dataset])", "add a z axis"))
    assert leftovers(tmp_path) == []


def test_a_prediction_too_large_to_return_is_refused_in_one_line_that_says_to_name_an_output(tmp_path):
    with pytest.raises(MemoryBudgetError) as caught:
        blockpred.predict(DATA, memory_limit="64MiB", **PINNED)
    message = str(caught.value)
    assert "\n" not in message and isinstance(caught.value, InvalidOptionError)
    assert message.startswith("the prediction returned as an array must fit in memory, but it takes at least 64 KiB "
                              "(1x16x32x32 float32)")
    assert "over the memory limit of 0.06 GiB; name an output" in message
    assert leftovers(tmp_path) == []


def test_a_run_that_fails_after_the_copy_leaves_no_temporary_folder(tmp_path):
    with pytest.raises(InvalidOptionError, match="must be a non-empty box inside the volume"):
        blockpred.predict(DATA, roi="0:99,0:32,0:32", **PINNED)
    assert leftovers(tmp_path) == []


def test_plan_takes_paths_only_and_says_so_in_one_line(tmp_path):
    with pytest.raises(InvalidOptionError) as caught:
        blockpred.plan(DATA, **PINNED)
    assert str(caught.value).startswith("blockpred.plan takes a path to a volume (a str or pathlib.Path), got a "
                                        "ndarray; write an array to zarr")
    assert leftovers(tmp_path) == []


def test_the_check_once_the_networks_channels_are_known_names_them_and_says_no_at_least():
    from blockpred.config import make_config
    from blockpred.run.arrays import array_input, check_fits

    with pytest.raises(MemoryBudgetError, match=r"it takes 64.00 GiB \(1048576x16x32x32 float32\), and with the "):
        check_fits(array_input(DATA), 2**20, make_config(None, memory_limit="1GiB"))
    check_fits(array_input(DATA), 2, make_config(None))  # 256 KiB fits
