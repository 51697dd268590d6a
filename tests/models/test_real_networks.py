"""Networks nobody here wrote, on real EM, at defaults: blockpred finds their geometry and leaves no seams.

* The trained 2D CREMI boundary network of ``../shared/realdata/cremi_dunet2d`` (a densely connected U-Net
  with overlapping pools, a legacy CUDA state dict, the user's own ``model.py`` importing inferno layers):
  run plane by plane over the real FIB-SEM volume with ``blockpred run`` and nothing but the model named.
  Each plane equals the network on the whole plane (padded as blockpred pads), and the recorded
  input/output pair is reproduced blockwise.
* Networks shaped like published ones (``tests/realnets.py``): a residual synapse U-Net with batch norm and
  (1, 2, 2) pooling saved in the legacy format, a valid U-Net with transposed convolutions, padded pooling
  with channels last, a network that pads odd sizes itself.  Each at its default halo equals the network on
  the whole volume.

Inferno is not installable (its last release is broken on Python 3): the tests provide the two names the
model file imports, as its README says a user may.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
import zarr

import blockpred
from blockpred.cli import main
from blockpred.errors import InvalidOptionError, ModelLoadError
from blockpred.geometry import Coord
from blockpred.models.discover import find_grid
from blockpred.models.field import network_field
from tests import realnets
from tests.ci import needs
from tests.helpers import REALDATA, ROOT, child_env, read_volume, run_blockpred, write_test_volume

CREMI = REALDATA / "cremi_dunet2d"
FIBSEM = REALDATA / "fibsem_neuroproof" / "training_sample2_raw_250cube.npz"

pytestmark = needs(FIBSEM.exists(), "../shared/realdata beside the checkout")



@pytest.fixture(scope="module")
def fibsem() -> np.ndarray:
    return np.load(FIBSEM)["raw"]


@pytest.fixture(scope="module")
def inferno_shim(tmp_path_factory) -> Path:
    return realnets.write_inferno_layers(tmp_path_factory.mktemp("inferno-shim"))


@pytest.fixture(scope="module")
def cremi_net(inferno_shim):
    """The user's DUNet2D from their model file, with the trained weights (as blockpred loads them)."""
    sys.path[:0] = [str(inferno_shim), str(CREMI)]
    try:
        from model import DUNet2D  # the user's file, imported as the user would
    finally:
        del sys.path[:2]
    net = DUNet2D(in_channels=1, out_channels=1)
    net.load_state_dict(torch.load(CREMI / "state.nn", map_location="cpu", weights_only=True))
    return net.eval()


def _whole(net, volume: np.ndarray, halo, step) -> np.ndarray:
    """The network on the whole volume padded by ``halo`` by reflection (as blockpred pads past the edge),
    then up to its step at the far end, cropped back: what blockwise output must equal."""
    padded = np.pad(volume, [(h, h) for h in halo], mode="reflect")
    padded = np.pad(padded, [(0, -s % d) for s, d in zip(padded.shape, step)], mode="reflect")
    with torch.no_grad():
        out = net(torch.from_numpy(np.ascontiguousarray(padded))[None, None])
    out = (out[0] if isinstance(out, (list, tuple)) else out)[0].numpy()
    # A 'same' network's output is the padded input; a valid one's is smaller by its context on each side.
    begin = [h - (p - o) // 2 for h, p, o in zip(halo, padded.shape, out.shape[1:])]
    return out[(slice(None),) + tuple(slice(b, b + s) for b, s in zip(begin, volume.shape))]


def _per_plane(net, planes: np.ndarray, halo: int) -> np.ndarray:
    """A 2D network on each whole plane, padded by ``halo`` and up to its step (8) by reflection."""
    out = []
    for plane in planes:
        padded = np.pad(plane, halo, mode="reflect")
        padded = np.pad(padded, [(0, -s % 8) for s in padded.shape], mode="reflect")
        with torch.no_grad():
            y = net(torch.from_numpy(padded)[None, None])[0]
        out.append(y[:, halo:halo + plane.shape[0], halo:halo + plane.shape[1]].numpy())
    return np.stack(out, axis=1)


def _read(path: Path) -> np.ndarray:
    group = zarr.open(str(path), mode="r")
    return np.asarray(group["0"] if isinstance(group, zarr.Group) else group)


# ------------------------------------------------------------------------------------------ the CREMI network


def test_the_cremi_network_runs_at_defaults_plane_by_plane_and_equals_each_whole_plane(
        tmp_path, fibsem, inferno_shim, cremi_net):
    planes = fibsem[100:103, :160, :144]
    source = write_test_volume(str(tmp_path / "fib.zarr"), planes)
    # The user's command: the model file's factory with its arguments, the legacy state dict, nothing else.
    result = run_blockpred("run", source, "out.zarr", "--model", "model:DUNet2D", "--weights", CREMI / "state.nn",
                           "--model-kwargs", "in_channels=1,out_channels=1", "--no-progress", "--json",
                           cwd=tmp_path, env=child_env(inferno_shim, CREMI, ROOT))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    # Found, not assumed: 8x8 pooling within the plane; the receptive field (radius 73) covered by halo 80.
    assert summary["plane"] == "yx" and summary["downsampling"] == [1, 8, 8]
    assert summary["receptive_radius"] == [0, 73, 73] and summary["halo"] == [0, 80, 80]
    assert summary["halo_source"] == "field" and summary["halo_covers_field"] is True
    assert result.stderr.strip() == "", result.stderr  # nothing to warn about
    expected = _per_plane(cremi_net, planes.astype(np.float32) / 255, 80)
    np.testing.assert_allclose(_read(tmp_path / "out.zarr"), expected, atol=1e-5, rtol=0)


def test_the_cremi_network_in_blocks_smaller_than_a_plane_leaves_no_seams(tmp_path, fibsem, inferno_shim, cremi_net,
                                                                       monkeypatch):
    monkeypatch.syspath_prepend(str(CREMI))
    monkeypatch.syspath_prepend(str(inferno_shim))
    planes = fibsem[50:52, 40:136, 40:136]
    source = write_test_volume(str(tmp_path / "fib.zarr"), planes)
    summary = blockpred.predict(source, str(tmp_path / "out.zarr"), model="model:DUNet2D",
                                weights=str(CREMI / "state.nn"), model_kwargs={"in_channels": 1, "out_channels": 1},
                                block=(1, 48, 48), precision="fp32", progress=False, local=True)
    assert summary.plan.num_blocks == 2 * 2 * 2 and tuple(summary.plan.halo) == (0, 80, 80)
    expected = _per_plane(cremi_net, planes.astype(np.float32) / 255, 80)
    np.testing.assert_allclose(_read(tmp_path / "out.zarr"), expected, atol=1e-5, rtol=0)


def test_the_recorded_cremi_pair_is_reproduced_blockwise_from_the_unmodified_model_file(tmp_path, monkeypatch, caplog):
    """The user's call on upstream's files as they are: model.py imports inferno, which is not installed, so
    blockpred's inferno stand-in provides its layers (one line says so); the legacy state dict loads strictly into
    them, and the recorded output is reproduced across four blocks."""
    from blockpred.models import compat

    for name in [n for n in sys.modules if n == "model" or n.split(".")[0] == "inferno"]:
        monkeypatch.delitem(sys.modules, name)  # (another test's inferno of its own, and the model imported with it)
    monkeypatch.syspath_prepend(str(CREMI))
    monkeypatch.setattr(compat, "_told", False)
    recorded_input = np.load(CREMI / "fwd_input.npy")[0, 0]  # (320, 320), already normalised
    recorded_output = np.load(CREMI / "fwd_out.npy")[0]
    source = write_test_volume(str(tmp_path / "pair.zarr"), recorded_input[None])
    with caplog.at_level(logging.WARNING, logger="blockpred"):
        blockpred.predict(source, str(tmp_path / "out.zarr"), model="model:DUNet2D", weights=str(CREMI / "state.nn"),
                          model_kwargs={"in_channels": 1, "out_channels": 1}, normalize="none", block=(1, 160, 160),
                          precision="fp32", progress=False, local=True)
    said = [r.getMessage() for r in caplog.records if "inferno compatibility module" in r.getMessage()]
    assert len(said) == 1 and "inferno, which is not installed" in said[0]
    assert "inferno" not in sys.modules  # the stand-in was there for the model's import only
    out = _read(tmp_path / "out.zarr")[0, 0]
    # Upstream padded the image with zeros inside the network; blockpred pads it by reflection: away from the
    # image's border (the halo, 80) the two agree, across the four blocks' seams.
    inner = (slice(80, 240), slice(80, 240))
    np.testing.assert_allclose(out[inner], recorded_output[inner], atol=1e-5, rtol=0)


def test_the_inferno_stand_in_loads_inferno_layers_by_their_names_and_a_real_inferno_wins(inferno_shim, monkeypatch,
                                                                                         caplog):
    """The stand-in's layers carry inferno's attribute names (their state dicts' keys), later inferno's batch-norm
    layout loads too, and the process is left as it was; where a package ``inferno`` is on the path (a user's own,
    here the tests' two-layer one) that one is imported and nothing is said."""
    from blockpred.models import compat

    for name in [n for n in sys.modules if n.split(".")[0] == "inferno"]:
        monkeypatch.delitem(sys.modules, name)  # (another test's inferno of its own)
    monkeypatch.setattr(compat, "_told", False)
    with caplog.at_level(logging.WARNING, logger="blockpred"), compat.inferno_stand_in():
        import inferno
        from inferno.extensions.layers import Concatenate, Upsample
        from inferno.extensions.layers.convolutional import BNReLUConv3D, Conv2D, ConvELU3D, ConvSigmoid2D
    assert inferno.__file__.startswith(str(Path(compat.__file__).parent)) and "inferno" not in sys.modules
    assert sum("inferno compatibility module" in r.getMessage() for r in caplog.records) == 1
    assert list(ConvELU3D(1, 2, 3).state_dict()) == ["conv.weight", "conv.bias"]
    assert isinstance(ConvSigmoid2D(1, 1, 3).activation, nn.Sigmoid) and Conv2D(1, 1, 3).activation is None
    layer = BNReLUConv3D(2, 3, 3)
    later = {k.replace("batchnorm.", "batchnorm.bn."): v for k, v in layer.state_dict().items()}
    layer.load_state_dict(later, strict=True)
    x = torch.rand(1, 2, 4, 6, 6)
    assert Concatenate()(x, x).shape[1] == 4 and Upsample(scale_factor=2)(x).shape[-1] == 12

    caplog.clear()
    monkeypatch.syspath_prepend(str(inferno_shim))
    with compat.inferno_stand_in():
        import inferno as own
    assert own.__file__.startswith(str(inferno_shim)) and not caplog.records


# ------------------------------------------------------------------------- published kinds of 3D networks


def test_a_synapse_unet_saved_in_the_legacy_format_runs_at_defaults_and_equals_the_whole_volume(tmp_path, fibsem):
    torch.manual_seed(0)
    net = realnets.synapse_unet()
    net.train()
    with torch.no_grad():  # batch norm with real running statistics, as a trained network has
        for _ in range(3):
            net(torch.rand(2, 1, 8, 32, 32))
    net.eval()
    weights = tmp_path / "synapse.chkpt"
    torch.save(net.state_dict(), weights, _use_new_zipfile_serialization=False)  # the pre-1.6 format
    volume = fibsem[:12, :128, :64]
    source = write_test_volume(str(tmp_path / "em.zarr"), volume)
    summary = blockpred.predict(source, str(tmp_path / "out.zarr"), model="tests.realnets:synapse_unet",
                                weights=str(weights), precision="fp32", progress=False, local=True)
    field = summary.halo.field
    assert tuple(field.downsampling) == (1, 4, 4) and tuple(field.radius) == (5, 23, 23)
    assert tuple(summary.plan.halo) == (5, 24, 24) and summary.halo.covers
    expected = _whole(net, volume.astype(np.float32) / 255, (5, 24, 24), (1, 4, 4))
    np.testing.assert_allclose(_read(tmp_path / "out.zarr"), expected, atol=1e-5, rtol=0)
    # Blocks far smaller than the volume, the halo still the measured one: no seams.
    summary = blockpred.predict(source, str(tmp_path / "small.zarr"), model="tests.realnets:synapse_unet",
                                weights=str(weights), block=(6, 64, 32), precision="fp32", progress=False, local=True)
    assert summary.plan.num_blocks == 2 * 2 * 2 and tuple(summary.plan.halo) == (5, 24, 24)
    np.testing.assert_allclose(_read(tmp_path / "small.zarr"), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("factory, downsampling", [
    pytest.param("valid_unet", (2, 2, 2), id="valid-convolutions-transposed-upsampling"),
    pytest.param("padded_pool_net", (2, 2, 2), id="padded-pooling-channels-last"),
    pytest.param("pads_odd_sizes", (4, 4, 4), id="pads-odd-sizes-itself"),
])
def test_published_kinds_of_network_at_their_default_halo_equal_the_whole_volume(tmp_path, fibsem, factory,
                                                                                downsampling):
    torch.manual_seed(1)
    net = getattr(realnets, factory)().eval()
    weights = tmp_path / "net.pt"
    torch.save(net.state_dict(), weights)
    volume = fibsem[60:84, 60:108, 60:108]
    source = write_test_volume(str(tmp_path / "em.zarr"), volume)
    summary = blockpred.predict(source, str(tmp_path / "out.zarr"), model=f"tests.realnets:{factory}",
                                weights=str(weights), block=(8, 16, 16), batch_size=1, precision="fp32",
                                progress=False, local=True)
    field = summary.halo.field
    assert tuple(field.downsampling) == downsampling and summary.halo.covers
    halo = summary.plan.context if any(summary.plan.context) else summary.plan.halo
    expected = _whole(net, volume.astype(np.float32) / 255, tuple(halo), downsampling)
    np.testing.assert_allclose(_read(tmp_path / "out.zarr"), expected, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------- finding the grid


def test_the_grid_of_a_torchscript_network_is_found_by_its_graph_run_node_by_node():
    torch.manual_seed(0)
    scripted = torch.jit.script(realnets.SynapseUNet(width=2).eval())  # no hooks: its graph's maps tell
    grid = find_grid(scripted, 1)
    assert tuple(grid.downsampling) == (1, 4, 4) and grid.how == ("sizes", "graph", "graph")  # z: no pooling
    assert tuple(grid.min_shape) == (1, 4, 4) and grid.takes(Coord((3, 8, 12))) and not grid.takes(Coord((3, 8, 10)))


def test_a_torchscript_network_that_takes_any_size_but_pools_is_found_by_its_graph():
    # As the nn.Module below: its sizes step by 1, and only its maps show the pooling by 4.  A search of sizes
    # found 1 for it, and took 48 dry runs on torch-em's UNet3d where the graph's maps take 2 passes.
    grid = find_grid(torch.jit.script(realnets.pads_odd_sizes().eval()), 1)
    assert tuple(grid.downsampling) == (4, 4, 4) and grid.how == ("graph",) * 3


def test_a_network_that_takes_any_size_but_pools_is_found_by_its_layers():
    # Its sizes step by 1; only its layers show the pooling by 4 its output is shift-equivariant by.
    grid = find_grid(realnets.pads_odd_sizes().eval(), 1)
    assert tuple(grid.downsampling) == (4, 4, 4) and grid.how == ("hooks",) * 3


class GlobalContext(torch.nn.Module):
    """A convolution plus the mean of its whole input (a global-context block, as squeeze-and-excitation)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, x):
        return self.conv(x) + x.mean(dim=(2, 3, 4), keepdim=True)


def test_a_network_whose_output_depends_on_the_whole_input_is_said_to_have_no_exact_halo(tmp_path, caplog):
    field = network_field(GlobalContext().eval(), 1, {"name": "global-context"})
    assert field.radius is None and field.note.startswith("unbounded")
    source = write_test_volume(str(tmp_path / "v.zarr"), np.zeros((8, 16, 16), np.uint8))
    with caplog.at_level(logging.WARNING, logger="blockpred"):
        summary = blockpred.predict(source, str(tmp_path / "o.zarr"), model=GlobalContext().eval(), progress=False,
                                    local=True)
    assert summary.halo.source == "fallback" and summary.halo.covers is False
    warned = [r.getMessage() for r in caplog.records if "receptive field" in r.getMessage()]
    assert len(warned) == 1 and "unbounded" in warned[0] and "name --halo" in warned[0]


def test_a_network_that_normalises_over_each_block_gets_its_convolutions_field_and_one_line_saying_so(tmp_path,
                                                                                                      caplog):
    # GroupNorm, as pytorch-3dunet and plantseg's networks use: their statistics are per block, whatever the halo.
    net = torch.nn.Sequential(torch.nn.Conv3d(1, 4, 3, padding=1), torch.nn.GroupNorm(2, 4), torch.nn.ELU(),
                              torch.nn.Conv3d(4, 1, 3, padding=1)).eval()
    source = write_test_volume(str(tmp_path / "v.zarr"), np.zeros((8, 16, 16), np.uint8))
    with caplog.at_level(logging.WARNING, logger="blockpred"):
        summary = blockpred.predict(source, str(tmp_path / "o.zarr"), model=net, progress=False, local=True)
    assert tuple(summary.halo.field.radius) == (2, 2, 2) and tuple(summary.plan.halo) == (2, 2, 2)
    assert summary.halo.covers is False and "GroupNorm normalises over each block" in summary.halo.note()
    warned = [r.getMessage() for r in caplog.records if "whole block" in r.getMessage()]
    assert warned == ["the network's output depends on the whole block: its GroupNorm normalises over each block, "
                      "so blocks differ from the whole volume however large the halo; halo 2x2x2 covers its "
                      "convolutions' field (radius 2x2x2)"]


def test_a_torchscript_network_whose_norm_measures_as_no_identity_is_unbounded_without_measuring(tmp_path):
    """The same network scripted: its GroupNorm cannot be swapped for the identity inside TorchScript code, so its
    statistics reach every voxel of any input.  Said at once, where the measurement went on to 1024-voxel inputs
    (MONAI's BasicUNet: 3.3-4.6 s of a first run)."""
    net = torch.jit.script(torch.nn.Sequential(torch.nn.Conv3d(1, 4, 3, padding=1), torch.nn.GroupNorm(2, 4),
                                               torch.nn.ELU(), torch.nn.Conv3d(4, 1, 3, padding=1)).eval())
    field = network_field(net, 1, {"name": "scripted-groupnorm"})
    assert field.radius is None, field
    assert field.note == ("unbounded: the output depends on the whole input along z, y, x (its GroupNorm "
                          "normalises over the whole input inside TorchScript code, which the measurement cannot "
                          "take out); no halo makes blocks equal the whole volume"), field.note


def test_a_named_halo_smaller_than_the_field_gets_one_warning_naming_the_exact_one(tmp_path, caplog):
    source = write_test_volume(str(tmp_path / "v.zarr"), np.zeros((8, 32, 32), np.uint8))
    with caplog.at_level(logging.WARNING, logger="blockpred"):
        summary = blockpred.predict(source, str(tmp_path / "o.zarr"), model="tests.realnets:padded_pool_net",
                                    halo=2, progress=False, local=True)
    assert summary.halo.covers is False and tuple(summary.halo.exact) == (6, 6, 6)
    warned = [r.getMessage() for r in caplog.records if "receptive field" in r.getMessage()]
    assert warned == ["--halo 2,2,2 is smaller than the network's receptive field (radius 5x5x5): the output will "
                      "differ from whole-volume prediction at block borders; --halo 6,6,6 makes it exact"]


def test_a_block_the_network_cannot_take_is_refused_naming_the_sizes_it_takes(tmp_path):
    source = write_test_volume(str(tmp_path / "v.zarr"), np.zeros((8, 32, 32), np.uint8))
    with pytest.raises(InvalidOptionError, match=r"multiple of the network's downsampling \(1, 4, 4\)"):
        blockpred.predict(source, str(tmp_path / "o.zarr"), model="tests.realnets:synapse_unet", block=(8, 10, 12),
                          progress=False, local=True)
    assert not (tmp_path / "o.zarr").exists()


def test_a_missing_dependency_of_the_users_module_is_named_not_the_module(tmp_path, monkeypatch):
    """A package not installed is named, and what installs it; a part of inferno the stand-in does not provide
    (its graph container) is named with what the stand-in does provide."""
    for name in [n for n in sys.modules if n.split(".")[0] == "inferno"]:
        monkeypatch.delitem(sys.modules, name)  # (another test's inferno of its own)
    (tmp_path / "needs_elf.py").write_text("import elf_not_installed\n")
    (tmp_path / "needs_graph.py").write_text("from inferno.extensions.containers.graph import Graph\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    source = write_test_volume(str(tmp_path / "v.zarr"), np.zeros((1, 32, 32), np.uint8))
    with pytest.raises(ModelLoadError, match=r"module 'needs_elf' imports 'elf_not_installed', which is not "
                                             r"installed .*install 'elf_not_installed'"):
        blockpred.predict(source, str(tmp_path / "o.zarr"), model="needs_elf:net", progress=False, local=True)
    with pytest.raises(ModelLoadError, match=r"module 'needs_graph' imports 'inferno.extensions.containers', which "
                                             r"is not installed .*stand-in provides its layers only"):
        blockpred.predict(source, str(tmp_path / "o.zarr"), model="needs_graph:net", progress=False, local=True)
    assert not (tmp_path / "o.zarr").exists() and "inferno" not in sys.modules


def test_model_kwargs_on_the_command_line_are_read_as_yaml_values(tmp_path, capsys):
    from blockpred.config import parse_model_kwargs

    assert parse_model_kwargs("n=16,pool=[1,2,2],name='a,b',bn=true,rate=0.5") == {
        "n": 16, "pool": [1, 2, 2], "name": "a,b", "bn": True, "rate": 0.5}
    source = write_test_volume(str(tmp_path / "v.zarr"), np.zeros((8, 16, 16), np.uint8))
    code = main(["run", source, str(tmp_path / "o.zarr"), "--model", "tests.realnets:synapse_unet", "--model-kwargs",
                 "width", "--no-progress"])
    assert code == 2 and "--model-kwargs must be KEY=VALUE pairs" in capsys.readouterr().err
    assert main(["run", source, str(tmp_path / "o.zarr"), "--model", "tests.realnets:synapse_unet",
                 "--model-kwargs", "width=2", "--no-progress", "--local"]) == 0


def test_a_trial_the_network_refuses_is_skipped_and_the_run_goes_on(tmp_path, caplog):
    volume = np.random.default_rng(0).integers(0, 255, (16, 96, 96), dtype=np.uint8)
    source = write_test_volume(str(tmp_path / "v.zarr"), volume)
    with caplog.at_level(logging.INFO, logger="blockpred"):
        summary = blockpred.predict(source, str(tmp_path / "o.zarr"), model="tests.realnets:refuses_large_blocks",
                                    block="auto", progress=False, local=True)
    failed = [t for t in summary.sizing.trials if t.failed]
    assert failed and all(max(t.block[1:]) + 2 > 40 for t in failed)  # the wide trials, and only they
    assert max(summary.plan.input_shape[1:]) <= 40  # the run took a block the network takes
    assert any("failed, skipped: this network takes at most 40" in r.getMessage() for r in caplog.records)


def test_plan_reports_the_receptive_field_and_the_halo_before_anything_runs(tmp_path, capsys):
    source = write_test_volume(str(tmp_path / "v.zarr"), np.zeros((8, 64, 64), np.uint8))
    assert main(["plan", source, str(tmp_path / "o.zarr"), "--model", "tests.realnets:synapse_unet"]) == 0
    lines = {line[:10].strip(): line[10:] for line in capsys.readouterr().out.splitlines()}
    assert lines["halo"].startswith("5x24x24 from the receptive field (receptive field radius 5x23x23, measured in")
    assert lines["halo"].endswith("downsampling 1x4x4): covered: blocks equal whole-volume prediction")
    assert not (tmp_path / "o.zarr").exists()


def test_a_resume_keeps_the_halo_it_started_with(tmp_path):
    source = write_test_volume(str(tmp_path / "v.zarr"), np.zeros((16, 32, 32), np.uint8))  # no axis under the halo
    options = dict(model="tiny", block=16, progress=False, local=True)
    first = blockpred.predict(source, str(tmp_path / "o.zarr"), halo=12, **options)
    written = read_volume(first.output)
    again = blockpred.predict(source, str(tmp_path / "o.zarr"), **options)  # no halo named: the run's own
    assert tuple(first.plan.halo) == tuple(again.plan.halo) == (12, 12, 12)
    assert (again.num_resumed, again.stats.num_blocks) == (first.plan.num_blocks, 0)  # nothing redone
    np.testing.assert_array_equal(read_volume(again.output), written)


def test_check_model_on_the_fib_sem_suggests_the_normalisation_the_cremi_network_was_trained_on(
        tmp_path, fibsem, monkeypatch, capsys):
    """The CREMI network at the default normalisation (uint8 / 255) gives a near-blank map on real EM; check-model
    --input tries the candidates on one plane's block, warns, and suggests one under which the output's mean is
    within 0.05 of upstream's recorded output (0.162)."""
    monkeypatch.syspath_prepend(str(CREMI))
    source = write_test_volume(str(tmp_path / "fib.zarr"), fibsem[120:122])
    assert main(["check-model", "model:DUNet2D", "--weights", str(CREMI / "state.nn"), "--model-kwargs",
                 "in_channels=1,out_channels=1", "--plane", "yx", "--input", source, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["normalization"]
    trials = {t["normalize"]: t for t in report["trials"]}
    assert set(trials) == {"auto", "meanstd:auto", "percentile:1,99.8"}
    suggested = trials[report["suggested"]]
    assert abs(suggested["output"]["mean"] - float(np.load(CREMI / "fwd_out.npy").mean())) <= 0.05
    assert report["warning"].startswith("the output at --normalize auto is near-constant")
