"""One worker = one device running a bounded prefetch -> infer -> write pipeline.

* :mod:`.prefetch` reads padded raw blocks ahead of the device.
* :mod:`.infer` moves batches to the device, normalises, runs the network,
  crops and converts there, and brings the stored values back.
* :mod:`.backoff` shrinks batch and block after an out-of-memory error.
* :mod:`.writer` writes finished blocks from a bounded pool.
* :mod:`.worker` connects them over a list of blocks.
* :mod:`.stream` keeps one such pipeline open and runs each caller's blocks on
  it (a dask worker's tasks), so it does not drain between callers.
"""

from .backoff import Backoff, is_out_of_memory
from .infer import DeviceSteps, Predictor, resolve_device
from .stats import RunStats
from .worker import PipelineSettings, run_blocks

__all__ = ["Backoff", "is_out_of_memory", "DeviceSteps", "Predictor", "resolve_device", "PipelineSettings", "RunStats", "run_blocks"]
