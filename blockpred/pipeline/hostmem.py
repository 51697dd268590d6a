"""Large host arrays without fresh pages on every pass: glibc's malloc keeps what it frees.

glibc serves an allocation above its mmap threshold with new pages from the
kernel and gives them back on free; the threshold adapts only up to 32 MiB.
A 3D block's activations are hundreds of MiB (``tiny``'s 84x276x276 input:
8 channels of float32 are 205 MiB per tensor), so every forward pass on a CPU
faulted all of its memory in again, and every block read or written by the
host did the same.  :func:`keep_freed_memory` raises the mmap threshold and the
trim threshold to their maximum, so freed memory stays in the process for the
next pass: one 84x276x276 pass of ``tiny`` went from 1.15 s to 0.65 s on two
cores, and a 12-feature U-Net's run from 7.2 s to 5.6 s.  The price is that the
process keeps its peak memory until it exits (what a prediction holds anyway).
It is set once per process, on Linux with glibc only; elsewhere it does nothing.

Large numpy arrays on small pages.  numpy asks the kernel for transparent huge
pages for every array of 4 MiB or more.  On a virtual machine whose host backs
memory in small pages (this project's 2-core machine), a huge page's first
touch costs 4-5x as much per MB as small pages' (61-69 ms against 13-14 ms for
16 MiB): the first blocks of a run spent more on it than on their steps.  The
host path streams its arrays (normalise, convert, copy: no random access), so
huge pages buy nothing there.  :func:`keep_freed_memory` turns numpy's request
off too, in the same process-wide way (torch's CPU allocator makes none).

:class:`BufferPool` reuses the host buffers of a shape from batch to batch (page-locked ones for CUDA's
copies, :func:`pinned`; numpy arrays on the CPU), so that no pass pays a fresh array's first touch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
import threading
from collections import OrderedDict

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = 2**31 - 1
_lock = threading.Lock()
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to the maximum (once per process); whether they are set."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _set_thresholds()
            _small_pages_for_numpy()
        return _applied


def _small_pages_for_numpy() -> None:
    """numpy's arrays of 4 MiB and more without ``madvise(MADV_HUGEPAGE)`` (see the module's docstring)."""
    import numpy as np

    multiarray = getattr(getattr(np, "_core", None), "multiarray", None) or getattr(np.core, "multiarray", None)
    switch = getattr(multiarray, "_set_madvise_hugepage", None)
    if switch is not None:
        switch(False)


def _set_thresholds() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(_INT_MAX)) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(_INT_MAX)) == 1 and ok
    except (OSError, AttributeError):  # no libc to load, or no mallopt in it
        return False
    logger.debug("glibc malloc keeps freed memory: %s", ok)
    return ok


class BufferPool:
    """Reusable host buffers, a few per (shape, dtype); the least recently used shapes go first.

    ``make(shape, dtype)`` makes a buffer when none of that key is free:
    page-locked tensors for CUDA's copies, numpy arrays on the CPU, where a
    fresh array costs its first touch (on this project's 2-core VM, 13-14 ms
    for 16 MiB on small pages, 61-69 ms on huge ones: more than the steps
    that fill it; see the module docstring).  Buffers
    come back from writer threads (see :meth:`blockpred.pipeline.infer.Pending.release`), so the pool
    is locked.  It holds at most what was in use at once.
    """

    def __init__(self, make, max_keys: int = 8, per_key: int = 16):
        self._make = make
        self._free: OrderedDict[tuple, list] = OrderedDict()
        self._max_keys, self._per_key = max_keys, per_key
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype):
        """A free buffer of ``shape`` and ``dtype`` (a torch dtype, or a :class:`numpy.dtype`, as buffers have)."""
        key = (tuple(shape), dtype)
        with self._lock:
            free = self._free.get(key)
            if free:
                self._free.move_to_end(key)
                return free.pop()
        return self._make(tuple(shape), dtype)

    def give(self, buffer) -> None:
        key = (tuple(buffer.shape), buffer.dtype)
        with self._lock:
            free = self._free.setdefault(key, [])
            self._free.move_to_end(key)
            if len(free) < self._per_key:
                free.append(buffer)
            while len(self._free) > self._max_keys:
                self._free.popitem(last=False)


def pinned(shape: tuple[int, ...], dtype):
    """A page-locked tensor (CUDA copies from it asynchronously)."""
    import torch

    return torch.empty(shape, dtype=dtype, pin_memory=True)
