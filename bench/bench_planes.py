"""A 2D network over a 3D volume: ``blockpred run`` at defaults against bioimage.io's own prediction per plane.

The network is a 2D U-Net (seeded, depth 3, 16 initial features, 1 -> 2
channels) packaged as a bioimage.io model (format 0.5, TorchScript weights):
input axes b, c, y, x of 32 + k*16, an output halo of 16, zero-mean-unit-
variance preprocessing and a sigmoid.  The volume is EM-like uint8,
``--shape`` (z, y, x); every z-plane is one plane to predict.

* **blockpred**: ``python -m blockpred run VOL.zarr OUT.zarr --model rdf.yaml
  --overwrite --no-progress``, a subprocess, nothing else named.  Run once with
  an empty cache (the first run, which measures) and once cached.  Reported:
  the summary's planes/s (pipeline), and planes per second of the whole
  command's wall time (imports, model load, statistics, dry run, measuring).
* **bioimage.io** (the in-memory peer): ``bench/bioimageio_peer.py`` in its
  own venv (``--peer-python``; see that script for its setup), which predicts
  each plane as one sample through bioimageio.core's prediction pipeline
  (``predict_sample_without_blocking``: the plane padded by the halo, the
  package's pre- and postprocessing), weights loaded once and one warm-up
  plane untimed: its steady state, no start-up counted.

Both use torch's default threads on this machine.  Both normalise each plane
by its own statistics where the package asks per plane (bioimage.io's of the
padded plane, blockpred's of the whole plane before the run: see
docs/models.md, "2D networks on 3D volumes"); the bench reports the speed.

Run: ``python bench/bench_planes.py --shape 32,512,512 --peer-python /work/peers-venv/bin/python``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from command import run_blockpred  # noqa: E402

HALO = 16


class UNet2d(nn.Module):
    """A plain 2D U-Net: two 3x3 convs per level, max pooling, nearest upsampling, skip concatenation."""

    def __init__(self, depth: int = 3, features: int = 16):
        super().__init__()
        widths = [features * 2 ** i for i in range(depth + 1)]
        self.down = nn.ModuleList(self._pair(1 if i == 0 else widths[i - 1], widths[i]) for i in range(depth))
        self.bottom = self._pair(widths[depth - 1], widths[depth])
        self.up = nn.ModuleList(self._pair(widths[i + 1] + widths[i], widths[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(widths[0], 2, 1)

    @staticmethod
    def _pair(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1),
                             nn.ReLU())

    def forward(self, x):
        skips = []
        for level in self.down:
            x = level(x)
            skips.append(x)
            x = nn.functional.max_pool2d(x, 2)
        x = self.bottom(x)
        for i, level in enumerate(self.up):
            skip = skips[len(skips) - 1 - i]
            x = level(torch.cat([nn.functional.interpolate(x, scale_factor=2.0, mode="nearest"), skip], dim=1))
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="32,512,512", help="volume z,y,x [32,512,512]")
    parser.add_argument("--peer-python", default="/work/peers-venv/bin/python",
                        help="the Python of a venv with bioimageio.core (see bench/bioimageio_peer.py)")
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.helpers import build_2d_package, write_test_volume  # the suite's builder and writer

    with tempfile.TemporaryDirectory(prefix="bench-planes-") as tmp:
        root = Path(tmp)
        rng = np.random.default_rng(0)
        raw = np.clip(rng.normal(128, 40, size=shape), 0, 255).astype(np.uint8)
        volume = write_test_volume(str(root / "vol.zarr"), raw, chunks=(1, 256, 256))
        np.save(root / "vol.npy", raw)
        torch.manual_seed(0)
        torch.jit.script(UNet2d().eval()).save(str(root / "unet2d.pt"))
        rdf = build_2d_package(root, root / "unet2d.pt", raw[0], halo=HALO, min_size=64, step=16,
                               zmuv_axes=("channel", "y", "x"), name="bench-unet2d")
        cache = root / "cache"
        rows = []
        for label in ("first run", "cached"):
            out = run_blockpred([volume, str(root / "out.zarr"), "--model", str(rdf), "--overwrite",
                                 "--no-progress"], cache)
            planes_s = shape[0] / out["pipeline_s"]
            rows.append((f"blockpred run, {label}", planes_s, shape[0] / out["wall_s"], out["chosen"]))
        peer = subprocess.run([args.peer_python, str(Path(__file__).with_name("bioimageio_peer.py")),
                               "--package", str(rdf), "--volume", str(root / "vol.npy"), "--repeats", "1"],
                              capture_output=True, text=True)
        if peer.returncode != 0:
            raise SystemExit(f"the bioimage.io peer failed: {peer.stderr.strip()[-2000:]}")
        found = json.loads(peer.stdout.strip().splitlines()[-1])
        rows.append((f"bioimageio.core {found['bioimageio_core']} per plane (steady state)", found["planes_per_s"],
                     None, f"torch threads {found['torch_threads']}"))
    best_peer = rows[-1][1]
    print(f"volume {'x'.join(map(str, shape))} uint8, bench unet2d (depth 3, 16 features), halo {HALO}")
    print("| what | planes/s (pipeline or steady) | planes/s of wall time | vs bioimage.io | notes |")
    print("|---|---|---|---|---|")
    for what, rate, wall, notes in rows:
        print(f"| {what} | {rate:.1f} | {'' if wall is None else f'{wall:.1f}'} | {rate / best_peer:.2f}x"
              f"{'' if wall is None else f' ({wall / best_peer:.2f}x wall)'} | {notes} |")


if __name__ == "__main__":
    main()
