"""Does the real command keep a device busy?  `blockpred run` around a stand-in device of a known speed.

The stand-in (:mod:`blockpred.models.standin`, ``--model
blockpred.models.standin:device``) sleeps as long as a device at ``--rate``
input Mvox/s would take over each batch; a sleep releases the GIL as a CUDA
kernel does, so everything else the command does -- read, pad, normalise,
hand over, crop, convert, write, mark done -- runs on the host's cores beside
it, as beside a GPU.  A perfect host keeps the stand-in asleep back to back.

The whole command runs as a user types it (a subprocess, timed from start to
exit) on two volumes, N and 4N voxels.  Start-up (interpreter, imports, model,
dry run, cluster) is the same for both, so the marginal rate

    3N / (t(4N) - t(N))

is what the pipeline sustains, and its efficiency is that rate over the
device's (in counted output voxels: the rate x core voxels / input voxels of a
block).  ``--workers 2`` runs two dask workers, two stand-ins: two GPUs.

    python bench/bench_device_feed.py [--rate 60] [--block 64,256,256] [--halo 8,16,16]
                                      [--shape 256,512,512] [--workers 0,2] [--rounds 3] [--dir /tmp/blockpred-feed]

``--workers 0`` is the default command (in process).  A round 0 fills a
private size cache first (its measuring is not timed); then rounds alternate
N and 4N, and the medians are reported.  Each run writes a new output, as a
first run does: the last round's output (and its markers) is deleted before
the command starts, untimed, and the disk is synced (``os.sync``), so that no
command starts while the kernel still writes back the last one's output or
its deletion.  (Replacing it with ``--overwrite`` would put the deletion of
4N's old output, four times N's, into the difference above.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
from datetime import date
from pathlib import Path

from blockpred.config import parse_shape
from blockpred.io.synthetic import write_em_volume
from blockpred.geometry import Coord
from command import run_blockpred


def run(source: str, output: str, args: argparse.Namespace, workers: int, cache: Path) -> dict:
    """The whole command once around the stand-in (see :func:`command.run_blockpred`)."""
    extra = ["--model", "blockpred.models.standin:device", "--halo", args.halo, "--output-dtype", "uint8",
             "--overwrite", "--no-progress"]
    if args.block != "default":
        extra += ["--block", args.block]
    if workers:
        extra += ["--workers", str(workers)]
    if args.rate != 60.0:
        config = cache / "rate.yaml"
        config.write_text(f"model_kwargs: {{rate_mvox_per_s: {args.rate}}}\n")
        extra += ["--config", str(config)]
    return run_blockpred([source, output, *extra], cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=60.0, help="the stand-in's input Mvox/s (default 60)")
    parser.add_argument("--block", default="64,256,256", help="a block, or 'default' to name none")
    parser.add_argument("--halo", default="8,16,16")
    parser.add_argument("--shape", default="256,512,512", help="volume N; 4N is four times as deep")
    parser.add_argument("--workers", default="0,2", help="0: in process (the default command); k: --workers k")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/blockpred-feed")
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    shape = parse_shape(args.shape, "shape")
    volumes = {}
    for name, factor in (("N", 1), ("4N", 4)):
        path = root / f"feed-{name}-{'x'.join(map(str, shape))}.zarr"
        if not path.exists():
            write_em_volume(str(path), Coord((shape[0] * factor, shape[1], shape[2])), chunks=Coord((64, 64, 64)))
        volumes[name] = str(path / "raw") if (path / "raw").exists() else str(path)
    report = {"date": date.today().isoformat(),
              "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "rate_input_mvox_per_s": args.rate,
              "block": args.block, "halo": args.halo, "shape_N": list(shape), "rounds": args.rounds, "runs": {}}
    for workers in (int(w) for w in args.workers.split(",")):
        label = "in process" if workers == 0 else f"--workers {workers}"
        cache = root / f"cache-{workers}"
        cache.mkdir(exist_ok=True)
        runs = {"N": [], "4N": []}
        for round_ in range(args.rounds + 1):  # round 0 measures the defaults into the cache: not counted
            for name in ("N", "4N"):
                output = root / f"out-{name}.zarr"
                for old in (output, output.with_name(output.name + ".blockpred")):
                    shutil.rmtree(old, ignore_errors=True)
                os.sync()  # the deletion's and the last run's writes reach the disk before the next command starts
                result = run(volumes[name], str(output), args, workers, cache)
                if round_:
                    runs[name].append(result)
                print(f"{label} round {round_} {name}: {result['wall_s']:.2f} s wall, pipeline "
                      f"{result['pipeline_s']:.2f} s ({result['mvox_per_s']:.1f} Mvox/s), started in "
                      f"{result['started_s']:.2f} s; {result['chosen']}", flush=True)
        t = {name: statistics.median(r["wall_s"] for r in rs) for name, rs in runs.items()}
        blocks, mvox = runs["N"][0]["blocks"], runs["N"][0]["mvox"]
        core = mvox * 1e6 / blocks  # counted voxels per block (the volume is a multiple of the block)
        halo, block_shape = parse_shape(args.halo, "halo"), _block_of(runs, args)
        device_counted = args.rate * core / (block_shape + halo * 2).prod() * max(1, workers)
        marginal = 3 * mvox / (t["4N"] - t["N"])
        pipe = {name: statistics.median(r["pipeline_s"] for r in rs) for name, rs in runs.items()}
        marginal_pipeline = 3 * mvox / (pipe["4N"] - pipe["N"])  # start-up's spread (cluster) left out
        report["runs"][label] = {
            "wall_s_N": round(t["N"], 2), "wall_s_4N": round(t["4N"], 2), "mvox_N": mvox, "blocks_N": blocks,
            "marginal_mvox_per_s": round(marginal, 2), "device_counted_mvox_per_s": round(device_counted, 2),
            "efficiency": round(marginal / device_counted, 3),
            "pipeline_s_N": round(pipe["N"], 2), "pipeline_s_4N": round(pipe["4N"], 2),
            "marginal_pipeline_mvox_per_s": round(marginal_pipeline, 2),
            "efficiency_pipeline": round(marginal_pipeline / device_counted, 3),
            "started_s": statistics.median(r["started_s"] for r in runs["N"]),
            "chosen": runs["N"][0]["chosen"],
        }
        print(f"{label}: marginal {marginal:.2f} Mvox/s against the device's {device_counted:.2f}: "
              f"efficiency {marginal / device_counted:.3f} (from the pipelines' seconds: "
              f"{marginal_pipeline / device_counted:.3f})", flush=True)
    one, two = report["runs"].get("in process"), report["runs"].get("--workers 2")
    if one and two:
        report["two_workers_over_one"] = round(two["marginal_mvox_per_s"] / one["marginal_mvox_per_s"], 3)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def _block_of(runs: dict, args: argparse.Namespace) -> Coord:
    """The block the runs used: the one named, or the one the defaults chose (from its ``chosen:`` line)."""
    if args.block != "default":
        return parse_shape(args.block, "block")
    if runs["N"][0]["block"] is None:
        raise SystemExit(f"cannot tell the block the defaults chose from {runs['N'][0]['chosen']!r}")
    return Coord(runs["N"][0]["block"])


if __name__ == "__main__":
    main()
