"""InfernoUNet: the state dict layout and the outputs of inferno's real UNet.

The fixtures in ``data/`` were made from inferno-pytorch's source
(``inferno.extensions.models.UNet`` at the commit named in each file) in a
scratch environment; no inferno code is part of blockpred or these tests.
"""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from blockpred.geometry import Coord
from blockpred.models.inferno import InfernoUNet, resolve_activation
from tests.ci import needs

DATA = Path(__file__).parent / "data"
KEYS = json.loads((DATA / "inferno_unet_keys.json").read_text())


def build(config: dict) -> InfernoUNet:
    with torch.device("meta"):  # shapes only: inferno's default config has 90M parameters
        return InfernoUNet(**config)


@pytest.mark.parametrize(
    "entry", [pytest.param(e, id="-".join(f"{k}={v}" for k, v in e["config"].items())) for e in KEYS["configs"]]
)
def test_state_dict_keys_shapes_and_order_match_inferno(entry):
    ours = [[k, list(v.shape)] for k, v in build(entry["config"]).state_dict().items()]
    assert ours == entry["state_dict"]


REGRESSION = DATA / "inferno_unet_regression.pt"


@needs(REGRESSION.exists(), f"the inferno regression fixture {REGRESSION.name} (tests/models/data)")
def test_inferno_weights_load_strictly_and_give_inferno_s_output():
    fixture = torch.load(REGRESSION, weights_only=True)
    net = InfernoUNet(**fixture["config"]).eval()
    net.load_state_dict(fixture["state_dict"], strict=True)
    with torch.no_grad():
        out = net(fixture["input"])
    assert (out - fixture["output"]).abs().max() <= 1e-5


def test_defaults_are_inferno_s():
    net = build(dict(in_channels=1, out_channels=1))
    assert (net.dim, net.depth, net.initial_features, net.gain) == (3, 4, 64, 2)
    assert net.downsampling == Coord((16, 16, 16)) and net.padding == "same"
    assert isinstance(net._output, nn.Module) and not isinstance(net._output, nn.Sequential)


def test_shapes_not_divisible_by_two_to_the_depth_are_refused():
    net = InfernoUNet(1, 1, depth=2, initial_features=2)
    with pytest.raises(ValueError, match=r"divisible by 4 \(2\*\*depth\)"):
        net(torch.rand(1, 1, 8, 8, 6))


def test_only_3d_is_supported():
    with pytest.raises(ValueError, match="dim=3 only"):
        InfernoUNet(1, 1, dim=2)


@pytest.mark.parametrize(
    "name, cls",
    [("Sigmoid", nn.Sigmoid), ("sigmoid", nn.Sigmoid), ("Softmax", nn.Softmax), ("Tanh", nn.Tanh), ("none", None)],
)
def test_final_activation_names_resolve_to_torch_modules(name, cls):
    module = resolve_activation(name)
    assert module is None if cls is None else isinstance(module, cls)
    if cls is nn.Softmax:
        assert module.dim == 1


def test_unknown_final_activation_is_refused():
    with pytest.raises(ValueError, match="must name a torch.nn activation"):
        resolve_activation("Linear")
