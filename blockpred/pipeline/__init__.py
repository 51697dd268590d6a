"""One worker = one device running a bounded prefetch -> infer -> write pipeline.

* :mod:`.blocking` cuts the region into blocks (:class:`~.blocking.Block`,
  :class:`~.blocking.BlockPlan`); :mod:`.padding` reads a block with its halo,
  padded past the volume's edge.
* :mod:`.prefetch` reads padded raw blocks ahead of the device.
* :mod:`.infer` moves batches to the device, normalises, runs the network,
  crops and converts there, and brings the stored values back.
* :mod:`.backoff` shrinks batch and block after an out-of-memory error.
* :mod:`.writer` writes finished blocks from a bounded pool.
* :mod:`.worker` connects them over a list of blocks; :mod:`.interrupts`
  makes a Ctrl-C in the main thread act between blocks, never inside a lock.
* :mod:`.stream` keeps one such pipeline open and runs each caller's blocks on
  it (a dask worker's tasks), so it does not drain between callers.
* :mod:`.job` is what a worker runs (a :class:`~.job.Job`: the network, the
  blocks, the output), and :mod:`.markers` the done marks it leaves.
* :mod:`.hostmem` keeps the host's freed memory for the next block.

It may import the models, the volumes (:mod:`blockpred.io`) and the core;
the tuning, the cluster and the run import it, never the reverse.
"""

import importlib

#: The pipeline's names, each from its module, imported on first use: a part of blockpred that needs one
#: module of the pipeline (the CLI's host memory settings, the blocks' geometry) does not import torch.
_EXPORTS = {
    "Backoff": ".backoff", "is_out_of_memory": ".backoff",
    "DeviceSteps": ".infer", "Predictor": ".infer", "resolve_device": ".infer",
    "RunStats": ".stats",
    "PipelineSettings": ".worker", "run_blocks": ".worker",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
