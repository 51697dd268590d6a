"""2D networks over 3D volumes, plane by plane: bioimage.io 2D packages, 2D TorchScript files and factories,
``--plane zy``, a 2D image, and the checks of options a 2D network cannot take."""

import os
import shutil

import numpy as np
import pytest
import torch
import yaml
from torch import nn

import blockpred
from blockpred.cli import main
from blockpred.io import open_volume
from blockpred.models import load_model
from blockpred.models.planes import PlaneNetwork, spatial_dims
from blockpred.models.tta import passes, with_tta
from tests.helpers import build_2d_package, write_test_volume
from tests.pipeline.test_exactness import em_like

SHAPE = (16, 48, 32)  # z, y, x: yx planes 48 x 32, zy planes 16 x 48 (the package takes 32 + k*16 per side)
HALO = 8  # the package's halo; the network's receptive radius is 5
TOLERANCE = 1e-5
EPS = 1e-6


class Net2d(nn.Module):
    """A small 2D U-Net: (b, 1, y, x) -> (b, 2, y, x), one pooling, a skip connection."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(1, 4, 3, padding=1)
        self.pool = nn.AvgPool2d(2)
        self.mid = nn.Conv2d(4, 4, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.out = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x):
        skip = torch.relu(self.down(x))
        return self.out(torch.cat([skip, self.up(torch.relu(self.mid(self.pool(skip))))], dim=1))


def make_net2d() -> Net2d:
    """The factory ``tests.models.test_planes:make_net2d``: seeded weights."""
    torch.manual_seed(0)
    return Net2d().eval()


def per_plane(net, planes: np.ndarray, halo: int = HALO) -> np.ndarray:
    """``net`` on each whole plane of ``planes`` (n, rows, cols), reflect-padded by ``halo``, cropped:
    (channels, n, rows, cols)."""
    padded = np.pad(planes.astype(np.float32), [(0, 0), (halo, halo), (halo, halo)], mode="reflect")
    with torch.inference_mode():
        out = net(torch.from_numpy(padded)[:, None]).numpy()
    return np.moveaxis(out[:, :, halo:-halo, halo:-halo], 1, 0)


def read_all(path: str) -> np.ndarray:
    volume = open_volume(path)
    return volume.read(volume.box)


def assert_close(got, expected):
    assert got.shape == expected.shape, (got.shape, expected.shape)
    diff = np.abs(got.astype(np.float64) - expected.astype(np.float64)).max()
    assert diff <= TOLERANCE, f"max |diff| {diff} exceeds {TOLERANCE}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("planes")
    raw = em_like(SHAPE, seed=5)
    net = make_net2d()
    scripted = root / "net2d.pt"
    torch.jit.script(net).save(str(scripted))
    return {"root": root, "raw": raw, "net": net, "scripted": scripted,
            "volume": write_test_volume(str(root / "vol.zarr"), raw, chunks=(4, 16, 16)),
            "package": build_2d_package(root, scripted, raw[0], halo=HALO, min_size=32, step=16)}


def _package_reference(setup, planes: np.ndarray) -> np.ndarray:
    """What the package computes on each whole plane: zero mean, unit variance by the volume's statistics
    (blockpred's for every plane of a volume), the network, a sigmoid."""
    values = setup["raw"].astype(np.float64)
    x = (planes.astype(np.float32) - np.float32(values.mean())) / np.float32(values.std() + EPS)
    return 1 / (1 + np.exp(-per_plane(setup["net"], x).astype(np.float64)))


def test_a_2d_package_predicts_each_plane_as_the_network_on_the_whole_plane(setup):
    target = str(setup["root"] / "package.zarr")
    summary = blockpred.predict(setup["volume"], target, model=str(setup["package"]), block=(4, 16, 16),
                                batch_size=2, device="cpu", progress=False, local=True)
    assert summary.plan.num_blocks == 4 * 3 * 2
    assert tuple(summary.plan.halo) == (0, HALO, HALO)  # the package's halo, none across planes
    assert summary.as_dict()["plane"] == "yx" and summary.planes_per_s > 0
    assert "2D network on yx planes: 8 planes of 16x16 per pass" in str(summary)  # batch 2 of 4 planes
    assert_close(read_all(target), _package_reference(setup, setup["raw"]))


def test_a_2d_package_with_state_dict_weights_builds_its_architecture_from_a_library(setup):
    folder = setup["root"] / "pkg2d-state"
    shutil.copytree(setup["package"].parent, folder)
    torch.save(setup["net"].state_dict(), folder / "state.pt")
    content = yaml.safe_load((folder / "rdf.yaml").read_text())
    content["weights"] = {"pytorch_state_dict": {"source": "state.pt", "pytorch_version": "2.0", "architecture": {
        "callable": "make_net2d", "import_from": "tests.models.test_planes"}}}
    (folder / "rdf.yaml").write_text(yaml.safe_dump(content))
    target = str(setup["root"] / "state.zarr")
    blockpred.predict(setup["volume"], target, model=str(folder / "rdf.yaml"), block=(16, 16, 16), device="cpu",
                      progress=False, local=True)
    assert_close(read_all(target), _package_reference(setup, setup["raw"]))


def test_plane_zy_equals_the_yx_prediction_of_the_volume_with_its_axes_swapped(setup):
    target = str(setup["root"] / "package-zy.zarr")
    assert main(["run", setup["volume"], target, "--model", str(setup["package"]), "--plane", "zy",
                 "--block", "16,16,4", "--local", "--device", "cpu", "--no-progress"]) == 0
    swapped = np.moveaxis(setup["raw"], 2, 0)  # (x, z, y): its yx planes are the volume's zy planes
    expected = np.moveaxis(_package_reference(setup, swapped), 1, 3)  # (c, x, z, y) -> (c, z, y, x)
    assert_close(read_all(target), expected)


def test_a_2d_torchscript_file_runs_plane_by_plane_and_tta_flips_within_planes(setup):
    data = setup["raw"].astype(np.float32) / 255
    source = write_test_volume(str(setup["root"] / "float.zarr"), data, chunks=(4, 16, 16))
    target = str(setup["root"] / "scripted.zarr")
    assert main(["run", source, target, "--model", str(setup["scripted"]), "--halo", f"0,{HALO},{HALO}",
                 "--block", "8,16,32", "--tta", "flips", "--local", "--device", "cpu", "--no-progress"]) == 0
    net, flips = setup["net"], [(), (1,), (2,), (1, 2)]
    expected = np.mean([np.flip(per_plane(net, np.flip(data, dims).copy()), tuple(d + 1 for d in dims))
                        for dims in flips], axis=0)
    assert_close(read_all(target), expected)
    loaded = load_model(str(setup["scripted"]))
    assert loaded.plane == "yx" and spatial_dims(torch.jit.load(str(setup["scripted"]))) == 2
    assert passes("flips", module=loaded.module) == 4 == len(with_tta(loaded.module, "flips").flips)


def test_a_2d_factory_predicts_a_2d_image(setup):
    image = setup["raw"][3].astype(np.float32) / 255
    source = write_test_volume(str(setup["root"] / "image.zarr"), image, chunks=(16, 16))
    target = str(setup["root"] / "image-out.zarr")
    summary = blockpred.predict(source, target, model="tests.models.test_planes:make_net2d", halo=(0, HALO, HALO),
                                block=(1, 16, 16), device="cpu", progress=False, local=True)
    assert summary.plan.num_blocks == 3 * 2
    got = read_all(target)
    assert got.shape == (2, 1) + image.shape  # a volume one plane deep
    assert_close(got, per_plane(setup["net"], image[None]))


def test_options_a_2d_network_cannot_take_get_one_line(setup, capsys):
    target = setup["root"] / "refused.zarr"
    cases = [
        (["--model", str(setup["scripted"]), "--halo", "2,8,8"], "halo 2,8,8 has 2 along z", "give --halo 0,8,8"),
        (["--model", str(setup["package"]), "--plane", "zy", "--halo", "0,8,8"], "has 8 along x",
         "give --halo 0,8,0"),
        (["--model", "tiny", "--plane", "zy"], "--plane zy runs 2D networks plane by plane", "drop --plane"),
    ]
    for options, *expected in cases:
        code = main(["run", setup["volume"], str(target), *options, "--local", "--device", "cpu", "--no-progress"])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("blockpred: error: "), (options, err)
        assert all(e in lines[0] for e in expected), lines[0]
        assert not target.exists() and not os.path.exists(str(target) + ".blockpred")


def test_the_wrapper_folds_the_stacking_axis_into_the_batch():
    seen = []

    class Recorder(nn.Module):
        def forward(self, x):
            seen.append(tuple(x.shape))
            return x[:, :1] * 2

    x = torch.arange(2 * 3 * 4 * 5 * 6, dtype=torch.float32).reshape(2, 3, 4, 5, 6)
    for plane, folded in (("yx", (8, 3, 5, 6)), ("zy", (12, 3, 4, 5)), ("zx", (10, 3, 4, 6))):
        assert torch.equal(PlaneNetwork(Recorder(), plane)(x), x[:, :1] * 2)
        assert seen.pop() == folded
