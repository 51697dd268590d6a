"""What the SLURM path costs: the whole `blockpred run --cluster slurm --jobs 2` beside `--local` and `--workers 2`.

Every mode is the command a user types (a subprocess, timed from start to
exit), on the same uint8 EM-like volume, around the stand-in device
(``--model blockpred.models.standin:device``, ``--rate`` input Mvox/s per
worker: it sleeps as a GPU would compute, so the host's cores stay free and
each worker is one "GPU").  ``--local`` is one device in this process;
``--workers 2`` two local dask worker processes; ``--cluster slurm --jobs 2``
two SLURM jobs of ``--cores`` cores (needs a SLURM that answers ``sinfo``:
``../shared/tools/slurm-local.sh`` starts one on this machine, as root).  The
report: wall seconds, the summary's start-up (``started in``: to the first
block) and pipeline Mvox/s; the SLURM path's overhead is its wall time over
``--workers 2``'s (the same two devices), and its start-up against both.

    python bench/bench_slurm.py [--shape 256,512,512] [--rate 60] [--rounds 3] [--cores 1] [--dir /tmp/blockpred-slurm]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from datetime import date
from pathlib import Path

import yaml

from blockpred.config import parse_shape
from blockpred.io.synthetic import write_em_volume
from blockpred.geometry import Coord
from command import run_blockpred


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="256,512,512")
    parser.add_argument("--rate", type=float, default=60.0, help="the stand-in's input Mvox/s per worker")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cores", type=int, default=1, help="cores per SLURM job")
    parser.add_argument("--dir", default="/tmp/blockpred-slurm")
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args()
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    source = root / "raw.zarr"
    if not source.exists():
        write_em_volume(str(source), parse_shape(args.shape, "shape"), chunks=Coord((64, 64, 64)))
    source_path = str(source / "raw") if (source / "raw").exists() else str(source)
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump({"model_kwargs": {"rate_mvox_per_s": args.rate}}))
    jobqueue = root / "jobqueue.yaml"  # the jobs run on this machine: the scheduler on loopback
    jobqueue.write_text(yaml.safe_dump({"jobqueue": {"slurm": {"scheduler-options": {"host": "127.0.0.1"},
                                                               "log-directory": str(root / "logs")}}}))
    common = ["--config", str(config), "--model", "blockpred.models.standin:device", "--block", "64,256,256",
              "--halo", "8,16,16", "--output-dtype", "uint8", "--batch-size", "1", "--memory-format", "contiguous",
              "--device", "cpu", "--overwrite", "--no-progress"]
    modes = {"--local": ["--local"], "--workers 2": ["--workers", "2"],
             "--cluster slurm --jobs 2": ["--cluster", "slurm", "--jobs", "2", "--cores", str(args.cores),
                                          "--memory", "4GB", "--jobqueue-config", str(jobqueue)]}
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    os.chdir(root)  # the SLURM jobs' working directory: their TLS folder goes here
    for round_ in range(args.rounds):
        for name, flags in modes.items():
            result = run_blockpred([source_path, str(root / "out.zarr"), *common, *flags], root / "cache")
            runs[name].append(result)
            print(f"round {round_} {name}: wall {result['wall_s']:.2f} s, started in {result['started_s']:.2f} s, "
                  f"pipeline {result['pipeline_s']:.2f} s ({result['mvox_per_s']:.1f} Mvox/s)", flush=True)
    report = {"date": date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
              "volume": list(parse_shape(args.shape, "shape")), "rate_input_mvox_per_s": args.rate,
              "rounds": args.rounds, "modes": {}}
    for name in modes:
        report["modes"][name] = {key: round(statistics.median(r[key] for r in runs[name]), 2)
                                 for key in ("wall_s", "started_s", "pipeline_s", "mvox_per_s")}
    slurm, two = report["modes"]["--cluster slurm --jobs 2"], report["modes"]["--workers 2"]
    report["slurm_wall_over_workers_2"] = round(slurm["wall_s"] / two["wall_s"], 3)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
