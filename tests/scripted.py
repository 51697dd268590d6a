"""TorchScript files as users make them: ``torch.jit.script(net).save(path)`` of networks nobody here wrote.

* ``loop-list``: a U-Net written the usual way, encoder and decoder as ``nn.ModuleList``s walked in ``for``
  loops, the skips kept in a Python list with ``append`` and ``pop``, ``ConvTranspose3d`` upsampling;
* ``monai-basicunet``, ``monai-unet``: MONAI's ``BasicUNet`` and ``UNet`` (``pip install -e '.[peers]'``);
* ``torch-em-unet3d``: torch-em's ``UNet3d`` (``pip install --no-deps torch-em``), imported from its file
  alone: its package ``__init__`` imports trainers, datasets and elf, which the network does not use;
* ``cremi-dunet2d``: the trained 2D CREMI network of ``../shared/realdata`` from the user's own ``model.py``
  and state dict.

``torch.jit.script`` refuses the last two (torch-em 0.10's encoder returns a tuple or a tensor by a flag; the
CREMI file calls ``super(DUNet2D, self).forward``), so their users save them with ``torch.jit.trace`` at an input
of the network's (:data:`TRACED`): the TorchScript file they have.

Each is 1 -> 2 channels (the CREMI network 1 -> 1), seeded, in eval mode, of a size a CPU runs in seconds.
:func:`save` writes one and says its halo; :data:`AVAILABLE` says which this install can make.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import torch
from torch import nn

NAMES = ("loop-list", "monai-basicunet", "monai-unet", "torch-em-unet3d", "cremi-dunet2d")
#: The halo per network: at least what its field needs at the blocks the tests and benchmarks use.
HALOS = {"loop-list": (16, 16, 16), "monai-basicunet": (16, 16, 16), "monai-unet": (16, 16, 16),
         "torch-em-unet3d": (16, 16, 16), "cremi-dunet2d": (0, 32, 32)}
#: Made with ``torch.jit.trace`` at this input, as ``torch.jit.script`` refuses them.
TRACED = {"torch-em-unet3d": (1, 1, 64, 64, 64), "cremi-dunet2d": (1, 1, 256, 256)}
REALDATA = Path(__file__).resolve().parents[2] / "shared" / "realdata"


class _Double(nn.Sequential):
    def __init__(self, channels_in: int, channels_out: int):
        super().__init__(nn.Conv3d(channels_in, channels_out, 3, padding=1), nn.ReLU(inplace=True),
                         nn.Conv3d(channels_out, channels_out, 3, padding=1), nn.ReLU(inplace=True))


class LoopListUNet(nn.Module):
    """Encoder and decoder walked in loops, skips in a list: what ``torch.jit.script`` keeps as loops and lists."""

    def __init__(self, in_channels: int = 1, out_channels: int = 2, features: int = 12, depth: int = 3):
        super().__init__()
        widths = [features * 2 ** level for level in range(depth + 1)]
        self.encoders = nn.ModuleList([_Double(in_channels if level == 0 else widths[level - 1], widths[level])
                                       for level in range(depth)])
        self.pools = nn.ModuleList([nn.MaxPool3d(2) for _ in range(depth)])
        self.base = _Double(widths[depth - 1], widths[depth])
        self.ups = nn.ModuleList([nn.ConvTranspose3d(widths[level + 1], widths[level], 2, stride=2)
                                  for level in reversed(range(depth))])
        self.decoders = nn.ModuleList([_Double(2 * widths[level], widths[level]) for level in reversed(range(depth))])
        self.out = nn.Conv3d(widths[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips: list[torch.Tensor] = []
        for encoder, pool in zip(self.encoders, self.pools):
            x = encoder(x)
            skips.append(x)
            x = pool(x)
        x = self.base(x)
        for up, decoder in zip(self.ups, self.decoders):
            x = decoder(torch.cat([skips.pop(), up(x)], dim=1))
        return torch.sigmoid(self.out(x))


def _monai_basicunet() -> nn.Module:
    from monai.networks.nets import BasicUNet

    return BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(8, 8, 16, 32, 64, 8))


def _monai_unet() -> nn.Module:
    from monai.networks.nets import UNet

    return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(12, 24, 48, 96), strides=(2, 2, 2),
                num_res_units=2)


def torch_em_unet_module() -> types.ModuleType:
    """``torch_em.model.unet`` from its file (it imports numpy and torch only)."""
    stub = sys.modules.get("torch_em")  # bench/peers.py's package without its __init__, where imported
    if stub is not None and getattr(stub, "__spec__", None) is None and getattr(stub, "__path__", None):
        locations = list(stub.__path__)
    else:
        spec = importlib.util.find_spec("torch_em")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("torch-em is not installed: pip install --no-deps torch-em")
        locations = list(spec.submodule_search_locations)
    path = Path(locations[0]) / "model" / "unet.py"
    loaded = importlib.util.spec_from_file_location("torch_em_unet_file", path)
    module = importlib.util.module_from_spec(loaded)
    sys.modules[loaded.name] = module  # TorchScript resolves the classes' globals through their module
    loaded.loader.exec_module(module)
    return module


def _torch_em_unet3d() -> nn.Module:
    return torch_em_unet_module().UNet3d(in_channels=1, out_channels=2, initial_features=12, depth=3,
                                         final_activation="Sigmoid")


def cremi_dunet2d(shim: Path) -> nn.Module:
    """The user's DUNet2D with its trained weights (``shim``: where the two inferno layers are, see realnets)."""
    sys.path[:0] = [str(shim), str(REALDATA / "cremi_dunet2d")]
    try:
        from model import DUNet2D
    finally:
        del sys.path[:2]
    net = DUNet2D(in_channels=1, out_channels=1)
    net.load_state_dict(torch.load(REALDATA / "cremi_dunet2d" / "state.nn", map_location="cpu", weights_only=True))
    return net


def build(name: str, scratch: Path) -> nn.Module:
    """Network ``name``, seeded, in eval mode (``scratch``: a folder for the CREMI network's inferno layers)."""
    torch.manual_seed(0)
    if name == "loop-list":
        net = LoopListUNet()
    elif name == "monai-basicunet":
        net = _monai_basicunet()
    elif name == "monai-unet":
        net = _monai_unet()
    elif name == "torch-em-unet3d":
        net = _torch_em_unet3d()
    elif name == "cremi-dunet2d":
        from tests.realnets import write_inferno_layers

        shim = scratch / "inferno-shim"
        net = cremi_dunet2d(shim if shim.exists() else write_inferno_layers(shim))
    else:
        raise ValueError(f"unknown network {name!r}: one of {', '.join(NAMES)}")
    return net.eval()


def save(name: str, root: Path) -> Path:
    """``root/<name>.pt``: network ``name`` as ``torch.jit.script(net).save(path)`` writes it (``torch.jit.trace``
    for those in :data:`TRACED`), made once."""
    path = root / f"{name}.pt"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        net = build(name, root)
        if name in TRACED:
            with torch.no_grad():
                scripted = torch.jit.trace(net, torch.rand(TRACED[name]), check_trace=False)
        else:
            scripted = torch.jit.script(net)
        tmp = path.with_suffix(".tmp")
        scripted.save(str(tmp))
        tmp.replace(path)
    return path


def available(name: str) -> bool:
    """Whether this install makes network ``name``."""
    if name.startswith("monai"):
        return importlib.util.find_spec("monai") is not None
    if name == "torch-em-unet3d":
        return "torch_em" in sys.modules or importlib.util.find_spec("torch_em") is not None
    if name == "cremi-dunet2d":
        return (REALDATA / "cremi_dunet2d" / "state.nn").exists()
    return True
