"""Peak memory and speed of `blockpred run` on a 512^3 uint8 zarr volume (128 Mvox).

The volume is written slab by slab (this process never holds it whole); the
prediction runs as a separate `blockpred run` process whose peak resident set
size (ru_maxrss of the child) is reported with its Mvox/s.  The claim under
test: memory is bounded by the pipeline's queues, not by the volume.

    python bench/bench_memory.py [--shape 512] [--model tiny] [--dir /tmp/blockpred-bench]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import resource
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

from blockpred.config import parse_shape
from blockpred.io.synthetic import make_em_volume
from blockpred.geometry import Box, Coord
from blockpred.io import create_volume


def write_volume(path: str, shape: Coord, slab: int = 64) -> None:
    volume = create_volume(path, spatial_shape=shape, num_channels=None, dtype=np.uint8,
                           chunk_shape=Coord((64, 64, 64)).minimum(shape), ome=False, overwrite=True)
    texture = make_em_volume(Coord((slab, shape[1], shape[2])), num_cells=max(48, shape[1] // 8))
    for z in range(0, shape[0], slab):
        box = Box(Coord((z, 0, 0)), Coord((min(z + slab, shape[0]), shape[1], shape[2])))
        volume.write(box, texture[: box.shape[0]])
    volume.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="512", help="volume shape Z,Y,X [512]")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dir", default="/tmp/blockpred-bench")
    parser.add_argument("extra", nargs="*", help="more `blockpred run` options after --")
    args = parser.parse_args()
    shape = parse_shape(args.shape, "shape")
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    source, target = str(root / "raw.zarr"), str(root / "prediction.zarr")
    start = time.perf_counter()
    write_volume(source, shape)
    print(f"wrote {source} {tuple(shape)} uint8 in {time.perf_counter() - start:.1f} s", flush=True)

    command = [sys.executable, "-m", "blockpred", "run", source, target, "--model", args.model,
               "--overwrite", "--no-progress", *args.extra]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"blockpred run failed ({result.returncode}): {result.stderr.strip()}")
    peak_rss_bytes = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    summary = result.stdout.strip().splitlines()[-1]
    mvox_per_s = float(re.search(r"\(([\d.]+) Mvox/s\)", summary).group(1))
    report = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''} {__import__('os').cpu_count()} CPUs".strip(),
        "command": " ".join(["blockpred", *command[3:]]),
        "volume_mvox": shape.prod() / 1e6,
        "mvox_per_s": mvox_per_s,
        "process_wall_s": round(wall_s, 2),
        "peak_rss_gib": round(peak_rss_bytes / 2**30, 3),
        "summary": summary,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
