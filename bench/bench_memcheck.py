"""Issue 46: memory checked before anything runs, and a finished output recognised before any pass.

Three measurements, each of fresh `python -m blockpred` processes (one cache directory per tree, in --dir):

1. The check's cost in a run: `pass_memory` counted (a network's first run on a machine) and cached (every run
   after), then the dry run at the start block, against the dry run alone, in fresh processes after the imports
   (medians): `tiny` at 84^3 and `unet32` at 192^3.
2. `blockpred plan` of a declared (metadata only) 100000^3 uint8 zarr with `--model tiny --device cpu --shards
   block` at `--block 512` and `--block 256`: exit code, wall time and the child's peak resident memory (wait4).
   The tree before this work runs only `--block 256`: its `--block 512` grew past 20 GB on this 24 GB machine
   until the kernel killed it (issue 46's report).
3. `blockpred run` of a 128x512x512 uint8 volume with `--block 1024` (one block): the first run's wall time,
   start-up and the network's passes at the block (from --verbose), then ``--repeats`` runs of the finished
   output (medians; each must predict no block).

    python bench/bench_memcheck.py [--before /tmp/base-tree] [--repeats 5] [--dir /tmp/blockpred-memcheck]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zarr

from blockpred.io import create_volume

COUNT_COST = """
import sys, time, torch
from pathlib import Path
from blockpred.geometry import Coord
from blockpred.models.loading import load_model
from blockpred.pipeline import Predictor
from blockpred.tuning.passmemory import PassMemoryCache, pass_memory
predictor = Predictor(load_model(sys.argv[2]).module, torch.device("cpu"))
cache = PassMemoryCache(Path(sys.argv[1]) / "passes.json")
start = time.perf_counter()
if sys.argv[3] != "none":
    pass_memory(predictor, 1, Coord((32, 32, 32)), {"name": sys.argv[2]}, cache)
counted = time.perf_counter()
predictor.output_shape((1, 1) + tuple(int(n) for n in sys.argv[4].split(",")))  # the dry run
print(round((counted - start) * 1000, 1), round((time.perf_counter() - start) * 1000, 1))
"""


def check_cost(work: Path, model: str, dry_run: str, repeats: int) -> None:
    """Milliseconds of the count and of count + dry run, in fresh processes, uncounted / counted / cached."""
    results: dict[str, list[tuple[float, float]]] = {"no count": [], "counted": [], "cached": []}
    for i in range(repeats):
        for mode in results:
            cache = work / f"count-cache-{i}"
            if mode == "counted":
                shutil.rmtree(cache, ignore_errors=True)
            out = subprocess.run([sys.executable, "-c", COUNT_COST, str(cache), model,
                                  "none" if mode == "no count" else "count", dry_run], capture_output=True, text=True,
                                 check=True).stdout.split()
            results[mode].append((float(out[0]), float(out[1])))
    print(f"1. {model}, dry run at {dry_run}: " + "; ".join(
        f"{mode} {statistics.median(c for c, _ in times):.1f} ms count, "
        f"{statistics.median(t for _, t in times):.0f} ms with the dry run" for mode, times in results.items()))


#: Runs argv[3:] with its output in the files argv[1] and argv[2]; prints its exit code and peak resident KiB.  A
#: child's peak counts the memory of the process it was started from until its exec (Linux keeps that mark): this
#: small process in between keeps the bench's own memory out of it.
PEAK_OF_CHILD = """
import os, subprocess, sys
with open(sys.argv[1], "w") as out, open(sys.argv[2], "w") as err:
    child = subprocess.Popen(sys.argv[3:], stdout=out, stderr=err)
_, status, usage = os.wait4(child.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def blockpred(args: list[str], tree: str | None, cache: Path, cwd: Path) -> tuple[int, float, int, str, str]:
    """Exit code, wall seconds, peak resident bytes, stdout and stderr of one ``python -m blockpred`` process."""
    env = dict(os.environ, BLOCKPRED_CACHE_DIR=str(cache))
    if tree:
        env["PYTHONPATH"] = tree
    out, err = cwd / "stdout.txt", cwd / "stderr.txt"
    start = time.perf_counter()
    measured = subprocess.run([sys.executable, "-c", PEAK_OF_CHILD, str(out), str(err), sys.executable, "-m",
                               "blockpred", *args], capture_output=True, text=True, env=env, cwd=cwd, check=True)
    wall = time.perf_counter() - start
    code, peak_kib = map(int, measured.stdout.split())
    return code, wall, peak_kib * 1024, out.read_text(), err.read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="the tree before this work (put first on PYTHONPATH)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/tmp/blockpred-memcheck")
    args = parser.parse_args()
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    zarr.create_array(str(work / "huge.zarr"), name="raw", shape=(100_000,) * 3, chunks=(128,) * 3, dtype="uint8")
    data = (np.random.default_rng(1).random((128, 512, 512)) * 255).astype("uint8")
    with create_volume(str(work / "in.zarr/raw"), spatial_shape=data.shape, num_channels=None, dtype=data.dtype,
                       chunk_shape=(64, 128, 128), ome=False) as volume:
        volume.write(volume.box, data)
    trees = {"this tree": None} | ({"before": args.before} if args.before else {})

    check_cost(work, "tiny", "84,84,84", args.repeats)
    check_cost(work, "unet32", "192,192,192", min(3, args.repeats))

    for name, tree in trees.items():
        cache = work / f"cache-{name.replace(' ', '-')}"
        for block in ("512", "256"):
            if tree is not None and block == "512":
                continue  # killed by the kernel past 20 GB on this machine (issue 46)
            code, wall, peak, _, err = blockpred(
                ["plan", str(work / "huge.zarr/raw"), "--model", "tiny", "--device", "cpu", "--block", block,
                 "--shards", "block"], tree, cache, work)
            last = err.strip().splitlines()[-1] if err.strip() else ""
            print(f"2. {name}: plan --block {block}: exit {code}, {wall:.2f} s, peak {peak / 2**30:.2f} GiB: "
                  f"{last[:160]}")
        out = str(work / f"out-{name.replace(' ', '-')}.zarr")
        run = ["run", str(work / "in.zarr/raw"), out, "--model", "tiny", "--device", "cpu", "--block", "1024",
               "--no-progress"]
        code, wall, peak, stdout, err = blockpred(["-v", *run], tree, cache, work)
        passes = sum("dry run of the network on an input of 148x532x532" in line for line in err.splitlines())
        chosen = next((line for line in stdout.splitlines() if line.startswith("chosen:")), "")
        started = next((line.split("started in ")[1].split(";")[0] for line in stdout.splitlines()
                        if "started in" in line), "?")
        print(f"3. {name}: first run exit {code}, {wall:.1f} s, started in {started}, dry runs at the block "
              f"{passes}; {chosen}")
        walls = []
        for _ in range(args.repeats if tree is None else min(2, args.repeats)):
            code, wall, _, stdout, _ = blockpred([*run, "--json"], tree, cache, work)
            summary = json.loads(stdout)
            assert code == 0 and summary["predicted_blocks"] == 0, stdout
            walls.append(wall)
        print(f"3. {name}: finished output again: median {statistics.median(walls):.2f} s of "
              f"{', '.join(f'{w:.2f}' for w in walls)}")


if __name__ == "__main__":
    main()
