"""The largest tensor a network makes per input voxel, and the block it allows on CUDA.

cuDNN's convolutions, and some of PyTorch's own CUDA kernels, index a tensor
with 32-bit integers.  A tensor of 2^31 elements or more makes a convolution
fall back to kernels many times slower, or fail with "an illegal memory access
was encountered", which leaves the device unusable in that process
(pytorch/pytorch#117736).  Memory does not warn of it: on an H200 (139 GiB),
2026-11-26, ``cremi2018`` at block 110x783x783 with halo (14, 135, 135)
(input 138x1053x1053; 24 maps at full resolution, 3.7 G elements) took 62 s a
pass where 55x594x594 (halo 5, 50, 50) took 0.13 s a block, and ``unet32`` at block 220x464x464 (input
284x528x528; 64 maps, 5.1 G elements) failed with that illegal memory access.

The network's first dry run counts the largest tensor any operation makes or
takes (:class:`LargestTensor`, a ``TorchDispatchMode``: TorchScript networks
are seen as well), the network's parameters and buffers left out.  Divided by
the input's voxels it gives the elements per input voxel, which the block
search on CUDA keeps under the limit (:func:`max_input_voxels`).

:class:`PeakFunctions` (and :class:`PeakTensors`, at the dispatcher's level)
count more: the bytes of the tensors alive at once, at their peak, with what a
convolution holds while it runs beyond its output (on the CPU, oneDNN's copies
of its output, and of an input of 16 channels or more, in a layout that pads
the channels to a multiple of 16).  Divided by the voxels it gives the memory a
pass takes per voxel, which :mod:`blockpred.tuning.passmemory` foresees a
block's memory from before the network runs at it.
"""

from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

#: Elements a tensor may have for 32-bit indexing.
INDEX_LIMIT = 2**31 - 1
#: The share of the limit a block may use: a valid-convolution network's maps grow a little faster than its input.
INDEX_MARGIN = 0.95


class _EagerDispatch(TorchDispatchMode):
    """A dispatch mode whose ``__torch_dispatch__`` torch leaves as it is: by default it wraps it in
    ``torch._dynamo``'s disable, whose first call imports ``torch._dynamo`` (1-2 s on two cores, 5 s of a run's
    start-up on an H200: issue 47).  The counts here run eager, never under ``torch.compile``."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # torch's hook (torch/utils/_python_dispatch.py); older torch has none
        return False


class LargestTensor(_EagerDispatch):
    """While active, :attr:`elements` is the largest tensor any operation took or made, except ``exclude``'s shapes."""

    def __init__(self, exclude: frozenset[tuple[int, ...]] = frozenset()):
        super().__init__()
        self.exclude = exclude
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten((args, kwargs, out))[0]:
            if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) not in self.exclude:
                self.elements = max(self.elements, tensor.numel())
        return out


#: oneDNN's blocked layouts pad the channels to a multiple of this (AVX-512's 16 floats; AVX2's 8 pad less).
CHANNEL_BLOCK = 16


class _Peak:
    """The count :class:`PeakTensors` and :class:`PeakFunctions` keep: :attr:`elements`, the largest tensor; and
    :attr:`peak_bytes`, the most bytes the tensors made under the mode held at once (their storages, each counted once
    however many views it has, until it is freed), starting from ``held_bytes`` (the input's), with a convolution's
    copies of its output and of an input of :data:`CHANNEL_BLOCK` channels or more while it runs (see the module
    docstring).  ``exclude``'s shapes (the weights and their casts) are not counted; :attr:`calls` counts the calls
    seen."""

    def _begin(self, exclude: frozenset[tuple[int, ...]], held_bytes: int) -> None:
        self.exclude = exclude
        self.elements = self.calls = 0
        self.live_bytes = self.peak_bytes = held_bytes
        self._storages: dict[int, int] = {}

    def _seen(self, name: str, args, kwargs, out) -> None:
        self.calls += 1
        for tensor in tree_flatten((args, kwargs, out))[0]:
            if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) not in self.exclude:
                self.elements = max(self.elements, tensor.numel())
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for tensor in outputs:
            if tuple(tensor.shape) not in self.exclude:
                self._hold(tensor.untyped_storage())
        during = self.live_bytes
        if "conv" in name and outputs and args and isinstance(args[0], torch.Tensor):
            during += _reordered_bytes(outputs[0]) + (_reordered_bytes(args[0]) if args[0].ndim > 1 and
                                                      args[0].shape[1] >= CHANNEL_BLOCK else 0)
        self.peak_bytes = max(self.peak_bytes, during)

    def _hold(self, storage) -> None:
        key = storage.data_ptr()
        if key in self._storages or storage.nbytes() == 0:
            return
        self._storages[key] = storage.nbytes()
        self.live_bytes += storage.nbytes()
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live_bytes -= self._storages.pop(key, 0)


class PeakFunctions(_Peak, TorchFunctionMode):
    """The count of :class:`_Peak` over torch's functions (``conv3d``, ``cat``, a tensor's methods): what a
    network written in Python calls.  A TorchScript network's calls are not seen (:attr:`calls` stays 0)."""

    def __init__(self, exclude: frozenset[tuple[int, ...]] = frozenset(), held_bytes: int = 0):
        super().__init__()
        self._begin(exclude, held_bytes)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._seen(getattr(func, "__name__", ""), args, kwargs, out)
        return out


class PeakTensors(_Peak, _EagerDispatch):
    """The count of :class:`_Peak` over the dispatcher's operations: a TorchScript network's too, and what autocast
    casts: for a network whose functions :class:`PeakFunctions` cannot see."""

    def __init__(self, exclude: frozenset[tuple[int, ...]] = frozenset(), held_bytes: int = 0):
        super().__init__()
        self._begin(exclude, held_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._seen(func.__name__, args, kwargs, out)
        return out


def _reordered_bytes(tensor: torch.Tensor) -> int:
    """The bytes of ``tensor`` with its channels (axis 1) padded to a multiple of :data:`CHANNEL_BLOCK`."""
    if tensor.ndim < 2 or tensor.shape[1] == 0:
        return 0
    channels = tensor.shape[1]
    padded = -(-channels // CHANNEL_BLOCK) * CHANNEL_BLOCK
    return tensor.numel() * tensor.element_size() * padded // channels


def weight_shapes(module: torch.nn.Module) -> frozenset[tuple[int, ...]]:
    """The shapes of ``module``'s parameters and buffers (and their casts, which keep the shape)."""
    return frozenset(tuple(t.shape) for t in (*module.parameters(), *module.buffers()))


def max_input_voxels(per_voxel: float | None) -> int | None:
    """Network input voxels (over a batch) whose largest tensor stays under the limit; None when not known."""
    if not per_voxel or per_voxel <= 0:
        return None
    return int(INDEX_LIMIT * INDEX_MARGIN / per_voxel)


def over_index_limit(per_voxel: float | None, input_voxels: int, batch_size: int = 1) -> int | None:
    """The largest tensor's elements at ``batch_size`` blocks of ``input_voxels`` where over the limit, else None."""
    if not per_voxel:
        return None
    elements = int(per_voxel * input_voxels * batch_size)
    return elements if elements > INDEX_LIMIT else None
