"""Peak memory and time of an OME-Zarr pyramid written below a large prediction.

Writes a prediction-like output (an OME-NGFF image group, float32, laid out as
`blockpred run` lays out such an output: chunks in shards of one block) slab by
slab, then builds its pyramid in a separate process whose peak resident set
size (ru_maxrss of the child) is reported beside the size of level 0. The claim
under test: the pyramid's memory is bounded by a few write units, not by the
volume.

    python bench/bench_pyramid.py [--shape 128,1024,1024] [--levels 3] [--shards 64,256,256]
                                  [--chunks 64,128,128] [--threads 2] [--dir /tmp/blockpred-pyramid]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

from blockpred.config import parse_shape
from blockpred.geometry import Box, Coord
from blockpred.io import create_volume

# The child reads its own high-water mark (VmHWM: this process image only; ru_maxrss of a child would
# include the parent's memory, which a fork copies before the exec).
_CHILD = """
import json, sys, time
def hwm_kib():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])
from blockpred.run.pyramid import build_pyramid
from blockpred.io import parse_volume_path
after_imports = hwm_kib()
start = time.perf_counter()
summary = build_pyramid(parse_volume_path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], threads=int(sys.argv[4]))
print(json.dumps({"seconds": time.perf_counter() - start, "rss_after_imports_kib": after_imports,
                  "peak_rss_kib": hwm_kib(), "levels": [list(lv.shape) for lv in summary.levels]}))
"""


def write_prediction(path: str, shape: Coord, chunks: Coord, shards: Coord | None, slab: int) -> None:
    volume = create_volume(path, spatial_shape=shape, num_channels=1, dtype=np.float32, chunk_shape=chunks,
                           shard_shape=shards, overwrite=True)
    rng = np.random.default_rng(0)
    plane = rng.random((1, slab, shape[1], shape[2]), dtype=np.float32)
    for z in range(0, shape[0], slab):
        box = Box(Coord((z, 0, 0)), Coord((min(z + slab, shape[0]), shape[1], shape[2])))
        volume.write(box, plane[:, : box.shape[0]] + np.float32(z))
    volume.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="128,1024,1024")
    parser.add_argument("--levels", type=int, default=3)
    parser.add_argument("--method", default="mean")
    parser.add_argument("--chunks", default="64,128,128")
    parser.add_argument("--shards", default="64,256,256", help="shard shape, or off")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/blockpred-pyramid")
    args = parser.parse_args()
    shape, chunks = parse_shape(args.shape, "shape"), parse_shape(args.chunks, "chunks")
    shards = None if args.shards == "off" else parse_shape(args.shards, "shards")
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    target = str(root / "prediction.zarr")
    start = time.perf_counter()
    write_prediction(target, shape, chunks, shards, slab=(shards or chunks)[0])
    level0_gib = shape.prod() * 4 / 2**30
    print(f"wrote {target} {tuple(shape)} float32 ({level0_gib:.2f} GiB) in {time.perf_counter() - start:.1f} s",
          flush=True)
    result = subprocess.run([sys.executable, "-c", _CHILD, target, str(args.levels), args.method,
                             str(args.threads)], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"pyramid failed:\n{result.stderr}")
    child = json.loads(result.stdout.strip().splitlines()[-1])
    peak_gib = child["peak_rss_kib"] / 2**20
    row = {
        "date": date.today().isoformat(), "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        "shape": list(shape), "chunks": list(chunks), "shards": shards and list(shards), "levels": child["levels"],
        "method": args.method, "threads": args.threads, "seconds": round(child["seconds"], 2),
        "level0_gib": round(level0_gib, 3), "peak_rss_gib": round(peak_gib, 3),
        "rss_after_imports_gib": round(child["rss_after_imports_kib"] / 2**20, 3),
        "mvox_per_s_of_level0": round(shape.prod() / child["seconds"] / 1e6, 1),
    }
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
