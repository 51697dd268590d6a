"""Reading a box that may reach past the volume edge, padded as ``numpy.pad`` would.

:func:`read_padded` returns exactly ``numpy.pad(volume, pad, mode)[box]`` for
any box and any pad width, but reads only the part of the volume it needs.
This is what makes blockwise prediction equal the whole-volume prediction at
the edges: every block sees the same padded values the whole volume would.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Literal

import numpy as np

from ..choices import PAD_MODES
from ..errors import InvalidOptionError
from ..geometry import Box, Coord
from ..io.base import Volume

PadMode = Literal["reflect", "edge", "constant"]


def source_indices(begin: int, end: int, size: int, mode: str) -> np.ndarray:
    """For positions ``begin..end-1`` on an axis of length ``size``, the index each reads.

    ``reflect`` mirrors without repeating the edge voxel (numpy's ``reflect``),
    periodically, so a pad wider than the axis still matches ``numpy.pad``;
    ``edge`` repeats the edge voxel; ``constant`` returns -1 outside.
    """
    positions = np.arange(begin, end, dtype=np.int64)
    if mode == "edge" or (mode == "reflect" and size == 1):
        return np.clip(positions, 0, size - 1)
    if mode == "reflect":
        period = 2 * (size - 1)
        folded = np.mod(positions, period)
        return np.where(folded >= size, period - folded, folded)
    if mode == "constant":
        return np.where((positions >= 0) & (positions < size), positions, -1)
    raise InvalidOptionError(f"pad mode must be one of {', '.join(PAD_MODES)}, got {mode!r}")


def read_padded(volume: Volume, box: Box, mode: str = "reflect", constant: float = 0) -> np.ndarray:
    """The data of ``box`` (spatial, may exceed the volume), padded by ``mode``.

    Channels, when the volume has them, come first and are never padded.
    """
    return _padded(volume.read, volume, box, mode, constant)


def read_padded_with_missing(volume: Volume, box: Box, mode: str = "reflect",
                             constant: float = 0) -> tuple[np.ndarray, tuple[Box, ...]]:
    """:func:`read_padded`, and the chunks of ``volume`` it found missing (see :meth:`Volume.read_with_missing`)."""
    missing: list[Box] = []

    def read(inside: Box) -> np.ndarray:
        data, found = volume.read_with_missing(inside)
        missing.extend(found)
        return data

    return _padded(read, volume, box, mode, constant), tuple(missing)


def _padded(read: Callable[[Box], np.ndarray], volume: Volume, box: Box, mode: str, constant: float) -> np.ndarray:
    """:func:`read_padded` with ``read`` reading the one box of ``volume`` it needs."""
    whole = volume.box
    if whole.contains(box):
        return read(box)
    lead = volume.shape[:-3]
    if mode == "constant":
        out = np.full(lead + tuple(box.shape), constant, dtype=volume.dtype)
        inside = box.intersect(whole)
        if not inside.empty:
            target = (slice(None),) * len(lead) + inside.relative_to(box.begin).to_slices()
            out[target] = read(inside)
        return out
    per_axis = [source_indices(b, e, n, mode) for b, e, n in zip(box.begin, box.end, whole.end)]
    source = Box(Coord(int(i.min()) for i in per_axis), Coord(int(i.max()) + 1 for i in per_axis))
    data = read(source)
    runs = [_runs(i - lo) for i, lo in zip(per_axis, source.begin)]
    channels = (slice(None),) * len(lead)
    if math.prod(len(r) for r in runs) > _MAX_PIECES:  # a pad many times the volume: one gather
        return data[channels + np.ix_(*[i - lo for i, lo in zip(per_axis, source.begin)])]
    out = np.empty(lead + tuple(box.shape), dtype=data.dtype)
    for pieces in itertools.product(*runs):
        out[channels + tuple(t for t, _ in pieces)] = data[channels + tuple(s for _, s in pieces)]
    return out


#: Pieces of a padded box copied slice by slice; beyond (a pad many times the axis) one gather copies it.
_MAX_PIECES = 64


def _runs(indices: np.ndarray) -> list[tuple[slice, slice]]:
    """``indices`` as runs of step +1, -1 or 0: (target slice, source slice) pairs.

    ``data[source]`` of every run, placed at its target, is ``data[indices]``;
    a step-0 run (an edge repeated) has a source of length 1, broadcast.  A
    reflected axis is at most three runs (mirror, inside, mirror), so a padded
    block is copied in at most 27 slices instead of gathered voxel by voxel.
    """
    runs, begin, n = [], 0, len(indices)
    while begin < n:
        end = begin + 1
        step = int(indices[end] - indices[begin]) if end < n else 1
        if step not in (-1, 0, 1):
            step = 1
        else:
            while end < n and indices[end] - indices[end - 1] == step:
                end += 1
        first, last = int(indices[begin]), int(indices[end - 1])
        if step == 1:
            source = slice(first, last + 1)
        elif step == -1:
            source = slice(first, last - 1 if last > 0 else None, -1)
        else:
            source = slice(first, first + 1)
        runs.append((slice(begin, end), source))
        begin = end
    return runs
