"""What `blockpred run` writes opens in other tools: zarr-python, tensorstore, OME-NGFF validators."""

import numpy as np
import ome_zarr_models.v05
import pytest
import tensorstore as ts
import torch
import zarr

import blockpred
from blockpred.io import open_volume
from tests.helpers import write_test_volume


@pytest.fixture
def em_volume(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 255, (16, 40, 36), dtype=np.uint8)
    return write_test_volume(str(tmp_path / "in.zarr/raw"), data, voxel_size=(40.0, 4.0, 4.0)), data


def test_a_zarr_v3_prediction_is_an_ome_0_5_image_readable_by_zarr_and_tensorstore(tmp_path, em_volume):
    path, _ = em_volume
    out = str(tmp_path / "pred.zarr")
    blockpred.predict(path, out, block=16, halo=4, output_dtype="uint8", progress=False, local=True)
    group = zarr.open_group(out, mode="r")
    image = ome_zarr_models.v05.Image.from_zarr(group)
    multiscale = image.ome_attributes.multiscales[0]
    assert [axis.name for axis in multiscale.axes] == ["c", "z", "y", "x"]
    assert list(multiscale.datasets[0].coordinateTransformations[0].scale) == [1.0, 40.0, 4.0, 4.0]
    via_zarr = zarr.open_array(out + "/0", mode="r")[...]
    via_ts = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": out + "/0"}}).result().read().result()
    via_blockpred = open_volume(out).read(open_volume(out).box)
    assert via_zarr.dtype == np.uint8 and via_zarr.shape == (2, 16, 40, 36)
    np.testing.assert_array_equal(via_zarr, via_ts)
    np.testing.assert_array_equal(via_zarr, via_blockpred)
    assert via_zarr.any()


def test_an_n5_prediction_opens_with_tensorstore_in_z_y_x_order(tmp_path):
    rng = np.random.default_rng(1)
    data = rng.integers(0, 255, (12, 20, 28), dtype=np.uint8)
    path = write_test_volume(str(tmp_path / "in.n5/raw"), data)
    summary = blockpred.predict(path, block=(4, 8, 12), halo=2, output_chunks=(4, 8, 4), progress=False, local=True)
    assert summary.output == str(tmp_path / "in.n5/prediction")
    store = ts.open({"driver": "n5", "kvstore": {"driver": "file", "path": summary.output}}).result()
    on_disk = store.read().result()  # N5 order: x, y, z, c
    assert on_disk.shape == (28, 20, 12, 2)
    ours = open_volume(summary.output)
    np.testing.assert_array_equal(on_disk.T, ours.read(ours.box))


def test_an_hdf5_input_gets_its_prediction_in_a_zarr_beside_its_file_never_inside_it(tmp_path):
    rng = np.random.default_rng(2)
    path = write_test_volume(str(tmp_path / "f.h5:/raw"), rng.integers(0, 255, (8, 16, 16), dtype=np.uint8))
    before = (tmp_path / "f.h5").read_bytes()
    summary = blockpred.predict(path, block=8, halo=2, progress=False, local=True)
    assert summary.output == str(tmp_path / "f.prediction.zarr")
    assert open_volume(summary.output).shape == (2, 8, 16, 16)
    assert (tmp_path / "f.h5").read_bytes() == before  # HDF5 has no journal: the input's file is never written


def test_an_output_named_inside_the_input_hdf5_file_is_written_there_with_one_warning(tmp_path, caplog):
    import h5py

    rng = np.random.default_rng(2)
    path = write_test_volume(str(tmp_path / "f.h5:/raw"), rng.integers(0, 255, (8, 16, 16), dtype=np.uint8))
    with caplog.at_level("WARNING", logger="blockpred"):
        blockpred.predict(path, f"{tmp_path}/f.h5:/prediction", block=8, halo=2, progress=False, local=True)
    said = [r.getMessage() for r in caplog.records if "own HDF5 file" in r.getMessage()]
    assert len(said) == 1 and "can leave the whole file unreadable" in said[0] and "f.prediction.zarr" in said[0]
    with h5py.File(tmp_path / "f.h5", "r") as f:
        assert f["prediction"].shape == (2, 8, 16, 16) and f["raw"].shape == (8, 16, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-5), ("bf16", 2e-2), ("fp16", 5e-3)])
def test_cuda_output_matches_cpu_output(tmp_path, em_volume, precision, tolerance):
    path, _ = em_volume
    cpu = blockpred.predict(path, str(tmp_path / "cpu.zarr"), block=16, halo=10, device="cpu", progress=False, local=True)
    gpu = blockpred.predict(path, str(tmp_path / "gpu.zarr"), block=16, halo=10, device="cuda",
                            precision=precision, batch_size=2, progress=False, local=True)
    a, b = open_volume(cpu.output), open_volume(gpu.output)
    assert np.abs(a.read(a.box) - b.read(b.box)).max() <= tolerance
