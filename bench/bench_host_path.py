"""The host path against the storage limit: blockpred with a copy network beside tensorstore's raw read+write.

A GPU at hundreds of Mvox/s is fed by the host: every input voxel is read and
decompressed, every output voxel (3 channels here) compressed and written.
This bench runs ``blockpred.predict`` (in-process, ``local=True``) with a
network that only copies its input to 3 channels over a uint8 volume with
uint8 output, and in the same run the storage limit: tensorstore alone reading
the same input and writing the same output (same chunks, codec and level) with
as many threads as the machine has cores.  Rounds alternate, so all see the
same machine; medians are reported, with the ratio raw time / blockpred time.

Two blockpred figures, because on a machine without a GPU the "device" is the
same CPU that reads and writes:

* **host path** -- what the host does when a GPU does the arithmetic: read,
  batch, hand the output over, write, mark done.  The device's place is taken
  by a predictor that returns the input repeated to 3 channels in uint8 (what
  the copy network gives after the device's steps) with the one copy a GPU's
  download makes.  This is the storage-limit ratio of the issue.
* **CPU device** -- the same run with the copy network and the device steps
  (normalise, crop, convert to uint8) on the CPU, competing for its cores.

On a CUDA machine (``--device cuda``) the host-path figure runs the real copy
network on the GPU instead.

    python bench/bench_host_path.py [--shape 256,512,512] [--block 64,256,256] [--halo 0,0,0]
                                    [--compression zstd] [--rounds 3] [--dir /tmp/blockpred-bench]

The halo defaults to 0 so every side moves the same bytes; a real run also
reads its halo (``--halo`` shows what that costs).  Output voxels are spatial
(channels not counted), as everywhere in blockpred.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path
from unittest import mock

import numpy as np
import torch

import blockpred
from blockpred.config import parse_shape
from blockpred.demo import write_em_volume
from blockpred.geometry import Box, Coord
from blockpred.io import open_volume
from blockpred.pipeline import Predictor

CHANNELS = 3


class CopyNetwork(torch.nn.Module):
    """Its input, repeated to 3 channels (a view: no compute, no new memory)."""

    in_channels, out_channels = 1, CHANNELS

    def forward(self, x):
        return x.expand(-1, CHANNELS, -1, -1, -1)


class HostOnly(Predictor):
    """The device's place taken by nothing: the raw input cropped and repeated to 3 channels, one copy.

    For uint8 input normalised by 1/255 and uint8 output this is exactly what
    :class:`CopyNetwork` and the device's steps return; the copy stands for a
    GPU's download into host memory.
    """

    def _steps(self, raw, raw_dtype, steps):
        y = raw if steps.crop is None else raw[(slice(None), slice(None)) + tuple(steps.crop)]
        return y.expand(-1, CHANNELS, -1, -1, -1).contiguous(), None  # no NaN/inf count: the device's work


def _tensorstore(path: str):
    """A zarr array opened with tensorstore alone (format 2 or 3)."""
    import tensorstore as ts

    driver = "zarr3" if (Path(path) / "zarr.json").exists() else "zarr"
    return ts.open({"driver": driver, "kvstore": {"driver": "file", "path": path + "/"}}).result()


def raw_copy(source: str, target: str, block: Coord, threads: int) -> float:
    """Seconds tensorstore takes to read ``source`` and write it to every channel of ``target``, block by block."""
    src, dst = _tensorstore(source), _tensorstore(target)
    shape = Coord(src.shape[-3:])
    boxes = [Box(Coord((z, y, x)), Coord((z, y, x)) + block).intersect(Box.from_shape(shape))
             for z in range(0, shape[0], block[0]) for y in range(0, shape[1], block[1])
             for x in range(0, shape[2], block[2])]

    def copy(box: Box) -> None:
        data = src[box.to_slices()].read().result()
        dst[(slice(None),) + box.to_slices()].write(np.broadcast_to(data, (CHANNELS,) + data.shape)).result()

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(copy, boxes))
    return time.perf_counter() - start


def check_copy(source: str, target: str) -> None:
    """The output must be the input in every channel, or the bench measures something broken."""
    box = Box.from_shape(Coord((16, 64, 64)))
    out, expected = open_volume(target).read(box), open_volume(source).read(box)
    if not all(np.array_equal(out[c], expected) for c in range(CHANNELS)):
        raise SystemExit(f"{target} is not its input repeated to {CHANNELS} channels: the bench is broken")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="256,512,512")
    parser.add_argument("--input-chunks", default="64,64,64")
    parser.add_argument("--input", help="an existing uint8 zarr volume instead of a new synthetic one (--shape)")
    parser.add_argument("--block", default="64,256,256")
    parser.add_argument("--halo", default="0,0,0")
    parser.add_argument("--compression", default="zstd")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--dir", default="/tmp/blockpred-bench")
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args()
    shape = parse_shape(args.shape, "shape")
    block = parse_shape(args.block, "block")
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    source = args.input or str(root / "host-path-raw.zarr")
    if args.input is None:
        write_em_volume(source, shape, chunks=parse_shape(args.input_chunks, "input chunks"))
    shape = open_volume(source).spatial_shape
    options = dict(model=CopyNetwork(), block=tuple(block), halo=args.halo, device=args.device,
                   output_dtype="uint8", compression=args.compression, local=True, overwrite=True, progress=False)
    threads = os.cpu_count() or 1
    host_only = args.device == "cpu"  # on a GPU the copy network's steps run there: the real run is the host path
    modes = {"host path": host_only, "CPU device": False} if host_only else {"host path": False}
    runs: dict[str, list[float]] = {name: [] for name in [*modes, "tensorstore"]}
    stages: dict[str, list[dict]] = {name: [] for name in modes}
    target, raw_target = str(root / "host-path-out.zarr"), str(root / "host-path-raw-out.zarr")
    for round_ in range(args.rounds + 1):  # round 0 warms caches and imports, and is not counted
        line = []
        for name, replaced in modes.items():
            with mock.patch("blockpred.prepare.Predictor", HostOnly) if replaced else contextlib.nullcontext():
                summary = blockpred.predict(source, target, **options)
            if round_ == 0:
                check_copy(source, target)
                continue
            s = summary.stats
            runs[name].append(s.seconds)
            stages[name].append({"read_s": s.read_s, "device_s": s.compute_s + s.transfer_s, "write_s": s.write_s})
            line.append(f"{name} {s.seconds:.2f} s ({s.mvox_per_s:.1f} Mvox/s; read {s.read_s:.2f}, "
                        f"device {s.compute_s + s.transfer_s:.2f}, write {s.write_s:.2f} s summed over threads)")
        shutil.rmtree(raw_target, ignore_errors=True)
        shutil.copytree(target, raw_target)  # same metadata; every chunk is rewritten
        raw_s = raw_copy(source, raw_target + "/0", summary.plan.block_shape, threads)
        if round_ == 0:
            continue
        runs["tensorstore"].append(raw_s)
        print(f"round {round_}: " + "; ".join(line) + f"; tensorstore {raw_s:.2f} s", flush=True)
    mvox = shape.prod() / 1e6
    medians = {name: statistics.median(seconds) for name, seconds in runs.items()}
    raw_s = medians["tensorstore"]
    report = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''} {threads} CPUs".strip(),
        "device": args.device,
        "volume": list(shape), "input_chunks": args.input_chunks, "block": list(summary.plan.block_shape),
        "halo": list(summary.plan.halo), "output_chunks": list(open_volume(target).chunk_shape),
        "compression": args.compression, "rounds": args.rounds,
        "tensorstore": {"seconds": round(raw_s, 3), "mvox_per_s": round(mvox / raw_s, 1),
                        "mvox_per_s_per_core": round(mvox / raw_s / threads, 1)},
    }
    for name in modes:
        report[name] = {
            "seconds": round(medians[name], 3), "mvox_per_s": round(mvox / medians[name], 1),
            "mvox_per_s_per_core": round(mvox / medians[name] / threads, 1),
            "ratio_to_tensorstore": round(raw_s / medians[name], 3),
            "stages_median": {k: round(statistics.median(st[k] for st in stages[name]), 3) for k in stages[name][0]},
        }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
