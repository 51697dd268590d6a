"""Client bookkeeping against volume size: one masked block on an 8.6 Gvox and an 8 Tvox volume.

Both input volumes are *virtual*: zarr v3 arrays whose metadata is written
and whose chunks are not (every read gives the fill value), so the 8 Tvox
case costs no disk.  Each gets a mask downsampled 16x in z and 64x in y and
x (finer than the block on every axis) with one voxel set in the middle of
one block, so exactly one block of ``--block`` (default 64,256,256) runs:

    8.6 Gvox  2048 x 2048 x 2048      2,048 blocks
    8.0 Tvox  11000 x 27000 x 27000   1,932,592 blocks (Platynereis' size)

Each run is the whole ``blockpred run`` command in its own process (the
dask path unless ``--local``), timed from start to exit, with that process's
peak resident set (the client's; dask workers are other processes) and the
time of ``blockpred plan`` on the same volume (``--repeats`` rounds, the
sizes alternating; medians); then the same command again
(a resume that finds everything finished), and the time to read the finished
set once every block's id is in the done log (a resume's bulk read of
millions of marks).  The
claim under test: the client's work grows with the blocks that run, not with
the volume.

    python bench/bench_scale.py [--repeats 3] [--block 64,256,256] [--model tiny] [--local]
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

import numpy as np
import zarr

from blockpred.pipeline.markers import DoneMarkers

SIZES = {"8.6G": (2048, 2048, 2048), "8T": (11000, 27000, 27000)}
MASK_SCALE = (16, 64, 64)

# Runs the CLI in this child process and prints its own peak RSS: the client alone.
_MEASURED = """
import resource, sys, time
from blockpred.cli import main
code = main(sys.argv[1:])
print("peak_rss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
sys.exit(code)
"""


def make_virtual(root: Path, name: str, shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[str, str]:
    """A chunkless uint8 input of ``shape`` and its downsampled mask with one voxel set (inside one block)."""
    source = root / f"{name}.zarr"
    zarr.create_array(str(source), shape=shape, chunks=block, dtype="uint8", fill_value=0, overwrite=True)
    mask_shape = tuple(-(-s // f) for s, f in zip(shape, MASK_SCALE))
    mask = zarr.create_array(str(root / f"{name}-mask.zarr"), shape=mask_shape, chunks=(64, 64, 64), dtype="uint8",
                             fill_value=0, overwrite=True)
    # The centre of the block at grid index (1, 1, 1): one block of the plan runs.
    centre = tuple((b + b // 2) * m // s for b, m, s in zip(block, mask_shape, shape))
    mask[centre] = 1
    return str(source), str(root / f"{name}-mask.zarr")


def timed(command: list[str]) -> tuple[float, int, str]:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", _MEASURED, *command], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"`blockpred {' '.join(command)}` failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    rss = int(result.stderr.rsplit("peak_rss_kib", 1)[1].split()[0])
    return seconds, rss, result.stdout.strip()


def measure(root: Path, name: str, source: str, mask: str, block: tuple[int, ...], args) -> dict:
    """``plan``, ``run``, the same ``run`` again (resume), then the bulk read of a finished set of every block."""
    target = str(root / f"{name}-prediction.zarr")
    options = ["--mask", mask, "--block", args.block, "--model", args.model, "--device", "cpu"]
    plan_s, plan_rss, _ = timed(["plan", source, target, *options])
    run = ["run", source, target, *options, "--no-progress"] + (["--local"] if args.local else [])
    run_s, run_rss, summary = timed(run)
    resume_s, _, _ = timed(run)  # the same command again: everything is finished
    # Every block marked done (as a finished unmasked run leaves it): the bulk read of a resume.
    blocks = int(np.prod([-(-s // b) for s, b in zip(SIZES[name], block)]))
    markers_dir = Path(target + ".blockpred") / "_root"
    np.arange(blocks, dtype="<i8").tofile(markers_dir / "done" / "simulated.ids")
    start = time.perf_counter()
    left = DoneMarkers.open(markers_dir).todo_ids()
    read_all_done_s = time.perf_counter() - start
    assert len(left) == 0, len(left)
    shutil.rmtree(target, ignore_errors=True)
    shutil.rmtree(target + ".blockpred", ignore_errors=True)
    return {"run_s": run_s, "client_peak_rss_gib": run_rss / 2**20, "plan_s": plan_s,
            "plan_peak_rss_gib": plan_rss / 2**20, "resume_s": resume_s, "read_all_done_s": read_all_done_s,
            "summary": summary.splitlines()[-1] if summary else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", default="64,256,256")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--local", action="store_true", help="run in the client process instead of on dask")
    parser.add_argument("--sizes", default="8.6G,8T", help=f"which of {', '.join(SIZES)} [all]")
    parser.add_argument("--dir", default="/tmp/blockpred-scale")
    parser.add_argument("--repeats", type=int, default=3, help="runs per size; medians are reported [3]")
    args = parser.parse_args()
    block = tuple(int(v) for v in args.block.split(","))
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    sizes = args.sizes.split(",")
    volumes = {name: make_virtual(root, name, SIZES[name], block) for name in sizes}
    runs: dict[str, list[dict]] = {name: [] for name in sizes}
    for _ in range(args.repeats):  # the sizes alternate, so a slow spell of the machine hits both
        for name in sizes:
            runs[name].append(measure(root, name, *volumes[name], block, args))
            print(json.dumps({"volume": name, **runs[name][-1]}), flush=True)
    rows = []
    for name in sizes:
        shape = SIZES[name]
        row = {"volume": name, "shape": shape, "tvox": round(float(np.prod(shape, dtype=float)) / 1e12, 4),
               "blocks": int(np.prod([-(-s // b) for s, b in zip(shape, block)]))}
        for key in runs[name][0]:
            if key != "summary":
                row[key] = round(statistics.median(r[key] for r in runs[name]), 3)
        row["summary"] = runs[name][-1]["summary"]
        rows.append(row)
    report = {"date": date.today().isoformat(),
              "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "command": "python bench/bench_scale.py " + " ".join(sys.argv[1:]), "rows": rows}
    if len(rows) == 2:
        report["ratio_run_s"] = round(rows[1]["run_s"] / rows[0]["run_s"], 2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
