"""bioimage.io model packages: built here, offline, with bioimageio.spec; predicted blockwise; bad ones refused."""

import os
import re
import shutil

import numpy as np
import pytest
import torch
import yaml

import blockpred
from blockpred.cli import main
from blockpred.errors import InputNotFoundError, InvalidOptionError, ModelLoadError, UntrustedPickleError
from blockpred.geometry import Coord
from blockpred.io import open_volume
from blockpred.models import load_model
from blockpred.models.bioimageio import STATISTICS_KEY, is_package, package_sha256, read_package
from blockpred.models.unet import UNet3d
from tests.helpers import write_test_volume

SHAPE = (32, 64, 64)
#: The network's receptive radius (22) plus one pooling step (4): blockwise equals the whole volume.
HALO = 26
BLOCK = (16, 32, 32)  # 2 x 2 x 2 blocks
TOLERANCE = 1e-4
EPS = 1e-6
#: Statistics for the scale_range package by hand (its step 1; step 0 is the ensure_dtype bioimageio.spec adds).
RANGE_0_255 = {STATISTICS_KEY: {"pre.1": {"lo": [0.0], "hi": [255.0]}}}


def make_unet() -> UNet3d:
    torch.manual_seed(0)
    return UNet3d(in_channels=1, out_channels=2, depth=2, initial_features=4, growth=2, pool_factors=2,
                  padding="same", activation="relu", final_activation="none").eval()


class ChannelsLast(torch.nn.Module):
    """The U-Net on (b, z, y, x, c) in and out: a package whose axes are not blockpred's order."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x.permute(0, 4, 1, 2, 3)).permute(0, 2, 3, 4, 1)


def whole_volume(net, x: np.ndarray) -> np.ndarray:
    """The network on the whole preprocessed (1, c, z, y, x) volume, padded by the halo (reflect), cropped."""
    padded = np.pad(x, [(0, 0), (0, 0)] + [(HALO, HALO)] * 3, mode="reflect")
    with torch.inference_mode():
        out = net(torch.from_numpy(padded.astype(np.float32))).numpy()
    return out[(slice(None), slice(None)) + tuple(slice(HALO, HALO + s) for s in SHAPE)]


def em_like(seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.normal(128, 40, size=SHAPE), 0, 255).astype(np.uint8)


def run_net(net, x: np.ndarray) -> np.ndarray:
    """The network on a whole float32 (1, c, z, y, x) array, no padding (as bioimage.io's test_model runs it)."""
    with torch.inference_mode():
        return net(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).numpy()


def padded_test_input(raw: np.ndarray, fixed: bool = False) -> np.ndarray:
    """``raw`` (c, z, y, x) reflect-padded to a size the test packages take (56 + k*4, or the fixed 16 + 2 * halo),
    as float32 (1, c, z, y, x): a package's test input must be one its network accepts."""
    sizes = [16 + 2 * HALO] * 3 if fixed else [56 + max(0, -(-(n - 56) // 4)) * 4 for n in raw.shape[1:]]
    pads = [(0, 0)] + [((s - n) // 2, s - n - (s - n) // 2) for s, n in zip(sizes, raw.shape[1:])]
    return np.pad(raw, pads, mode="reflect").astype(np.float32)[None]


def build_package(root, name, *, raw, reference, weights_file, preprocessing=(), postprocessing=(),
                  channels_last=False, fixed=False, batch=True):
    """A model package in folder ``root/name`` (rdf.yaml) and ``root/name.zip``, made by bioimageio.spec.

    ``raw`` (z, y, x) or (c, z, y, x), padded to a size the package takes (:func:`padded_test_input`), is its test
    input, and ``reference(x)`` of that (1, c, z, y, x) input, the package's processing and network on the
    whole tensor, (1, c, z, y, x), its test output; ``channels_last``: the network's axes are (b, z, y, x, c);
    ``batch=False``: (c, z, y, x), no batch axis.
    """
    from bioimageio.spec import ValidationContext, save_bioimageio_package, save_bioimageio_package_as_folder
    from bioimageio.spec.common import FileDescr
    from bioimageio.spec.generic.v0_3 import Author, CiteEntry, Doi, LicenseId
    from bioimageio.spec.model import v0_5 as m

    work = root / f"{name}-src"
    work.mkdir()
    raw = raw if raw.ndim == 4 else raw[None]
    test_in = padded_test_input(raw, fixed)
    test_out = np.asarray(reference(test_in), dtype=np.float32)
    if not batch:
        test_in, test_out = test_in[0], test_out[0]
    if channels_last:
        test_in, test_out = np.moveaxis(test_in, 1, -1), np.moveaxis(test_out, 1, -1)
    np.save(work / "input.npy", test_in)
    np.save(work / "output.npy", test_out)
    shutil.copy(weights_file, work / "weights.pt")

    def space(axis_id):
        size = 16 + 2 * HALO if fixed else m.ParameterizedSize(min=56, step=4)
        return m.SpaceInputAxis(id=m.AxisId(axis_id), size=size)

    def space_out(axis_id):
        return m.SpaceOutputAxisWithHalo(id=m.AxisId(axis_id), halo=HALO,
                                         size=m.SizeReference(tensor_id=m.TensorId("raw"), axis_id=m.AxisId(axis_id)))

    in_channel = m.ChannelAxis(channel_names=[m.Identifier(f"em{i}") for i in range(raw.shape[0])])
    out_channel = m.ChannelAxis(channel_names=[m.Identifier("a"), m.Identifier("b")])
    in_axes = [m.BatchAxis()] * batch + [*map(space, "zyx")]
    out_axes = [m.BatchAxis()] * batch + [*map(space_out, "zyx")]
    in_axes.insert(len(in_axes) if channels_last else int(batch), in_channel)
    out_axes.insert(len(out_axes) if channels_last else int(batch), out_channel)
    with ValidationContext(perform_io_checks=False, root=work):
        descr = m.ModelDescr(
            name=f"blockpred test {name}", description="a tiny 3D U-Net for blockpred's tests",
            authors=[Author(name="blockpred")], cite=[CiteEntry(text="blockpred", doi=Doi("10.1000/xyz"))],
            license=LicenseId("MIT"),
            inputs=[m.InputTensorDescr(id=m.TensorId("raw"), axes=in_axes, test_tensor=FileDescr(source="input.npy"),
                                       preprocessing=list(preprocessing))],
            outputs=[m.OutputTensorDescr(id=m.TensorId("pred"), axes=out_axes,
                                         test_tensor=FileDescr(source="output.npy"),
                                         postprocessing=list(postprocessing))],
            weights=m.WeightsDescr(torchscript=m.TorchscriptWeightsDescr(
                source="weights.pt", pytorch_version=m.Version(torch.__version__.split("+")[0]))),
        )
        folder = save_bioimageio_package_as_folder(descr, output_path=root / name)
        save_bioimageio_package(descr, output_path=root / f"{name}.zip")
    return folder / "rdf.yaml"


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """A volume and packages over it, built once: scale_range (percentiles) + clip, and zero_mean_unit_variance
    on a channels-last network with postprocessing; their test outputs computed with numpy on the whole volume."""
    from bioimageio.spec.model import v0_5 as m

    root = tmp_path_factory.mktemp("bioimageio")
    raw = em_like()
    volume = write_test_volume(str(root / "vol.zarr/raw"), raw, chunks=(16, 32, 32))
    net = make_unet()
    scripted = root / "unet.pt"
    torch.jit.script(net).save(str(scripted))
    wrapped = root / "unet_channels_last.pt"
    torch.jit.script(ChannelsLast(net)).save(str(wrapped))

    values = raw.astype(np.float32)[None, None]
    lo, hi = np.percentile(values, [1.0, 99.5])
    x = np.clip((values - np.float32(lo)) / np.float32(hi - lo + EPS), 0.0, 1.0)
    expected_range = whole_volume(net, x)
    scale_range = build_package(
        root, "scale_range", raw=raw, reference=lambda t: run_net(net, np.clip(scale_range_of(t, 1.0, 99.5), 0, 1)),
        weights_file=scripted,
        preprocessing=[m.ScaleRangeDescr(kwargs=m.ScaleRangeKwargs(
                           axes=[m.AxisId(a) for a in ("channel", "z", "y", "x")], min_percentile=1.0,
                           max_percentile=99.5)),
                       m.ClipDescr(kwargs=m.ClipKwargs(min=0.0, max=1.0))])

    mean, std = values.astype(np.float64).mean(), values.astype(np.float64).std()
    x = (values - np.float32(mean)) / np.float32(std + EPS)
    expected_zmuv = whole_volume(net, x) * 2.0 + 0.5
    zmuv = build_package(
        root, "zmuv", raw=raw, reference=lambda t: run_net(net, zero_mean_unit_variance(t)) * 2.0 + 0.5,
        weights_file=wrapped, channels_last=True,
        preprocessing=[m.ZeroMeanUnitVarianceDescr(kwargs=m.ZeroMeanUnitVarianceKwargs(
            axes=[m.AxisId(a) for a in ("batch", "z", "y", "x")]))],
        postprocessing=[m.ScaleLinearDescr(kwargs=m.ScaleLinearKwargs(gain=2.0, offset=0.5))])
    return {"root": root, "volume": volume, "raw": raw, "net": net, "scripted": scripted,
            "scale_range": (scale_range, expected_range, (lo, hi)), "zmuv": (zmuv, expected_zmuv, (mean, std))}


def scale_range_of(x: np.ndarray, lo_q: float, hi_q: float, per_channel: bool = False) -> np.ndarray:
    """scale_range of (1, c, z, y, x) float32 by its own percentiles (per channel, or over all channels)."""
    values = x[0].reshape(x.shape[1], -1) if per_channel else x.reshape(1, -1)
    lo, hi = np.percentile(values, [lo_q, hi_q], axis=1)
    shape = (1, -1, 1, 1, 1)
    return (x - lo.astype(np.float32).reshape(shape)) / (hi - lo + EPS).astype(np.float32).reshape(shape)


def zero_mean_unit_variance(x: np.ndarray) -> np.ndarray:
    """zero_mean_unit_variance of float32 ``x`` by its own mean and standard deviation (float64, ddof 0)."""
    values = x.astype(np.float64)
    return (x - np.float32(values.mean())) / np.float32(values.std() + EPS)


def predict(packages, model, out_name, **options):
    target = str(packages["root"] / f"{out_name}.zarr")
    summary = blockpred.predict(packages["volume"], target, model=str(model), block=BLOCK, device="cpu",
                                batch_size=2, memory_format="contiguous", progress=False, local=True, **options)
    assert summary.plan.num_blocks == 8
    out = open_volume(target)
    return out.read(out.box), target


def assert_close(got, expected):
    diff = np.abs(got.astype(np.float64) - expected.astype(np.float64)).max()
    assert diff <= TOLERANCE, f"max |diff| {diff} exceeds {TOLERANCE}"


# ---------------------------------------------------------------------- predicting


def test_a_package_with_percentile_scaling_predicts_blockwise_as_the_network_on_the_whole_volume(packages):
    """(Its test output is the network on its test input, unpadded, as bioimage.io's test_model runs it: the run
    checks it first, see tests/models/test_check.py; the blocks equal the whole volume padded by the halo.)"""
    rdf, expected, _ = packages["scale_range"]
    got, _ = predict(packages, rdf, "scale_range")
    assert_close(got, expected[0])  # computed here from numpy's percentiles of the whole volume


def test_a_zipped_channels_last_package_with_dataset_statistics_and_postprocessing_predicts_blockwise(packages):
    rdf, expected, _ = packages["zmuv"]
    zipped = rdf.parent.parent / "zmuv.zip"
    got, _ = predict(packages, zipped, "zmuv")
    assert_close(got, expected[0])


RDF_0_4 = """
format_version: 0.4.10
type: model
name: blockpred test 0.4
description: a format 0.4 package, converted to 0.5 on load
authors: [{name: blockpred}]
cite: [{text: blockpred, doi: 10.1000/xyz}]
license: MIT
documentation: README.md
timestamp: 2026-11-23T00:00:00
test_inputs: [input.npy]
test_outputs: [output.npy]
inputs:
  - {name: raw, axes: bczyx, data_type: float32, data_range: [-.inf, .inf],
     shape: {min: [1, 1, 56, 56, 56], step: [0, 0, 4, 4, 4]},
     preprocessing: [{name: zero_mean_unit_variance, kwargs: {mode: per_dataset, axes: zyx}}]}
outputs:
  - {name: pred, axes: bczyx, data_type: float32, data_range: [-.inf, .inf], halo: [0, 0, HALO, HALO, HALO],
     shape: {reference_tensor: raw, scale: [1, 1, 1, 1, 1], offset: [0, 1, 0, 0, 0]},
     postprocessing: [{name: sigmoid}]}
weights:
  torchscript: {source: weights.pt}
"""


def test_a_format_0_4_package_with_per_dataset_statistics_predicts_blockwise(packages, tmp_path):
    folder = tmp_path / "v04"
    shutil.copytree(packages["scale_range"][0].parent, folder)
    (folder / "README.md").write_text("# a test package\n")
    (folder / "rdf.yaml").write_text(RDF_0_4.replace("HALO", str(HALO)))
    test_input = np.load(folder / "input.npy")  # its test output: what this package makes of it
    np.save(folder / "output.npy", 1 / (1 + np.exp(-run_net(packages["net"], zero_mean_unit_variance(test_input)))))
    values = packages["raw"].astype(np.float64)[None, None]
    x = ((values - values.mean()) / (values.std() + EPS)).astype(np.float32)
    expected = 1 / (1 + np.exp(-whole_volume(packages["net"], x).astype(np.float64)))
    got, _ = predict(packages, folder / "rdf.yaml", "v04")
    assert_close(got, expected[0])


def test_the_statistics_are_numpys_over_the_volume_and_part_of_the_runs_fingerprint(packages):
    from blockpred.pipeline.markers import DoneMarkers, markers_path
    from blockpred.io import parse_volume_path

    (rdf, _, (lo, hi)), (zmuv, _, (mean, std)) = packages["scale_range"], packages["zmuv"]
    plan = blockpred.plan(packages["volume"], str(packages["root"] / "planned.zarr"), model=str(rdf), block=BLOCK,
                          device="cpu", batch_size=1, memory_format="contiguous")
    assert plan.plan.halo == Coord((HALO,) * 3)  # the package's halo is the default
    assert not os.path.exists(packages["root"] / "planned.zarr")
    _, target = predict(packages, zmuv, "zmuv-fingerprint")
    stats = DoneMarkers.open(markers_path(parse_volume_path(target))).fingerprint["model_kwargs"][STATISTICS_KEY]
    (step,) = stats.values()  # the one step that needs statistics (bioimageio.spec adds ensure_dtype steps)
    assert step["mean"] == pytest.approx([mean], rel=1e-12) and step["std"] == pytest.approx([std], rel=1e-12)
    again = blockpred.predict(packages["volume"], target, model=str(zmuv), block=BLOCK, device="cpu", batch_size=2,
                              memory_format="contiguous", progress=False, local=True)
    assert again.num_resumed == 8  # the same statistics again: the run resumes, nothing is redone
    from blockpred.models.bioimageio import read_package
    from blockpred.models.bioimageio_stats import compute_statistics
    from blockpred.run.package_stats import volume_sample

    sample = volume_sample(open_volume(packages["volume"]))
    (percentiles,) = compute_statistics(read_package(rdf), sample).values()
    assert (percentiles["lo"], percentiles["hi"]) == (pytest.approx([lo]), pytest.approx([hi]))


def test_a_loaded_package_says_its_name_channels_halo_and_input_sizes(packages):
    rdf = packages["scale_range"][0]
    loaded = load_model(str(rdf), model_kwargs=RANGE_0_255)
    assert (loaded.name, loaded.kind) == ("blockpred test scale_range", "bioimageio")
    assert (loaded.in_channels, loaded.out_channels, loaded.padding) == (1, 2, "same")
    assert loaded.downsampling == Coord((4, 4, 4)) and loaded.default_halo == Coord((HALO,) * 3)
    assert loaded.default_block == Coord((64, 64, 64))
    assert len(loaded.weights_sha256) == 64
    assert loaded.weights_sha256 == package_sha256(read_package(rdf))  # told without loading (a check's cache key)
    with pytest.raises(ValueError, match="accepts network inputs of z 56 \\+ k\\*4"):
        loaded.module(torch.zeros(1, 1, 18, 16, 16))


def test_a_fixed_input_shape_makes_the_default_block_and_refuses_others(packages, tmp_path):
    raw = packages["raw"]
    rdf = build_package(tmp_path, "fixed", raw=raw, reference=lambda t: run_net(packages["net"], t),
                        weights_file=packages["scripted"], fixed=True)
    loaded = load_model(str(rdf))
    assert loaded.default_block == Coord((16, 16, 16)) and loaded.downsampling == Coord((1, 1, 1))
    out = loaded.module(torch.zeros(1, 1, 16 + 2 * HALO, 16 + 2 * HALO, 16 + 2 * HALO))
    assert out.shape == (1, 2) + (16 + 2 * HALO,) * 3
    with pytest.raises(ValueError, match="exactly 68"):
        loaded.module(torch.zeros(1, 1, 72, 68, 68))
    options = dict(model=str(rdf), roi="0:16,0:32,0:32", device="cpu", progress=False, local=True)
    summary = blockpred.predict(packages["volume"], str(tmp_path / "fixed.zarr"), **options)
    assert summary.plan.block_shape == Coord((16, 16, 16)) and summary.plan.num_blocks == 4
    with pytest.raises(ModelLoadError, match="accepts network inputs of z exactly 68"):
        blockpred.predict(packages["volume"], str(tmp_path / "other.zarr"), block=32, **options)
    assert not (tmp_path / "other.zarr").exists()


def test_an_architecture_from_an_installed_library_loads_a_state_dict_without_trust(packages, tmp_path):
    rdf = _edited(packages, tmp_path, "library", _state_dict_weights(packages, tmp_path / "library", {
        "import_from": "blockpred.models.unet", "callable": "UNet3d",
        "kwargs": {"in_channels": 1, "out_channels": 2, "depth": 2, "initial_features": 4,
                   "activation": "relu", "final_activation": "none"}}))
    loaded = load_model(str(rdf), model_kwargs=RANGE_0_255)
    x = torch.rand(1, 1, 56, 56, 56)
    with torch.inference_mode():
        assert torch.allclose(loaded.module(x * 255), packages["net"](torch.clamp(x, 0, 1)), atol=1e-5)


def test_an_architecture_source_in_the_package_runs_only_with_trust(packages, tmp_path):
    marker = tmp_path / "ran"
    rdf = _edited(packages, tmp_path, "source", _state_dict_weights(packages, tmp_path / "source", {
        "source": "arch.py", "callable": "make"}))
    (rdf.parent / "arch.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from blockpred.models.unet import UNet3d\n"
        "def make():\n"
        "    return UNet3d(in_channels=1, out_channels=2, depth=2, initial_features=4, activation='relu', final_activation='none')\n")
    stats = RANGE_0_255
    with pytest.raises(UntrustedPickleError, match="--trust-pickle"):
        load_model(str(rdf), model_kwargs=stats)
    assert not marker.exists()
    loaded = load_model(str(rdf), model_kwargs=stats, trust_pickle=True)
    assert marker.exists() and loaded.out_channels == 2
    assert loaded.weights_sha256 == package_sha256(read_package(rdf))  # the weights and the source


def test_a_config_file_cannot_trust_an_architecture_source(packages, tmp_path):
    """Trust comes from the command line or the call only (issue 21): a YAML's trust_pickle is refused, and
    the package named by a YAML without trust is refused as untrusted; its source never runs."""
    marker = tmp_path / "ran"
    rdf = _edited(packages, tmp_path, "source", _state_dict_weights(packages, tmp_path / "source", {
        "source": "arch.py", "callable": "make"}))
    (rdf.parent / "arch.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": str(rdf), "trust_pickle": True}))
    target = str(tmp_path / "out.zarr")
    with pytest.raises(InvalidOptionError, match="trust cannot come from a config file"):
        blockpred.predict(packages["volume"], target, config=str(config), device="cpu", progress=False)
    config.write_text(yaml.safe_dump({"model": str(rdf)}))
    with pytest.raises(UntrustedPickleError, match="--trust-pickle"):
        blockpred.predict(packages["volume"], target, config=str(config), device="cpu", progress=False)
    assert not marker.exists() and not os.path.exists(target)


# ---------------------------------------------------------------------- bad packages


def _edited(packages, tmp_path, name, edit):
    """A copy of the scale_range package with its rdf.yaml changed by ``edit(content)``."""
    folder = tmp_path / name
    if not folder.exists():
        shutil.copytree(packages["scale_range"][0].parent, folder)
    rdf = folder / "rdf.yaml"
    content = yaml.safe_load(rdf.read_text())
    edit(content)
    rdf.write_text(yaml.safe_dump(content))
    return rdf


def _state_dict_weights(packages, folder, architecture):
    def edit(content):
        shutil.copytree(packages["scale_range"][0].parent, folder, dirs_exist_ok=True)
        torch.save(packages["net"].state_dict(), folder / "state.pt")
        content["weights"] = {"pytorch_state_dict": {"source": "state.pt", "architecture": architecture,
                                                     "pytorch_version": "2.0"}}
    return edit


def _drop_axis(axis_id):
    def edit(content):
        for tensor in content["inputs"] + content["outputs"]:
            tensor["axes"] = [a for a in tensor["axes"] if a.get("id") != axis_id]
        content["inputs"][0]["preprocessing"] = []  # its axes name the dropped one
    return edit


def _add_time_axis(content):
    content["inputs"][0]["axes"].insert(1, {"type": "time", "id": "t", "size": 1})


def _per_slice(content):
    content["inputs"][0]["preprocessing"] = [{"id": "scale_range", "kwargs": {"axes": ["y", "x"]}}]


def _output_statistics(content):
    content["outputs"][0]["postprocessing"] = [{"id": "zero_mean_unit_variance"}]


def _bad_cases(packages, tmp_path):
    missing = _edited(packages, tmp_path, "missing", lambda c: None)
    (missing.parent / "weights.pt").unlink()
    source = _edited(packages, tmp_path, "source", _state_dict_weights(packages, tmp_path / "source", {
        "source": "arch.py", "callable": "make"}))
    (source.parent / "arch.py").write_text(f"open({str(tmp_path / 'pwned')!r}, 'w').close()\n")
    return [
        pytest.param(missing, InputNotFoundError, "names torchscript weights 'weights.pt', which is not in the "
                     "package", id="missing-weights"),
        pytest.param(_edited(packages, tmp_path, "per-slice", _per_slice), InvalidOptionError,
                     "statistics per slice do not exist blockwise", id="per-slice-preprocessing"),
        pytest.param(_edited(packages, tmp_path, "output-stats", _output_statistics), InvalidOptionError,
                     "needs statistics of the network's output", id="output-statistics"),
        pytest.param(_edited(packages, tmp_path, "no-y", _drop_axis("y")), Exception,
                     "has no space axis y", id="no-y-axis"),
        pytest.param(_edited(packages, tmp_path, "time", _add_time_axis), Exception,
                     "cannot be mapped to blockpred's (batch, channel, z, y, x): time axis", id="time-axis"),
        pytest.param(source, UntrustedPickleError, "pass --trust-pickle", id="architecture-source-untrusted"),
    ]


def test_each_bad_package_gets_one_line_exit_2_and_no_output(packages, tmp_path, capsys):
    for case in _bad_cases(packages, tmp_path):
        rdf, _, expected = case.values
        target = tmp_path / f"out-{case.id}.zarr"
        code = main(["run", packages["volume"], str(target), "--model", str(rdf), "--no-progress", "--local",
                     "--device", "cpu"])
        err = capsys.readouterr().err
        assert code == 2, f"{case.id}: exit {code}, stderr {err!r}"
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("blockpred: error: "), f"{case.id}: {err!r}"
        assert expected in lines[0], f"{case.id}: {lines[0]!r} lacks {expected!r}"
        assert not target.exists() and not os.path.exists(str(target) + ".blockpred"), case.id
    assert not (tmp_path / "pwned").exists(), "the package's architecture source ran without trust"


def test_bad_packages_raise_their_error_class(packages, tmp_path):
    for case in _bad_cases(packages, tmp_path):
        rdf, error, expected = case.values
        with pytest.raises(error, match=re.escape(expected)):
            load_model(str(rdf))


def test_packages_are_told_from_other_model_files(packages):
    rdf = packages["scale_range"][0]
    assert is_package(rdf) and is_package(rdf.parent) and is_package(rdf.parent.parent / "scale_range.zip")
    assert not is_package(packages["scripted"]) and not is_package("tiny") and not is_package("pkg.module:make")


# ---------------------------------------------------------------------- axes, channels and steps


class NoBatch(torch.nn.Module):
    """The U-Net on (c, z, y, x): a package without a batch axis."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x[None])[0]


def test_a_package_without_a_batch_axis_runs_a_batch_one_block_at_a_time(packages, tmp_path):
    from bioimageio.spec.model import v0_5 as m

    weights = tmp_path / "nobatch.pt"
    torch.jit.script(NoBatch(packages["net"])).save(str(weights))
    x = packages["raw"].astype(np.float32)[None, None] * np.float32(1 / 255)
    expected = 1 / (1 + np.exp(-whole_volume(packages["net"], x).astype(np.float64)))
    rdf = build_package(tmp_path, "nobatch", raw=packages["raw"],
                        reference=lambda t: 1 / (1 + np.exp(-run_net(packages["net"], t * np.float32(1 / 255)))),
                        weights_file=weights, batch=False,
                        preprocessing=[m.ScaleLinearDescr(kwargs=m.ScaleLinearKwargs(gain=1 / 255))],
                        postprocessing=[m.SigmoidDescr()])
    assert load_model(str(rdf)).module.batch_one
    got, _ = predict(packages, rdf, "nobatch")  # batch 2
    assert_close(got, expected[0])


def test_statistics_per_channel_when_the_axes_leave_the_channel_out(tmp_path):
    from bioimageio.spec.model import v0_5 as m
    from blockpred.models.bioimageio import read_package
    from blockpred.models.bioimageio_stats import compute_statistics

    torch.manual_seed(1)
    net = UNet3d(in_channels=2, out_channels=2, depth=2, initial_features=4, activation="relu",
                 final_activation="none").eval()
    weights = tmp_path / "two.pt"
    torch.jit.script(net).save(str(weights))
    raw = np.stack([em_like(0), em_like(1) // 2])
    rdf = build_package(tmp_path, "two", raw=raw, weights_file=weights,
                        reference=lambda t: np.clip(run_net(net, scale_range_of(t, 5, 95, per_channel=True)), -.5, .5),
                        preprocessing=[m.ScaleRangeDescr(kwargs=m.ScaleRangeKwargs(
                            axes=[m.AxisId(a) for a in "zyx"], min_percentile=5.0, max_percentile=95.0))],
                        postprocessing=[m.ClipDescr(kwargs=m.ClipKwargs(min=-0.5, max=0.5))])
    statistics = compute_statistics(read_package(rdf), raw.reshape(2, -1).astype(np.float32))
    (step,) = statistics.values()
    lo, hi = np.percentile(raw.reshape(2, -1).astype(np.float32), [5.0, 95.0], axis=1)
    assert step["lo"] == pytest.approx(lo.tolist()) and step["hi"] == pytest.approx(hi.tolist())
    loaded = load_model(str(rdf), model_kwargs={STATISTICS_KEY: statistics})
    crop = np.concatenate([raw, raw[:, ::-1]], axis=1)[:, :56, :56, :56].astype(np.float32)[None]  # the min input
    x = (crop - lo[:, None, None, None]) / (hi - lo + EPS)[:, None, None, None]
    with torch.inference_mode():
        got = loaded.module(torch.from_numpy(crop)).numpy()
        expected = np.clip(net(torch.from_numpy(x.astype(np.float32))).numpy(), -0.5, 0.5)
    assert_close(got, expected)


@pytest.mark.parametrize("step, reference", [
    pytest.param(("linear", {"gain": [2.0, 3.0], "offset": [1.0, -1.0]}), lambda x: x * [[2], [3]] + [[1], [-1]],
                 id="scale_linear-per-channel"),
    pytest.param(("clip", {"low": None, "high": 0.25}), lambda x: np.minimum(x, 0.25), id="clip-max-only"),
    pytest.param(("binarize", {"threshold": [0.3, 0.6]}), lambda x: (x > [[0.3], [0.6]]).astype(np.float32),
                 id="binarize-per-channel"),
    pytest.param(("sigmoid", {}), lambda x: 1 / (1 + np.exp(-x)), id="sigmoid"),
    pytest.param(("softmax", {}), lambda x: np.exp(x) / np.exp(x).sum(axis=0), id="softmax"),
    pytest.param(("cast", {"dtype": "uint8", "back": True}), lambda x: (x * 0).astype(np.float32), id="ensure_dtype"),
])
def test_each_processing_step_is_numpys(step, reference):
    from blockpred.models.bioimageio_ops import Step, build_op

    x = np.random.default_rng(0).random((2, 100)).astype(np.float32)
    with torch.inference_mode():
        got = build_op(Step(*step), None)(torch.from_numpy(x)[None, :, :, None, None])[0, :, :, 0, 0].numpy()
    np.testing.assert_allclose(got, reference(x.astype(np.float64)), rtol=1e-6, atol=1e-6)


def test_a_large_volume_is_sampled_in_a_fixed_bounded_grid_of_tiles_spread_over_every_axis():
    from blockpred.geometry import Box
    from blockpred.run.package_stats import SAMPLE_TILE, SAMPLE_VOXELS, volume_sample

    class Virtual:
        """A (2, 1000, 3000, 3000) volume whose voxels hold their read's z begin (channel 0) or x begin (1)."""

        spatial_shape, num_channels = Coord((1000, 3000, 3000)), 2
        box = Box.from_shape(spatial_shape)
        reads = []

        def read(self, box):
            self.reads.append(box)
            return np.stack([np.full(box.shape, box.begin[0]), np.full(box.shape, box.begin[2])]).astype(np.uint16)

    volume = Virtual()
    sample = volume_sample(volume)
    assert sample.shape[0] == 2 and sample.shape[1] <= SAMPLE_VOXELS
    assert len(volume.reads) == 27 and all(box.shape == SAMPLE_TILE for box in volume.reads)
    # The first, middle and last tiles of the grid (32 x 24 x 24 tiles), the last moved back inside the volume.
    assert set(np.unique(sample[0])) == {0, 16 * 32, 1000 - 32}
    assert set(np.unique(sample[1])) == {0, 12 * 128, 3000 - 128}
    volume.reads.clear()
    assert np.array_equal(volume_sample(volume), sample)  # deterministic
