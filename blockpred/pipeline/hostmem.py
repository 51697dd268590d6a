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

Giving memory back.  What a process keeps is what its largest pass needed, so
the size trials' larger blocks would stay resident through a run at a smaller
one.  :func:`release_freed_memory` (glibc's ``malloc_trim(0)``) hands the heap's
free pages back after the trials (see :meth:`blockpred.pipeline.infer.Predictor.release_memory`):
``tiny``'s 84^3 trial pass in torch grew the process by 0.19 GiB, of which 0.02
GiB stayed once handed back (all of it without).  OpenVINO keeps the buffers of
the largest input it ran until its compiled model releases them (after trials up
to 276^3, 2.04 GiB resident; released and trimmed, 0.76 GiB, and 0.63 GiB
without the trial shapes' pooled arrays).  A trimmed process so needs no child
process for its trials.

Measuring it.  :func:`resident_bytes` and :func:`peak_resident_bytes` read this
process's resident memory and its peak; :class:`ResidentPeak` measures the peak
of a step (a trial pass) without resetting the process's own peak, which the
summary and ``/usr/bin/time`` report.  :func:`available_bytes` is what the
machine (or the cgroup of a container or a batch job) still has, and
:func:`parse_size` reads ``--memory-limit``'s sizes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import platform
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Self

from ..errors import InvalidOptionError

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = 2**31 - 1
_lock = threading.Lock()
_applied: bool | None = None
_libc = None  # glibc, once loaded (False: none here)


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


def _glibc():
    """glibc's C library (loaded once), None on other systems or C libraries."""
    global _libc
    if _libc is None:
        _libc = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            except OSError:  # no libc to load
                pass
    return _libc or None


def _set_thresholds() -> bool:
    libc = _glibc()
    if libc is None:
        return False
    try:
        ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(_INT_MAX)) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(_INT_MAX)) == 1 and ok
    except AttributeError:  # no mallopt in it
        return False
    logger.debug("glibc malloc keeps freed memory: %s", ok)
    return ok


def release_freed_memory() -> int:
    """Hand the heap's free pages back to the kernel (glibc's ``malloc_trim(0)``, every arena); the bytes this
    process's resident memory fell by (0 where it cannot be told, or elsewhere than glibc)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return 0
    before = resident_bytes()
    libc.malloc_trim(0)
    after = resident_bytes()
    return max(0, before - after) if before is not None and after is not None else 0


def resident_bytes() -> int | None:
    """This process's resident memory now (None where it cannot be read)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux
        try:
            import psutil

            return int(psutil.Process().memory_info().rss)
        except Exception:  # noqa: BLE001 - no psutil, or no such figure here
            return None


def peak_resident_bytes() -> int | None:
    """This process's peak resident memory so far (``VmHWM``; elsewhere ``getrusage``'s, in kibibytes but bytes on
    macOS; None where neither can be read)."""
    try:
        with open("/proc/self/status") as status:
            line = next((line for line in status if line.startswith("VmHWM:")), "")
        if line:
            return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (1 if sys.platform == "darwin" else 1024)


class ResidentPeak:
    """The peak resident memory of this process while a ``with`` block runs, in :attr:`bytes` after it.

    Sampled every ``interval_s`` on a thread; exact where the process's own peak
    rose during the block (it was then reached in the block).  The process's
    peak is never reset: the summary and ``/usr/bin/time`` report it.  A block
    shorter than the interval is read at its start and end.  :attr:`bytes` is
    None where resident memory cannot be read.
    """

    def __init__(self, interval_s: float = 0.005):
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.bytes: int | None = None

    def __enter__(self) -> Self:
        self._peak_before = peak_resident_bytes()
        self.bytes = resident_bytes()
        self._thread = threading.Thread(target=self._sample, name="blockpred-resident-peak", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._note(resident_bytes())

    def _note(self, value: int | None) -> None:
        if value is not None:
            self.bytes = value if self.bytes is None else max(self.bytes, value)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._note(resident_bytes())
        peak = peak_resident_bytes()
        if peak is not None and self._peak_before is not None and peak > self._peak_before:
            self._note(peak)


def available_bytes() -> int | None:
    """Memory this process may still take: the machine's available memory (page cache counts as available),
    or less where the cgroup of a container or a batch job (SLURM's) leaves less; None where neither is told."""
    try:
        import psutil

        free = int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no psutil, or no figure on this system
        free = None
    room = _cgroup_room()
    return room if free is None else free if room is None else min(free, room)


def _cgroup_room() -> int | None:
    """What this process's memory cgroup (v2, else v1) still allows; None where it sets no limit or is not told."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            names, root = ("memory.max", "memory.current"), Path("/sys/fs/cgroup")
        elif "memory" in controllers.split(","):
            names, root = ("memory.limit_in_bytes", "memory.usage_in_bytes"), Path("/sys/fs/cgroup/memory")
        else:
            continue
        for folder in (root / path.lstrip("/"), root):  # a container sees its own group at the root
            try:
                limit, usage = ((folder / name).read_text().strip() for name in names)
                if limit != "max" and int(limit) < 2**60:  # v1 writes "no limit" as a huge number
                    return max(0, int(limit) - int(usage))
                break
            except (OSError, ValueError):
                continue
    return None


def parse_size(value, name: str = "memory_limit") -> int:
    """A size in bytes from ``2GB``, ``1.5GiB``, ``800MB`` or a number of bytes, read as dask reads ``--memory``
    (:func:`dask.utils.parse_bytes`: kB, MB, GB are powers of 1000, KiB, MiB, GiB of 1024)."""
    from dask.utils import parse_bytes

    try:
        size = math.nan if isinstance(value, bool) else float(parse_bytes(value))
    except (TypeError, ValueError):
        size = math.nan
    if not (math.isfinite(size) and size >= 1):
        raise InvalidOptionError(f"{name} must be a size such as 2GB, 1.5GiB or 800MB (kB, MB, GB: powers of 1000; "
                                 f"KiB, MiB, GiB: of 1024), got {value!r}")
    return int(size)


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

    def clear(self) -> None:
        """Drop every free buffer (those in use come back as usual)."""
        with self._lock:
            self._free.clear()


def pinned(shape: tuple[int, ...], dtype):
    """A page-locked tensor (CUDA copies from it asynchronously)."""
    import torch

    return torch.empty(shape, dtype=dtype, pin_memory=True)
