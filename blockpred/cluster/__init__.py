"""Dask: the blocks of a run spread over workers, locally, on a running scheduler or as SLURM jobs.

The scheduler (:mod:`.scheduler`: tasks, retries, done markers, workers that die), what runs on a worker
(:mod:`.tasks`), the local cluster of one worker per GPU (:mod:`.local`, :mod:`.nanny`), a running scheduler's
address, checked and reached before anything starts (:mod:`.address`), batch jobs through
dask-jobqueue (:mod:`.jobqueue`) and the watch that ends a worker whose client died (:mod:`.orphan`).  It may
import the config, the pipeline (a worker runs a :class:`~blockpred.pipeline.job.Job`) and below; the run
imports it, nothing below does.
"""
