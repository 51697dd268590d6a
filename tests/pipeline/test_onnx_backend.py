"""``--backend onnxruntime``: presets, TorchScript files and factories run through ONNX Runtime and equal torch at
fp32; the export is cached; a network that does not export runs with torch and says why; a missing install is
one line."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import torch

import blockpred
from blockpred.cli import main
from blockpred.errors import InvalidOptionError
from blockpred.pipeline import Predictor
from blockpred.pipeline.onnx_backend import MISSING, onnxruntime_available
from tests import realnets
from tests.ci import needs
from tests.helpers import read_volume, write_test_volume

installed = needs(onnxruntime_available(), "onnxruntime (the onnx and test extras)")

TOLERANCE = 1e-5
#: Pinned, so that the two backends run the same blocks in the same batches (no halo: small inputs, fast).
PINNED = {"block": (16, 32, 32), "halo": 0, "batch_size": 1, "precision": "fp32", "progress": False, "local": True}


@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> str:
    data = np.random.default_rng(0).integers(0, 255, (16, 48, 40), dtype=np.uint8)
    return write_test_volume(str(tmp_path_factory.mktemp("onnx") / "v.zarr"), data)


@pytest.fixture(scope="module")
def networks(tmp_path_factory) -> dict:
    """A factory's weights and a TorchScript file (a scripted 3D U-Net that upsamples by F.interpolate)."""
    from blockpred.models.unet import UNet3d

    folder = tmp_path_factory.mktemp("networks")
    torch.manual_seed(0)
    torch.save(realnets.synapse_unet().state_dict(), folder / "synapse.pt")
    scripted = torch.jit.script(UNet3d(in_channels=1, out_channels=2, depth=2, initial_features=4).eval())
    scripted.save(str(folder / "unet3d.pt"))
    return {"synapse": str(folder / "synapse.pt"), "script": str(folder / "unet3d.pt")}


@installed
@pytest.mark.parametrize("options", [
    pytest.param({"model": "tiny"}, id="preset"),
    pytest.param({"model": "tests.realnets:synapse_unet", "weights": "synapse"}, id="factory-and-weights"),
    pytest.param({"model": "script"}, id="torchscript-file"),
])
def test_onnxruntime_equals_torch_at_fp32(volume, tmp_path, networks, options):
    options = {k: networks.get(v, v) for k, v in options.items()}
    blockpred.predict(volume, str(tmp_path / "torch.zarr"), backend="torch", **{**PINNED, **options})
    summary = blockpred.predict(volume, str(tmp_path / "ort.zarr"), backend="onnxruntime", **{**PINNED, **options})
    assert summary.backend == "onnxruntime"
    np.testing.assert_allclose(read_volume(tmp_path / "ort.zarr"), read_volume(tmp_path / "torch.zarr"), atol=TOLERANCE,
                               rtol=0)


@installed
def test_the_export_is_cached_and_a_second_predictor_exports_nothing():
    from blockpred.models import build_preset

    net, batch = build_preset("tiny"), np.random.default_rng(0).random((1, 1, 24, 24, 24), dtype=np.float32)
    first = Predictor(net, torch.device("cpu"), backend="onnxruntime", backend_key={"name": "tiny-cache-test"})
    first(batch)
    second = Predictor(net, torch.device("cpu"), backend="onnxruntime", backend_key={"name": "tiny-cache-test"})
    np.testing.assert_array_equal(second(batch), first(batch))
    assert (first._forward.cached, second._forward.cached) == (False, True)
    assert first.backend_note == second.backend_note == "onnxruntime"


class Opaque(torch.nn.Module):
    """A network the tracer cannot follow: it leaves torch for numpy, so a trace records a constant."""

    def forward(self, x):
        return torch.from_numpy(np.tanh(x.detach().cpu().numpy()))


@installed
def test_a_network_that_does_not_export_runs_with_torch_and_one_line_says_why(volume, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="blockpred"):
        summary = blockpred.predict(volume, str(tmp_path / "o.zarr"), model=Opaque(), backend="onnxruntime",
                                    **PINNED)
    warned = [r.getMessage() for r in caplog.records if "--backend onnxruntime" in r.getMessage()]
    assert len(warned) == 1 and "running it with torch" in warned[0], warned
    assert summary.backend.startswith("torch (onnxruntime: ")
    expected = np.tanh(read_volume(volume).astype(np.float32) / 255)
    np.testing.assert_allclose(read_volume(tmp_path / "o.zarr")[0], expected, atol=1e-6, rtol=0)


def test_a_missing_install_is_one_line_and_writes_nothing(volume, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # an import of it fails, as where it is not installed
    target = tmp_path / "out.zarr"
    code = main(["run", volume, str(target), "--model", "tiny", "--backend", "onnxruntime", "--block", "16,32,32",
                 "--no-progress", "--local"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and MISSING in err[0], err
    assert not target.exists()


@installed
def test_onnxruntime_refuses_a_precision_other_than_fp32_in_one_line():
    from blockpred.models import build_preset

    with pytest.raises(InvalidOptionError, match="--backend onnxruntime runs at fp32, got --precision bf16"):
        Predictor(build_preset("tiny"), torch.device("cpu"), "bf16", backend="onnxruntime")
