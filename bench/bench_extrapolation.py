"""Does the bench's extrapolation hold?  Predict the run time of a volume 8x the sampled one, then run it.

1. ``blockpred run`` (the default dask path) on a sampled volume gives Mvox/s
   (output voxels per second of pipeline, as the bench reports it).
2. :func:`blockpred.bench.metrics.hours_for` turns that into the expected pipeline
   time of a volume 8x larger (2x per axis).
3. ``blockpred run`` on that volume gives the real time; the error is printed.
   The whole-command wall times (cluster start, model load) are printed too:
   they are a fixed cost that extrapolation by throughput leaves out.

    python bench/bench_extrapolation.py [--shape 64,192,192] [--model tiny]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import blockpred
from blockpred.config import parse_shape
from blockpred.io.synthetic import make_em_volume
from blockpred.io import create_volume
from blockpred.bench.metrics import hours_for


def write(path: str, shape) -> None:
    volume = create_volume(path, spatial_shape=shape, num_channels=None, dtype="uint8", chunk_shape=(64, 64, 64),
                           ome=False, overwrite=True)
    volume.write(volume.box, make_em_volume(shape))
    volume.close()


def run(source: str, target: str, model: str):
    start = time.perf_counter()
    summary = blockpred.predict(source, target, model=model, overwrite=True, progress=False)
    return summary, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="64,192,192", help="the sampled volume; the large one is 2x per axis")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dir", default="/tmp/blockpred-extrapolation")
    args = parser.parse_args()
    small_shape = parse_shape(args.shape, "shape")
    large_shape = small_shape * 2
    root = Path(args.dir)
    small, large = str(root / "small.zarr"), str(root / "large.zarr")
    write(small, small_shape)
    write(large, large_shape)

    sampled, sampled_wall = run(small, str(root / "small-out.zarr"), args.model)
    predicted_s = hours_for(large_shape.prod(), sampled.mvox_per_s) * 3600
    measured, measured_wall = run(large, str(root / "large-out.zarr"), args.model)
    report = {
        "sampled_shape": list(small_shape), "sampled_mvox_per_s": round(sampled.mvox_per_s, 3),
        "sampled_pipeline_s": round(sampled.stats.seconds, 2), "sampled_wall_s": round(sampled_wall, 2),
        "large_shape": list(large_shape), "predicted_pipeline_s": round(predicted_s, 2),
        "measured_pipeline_s": round(measured.stats.seconds, 2), "measured_wall_s": round(measured_wall, 2),
        "error_pct": round(100 * (predicted_s / measured.stats.seconds - 1), 1),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
