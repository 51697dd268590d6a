#!/usr/bin/env bash
# blockpred on many GPUs: examples to copy from, not a script to run top to bottom.
# Each `blockpred run` prints the dask dashboard address on stderr, a progress bar, and at the end
# one line per worker ("worker blockpred-0 on cuda:0: 40 blocks, 9.80 Mvox/s") and the total.
set -euo pipefail

# All GPUs of this machine: a local dask cluster with one worker process per visible GPU,
# each worker pinned to its GPU through CUDA_VISIBLE_DEVICES and loading the model once.
blockpred run vol.zarr/raw out.zarr --model cremi2018 --precision bf16

# Only some GPUs: blockpred uses the GPUs CUDA_VISIBLE_DEVICES lists (here two workers, on GPUs 2 and 3).
CUDA_VISIBLE_DEVICES=2,3 blockpred run vol.zarr/raw out.zarr --model cremi2018 --precision bf16

# One chosen GPU: a single worker on GPU 1 (the same as CUDA_VISIBLE_DEVICES=1).
blockpred run vol.zarr/raw out.zarr --model cremi2018 --precision bf16 --device cuda:1

# One GPU in one process, without dask (debugging, profiling).
CUDA_VISIBLE_DEVICES=1 blockpred run vol.zarr/raw out.zarr --model cremi2018 --precision bf16 --local

# CPU only: two worker processes, each with half of the cores for torch.
blockpred run vol.zarr/raw out.zarr --model tiny --device cpu --workers 2

# SLURM: up to 8 jobs of one GPU each, started as granted, replaced when they end (pip install -e ".[slurm]").
blockpred run /shared/vol.zarr/raw /shared/out.zarr --model cremi2018 --precision bf16 \
    --cluster slurm --jobs 8 --partition gpu --cores 8 --memory 64GB --gpus-per-job 1 --walltime 04:00:00

# Join a running dask cluster (a dask scheduler and one worker per GPU that you started);
# paths must be the same on every worker (shared filesystem).  --device auto where this machine has no GPU.
blockpred run /shared/vol.zarr/raw /shared/out.zarr --model cremi2018 --precision bf16 \
    --scheduler tcp://scheduler-host:8786 --retries 3
# ... or the same with the options in a file (flags still override it)
blockpred run /shared/vol.zarr/raw /shared/out.zarr --config configs/cluster-run.yaml

# After a crash, a kill or a failed block: the same command again resumes.  Done markers beside
# the output (out.zarr.blockpred/_root/ here; vol.zarr.blockpred/prediction/ for vol.zarr/prediction)
# say which blocks are finished; only the others run.  The worker count may differ between runs.
blockpred run vol.zarr/raw out.zarr --model cremi2018 --precision bf16

# Other settings (model, block, halo, precision, ...) for an existing output are refused, naming
# what changed; --overwrite deletes the output and its markers and starts again.
blockpred run vol.zarr/raw out.zarr --model cremi2018 --precision fp32 --overwrite

# HDF5 has no concurrent writers: an HDF5 output with several workers is refused before anything
# is written.  Write it in one process with --local (or write zarr/N5 with many GPUs).
blockpred run vol.h5:/raw pred.h5:/prediction --model cremi2018 --local
