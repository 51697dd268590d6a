"""What a user feels: the whole ``blockpred run`` command at defaults against its peers.

For each volume size and each network, on the same synthetic EM-like uint8
zarr volume, the same network weights and the same halo:

* ``blockpred run`` as a user types it: ``python -m blockpred run RAW OUT
  --model M [--halo H] --overwrite --no-progress``, a subprocess, timed from
  start to exit (imports, model load, dry run, measuring, pipeline, exit), with
  no block, batch, memory format or device named: the measured defaults
  (:mod:`blockpred.defaults`) choose.  Timed once on an empty cache (the
  **first run**, which pays for measuring; its cache is then kept) and in every
  round after it (**cached**: what every later run costs).  The configuration
  the command chose (its ``chosen:`` line) is printed;
* ``torch-em predict_with_halo_pipelined`` (and ``predict_with_halo`` with
  ``--all-peers``), timed in-process on the same network object: block 64^3
  (the block a user of those tools picks; blockpred's start block), the same
  halo per side, the zarr array read lazily, a zarr array written with
  blockpred's output chunks and codec;
* ``MONAI sliding_window_inference`` in-process with its defaults (overlap
  0.25, blend ``constant``), ``roi_size`` = block + 2 x halo, ``sw_batch_size``
  1, timed from reading the zarr volume into memory to the result in memory
  (it needs the whole volume and the whole output there; nothing is written).

The peers are timed in this process after an untimed warm-up forward pass,
so they pay no import, no interpreter start and no model load: blockpred's
times include all of these.  Every tool sees the same input values (uint8 ->
float32 x 1/255, blockpred's ``auto`` normalisation).  Rounds alternate the
tools; the table shows medians (seconds of wall time) and each tool's time
against blockpred's (cached and first run).  Max |diff| against blockpred over
the interior (the halo away from every face): blockpred's chosen block
differs from the peers' 64^3, so outputs agree to float rounding where the halo
covers the network's receptive field (``tiny``) and differ near block edges
where it does not (``unet12``: depth 3, the halo 16 covers less than its field).

Networks: ``tiny`` (the preset: 4 features, depth 1, halo 10) and ``unet12``
(a user's TorchScript file: blockpred's UNet3d with 12 initial features, depth
3, 1 -> 2 channels, sigmoid, scripted and saved with ``torch.jit.script``; halo 16).

Sizes: ``--sizes 64,256,256x3,128,704,704x1`` = 64x256x256 (4.2 Mvox) in 3
rounds and 128x704x704 (63 Mvox) in 1.

Peers' installs: ``pip install -e ".[peers]"`` (monai; 1.6.x needs only torch>=2.8 and numpy);
``pip install --no-deps torch-em bioimage-cpp`` (see below).

torch-em import (torch-em 0.10.x): ``torch_em.util.prediction`` needs only
numpy, torch, tqdm, ``bioimage_cpp`` for its blocking, and
``torch_em.transform.raw`` for the default ``standardize`` preprocessing.  Its
declared dependencies include torchvision, and the only torchvision on the
registry (0.29.x) pulls torch 2.15 with CUDA, replacing this venv's torch
2.13.0+cpu.  The package ``__init__`` files of ``torch_em``, ``torch_em.util``
and ``torch_em.transform`` import trainers, datasets, augmentations, kornia,
elf, imageio, matplotlib, tensorboard and torchvision, none of which
prediction uses.  So :func:`import_torch_em_prediction` registers those three
packages in ``sys.modules`` as empty package modules whose ``__path__`` is the
installed directory (their ``__init__`` never runs; their submodules load from
the real files), and, only when torchvision is not installed, a
``torchvision`` stub whose ``transforms`` attribute raises on any use.  The
stubs live in this process only.

    python bench/compare_peers.py [--networks tiny,unet12] [--sizes 64,256,256x3,128,704,704x1]
                                  [--all-peers] [--dir /tmp/blockpred-peers] [--json F]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from blockpred.demo import make_em_volume
from blockpred.io import create_volume
from blockpred.models import build_preset
from blockpred.models.unet import UNet3d

SCALE = np.float32(1.0 / 255.0)
PEER_BLOCK = (64, 64, 64)


def normalise(block: Any) -> np.ndarray:
    """uint8 -> float32 in [0, 1]: the same operations as blockpred's ``auto`` normalisation."""
    out = np.asarray(block).astype(np.float32)
    out *= SCALE
    return out


# --------------------------------------------------------------------------- torch-em import


class _Unavailable(types.ModuleType):
    """A stub module: any attribute use raises, naming why the stub is there."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(
            f"{self.__name__}.{name}: {self.__name__} is a stub from bench/compare_peers.py "
            "(torchvision is not installed; torch-em's prediction does not use it)"
        )


def import_torch_em_prediction() -> tuple[types.ModuleType, list[str]]:
    """``torch_em.util.prediction`` without running torch-em's package ``__init__`` files.

    Returns the module and a list of what was stubbed (see the module docstring).
    """
    spec = importlib.util.find_spec("torch_em")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torch-em is not installed: pip install --no-deps torch-em bioimage-cpp")
    root = Path(list(spec.submodule_search_locations)[0])
    stubbed = []
    for name, directory in (("torch_em", root), ("torch_em.util", root / "util"),
                            ("torch_em.transform", root / "transform")):
        if name in sys.modules:
            continue
        package = types.ModuleType(name, f"{name} without its __init__ (bench/compare_peers.py)")
        package.__path__ = [str(directory)]
        package.__package__ = name
        package.__file__ = None
        sys.modules[name] = package
        stubbed.append(f"{name} (package __init__ skipped)")
    if importlib.util.find_spec("torchvision") is None and "torchvision" not in sys.modules:
        torchvision = _Unavailable("torchvision")
        transforms = _Unavailable("torchvision.transforms")
        torchvision.__dict__["transforms"] = transforms
        sys.modules["torchvision"] = torchvision
        sys.modules["torchvision.transforms"] = transforms
        stubbed.append("torchvision, torchvision.transforms (raising stubs)")
    import torch_em.util.prediction as prediction

    return prediction, stubbed


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# --------------------------------------------------------------------------- networks and volumes


def make_network(name: str, root: Path) -> tuple[torch.nn.Module, list[str], tuple[int, int, int]]:
    """The module the peers run, blockpred's model options for the same weights, and the halo."""
    if name == "tiny":
        return build_preset("tiny"), ["--model", "tiny"], (10, 10, 10)
    if name == "unet12":
        path = root / "unet12.pt"
        if not path.exists():
            torch.manual_seed(0)
            net = UNet3d(in_channels=1, out_channels=2, depth=3, initial_features=12).eval()
            torch.jit.script(net).save(str(path))
        return torch.jit.load(str(path)).eval(), ["--model", str(path), "--halo", "16,16,16"], (16, 16, 16)
    raise SystemExit(f"unknown network {name!r}: use tiny or unet12")


def make_volume(root: Path, shape: tuple[int, ...]) -> str:
    path = root / f"raw-{'x'.join(map(str, shape))}.zarr"
    if not path.exists():
        volume = create_volume(str(path), spatial_shape=shape, num_channels=None, dtype="uint8",
                               chunk_shape=(64, 64, 64), ome=False, overwrite=True)
        volume.write(volume.box, make_em_volume(shape))
        volume.close()
    return str(path)


def parse_sizes(text: str) -> list[tuple[tuple[int, int, int], int]]:
    """``64,256,256x3,128,704,704x1`` -> [((64, 256, 256), 3), ((128, 704, 704), 1)]."""
    sizes = []
    for match in re.finditer(r"(\d+),(\d+),(\d+)x(\d+)", text):
        z, y, x, rounds = (int(v) for v in match.groups())
        sizes.append(((z, y, x), rounds))
    if not sizes:
        raise SystemExit(f"--sizes: expected Z,Y,XxROUNDS[,...], got {text!r}")
    return sizes


# --------------------------------------------------------------------------- the tools


def run_blockpred(source: str, output: str, model_args: list[str], cache: Path) -> tuple[float, float, str]:
    """The whole command as a user runs it: (wall s, pipeline s, its chosen: line)."""
    env = dict(os.environ, BLOCKPRED_CACHE_DIR=str(cache))
    command = [sys.executable, "-m", "blockpred", "run", source, output, *model_args, "--overwrite", "--no-progress"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"blockpred run failed ({' '.join(command)}): {result.stderr.strip()[-2000:]}")
    lines = result.stdout.strip().splitlines()
    pipeline = float(re.search(r" in ([\d.]+) s \(", lines[-1]).group(1))
    chosen = next((line for line in lines if line.startswith("chosen:")), "chosen: (not printed)")
    return wall, pipeline, chosen


def read_output(path: str) -> np.ndarray:
    import zarr

    node = zarr.open(path, mode="r")
    array = node if isinstance(node, zarr.Array) else node["0"]
    return np.asarray(array[...])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--networks", default="tiny,unet12")
    parser.add_argument("--sizes", default="64,256,256x3,128,704,704x1",
                        help="volume shapes and their rounds, Z,Y,XxROUNDS (default 64,256,256x3,128,704,704x1)")
    parser.add_argument("--all-peers", action="store_true", help="also torch-em predict_with_halo (not pipelined)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for the peers (default 2)")
    parser.add_argument("--dir", default="/tmp/blockpred-peers")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    print(f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"torch threads {torch.get_num_threads()}; monai {version('monai')}, torch-em {version('torch-em')}, "
          f"blockpred {version('blockpred')}", flush=True)
    prediction, stubbed = import_torch_em_prediction()
    from monai.inferers import sliding_window_inference
    import zarr

    report = []
    for shape, rounds in parse_sizes(args.sizes):
        source = make_volume(root, shape)
        mvox = float(np.prod(shape)) / 1e6
        for name in args.networks.split(","):
            net, model_args, halo = make_network(name, root)
            window = tuple(b + 2 * h for b, h in zip(PEER_BLOCK, halo))
            with torch.no_grad():
                net(torch.zeros((1, 1) + window))  # the peers' warm-up: kernels created, untimed
            tag = f"{name}-{'x'.join(map(str, shape))}"
            cache = root / f"cache-{tag}"
            shutil.rmtree(cache, ignore_errors=True)
            bp_out = str(root / f"{tag}-blockpred.zarr")

            def torch_em(function: Callable, key: str) -> tuple[float, np.ndarray | None]:
                reference = zarr.open_array(str(Path(bp_out) / "0"), mode="r") if (Path(bp_out) / "0").exists() \
                    else zarr.open_array(bp_out, mode="r")
                out = zarr.create_array(store=str(root / f"{tag}-{key}.zarr"), shape=(2,) + shape, dtype="float32",
                                        chunks=reference.chunks, compressors=reference.compressors, fill_value=0.0,
                                        overwrite=True)
                start = time.perf_counter()
                function(zarr.open_array(source, mode="r"), net, gpu_ids=["cpu"], block_shape=PEER_BLOCK, halo=halo,
                         output=out, preprocess=normalise, disable_tqdm=True)
                return time.perf_counter() - start, None

            def monai() -> tuple[float, np.ndarray]:
                start = time.perf_counter()
                tensor = torch.from_numpy(normalise(zarr.open_array(source, mode="r")[...]))[None, None]
                with torch.no_grad():
                    result = sliding_window_inference(tensor, roi_size=window, sw_batch_size=1, predictor=net,
                                                      overlap=0.25, mode="constant")
                return time.perf_counter() - start, result[0].numpy()

            first = run_blockpred(source, bp_out, model_args, cache)
            print(f"{tag}: blockpred first run (empty cache) {first[0]:.2f} s wall, pipeline {first[1]:.2f} s; "
                  f"{first[2]}", flush=True)
            peers: list[tuple[str, Callable[[], tuple[float, Any]]]] = [
                ("torch-em predict_with_halo_pipelined",
                 lambda: torch_em(prediction.predict_with_halo_pipelined, "torch-em-pipelined")),
                ("MONAI sliding_window_inference", monai)]
            if args.all_peers:
                peers.insert(0, ("torch-em predict_with_halo", lambda: torch_em(prediction.predict_with_halo,
                                                                                 "torch-em-halo")))
            times: dict[str, list[float]] = {}
            pipelines, chosen, outputs = [], first[2], {}
            for round_ in range(rounds):
                wall, pipeline, chosen = run_blockpred(source, bp_out, model_args, cache)
                times.setdefault("blockpred run (cached)", []).append(wall)
                pipelines.append(pipeline)
                print(f"{tag} round {round_ + 1}/{rounds}: blockpred run {wall:.2f} s (pipeline {pipeline:.2f} s)",
                      flush=True)
                for label, run in peers:
                    seconds, result = run()
                    times.setdefault(label, []).append(seconds)
                    if round_ == 0:
                        outputs[label] = result if result is not None else None
                    print(f"{tag} round {round_ + 1}/{rounds}: {label} {seconds:.2f} s", flush=True)
            reference = read_output(bp_out)
            margin = max(halo)
            interior = (slice(None),) + tuple(slice(margin, n - margin) for n in shape)
            diffs = {}
            for label, _ in peers:
                other = outputs.get(label)
                if other is None:
                    key = "torch-em-pipelined" if "pipelined" in label else "torch-em-halo"
                    other = read_output(str(root / f"{tag}-{key}.zarr"))
                inner = np.abs(other[interior].astype(np.float64) - reference[interior])
                diffs[label] = float(inner.max()) if inner.size else float("nan")
            medians = {label: statistics.median(t) for label, t in times.items()}
            best_peer = min((label for label in medians if not label.startswith("blockpred")), key=medians.get)
            row = {
                "network": name, "shape": list(shape), "mvox": mvox, "halo": list(halo), "rounds": rounds,
                "chosen": chosen.removeprefix("chosen: "), "first_run_s": first[0], "first_pipeline_s": first[1],
                "chosen_first": first[2].removeprefix("chosen: "), "cached_run_s": medians["blockpred run (cached)"],
                "cached_pipeline_s": statistics.median(pipelines), "peers_s": {k: v for k, v in medians.items()
                                                                               if not k.startswith("blockpred")},
                "best_peer": best_peer, "speedup_cached": medians[best_peer] / medians["blockpred run (cached)"],
                "speedup_first": medians[best_peer] / first[0], "max_abs_diff_interior": diffs, "runs": times,
            }
            report.append(row)
            print(f"{tag}: best peer {best_peer} {medians[best_peer]:.2f} s; blockpred cached "
                  f"{row['cached_run_s']:.2f} s ({row['speedup_cached']:.2f}x), first run {first[0]:.2f} s "
                  f"({row['speedup_first']:.2f}x); chosen {row['chosen']}", flush=True)

    print()
    print("| network | volume | blockpred run, cached | first run (empty cache) | "
          "torch-em pipelined | MONAI | best peer / blockpred cached (first) | blockpred chose |")
    print("|---|---|---|---|---|---|---|---|")
    for r in report:
        peers = r["peers_s"]
        print(f"| {r['network']} | {'x'.join(map(str, r['shape']))} ({r['mvox']:.1f} Mvox) | "
              f"{r['cached_run_s']:.2f} s (pipeline {r['cached_pipeline_s']:.2f}) | {r['first_run_s']:.2f} s | "
              f"{peers.get('torch-em predict_with_halo_pipelined', float('nan')):.2f} s | "
              f"{peers.get('MONAI sliding_window_inference', float('nan')):.2f} s | "
              f"**{r['speedup_cached']:.2f}x** ({r['speedup_first']:.2f}x) | {r['chosen']} |")
    for r in report:
        diffs = ", ".join(f"{k} {v:.1e}" for k, v in r["max_abs_diff_interior"].items())
        print(f"  {r['network']} {'x'.join(map(str, r['shape']))}: max |diff| to blockpred in the interior: {diffs}")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "monai": version("monai"),
                                               "torch_em": version("torch-em"), "stubs": stubbed,
                                               "threads": args.threads, "rows": report}, indent=2))


if __name__ == "__main__":
    main()
