"""Predict a volume on a SLURM cluster: one SLURM job per GPU, one dask worker per job.

Needs ``pip install "blockpred[slurm]"`` (dask-jobqueue) on the machine that
runs this script, and a filesystem shared by that machine and the compute
nodes: every worker imports blockpred from the same Python environment
(``sys.executable`` by default) and reads the input and writes the output (and
its done markers, ``<container>.blockpred/<dataset>/``) at the same paths.
Give absolute paths: a worker resolves a relative one against its own working
directory.

    python examples/slurm_cluster.py /shared/vol.zarr/raw /shared/vol.zarr/prediction \\
        --jobs 8 --model cremi2018 --partition gpu --account myproject

    # the SLURM settings from a dask-jobqueue config file instead of the defaults below
    python examples/slurm_cluster.py /shared/vol.zarr/raw --jobqueue-config configs/slurm.yaml --jobs 8

blockpred itself checks the device and runs a dry run of the network in this
process, so with ``--device cuda`` (the default) run the script where a GPU is
visible (inside an ``salloc``/``sbatch`` allocation).  On a login node without
a GPU pass ``--device auto``: the dry run (one block) then runs on the CPU,
and every worker still uses its own GPU.

Running the same command again resumes: finished blocks are skipped.  A run
with other settings (model, block, halo, precision ...) is refused unless
``--overwrite``; the number of jobs may change between runs.

The same without dask-jobqueue, in two steps: start a scheduler and one worker
per GPU yourself (each worker two threads and one GPU), then point blockpred at
the scheduler.

    # on one node (8786: scheduler, 8787: dashboard)
    dask scheduler --port 8786 &
    # on every GPU node, one worker per GPU ...
    CUDA_VISIBLE_DEVICES=0 dask worker tcp://HOST:8786 --nthreads 2 &
    CUDA_VISIBLE_DEVICES=1 dask worker tcp://HOST:8786 --nthreads 2 &
    # ... or let dask-cuda start one per GPU (pip install "blockpred[cuda]")
    dask-cuda-worker tcp://HOST:8786 --nthreads 2 &
    # then, from a machine that sees the same files (--device auto where it has no GPU):
    blockpred run /shared/vol.zarr/raw /shared/vol.zarr/prediction \\
        --scheduler tcp://HOST:8786 --model cremi2018 --device cuda --precision bf16 --retries 3

Two threads per worker: a worker runs two tasks at once, both feeding its one
pipeline, so the GPU does not drain between tasks (``--nthreads 1`` works, a
little slower).  Workers may start before or during the run: tasks are handed
out as workers become free, and a worker that joins late loads the model and
takes tasks too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

#: SLURM settings of one job = one dask worker = one GPU (used without --jobqueue-config).
JOB_SETTINGS = dict(
    cores=8,                                 # CPUs of the job (--cpus-per-task): readers, writers, decompression
    memory="64GB",                           # host memory of the job (--mem)
    processes=1,                             # one dask worker process per job
    walltime="04:00:00",
    job_extra_directives=["--gres=gpu:1"],   # one GPU per job; SLURM sets CUDA_VISIBLE_DEVICES
    worker_extra_args=["--nthreads", "2"],   # two tasks feed the GPU's one pipeline (overrides nthreads=cores)
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="blockpred on a SLURM cluster through dask-jobqueue")
    parser.add_argument("input", help="vol.zarr/raw, vol.n5/raw ... on a shared filesystem")
    parser.add_argument("output", nargs="?", help="where to write [a sibling 'prediction' dataset]")
    parser.add_argument("--jobs", type=int, default=4, help="SLURM jobs, one GPU worker each [4]")
    parser.add_argument("--model", default="cremi2018", help="preset, model file or package.module:factory [cremi2018]")
    parser.add_argument("--weights", help="state-dict file for a preset or factory")
    parser.add_argument("--device", default="cuda", help="cuda, or auto on a login node without a GPU [cuda]")
    parser.add_argument("--precision", default="bf16", choices=("fp32", "tf32", "fp16", "bf16"), help="[bf16]")
    parser.add_argument("--partition", help="SLURM partition (#SBATCH -p)")
    parser.add_argument("--account", help="SLURM account (#SBATCH -A)")
    parser.add_argument("--jobqueue-config", help="dask-jobqueue YAML (such as configs/slurm.yaml) instead of JOB_SETTINGS")
    parser.add_argument("--retries", type=int, default=3, help="retries of a failed task [3]")
    parser.add_argument("--overwrite", action="store_true", help="start again even if an output exists")
    parser.add_argument("--wait-s", type=float, default=1800, help="how long to wait for every job to start [1800]")
    return parser.parse_args(argv)


def make_cluster(args: argparse.Namespace):
    """A SLURMCluster from JOB_SETTINGS, or from a dask-jobqueue config file; partition and account override."""
    import dask.config
    import yaml
    from dask_jobqueue import SLURMCluster  # imported here: the module imports without dask-jobqueue

    overrides = {key: value for key, value in (("queue", args.partition), ("account", args.account)) if value}
    if args.jobqueue_config:
        # Merged into dask's configuration, like a file in ~/.config/dask/; explicit arguments still win.
        dask.config.update(dask.config.config, yaml.safe_load(Path(args.jobqueue_config).read_text()), priority="new")
        return SLURMCluster(**overrides)
    return SLURMCluster(**JOB_SETTINGS, **overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import blockpred
    from distributed import Client

    with make_cluster(args) as cluster:
        print(cluster.job_script(), file=sys.stderr)  # what each `sbatch` gets
        cluster.scale(jobs=args.jobs)
        with Client(cluster) as client:
            # Tasks are sized for the workers present when predict starts: wait for all of them.
            client.wait_for_workers(n_workers=args.jobs, timeout=args.wait_s)
            print(f"dashboard: {cluster.dashboard_link}", file=sys.stderr)
            summary = blockpred.predict(
                args.input, args.output,
                scheduler=cluster.scheduler_address,   # join this cluster instead of starting a local one
                model=args.model, weights=args.weights,
                device=args.device, precision=args.precision,
                retries=args.retries, overwrite=args.overwrite,
            )
    print(summary)  # one line per worker, then the total
    return 0


if __name__ == "__main__":
    sys.exit(main())
