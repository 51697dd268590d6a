"""HDF5 output throughput of the whole command, before and after a change: `blockpred run` of a copy network.

The command a user types, with a network that costs nothing (``copy1.pt``: its input as one channel, a
TorchScript file), so that what is measured is the host path into HDF5: read the zarr input, convert, and
write the HDF5 output (gzip level 1, one writer thread, its blocks made durable as the tree does it):

    python -m blockpred run RAW OUT.h5:/pred --model copy1.pt --halo 0,0,0 --output-dtype uint8 --block B
        --batch-size 1 --memory-format contiguous --backend torch --no-progress

Each tree (``--tree NAME=PATH``, a checkout put first on ``PYTHONPATH``) writes a new file each round; a
tree named with ``--old-file`` also writes into a file that existed before in HDF5 1.8's format
(superblock 0, h5py's defaults: written without SWMR).  Rounds alternate the trees, so all see the same
machine; medians of the rounds after round 0 are reported, with each tree's ratio to the first.  The
Mvox/s is the summary's (output voxels over the pipeline's seconds); ``write`` is the summary's write
stage (summed over threads: for HDF5 from a block's submission to its durable completion).

    python bench/bench_hdf5_writes.py --tree before=/tmp/tree-before --tree after=. [--old-file after]
        [--shape 1024,1024,1024] [--block 64,256,256] [--rounds 3] [--dir /tmp/blockpred-hdf5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import h5py
import numpy as np
import torch

from blockpred.config import parse_shape
from blockpred.io.synthetic import write_em_volume
from blockpred.models.standin import CopyNetwork
from command import _SUMMARY, _TIME


def run(tree: Path, source: str, target: str, model: str, block: str, cache: Path) -> dict:
    command = [sys.executable, "-m", "blockpred", "run", source, target, "--model", model, "--halo", "0,0,0",
               "--output-dtype", "uint8", "--block", block, "--batch-size", "1", "--memory-format", "contiguous",
               "--backend", "torch", "--no-progress"]
    env = dict(os.environ, BLOCKPRED_CACHE_DIR=str(cache), PYTHONPATH=str(tree.resolve()))
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} (tree {tree}) failed: {result.stderr.strip()[-2000:]}")
    summary, times = _SUMMARY.search(result.stdout), _TIME.search(result.stdout)
    return {"wall_s": wall, "pipeline_s": float(summary.group(3)), "mvox_per_s": float(summary.group(4)),
            "started_s": float(times.group(1)), "write_s": float(times.group(4))}


def fresh_target(root: Path, name: str, old_file: bool) -> str:
    """A path to write: a new file, or a file in HDF5 1.8's format holding another dataset."""
    file = root / f"{name}.h5"
    file.unlink(missing_ok=True)
    shutil.rmtree(root / f"{name}.h5.blockpred", ignore_errors=True)
    if old_file:
        with h5py.File(file, "w") as handle:  # h5py's defaults: superblock 0
            handle["other"] = np.zeros((4, 4, 4), np.uint8)
    return f"{file}:/pred"


def check_copy(source: str, target: str) -> None:
    """The output must be the input, or the bench measures something broken."""
    from blockpred.geometry import Box
    from blockpred.io import open_volume

    box = Box((0, 0, 0), (16, 64, 64))
    if not np.array_equal(open_volume(target).read(box)[0], open_volume(source).read(box)):
        raise SystemExit(f"{target} is not a copy of its input: the bench is broken")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH of a checkout (repeat)")
    parser.add_argument("--old-file", action="append", default=[], help="a tree NAME that also writes an old file")
    parser.add_argument("--shape", default="1024,1024,1024")
    parser.add_argument("--block", default="64,256,256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/blockpred-hdf5")
    args = parser.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    source = str(root / f"raw-{args.shape.replace(',', 'x')}.zarr")
    if not Path(source).exists():
        write_em_volume(source, parse_shape(args.shape, "shape"), chunks=parse_shape("64,64,64", "chunks"))
    model = str(root / "copy1.pt")
    torch.jit.save(torch.jit.script(CopyNetwork(1)), model)
    trees = dict(item.split("=", 1) for item in args.tree)
    modes = [(name, False) for name in trees] + [(name, True) for name in args.old_file]
    runs: dict[str, list[dict]] = {}
    for round_ in range(args.rounds + 1):
        for name, old in modes:
            label = f"{name}{' (old file)' if old else ''}"
            target = fresh_target(root, "out", old)
            result = run(Path(trees[name]), source, target, model, args.block, root / "cache")
            if round_ == 0:
                check_copy(source, target)
            else:
                runs.setdefault(label, []).append(result)
            print(f"round {round_} {label}: {result['mvox_per_s']:.1f} Mvox/s (pipeline {result['pipeline_s']:.2f} s, "
                  f"write stage {result['write_s']:.2f} s, wall {result['wall_s']:.2f} s)", flush=True)
    first = next(iter(runs))
    report = {"date": date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
              "shape": args.shape, "block": args.block, "rounds": args.rounds, "trees": trees}
    for label, results in runs.items():
        mvox = statistics.median(r["mvox_per_s"] for r in results)
        report[label] = {"mvox_per_s": round(mvox, 1), "all_mvox_per_s": [r["mvox_per_s"] for r in results],
                         "write_s": round(statistics.median(r["write_s"] for r in results), 2),
                         "wall_s": round(statistics.median(r["wall_s"] for r in results), 2),
                         f"ratio_to_{first}": round(mvox / statistics.median(r["mvox_per_s"] for r in runs[first]), 3)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
