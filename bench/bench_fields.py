"""What blockpred finds of each network by itself: downsampling, receptive field, default halo, and the cost.

For every preset (measured here, not taken from what the preset states) and every trained network in
``../shared/realdata`` whose weights are there (the 2D CREMI DUNet, with a stand-in for the two inferno layers
its model file imports), plus the published kinds of ``tests/realnets.py``: the grid found by dry runs
(:func:`blockpred.models.discover.find_grid`), the receptive-field radius
(:func:`blockpred.models.receptive.field_radius`), the default halo a run takes
(:func:`blockpred.halo.choose_halo`), and the seconds each took, the process's peak memory after it.

    python bench/bench_fields.py [--networks tiny,cremi2018,unet32,cremi-dunet2d,...]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blockpred.geometry import Coord  # noqa: E402
from blockpred.halo import choose_halo  # noqa: E402
from blockpred.models import build_preset  # noqa: E402
from blockpred.models.discover import find_grid  # noqa: E402
from blockpred.models.field import NetworkField  # noqa: E402
from blockpred.models.planes import PlaneNetwork, stack_axis  # noqa: E402
from blockpred.models.presets import PRESETS  # noqa: E402
from blockpred.models.receptive import UnboundedField, field_radius  # noqa: E402

REALDATA = ROOT.parent / "shared" / "realdata"
INFERNO_LAYERS = """
    import torch.nn as nn

    class _ConvActivation(nn.Module):
        def __init__(self, in_channels, out_channels, kernel_size, activation):
            super().__init__()
            self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2)
            self.activation = activation

        def forward(self, x):
            x = self.conv(x)
            return x if self.activation is None else self.activation(x)

    class ConvELU2D(_ConvActivation):
        def __init__(self, in_channels, out_channels, kernel_size):
            super().__init__(in_channels, out_channels, kernel_size, nn.ELU())

    class Conv2D(_ConvActivation):
        def __init__(self, in_channels, out_channels, kernel_size):
            super().__init__(in_channels, out_channels, kernel_size, None)
"""


def cremi_dunet2d() -> torch.nn.Module:
    shim = Path(tempfile.mkdtemp(prefix="inferno-shim-"))
    layers = shim / "inferno" / "extensions" / "layers"
    layers.mkdir(parents=True)
    for folder in (shim / "inferno", shim / "inferno" / "extensions", layers):
        (folder / "__init__.py").write_text("")
    (layers / "convolutional.py").write_text(textwrap.dedent(INFERNO_LAYERS))
    sys.path[:0] = [str(shim), str(REALDATA / "cremi_dunet2d")]
    from model import DUNet2D

    net = DUNet2D(in_channels=1, out_channels=1)
    state = torch.load(REALDATA / "cremi_dunet2d" / "state.nn", map_location="cpu", weights_only=True)
    net.load_state_dict(state)
    return PlaneNetwork(net.eval(), "yx")


def networks() -> dict:
    from tests import realnets

    found = {name: (lambda name=name: build_preset(name)) for name in PRESETS}
    found["cremi-dunet2d"] = cremi_dunet2d
    found["synapse-unet (tests/realnets)"] = lambda: realnets.synapse_unet().eval()
    found["valid-unet (tests/realnets)"] = lambda: realnets.valid_unet().eval()
    found["padded-pool (tests/realnets)"] = lambda: realnets.padded_pool_net().eval()
    found["pads-odd-sizes (tests/realnets)"] = lambda: realnets.pads_odd_sizes().eval()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--networks", help="comma-separated names [all]")
    args = parser.parse_args()
    available = networks()
    names = args.networks.split(",") if args.networks else list(available)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"| network | downsampling (how) | sizes taken | receptive radius | default halo | covers | "
          f"grid s (dry runs) | field s | peak RSS GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        module = available[name]()
        plane_axis = stack_axis(module.plane) if isinstance(module, PlaneNetwork) else None
        in_channels = 1
        started = time.perf_counter()
        grid = find_grid(module, in_channels, plane_axis=plane_axis)
        grid_s = time.perf_counter() - started
        started = time.perf_counter()
        note = ""
        if any(grid.context):
            radius = grid.context
        else:
            try:
                radius = field_radius(module, in_channels, grid, plane_axis=plane_axis)
            except UnboundedField as err:
                radius, note = None, f"unbounded: {err}"
        field_s = time.perf_counter() - started
        field = NetworkField(grid, radius, note, grid_s + field_s)
        halo = choose_halo(named=None, model_halo=None, field=field, downsampling=grid.downsampling,
                           plane_axis=plane_axis)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        shape = lambda c: "x".join(map(str, c))  # noqa: E731
        print(f"| {name} | {shape(grid.downsampling)} ({'/'.join(grid.how)}) | {grid.sizes_taken()} | "
              f"{shape(radius) if radius is not None else note} | {shape(halo.halo)}"
              f"{' (capped)' if halo.capped else ''} | {halo.covers} | {grid_s:.2f} ({grid.dry_runs}) | "
              f"{field_s:.2f} | {peak:.2f} |", flush=True)


if __name__ == "__main__":
    main()
