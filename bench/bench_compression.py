"""What output compression costs: write and read speed per codec, dtype and thread count.

A prediction's writer threads compress every output chunk.  At hundreds of
Mvox/s per GPU that is the CPU stage most likely to starve the device, so this
measures, for a realistic output (3 affinity channels of a smooth prediction,
128^3 chunks, as ``blockpred run`` writes them), how many Mvox/s of output one
writer thread sustains per codec, and the compression ratio.  Divide a GPU's
Mvox/s by the per-thread figure for the writer threads it needs.

    python bench/bench_compression.py [--shape 128,512,512] [--threads 1,2] [--dir /tmp/blockpred-bench]
"""

from __future__ import annotations

import argparse
import platform
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import numpy as np

from blockpred.config import parse_shape
from blockpred.io.synthetic import make_em_volume
from blockpred.geometry import Box, Coord
from blockpred.io import create_volume

CHUNK = Coord((128, 128, 128))


def prediction_like(shape: Coord) -> np.ndarray:
    """Three smooth channels in [0, 1]: boundaries of synthetic EM, blurred, as affinities look."""
    em = make_em_volume(shape).astype(np.float32) / 255.0
    channels = [1.0 - np.abs(np.diff(em, axis=a, append=em.take([-1], axis=a))) * 4 for a in range(3)]
    return np.clip(np.stack(channels), 0.0, 1.0)


def write_speed(path: Path, values: np.ndarray, dtype: str, codec: str, threads: int) -> tuple[float, float]:
    """(Mvox/s of output written with ``threads`` writers, bytes on disk / raw bytes)."""
    shutil.rmtree(path, ignore_errors=True)
    shape = Coord(values.shape[1:])
    volume = create_volume(str(path), spatial_shape=shape, num_channels=values.shape[0], dtype=dtype,
                           chunk_shape=CHUNK, compression=codec, ome=False, overwrite=True)
    if dtype == "uint8":
        data = np.rint(values * 255).astype(np.uint8)
    else:
        data = values.astype(dtype)
    boxes = [Box(Coord((z, y, x)), Coord((z, y, x)) + CHUNK) for z in range(0, shape[0], CHUNK[0])
             for y in range(0, shape[1], CHUNK[1]) for x in range(0, shape[2], CHUNK[2])]
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda b: volume.write(b, data[(slice(None),) + b.to_slices()]), boxes))
    seconds = time.perf_counter() - start
    volume.close()
    on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return shape.prod() / seconds / 1e6, on_disk / data.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="128,512,512")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--dir", default="/tmp/blockpred-bench")
    args = parser.parse_args()
    shape = parse_shape(args.shape, "shape")
    workdir = Path(args.dir)
    workdir.mkdir(parents=True, exist_ok=True)
    values = prediction_like(shape)
    print(f"{date.today()} {platform.node()} ({platform.processor() or platform.machine()}), "
          f"output 3x{'x'.join(map(str, shape))}, chunks 3x{'x'.join(map(str, CHUNK))}")
    print("| output dtype | codec | threads | output Mvox/s | on disk / raw |")
    print("|---|---|---|---|---|")
    for dtype in ("uint8", "float16", "float32"):
        for codec in ("raw", "zstd", "blosc", "gzip"):
            for threads in (int(t) for t in args.threads.split(",")):
                mvox, ratio = write_speed(workdir / "compression.zarr", values, dtype, codec, threads)
                print(f"| {dtype} | {codec} | {threads} | {mvox:.1f} | {ratio:.3f} |", flush=True)
    shutil.rmtree(workdir / "compression.zarr", ignore_errors=True)


if __name__ == "__main__":
    main()
