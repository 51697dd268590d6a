"""2D bioimage.io packages on 3D volumes: the package's 2D geometry lifted to the volume's, and its per-sample
statistics per plane (computed over the planes, stored with the run, applied to each plane of each block)."""

import logging
import shutil

import numpy as np
import pytest
import torch
import yaml
from torch import nn

import blockpred
from blockpred.cli import main
from blockpred.errors import InvalidOptionError, OutputExistsError
from blockpred.geometry import Coord
from blockpred.io import open_volume, parse_volume_path
from blockpred.pipeline.markers import DoneMarkers, markers_path
from blockpred.models.bioimageio import STATISTICS_KEY
from blockpred.models.bioimageio_planes import PLANES_KEY, PlaneStatistics
from blockpred.run.package_stats import RUN_FILE
from tests.helpers import build_2d_package, write_test_volume
from tests.models.test_planes import make_net2d

SHAPE = (3, 64, 48)  # three planes of very different brightness
HALO = 32  # as the published nuclei U-Net's; this network's receptive radius is 5
MIN, STEP, FIXED = 96, 16, 176  # input sizes 96 + k*16; the fixed package takes 176 only (blocks of 112)
TOLERANCE = 1e-5
EPS = 1e-6


def package_on_plane(net, plane: np.ndarray) -> np.ndarray:
    """What the package predicts for one whole plane: zero mean, unit variance by the plane's own mean and
    standard deviation, the network on the plane padded by the halo (reflect; one more at the end of an odd
    side), cropped, a sigmoid: (2, rows, cols)."""
    x = plane.astype(np.float32)
    x = (x - np.float32(x.astype(np.float64).mean())) / np.float32(x.astype(np.float64).std() + EPS)
    rows, cols = x.shape
    padded = np.pad(x, [(HALO, HALO + rows % 2), (HALO, HALO + cols % 2)], mode="reflect")  # even: one pooling
    with torch.inference_mode():
        out = net(torch.from_numpy(padded)[None, None]).numpy()[0]
    return 1 / (1 + np.exp(-out[:, HALO:HALO + rows, HALO:HALO + cols].astype(np.float64)))


def package_on_volume(net, raw: np.ndarray) -> np.ndarray:
    return np.stack([package_on_plane(net, plane) for plane in raw], axis=1)


def read_all(path) -> np.ndarray:
    volume = open_volume(str(path))
    return volume.read(volume.box)


def assert_close(got, expected):
    assert got.shape == expected.shape, (got.shape, expected.shape)
    diff = np.abs(got.astype(np.float64) - expected.astype(np.float64)).max()
    assert diff <= TOLERANCE, f"max |diff| {diff} exceeds {TOLERANCE}"


def planes_of(seed: int) -> np.ndarray:
    """Three planes: plane 1 is twice plane 0 plus 50, plane 2 another image at another scale (float32)."""
    rng = np.random.default_rng(seed)
    first = rng.random(SHAPE[1:]).astype(np.float32)
    return np.stack([first, 2 * first + 50, rng.normal(-3, 10, SHAPE[1:]).astype(np.float32)])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("planes2d")
    net = make_net2d()
    scripted = root / "net2d.pt"
    torch.jit.script(net).save(str(scripted))
    rng = np.random.default_rng(7)
    raw = planes_of(0)
    sized = build_2d_package(root, scripted, rng.random((MIN + STEP, MIN)).astype(np.float32) * 4 + 1, halo=HALO,
                             min_size=MIN, step=STEP, zmuv_axes=("x", "y"), name="sized")
    fixed = build_2d_package(root, scripted, rng.random((FIXED, FIXED)).astype(np.float32), halo=HALO,
                             min_size=MIN, step=STEP, zmuv_axes=("x", "y"), name="fixed")
    content = yaml.safe_load(fixed.read_text())
    for axis in content["inputs"][0]["axes"]:
        if axis.get("type") == "space":
            axis["size"] = FIXED  # fixed input 176 x 176: blocks of 176 - 2 * 32 = 112
    fixed.write_text(yaml.safe_dump(content))
    return {"root": root, "net": net, "scripted": scripted, "raw": raw, "sized": sized, "fixed": fixed,
            "volume": write_test_volume(str(root / "vol.zarr/raw"), raw, chunks=(1, 32, 48))}


@pytest.mark.parametrize("package", [
    pytest.param("fixed", id="fixed-input-176"),
    pytest.param("sized", id="input-96-plus-k-16"),
])
def test_blockpred_run_of_a_2d_package_with_no_options_predicts_each_plane_as_the_package_does(setup, package,
                                                                                              tmp_path):
    """The reported failure ("dimension mismatch: (3, 512, 512) has 3 axes, (112, 112) has 2"): a fixed input
    shape's block was the package's 2D (rows, cols), never lifted to (planes, rows, cols)."""
    target = tmp_path / "out.zarr"
    assert main(["run", setup["volume"], str(target), "--model", str(setup[package])]) == 0
    assert_close(read_all(target), package_on_volume(setup["net"], setup["raw"]))
    fingerprint = DoneMarkers.open(markers_path(parse_volume_path(str(target)))).fingerprint
    assert fingerprint["plane"] == "yx" and fingerprint["halo"] == [0, HALO, HALO]
    if package == "fixed":
        assert fingerprint["block"] == [1, FIXED - 2 * HALO, FIXED - 2 * HALO]


def test_each_plane_gets_its_own_statistics_in_blocks_deeper_than_the_planes_left(setup, tmp_path):
    target = tmp_path / "blocks.zarr"
    summary = blockpred.predict(setup["volume"], str(target), model=str(setup["sized"]), block=(2, 32, 32),
                                batch_size=2, device="cpu", progress=False, local=True)
    assert summary.plan.num_blocks == 2 * 2 * 2  # the second z block reads planes 2 and 3 (3 reflects plane 1)
    assert_close(read_all(target), package_on_volume(setup["net"], setup["raw"]))
    # The table the run used: each plane's own mean and standard deviation, the fingerprint holding its sha256.
    folder = markers_path(parse_volume_path(str(target)))
    table = PlaneStatistics.from_json((folder / RUN_FILE).read_text())
    (key,) = table.values
    values = setup["raw"].reshape(3, -1).astype(np.float64)
    assert table.values[key]["mean"][:, 0] == pytest.approx(values.mean(axis=1), rel=1e-12)
    assert table.values[key]["std"][:, 0] == pytest.approx(values.std(axis=1), rel=1e-12)
    assert (table.axis, table.first, table.num_planes) == (0, 0, 3)
    stated = DoneMarkers.open(folder).fingerprint["model_kwargs"][STATISTICS_KEY]
    assert stated == {PLANES_KEY: f"sha256:{table.sha256}"}  # the hash, not the numbers


def test_a_resume_reads_the_stored_statistics_and_another_volume_is_another_run(setup, tmp_path, monkeypatch,
                                                                                  caplog):
    from blockpred.run import package_stats

    target = tmp_path / "resumed.zarr"
    options = dict(model=str(setup["sized"]), block=(1, 32, 32), device="cpu", progress=False, local=True)
    blockpred.predict(setup["volume"], str(target), **options)
    # A run cut short: the marks of all but the first 5 of its 12 blocks lost (those blocks are computed again).
    folder = markers_path(parse_volume_path(str(target)))
    (log,) = (folder / "done").iterdir()
    log.write_bytes(log.read_bytes()[:5 * 8])

    def recomputed(*args, **kwargs):
        raise AssertionError("a resume computed the per-plane statistics again")

    monkeypatch.setattr(package_stats, "compute_plane_statistics", recomputed)
    with caplog.at_level(logging.INFO, logger="blockpred.run.package_stats"):
        again = blockpred.predict(setup["volume"], str(target), **options)
    assert (again.num_resumed, again.stats.num_blocks) == (5, 7)
    assert "per-plane statistics of 3 planes stored with the run" in caplog.text
    assert_close(read_all(target), package_on_volume(setup["net"], setup["raw"]))
    monkeypatch.undo()
    # Another volume (other planes, other statistics) at the same output: another run, refused.
    other = write_test_volume(str(tmp_path / "other.zarr/raw"), planes_of(1)[::-1].copy(), chunks=(1, 32, 48))
    with pytest.raises(OutputExistsError, match="made with other settings") as refused:
        blockpred.predict(other, str(target), **options)
    assert "input " in str(refused.value) and "model_kwargs " in str(refused.value)


def test_each_block_names_the_volume_plane_of_every_input_plane_reflected_past_the_edge(tmp_path):
    from blockpred.pipeline.blocking import plan_blocks
    from blockpred.io import create_volume
    from blockpred.pipeline import PipelineSettings, Predictor, resolve_device, run_blocks

    seen = []

    class Recorder(nn.Module):
        def forward(self, x, planes=None):
            seen.append(None if planes is None else planes.tolist())
            return x

    source = open_volume(write_test_volume(str(tmp_path / "in.zarr"), np.zeros((3, 8, 8), np.float32)))
    plan = plan_blocks(volume_shape=source.spatial_shape, block_shape=Coord((2, 8, 8)), halo=Coord((0, 0, 0)),
                       roi=source.box)
    for mode, padded in (("reflect", 1), ("edge", 2), ("constant", -1)):
        with create_volume(str(tmp_path / f"out-{mode}.zarr"), spatial_shape=source.spatial_shape, num_channels=1,
                           dtype=np.float32, chunk_shape=(2, 8, 8), ome=False) as sink:
            run_blocks(iter(plan), source=source, sink=sink, predictor=Predictor(Recorder(), resolve_device("cpu")),
                       settings=PipelineSettings(batch_size=2, planes_along=0, pad_mode=mode))
        assert seen.pop() == [[0, 1], [2, padded]], mode  # one batch of both blocks


def test_per_plane_constants_are_looked_up_by_the_plane_each_input_plane_reads():
    from blockpred.models.bioimageio_ops import PlaneNormalize

    op = PlaneNormalize(sub=[[0.0], [10.0], [20.0]], div=[[1.0], [2.0], [4.0]], first=5, dim=2)
    x = torch.full((2, 1, 3, 1, 1), 40.0)
    planes = torch.tensor([[5, 6, 7], [7, 6, 9]])  # plane 9 is past the table: its nearest row (7)
    assert op(x, planes)[:, 0, :, 0, 0].tolist() == [[40.0, 15.0, 5.0], [5.0, 15.0, 5.0]]
    assert op(x)[:, 0, :, 0, 0].tolist() == [[40.0, 15.0, 5.0]] * 2  # no planes named: the table's first ones


@pytest.mark.parametrize("axes, per_plane", [
    pytest.param(["x", "y"], True, id="x-y"),
    pytest.param(["channel", "y", "x"], True, id="channel-y-x"),
    pytest.param(["batch", "x", "y"], False, id="batch-x-y-over-the-volume"),
    pytest.param(None, False, id="no-axes-over-the-volume"),
])
def test_a_2d_packages_statistics_are_per_plane_when_its_axes_leave_the_batch_out(setup, tmp_path, axes, per_plane):
    from blockpred.models.bioimageio import read_package

    folder = tmp_path / "edited"
    shutil.copytree(setup["sized"].parent, folder)
    content = yaml.safe_load((folder / "rdf.yaml").read_text())
    step = next(p for p in content["inputs"][0]["preprocessing"] if p["id"] == "zero_mean_unit_variance")
    step["kwargs"] = {} if axes is None else {"axes": axes}
    (folder / "rdf.yaml").write_text(yaml.safe_dump(content))
    (step,) = [s for s in read_package(folder / "rdf.yaml").pre if s.stat]
    assert step.per_plane == per_plane


def test_a_step_over_the_volume_after_one_per_plane_is_refused_in_one_line(setup, tmp_path):
    from blockpred.models.bioimageio import read_package

    folder = tmp_path / "after"
    shutil.copytree(setup["sized"].parent, folder)
    content = yaml.safe_load((folder / "rdf.yaml").read_text())
    content["inputs"][0]["preprocessing"].append({"id": "scale_range", "kwargs": {"axes": ["batch", "y", "x"]}})
    (folder / "rdf.yaml").write_text(yaml.safe_dump(content))
    with pytest.raises(InvalidOptionError, match="after a step with statistics per plane"):
        read_package(folder / "rdf.yaml")


def test_the_planes_statistics_on_dask_workers_are_those_of_the_thread_pool(setup):
    from distributed import LocalCluster

    from blockpred.models.bioimageio import read_package
    from blockpred.models.bioimageio_planes import Processing
    from blockpred.run.package_stats import compute_plane_statistics

    package = read_package(setup["sized"])
    path = parse_volume_path(setup["volume"]).absolute()
    args = dict(axis=0, first=1, end=3, given={})
    with open_volume(path) as source:
        here = compute_plane_statistics(Processing(package.pre, package.post), source, threads=2, **args)
        with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as cluster:
            there = compute_plane_statistics(Processing(package.pre, package.post), source, source_path=path,
                                             scheduler=cluster.scheduler_address, **args)
    assert there == here and here.num_planes == 2


def test_blockpred_plan_reads_one_plane_for_its_dry_run_not_every_plane(setup, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="blockpred"):
        plan = blockpred.plan(setup["volume"], str(tmp_path / "planned.zarr"), model=str(setup["sized"]),
                              device="cpu")
    assert plan.plan.num_blocks > 0 and not (tmp_path / "planned.zarr").exists()
    assert "computed the per-plane statistics of 1 planes" in caplog.text
    assert "the plan's dry run takes the first plane's for all" in caplog.text


def test_zy_planes_stacked_along_x_each_get_their_own_statistics(setup, tmp_path):
    target = tmp_path / "zy.zarr"
    blockpred.predict(setup["volume"], str(target), model=str(setup["sized"]), plane="zy", block=(32, 32, 8),
                      device="cpu", progress=False, local=True)
    swapped = np.moveaxis(setup["raw"], 2, 0)  # (x, z, y): its planes are the volume's zy planes
    assert_close(read_all(target), np.moveaxis(package_on_volume(setup["net"], swapped), 1, 3))


class Wide2d(nn.Module):
    """A 2D network whose receptive radius (14) reaches far past the halo its package will state (4)."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Sequential(*[m for i in range(5) for m in (nn.Conv2d(1 if i == 0 else 4, 4, 3, padding=1),
                                                                 nn.ELU())])
        self.down = nn.MaxPool2d(2)
        self.mid = nn.Sequential(*[m for _ in range(4) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.ELU())])
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        a = self.pre(x)
        b = nn.functional.interpolate(self.mid(self.down(a)), scale_factor=2.0, mode="nearest")
        return self.out(torch.cat([a, b], 1))


def test_a_package_whose_stated_halo_is_below_its_field_runs_with_the_fields_halo_and_equals_its_whole_plane(
        tmp_path):
    """The package states halo 4; its measured field reaches 14: the run takes the field's halo (16, on the grid),
    says so in one line and in the summary, and blocks of 64 inside a 256 plane equal the package on the whole
    plane away from its edges, where the stated halo leaves seams."""
    torch.manual_seed(0)
    net = Wide2d().eval()
    torch.jit.script(net).save(str(tmp_path / "wide.pt"))
    rng = np.random.default_rng(3)
    package = build_2d_package(tmp_path, tmp_path / "wide.pt", rng.random((96, 96)).astype(np.float32), halo=4,
                               min_size=32, step=16, zmuv_axes=("x", "y"), name="wide")
    raw = (rng.random((2, 256, 256)) * 4 + 1).astype(np.float32)
    source = write_test_volume(str(tmp_path / "vol.zarr/raw"), raw)
    common = dict(model=str(package), block=(1, 64, 64), progress=False, local=True)
    checked = blockpred.predict(source, str(tmp_path / "checked.zarr"), **common)
    assert tuple(checked.plan.halo) == (0, 16, 16) and checked.halo.stated == Coord((0, 4, 4))
    assert "not the 0x4x4 the package states" in str(checked) and checked.as_dict()["stated_halo"] == [0, 4, 4]
    stated = blockpred.predict(source, str(tmp_path / "stated.zarr"), halo=(0, 4, 4), **common)
    whole = np.stack([_package_whole_plane(net, plane) for plane in raw], axis=1)
    inner = (slice(None), slice(None), slice(64, 192), slice(64, 192))
    assert np.abs(read_all(checked.output)[inner] - whole[inner]).max() <= 1e-5
    assert np.abs(read_all(stated.output)[inner] - whole[inner]).max() > 1e-3  # the stated halo leaves seams


def _package_whole_plane(net, plane: np.ndarray) -> np.ndarray:
    """The package on one whole plane as bioimage.io runs it: the plane's own mean and std, the network, a
    sigmoid (2, rows, cols)."""
    x = plane.astype(np.float32)
    x = (x - np.float32(x.astype(np.float64).mean())) / np.float32(x.astype(np.float64).std() + EPS)
    with torch.inference_mode():
        out = net(torch.from_numpy(x)[None, None]).numpy()[0]
    return 1 / (1 + np.exp(-out.astype(np.float64)))
