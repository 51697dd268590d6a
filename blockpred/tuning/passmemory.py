"""The memory a pass takes, foreseen before the network runs at a block: :func:`pass_memory` and :class:`MemoryRoom`.

A network's tensors grow with its input's voxels, so one pass at a small
shape says what a pass at any block takes: :class:`~.tensors.PeakFunctions`
counts the bytes its tensors hold at once, at their peak, with what a
convolution holds while it runs (on the CPU, oneDNN's copies in a layout that
pads the channels to 16), per voxel of that pass's output (a valid network's
output is smaller than its input: counted per output voxel, the foresight
errs on the large side).  Times :data:`HEADROOM`, for what the count does not
see (the allocator, the kernels' own buffers, a process's first pass), it is
a block's pass.  The count is cached per network, precision, layout and
device type (``passes.json`` of the cache directory, once the run that made it
is accepted: :func:`remember`): after the first run of a network the foresight
costs a file read.

The count against the resident memory a first pass at the block grew a
process by (``bench/bench_passmemory.py --device cpu``, two cores,
2026-11-27):

* ``tiny`` at 276^3: 3288 MiB counted, 3279 MiB measured;
* ``unet32`` at 128^3: 2140 MiB counted, 2001 MiB measured; at 96^3: 903 and 1099 MiB;
* ``cremi2018`` at 54x216x216: 1147 MiB counted, 1370 MiB measured.

With :data:`HEADROOM` the foresight was 1.03-1.34 times what was measured.  On
an H200 (torch 2.11) it was 1.19-1.27 times the device's peak allocation at
bf16 and 1.63-1.97 times at fp32 (cuDNN makes no blocked copies): cautious,
never under.  The largest tensor alone (8, 64 and 24 elements per voxel) is a
fifth to a third of the count: a block it allows may still not fit.

:class:`MemoryRoom` is what a run's pass may take: on the CPU the process's
peak resident memory (``--memory-limit``, else what it holds and what the
machine has available), on CUDA the device's free memory.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..cache import JsonFile, default_cache_dir, digest
from ..geometry import Coord
from ..pipeline import Predictor, is_out_of_memory
from ..pipeline.hostmem import available_bytes, resident_bytes
from .hostbudget import HostBudget
from .tensors import PeakFunctions, PeakTensors, weight_shapes

logger = logging.getLogger(__name__)

#: Bumped when the cached entries change meaning.
CACHE_VERSION = 1
#: A pass's memory over what its tensors are counted at: the allocator's rounding, the kernels' own buffers, the
#: process's first pass (the measurements of the module docstring are within 0.94-1.22 of the count).
HEADROOM = 1.25


@dataclass(frozen=True)
class PassMemory:
    """What one pass at a small shape counted: the bytes a pass takes per voxel, its largest tensor and its output."""

    #: Bytes of a pass per voxel of the block's input (:data:`HEADROOM` included).
    bytes_per_voxel: float
    #: Elements of the largest tensor per input voxel (CUDA's index limit: :mod:`.tensors`).
    largest_per_voxel: float
    #: The network's output channels, and the voxels it consumes on each side (0 for a 'same' network).
    out_channels: int
    context: Coord
    #: The input the count ran at.
    input_shape: Coord
    cached: bool = False
    #: What it is cached under (:func:`remember`).
    key: dict | None = field(default=None, compare=False, repr=False)

    def pass_bytes(self, input_shape: Coord, batch: int = 1) -> int:
        """Bytes a pass of ``batch`` blocks of ``input_shape`` is foreseen to take."""
        return int(self.bytes_per_voxel * Coord(input_shape).prod() * batch)


def pass_memory(predictor: Predictor, in_channels: int, input_shape: Coord, key: dict,
                cache: "PassMemoryCache | None" = None, store: bool = True) -> PassMemory | None:
    """The memory a pass of ``predictor``'s network takes per voxel: cached under ``key`` (the model's), else
    counted in one pass at ``input_shape`` (small: milliseconds) and cached, unless ``store`` is False: then
    :func:`remember` caches it once the run has passed its checks (a refused run writes nothing).  None where that
    pass fails (the network's dry run then says why)."""
    cache = cache if cache is not None else PassMemoryCache()
    full_key = {"version": CACHE_VERSION, "model": key, "in_channels": in_channels, "device": predictor.device.type,
                "precision": predictor.precision if predictor.backend == "torch" else "fp32",
                "memory_format": predictor.memory_format}
    found = cache.get(full_key)
    if found is not None:
        return found
    counted = count_pass(predictor, in_channels, Coord(input_shape))
    if counted is not None:
        counted = replace(counted, key=full_key)
        if store:
            cache.put(full_key, counted)
    return counted


def remember(memory: PassMemory | None, cache: "PassMemoryCache | None" = None) -> None:
    """Cache a count :func:`pass_memory` made and did not store (nothing where it was read from the cache)."""
    if memory is not None and not memory.cached and memory.key is not None:
        (cache if cache is not None else PassMemoryCache()).put(memory.key, memory)


def count_pass(predictor: Predictor, in_channels: int, input_shape: Coord) -> PassMemory | None:
    """One pass of the network, in torch as the predictor runs it (its precision and layout; another backend's
    network is counted in torch at fp32), on zeros of ``input_shape``, counted (see the module docstring)."""
    import torch

    module = predictor.module
    try:
        x = torch.zeros((1, in_channels, *input_shape), device=predictor.device)
        if predictor.memory_format == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last_3d)
        for mode in (PeakFunctions, PeakTensors):  # a TorchScript network's calls only the dispatcher sees
            counter = mode(weight_shapes(module), held_bytes=x.numel() * x.element_size())
            low = predictor.autocast() if predictor.backend == "torch" else contextlib.nullcontext()
            with torch.inference_mode(), low, counter:
                out = module(x)
            if counter.calls:
                break
        out = next(t for t in torch.utils._pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor))
    except Exception as err:  # noqa: BLE001 - the dry run that follows says what is wrong
        logger.info("the network's memory was not counted at input %s: %s", "x".join(map(str, input_shape)),
                    "out of memory" if is_out_of_memory(err) else str(err).strip().split("\n")[0])
        return None
    if out.ndim != 5 or not out.shape[2:].numel():
        return None
    output_shape = Coord(out.shape[2:])
    shrink = input_shape - output_shape
    if any(s < 0 or s % 2 for s in shrink):
        return None  # not a network blockpred runs: the dry run says so
    counted = PassMemory(HEADROOM * counter.peak_bytes / output_shape.prod(), counter.elements / input_shape.prod(),
                         int(out.shape[1]), shrink // 2, input_shape)
    logger.info("memory of a pass at input %s: %.0f bytes per voxel (%d KiB counted); largest tensor %.1f elements "
                "per voxel", "x".join(map(str, input_shape)), counted.bytes_per_voxel, counter.peak_bytes // 1024,
                counted.largest_per_voxel)
    return counted


class PassMemoryCache:
    """Networks' pass memory by key in one JSON file of the cache directory (``passes.json``)."""

    def __init__(self, path: Path | None = None):
        self.path = path if path is not None else default_cache_dir() / "passes.json"
        self._file = JsonFile(self.path)

    def get(self, key: dict) -> PassMemory | None:
        entry = self._file.read().get(digest(key))
        try:
            return PassMemory(float(entry["bytes_per_voxel"]), float(entry["largest_per_voxel"]),
                              int(entry["out_channels"]), Coord(entry["context"]), Coord(entry["input_shape"]),
                              cached=True)
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: dict, memory: PassMemory) -> None:
        self._file.merge({digest(key): {
            "key": key, "bytes_per_voxel": memory.bytes_per_voxel, "largest_per_voxel": memory.largest_per_voxel,
            "out_channels": memory.out_channels, "context": list(memory.context),
            "input_shape": list(memory.input_shape)}}, "the network's memory per voxel")


def size_text(size: float) -> str:
    """``28.91 GiB``, or ``734 MiB`` below a GiB."""
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"


@dataclass(frozen=True)
class MemoryRoom:
    """What a run's pass may take, told before it runs, in bytes of what :attr:`where` names.

    ``held_bytes``: what is taken already (this process's resident memory; on CUDA nothing: the free memory is what
    is left).  ``most_bytes``: the most a run may take there, over which a block cannot run (the named limit, else
    what the process holds and what the machine has available; the device's free memory).  ``budget_bytes``: what a
    block blockpred suggests or starts at keeps under (the named limit; else the run's budget,
    :class:`~.hostbudget.HostBudget`).  Each says what it is in ``most_what`` and ``budget_what``.
    """

    where: str
    held_bytes: int
    most_bytes: int
    most_what: str
    budget_bytes: int
    budget_what: str
    named: bool = False

    @classmethod
    def of_host(cls, budget: HostBudget) -> "MemoryRoom | None":
        """This process's room: the budget's named limit, else what it holds and its local workers' share of what
        the machine has available, of which the budget is a share (:meth:`HostBudget.resolve`); None where the
        memory cannot be told."""
        held, resolved = resident_bytes(), budget.resolve()
        if held is None or resolved is None:
            return None
        limit, what = resolved
        if budget.limit_bytes is not None:
            what = f"the memory limit of {size_text(limit)}"
            return cls("memory", held, limit, what, limit, what, named=True)
        workers = max(1, budget.workers)
        most = held + (available_bytes() or 0) // workers
        share = f" (over {workers} workers)" if workers > 1 else ""
        return cls("memory", held, most, f"the {size_text(most)} this process holds and the machine has available"
                   f"{share}", limit, what)

    @classmethod
    def of_device(cls, predictor: Predictor, fraction: float) -> "MemoryRoom | None":
        """A CUDA device's room: its free memory, of which the budget is ``fraction``."""
        import torch

        if predictor.device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(predictor.device)
        return cls(f"{predictor.device}'s memory", 0, free, f"the {size_text(free)} free on {predictor.device}",
                   int(free * fraction), f"{fraction:.0%} of the memory free on {predictor.device}")
