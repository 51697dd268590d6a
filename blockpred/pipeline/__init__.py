"""One worker = one device running a bounded prefetch -> infer -> write pipeline.

* :mod:`.prefetch` reads padded, normalised blocks ahead of the device.
* :mod:`.infer` moves batches to the device and runs the network.
* :mod:`.writer` crops and writes finished blocks from a bounded pool.
* :mod:`.worker` connects the three over a list of blocks.
"""

from .infer import Predictor, resolve_device
from .worker import PipelineSettings, RunStats, run_blocks

__all__ = ["Predictor", "resolve_device", "PipelineSettings", "RunStats", "run_blocks"]
