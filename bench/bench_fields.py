"""What blockpred finds of each network by itself: downsampling, receptive field, default halo, and the cost.

For every preset (measured here, not taken from what the preset states) and every trained network in
``../shared/realdata`` whose weights are there (the 2D CREMI DUNet, with a stand-in for the two inferno layers
its model file imports), plus the published kinds of ``tests/realnets.py``: the grid found by dry runs
(:func:`blockpred.models.discover.find_grid`), the receptive-field radius
(:func:`blockpred.models.receptive.field_radius`), both as a run finds them
(:func:`blockpred.models.field.network_field`, with an empty cache), the default halo a run takes
(:func:`blockpred.run.halo.choose_halo`), and the seconds each took, the process's peak memory after it.

    python bench/bench_fields.py [--networks tiny,cremi2018,unet32,cremi-dunet2d,...]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from blockpred.run.halo import choose_halo  # noqa: E402
from blockpred.models import build_preset  # noqa: E402
from blockpred.models.field import FieldCache, network_field  # noqa: E402
from blockpred.models.planes import PlaneNetwork, stack_axis  # noqa: E402
from blockpred.models.presets import PRESETS  # noqa: E402

REALDATA = ROOT.parent / "shared" / "realdata"


def cremi_dunet2d() -> torch.nn.Module:
    from tests.realnets import write_inferno_layers

    shim = write_inferno_layers(Path(tempfile.mkdtemp(prefix="inferno-shim-")))
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
    print("| network | downsampling (how) | sizes taken | receptive radius | default halo | covers | "
          "grid s (dry runs) | field s | peak RSS GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        module = available[name]()
        plane_axis = stack_axis(module.plane) if isinstance(module, PlaneNetwork) else None
        with tempfile.TemporaryDirectory() as cache:  # measured here, whatever a run cached
            field = network_field(module, 1, {"name": name}, plane_axis=plane_axis,
                                  cache=FieldCache(Path(cache) / "networks.json"))
        grid, radius = field.grid, field.radius
        halo = choose_halo(named=None, model_halo=None, field=field, downsampling=grid.downsampling,
                           plane_axis=plane_axis)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        shape = lambda c: "x".join(map(str, c))  # noqa: E731
        print(f"| {name} | {shape(grid.downsampling)} ({'/'.join(grid.how)}) | {grid.sizes_taken()} | "
              f"{shape(radius) if radius is not None else field.note} | {shape(halo.halo)}"
              f"{' (capped)' if halo.capped else ''} | {halo.covers} | {grid.seconds:.2f} ({grid.dry_runs}) | "
              f"{field.seconds - grid.seconds:.2f} | {peak:.2f} |", flush=True)


if __name__ == "__main__":
    main()
