"""Overhead of the dask path against the in-process path, one worker, same volume.

Runs ``blockpred.predict(..., local=True)`` (no dask) and
``blockpred.predict(..., workers=1)`` (a local dask cluster with one worker:
a worker process before issue 12, a worker in this process since; use
``--workers 2`` figures from other benches for worker processes) alternately on the same EM-like volume and reports, per mode, the
pipeline seconds (first task to last result: what Mvox/s counts) and the wall
seconds of the whole call (cluster start, model loading and dry run included).

    python bench/bench_dask_overhead.py [--shape 128,384,384] [--repeats 2] [--model tiny] [--workers 1]

``--workers N`` (N > 1) compares worker processes with the in-process run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import blockpred
from blockpred.config import parse_shape
from blockpred.io.synthetic import make_em_volume
from blockpred.io import create_volume


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="128,384,384")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dir", default="/tmp/blockpred-dask-bench")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    shape = parse_shape(args.shape, "shape")
    root = Path(args.dir)
    source = str(root / "raw.zarr")
    volume = create_volume(source, spatial_shape=shape, num_channels=None, dtype="uint8",
                           chunk_shape=(64, 64, 64), ome=False, overwrite=True)
    volume.write(volume.box, make_em_volume(shape))
    volume.close()

    dask_mode = f"dask, {args.workers} worker{'s' if args.workers > 1 else ''}"
    runs: dict[str, list[tuple[float, float]]] = {"in-process": [], dask_mode: []}
    for repeat in range(args.repeats):
        for mode, options in (("in-process", {"local": True}), (dask_mode, {"workers": args.workers})):
            start = time.perf_counter()
            summary = blockpred.predict(source, str(root / "out.zarr"), model=args.model, overwrite=True,
                                        progress=False, **options)
            runs[mode].append((summary.stats.seconds, time.perf_counter() - start))
            print(f"{mode:16s} repeat {repeat}: {summary.stats.seconds:.2f} s pipeline, "
                  f"{runs[mode][-1][1]:.2f} s wall, {summary.mvox_per_s:.2f} Mvox/s", flush=True)
    report = {"shape": list(shape), "model": args.model, "cpus": os.cpu_count()}
    for mode, values in runs.items():
        report[mode] = {"pipeline_s": statistics.median(v[0] for v in values),
                        "wall_s": statistics.median(v[1] for v in values)}
    local, dask = report["in-process"], report[dask_mode]
    report["pipeline_overhead_pct"] = round(100 * (dask["pipeline_s"] / local["pipeline_s"] - 1), 1)
    report["wall_overhead_s"] = round(dask["wall_s"] - local["wall_s"], 2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
