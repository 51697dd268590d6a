"""The host path of the real command against the storage limit: `blockpred run` on a copy network beside tensorstore.

A GPU at hundreds of Mvox/s is fed by the host: every input voxel is read and
decompressed, every output voxel (3 channels here) compressed and written.
This bench runs the command a user types,

    python -m blockpred run RAW OUT --model copy3.pt --halo 0,0,0 --output-dtype uint8 --overwrite --no-progress

with ``copy3.pt`` a TorchScript network that copies its input to 3 channels
(:class:`blockpred.models.standin.CopyNetwork`, scripted as a user's network
would be), over a uint8 EM-like volume: at its defaults and at a named block
(``--block``).  In the same run, tensorstore alone reads the same input and
writes the same output (same metadata, every chunk rewritten) block by block
at the command's block on as many threads as the machine has cores: the
storage limit.  Rounds alternate, so all see the same machine; medians are
reported, with the ratio command / limit in Mvox/s.

The command's Mvox/s is its own summary's (output voxels over the pipeline's
seconds: from its first block read to its last written), and its start-up
(``started in``) and stage split (read, device, write; summed over threads)
are its summary's ``time:`` line.  Round 0 runs with an empty size cache (the
first run of a new user: it measures its defaults) and is reported apart.

    python bench/bench_host_path.py [--shape 256,512,512] [--block 64,256,256 [--block ...]] [--rounds 3]
                                    [--dir /tmp/blockpred-host]

Output voxels are spatial (channels not counted), as everywhere in blockpred.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import numpy as np
import torch

from blockpred.config import parse_shape
from blockpred.io.synthetic import write_em_volume
from blockpred.geometry import Box, Coord
from blockpred.io import open_volume
from blockpred.models.standin import CopyNetwork
from command import run_blockpred

CHANNELS = 3
def run_command(source: str, target: str, model: str, extra: list[str], cache: Path) -> dict:
    """``blockpred run`` of the copy network once, as a user types it (see :func:`command.run_blockpred`)."""
    return run_blockpred([source, target, "--model", model, "--halo", "0,0,0", "--output-dtype", "uint8",
                          "--overwrite", "--no-progress", *extra], cache)


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
    parser.add_argument("--block", action="append",
                        help="a named block run beside the defaults (repeat for several; default 64,256,256)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/blockpred-host")
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    source = args.input or str(root / "host-raw.zarr")
    if args.input is None and not Path(source).exists():
        write_em_volume(source, parse_shape(args.shape, "shape"), chunks=parse_shape(args.input_chunks, "chunks"))
    shape = open_volume(source).spatial_shape
    model = str(root / "copy3.pt")
    torch.jit.save(torch.jit.script(CopyNetwork(CHANNELS)), model)
    cache = root / "cache"
    shutil.rmtree(cache, ignore_errors=True)  # round 0 is a first run
    threads = os.cpu_count() or 1
    named = args.block or ["64,256,256"]
    modes = {"defaults": [], **{f"--block {block}": ["--block", block] for block in named}}
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    limits: dict[str, list[float]] = {name: [] for name in modes}
    first: dict[str, dict] = {}
    target, raw_target = str(root / "host-out.zarr"), str(root / "host-raw-out.zarr")
    for round_ in range(args.rounds + 1):
        for name, extra in modes.items():
            result = run_command(source, target, model, extra, cache)
            block = Coord(result["block"]) if result["block"] else parse_shape(extra[1], "block")
            shutil.rmtree(raw_target, ignore_errors=True)
            shutil.copytree(target, raw_target)  # the same metadata; every chunk is rewritten
            array = raw_target + "/0" if (Path(raw_target) / "0").exists() else raw_target
            limit_s = raw_copy(source, array, block, threads)
            limit = shape.prod() / 1e6 / limit_s
            print(f"round {round_} {name}: {result['mvox_per_s']:.1f} Mvox/s (pipeline {result['pipeline_s']:.2f} s, "
                  f"wall {result['wall_s']:.2f} s, started in {result['started_s']:.2f} s; read {result['read_s']:.2f}, "
                  f"device {result['device_s']:.2f}, write {result['write_s']:.2f} s); tensorstore at block "
                  f"{'x'.join(map(str, block))} {limit:.1f} Mvox/s: ratio {result['mvox_per_s'] / limit:.2f}; "
                  f"{result['chosen']}", flush=True)
            if round_ == 0:
                check_copy(source, target)
                first[name] = dict(result, tensorstore_mvox_per_s=round(limit, 1))
                continue
            runs[name].append(result)
            limits[name].append(limit)
    report = {"date": date.today().isoformat(),
              "machine": f"{platform.machine()} {platform.processor() or ''} {threads} CPUs".strip(),
              "volume": list(shape), "input_chunks": args.input_chunks, "rounds": args.rounds, "first_run": first}
    for name in modes:
        mvox = statistics.median(r["mvox_per_s"] for r in runs[name])
        limit = statistics.median(limits[name])
        ratios = [r["mvox_per_s"] / lim for r, lim in zip(runs[name], limits[name])]
        report[name] = {
            "mvox_per_s": round(mvox, 1), "tensorstore_mvox_per_s": round(limit, 1),
            "ratio_median": round(statistics.median(ratios), 3),
            "started_s": round(statistics.median(r["started_s"] for r in runs[name]), 2),
            "wall_s": round(statistics.median(r["wall_s"] for r in runs[name]), 2),
            "stages_s": {k: round(statistics.median(r[k] for r in runs[name]), 2)
                         for k in ("read_s", "device_s", "write_s")},
            "chosen": runs[name][-1]["chosen"],
        }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
