"""Start-up overhead of the whole `blockpred run` command: wall time minus pipeline time.

Writes the demo volume (128x256x256, as `blockpred demo`) once, then runs
`python -m blockpred run VOLUME --overwrite --no-progress` as a fresh process
``--repeats`` times per mode and reports the medians of the whole command's
wall time, the pipeline seconds it printed (first task to last write: what
Mvox/s counts) and their difference, the start-up and shut-down overhead.
Modes: the default (in this process since issue 12, when there is one device),
``--workers 1`` (one dask worker: the dask path) and ``--local``.  Every run
uses one cache directory (``--dir``/cache), filled by one untimed run per tree
first, so what the measured defaults choose is measured once and the timed
runs are what every later run costs.  ``--before DIR`` also runs the tree at
DIR (first on ``PYTHONPATH``), alternating with this one.

    python bench/bench_startup.py [--repeats 5] [--before /tmp/old-tree]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from blockpred.io.synthetic import write_demo_volume
from blockpred.geometry import Coord


def run_once(volume: str, extra: list[str], pythonpath: str | None, cwd: str) -> tuple[float, float]:
    env = dict(os.environ, BLOCKPRED_CACHE_DIR=str(Path(cwd) / "cache"))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "blockpred", "run", volume, "--overwrite", "--no-progress", *extra],
                            capture_output=True, text=True, env=env, cwd=cwd)  # not a checkout: -m finds cwd first
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"blockpred run failed: {result.stderr.strip()[-2000:]}")
    pipeline = float(re.search(r" in ([\d.]+) s \(", result.stdout.strip().splitlines()[-1]).group(1))
    return wall, pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", help="another blockpred tree to compare with (put first on PYTHONPATH)")
    parser.add_argument("--dir", default="/tmp/blockpred-startup")
    args = parser.parse_args()
    volume = write_demo_volume(Path(args.dir), Coord((128, 256, 256)))
    trees = {"this tree": None} | ({"before": args.before} if args.before else {})
    modes = {"default": [], "--workers 1 (dask)": ["--workers", "1"], "--local": ["--local"]}
    times: dict[str, list[tuple[float, float]]] = {}
    for path in trees.values():
        run_once(volume, [], path, args.dir)  # untimed: fills the cache (measured defaults)
    for _ in range(args.repeats):
        for tree, path in trees.items():
            for mode, extra in modes.items():
                times.setdefault(f"{tree}, {mode}", []).append(run_once(volume, extra, path, args.dir))
    rows = {}
    for name, runs in times.items():
        wall = statistics.median(w for w, _ in runs)
        pipeline = statistics.median(p for _, p in runs)
        overhead = statistics.median(w - p for w, p in runs)
        rows[name] = {"wall_s": round(wall, 2), "pipeline_s": round(pipeline, 2), "overhead_s": round(overhead, 2)}
        print(f"{name:<28} wall {wall:6.2f} s  pipeline {pipeline:6.2f} s  overhead {overhead:5.2f} s", flush=True)
    print(json.dumps({"date": date.today().isoformat(), "cpus": os.cpu_count(), "repeats": args.repeats,
                      "command": "python bench/bench_startup.py " + " ".join(sys.argv[1:]), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
