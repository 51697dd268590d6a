"""Predict a volume on a SLURM cluster from Python: the same as ``blockpred run ... --cluster slurm``.

Needs ``pip install -e ".[slurm]"`` (dask-jobqueue) and a file system shared
by this machine and the compute nodes: the workers import blockpred from this
Python environment and read and write the same paths.  Every job is one dask
worker; the run starts with the first job that starts, replaces jobs that end
(time limit, scancel, a lost node), and cancels all of them when it ends.

    python examples/slurm_cluster.py /shared/vol.zarr/raw /shared/vol.zarr/prediction --jobs 8 --partition gpu

The command line does the same with no script:

    blockpred run /shared/vol.zarr/raw /shared/vol.zarr/prediction --model cremi2018 --precision bf16 \\
        --cluster slurm --jobs 8 --partition gpu --cores 8 --memory 64GB --gpus-per-job 1 --walltime 04:00:00

Job settings the flags do not cover (interface, prologue, log directory ...)
come from dask-jobqueue's configuration: ``~/.config/dask/jobqueue.yaml``, or
``jobqueue_config="configs/slurm.yaml"`` here (``--jobqueue-config``).
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="blockpred on a SLURM cluster (blockpred.predict(cluster='slurm'))")
    parser.add_argument("input", help="vol.zarr/raw, vol.n5/raw ... on a shared file system")
    parser.add_argument("output", nargs="?", help="where to write [a sibling 'prediction' dataset]")
    parser.add_argument("--jobs", type=int, default=4, help="SLURM jobs at most, one GPU worker each [4]")
    parser.add_argument("--partition", help="SLURM partition")
    parser.add_argument("--account", help="SLURM account")
    parser.add_argument("--model", default="cremi2018", help="[cremi2018]")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import blockpred

    summary = blockpred.predict(
        args.input, args.output, model=args.model, precision="bf16",
        cluster="slurm", jobs=args.jobs, partition=args.partition, account=args.account,
        cores=8, memory="64GB", gpus_per_job=1, walltime="04:00:00",
        jobqueue_config="configs/slurm.yaml",  # interface, prologue, log directory: see the file
    )
    print(summary)  # one line per worker, then the total
    return 0


if __name__ == "__main__":
    sys.exit(main())
