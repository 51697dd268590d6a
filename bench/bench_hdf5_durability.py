"""What making one block durable costs in an HDF5 file: h5py's write, then the file's flush, then its fsync.

Blocks of the synthetic EM volume that ``bench_hdf5_writes.py`` makes (``--source``; ``--block``, gzip level 1 in chunks of the block) written one after the other into a new
file, timed step by step, in the three ways a blockpred HDF5 output can be open: a new file (HDF5 1.10's format,
single-writer/multiple-reader mode), and a file that existed in HDF5 1.8's format (no SWMR), each flushed and
fsynced after every block; and the same new file never flushed before its close (as blockpred wrote before).
blockpred's writer flushes and fsyncs once per round of the writes that gathered meanwhile, beside the next
writes (``blockpred/io/hdf5_files.py``), so per block this is the most it can cost.

    python bench/bench_hdf5_durability.py [--source /tmp/blockpred-hdf5/raw-1024x1024x1024.zarr] [--blocks 48]
        [--block 64,256,256] [--dir /tmp/blockpred-hdf5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import h5py
import numpy as np

from blockpred.geometry import Box, Coord
from blockpred.io import open_volume


def one_way(path: Path, data: list[np.ndarray], block: tuple[int, ...], swmr: bool, durable: bool) -> dict:
    path.unlink(missing_ok=True)
    libver = ("v110", "latest") if swmr else None
    steps: dict[str, list[float]] = {"write_ms": [], "flush_ms": [], "fsync_ms": []}
    start = time.perf_counter()
    with h5py.File(path, "w", libver=libver) as handle:
        dataset = handle.create_dataset("pred", shape=(len(data) * block[0],) + block[1:], dtype="uint8",
                                        chunks=block, compression="gzip", compression_opts=1)
        if swmr:
            handle.swmr_mode = True
        fd = handle.id.get_vfd_handle()
        for i, values in enumerate(data):
            t0 = time.perf_counter()
            dataset[i * block[0]:(i + 1) * block[0]] = values
            t1 = time.perf_counter()
            if durable:
                handle.flush()
                t2 = time.perf_counter()
                os.fsync(fd)
                t3 = time.perf_counter()
                steps["flush_ms"].append((t2 - t1) * 1e3)
                steps["fsync_ms"].append((t3 - t2) * 1e3)
            steps["write_ms"].append((t1 - t0) * 1e3)
    total = time.perf_counter() - start
    out = {name: round(statistics.median(values), 2) for name, values in steps.items() if values}
    out.update({f"{name}_max": round(max(values), 2) for name, values in steps.items() if values})
    out["total_s"] = round(total, 2)
    out["mvox_per_s"] = round(float(len(data) * np.prod(block)) / total / 1e6, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="/tmp/blockpred-hdf5/raw-1024x1024x1024.zarr")
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--block", default="64,256,256")
    parser.add_argument("--dir", default="/tmp/blockpred-hdf5")
    args = parser.parse_args()
    block = tuple(int(v) for v in args.block.split(","))
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    source = open_volume(args.source)
    grid = [n // b for n, b in zip(source.spatial_shape, block)]
    corners = [tuple(int(v) * b for v, b in zip(np.unravel_index(i, grid), block)) for i in range(args.blocks)]
    data = [source.read(Box(Coord(c), Coord(c) + Coord(block))) for c in corners]
    report = {"date": date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
              "source": args.source, "blocks": args.blocks, "block": args.block}
    for label, swmr, durable in (("new file, SWMR, durable each block", True, True),
                                 ("1.8 file, durable each block", False, True),
                                 ("new file, SWMR, never flushed", True, False)):
        report[label] = one_way(root / "durability.h5", data, block, swmr, durable)
        print(label, report[label], flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
