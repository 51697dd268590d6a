"""The device's steps around the network when the device is the CPU: numpy, slab by slab, one thread each.

On the CPU the steps around the network (normalise before it; crop, count
NaN/inf, keep channels and convert after it) share the cores with the
readers, the writers and the network.  Each step here is a numpy loop over
pieces of about :data:`SLAB_ELEMENTS` (1 MB of float32, a core's cache), so
every operation of a piece finds it in the cache, and none starts an OpenMP
team: torch's elementwise kernels split each piece over every core and then
wait at a barrier for a core that a reader or writer holds -- three times
slower under the pipeline's load than alone.  numpy releases the GIL in its
loops, so the normalisation (caller's thread) and the conversion (the
predictor's second thread) run beside each other and beside the network.

The numbers are those of the host-side definitions
(:meth:`blockpred.normalize.Normalization.apply`,
:func:`blockpred.normalize.convert_output`) and of the CUDA path, bit for
bit: float32 arithmetic, [0, 1] -> 0-255 rounded half to even; NaN and -inf
become 0 and +inf 255 in uint8 (counted first, when asked).
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Sequence

import numpy as np

#: Elements per piece of the elementwise steps: 1 MB of float32, a core's cache.
SLAB_ELEMENTS = 1 << 18


def slabs(shape: tuple[int, ...]) -> Iterator[tuple[int, int, slice, slice]]:
    """(b, c, z-range, y-range) pieces of a (B, C, Z, Y, X) array, each at most :data:`SLAB_ELEMENTS` elements.

    Whole planes where they fit; rows of one plane where a plane is larger.
    """
    depth, rows, row = shape[2], shape[3], max(1, shape[4])
    plane = rows * row
    if plane <= SLAB_ELEMENTS:
        step = SLAB_ELEMENTS // max(1, plane)
        pieces = [(slice(z, z + step), slice(None)) for z in range(0, depth, step)]
    else:
        step = max(1, SLAB_ELEMENTS // row)
        pieces = [(slice(z, z + 1), slice(y, y + step)) for z in range(depth) for y in range(0, rows, step)]
    for b in range(shape[0]):
        for c in range(shape[1]):
            for z, y in pieces:
                yield b, c, z, y


def is_normalized(dtype: np.dtype, scale: float, offset: float) -> bool:
    """Whether raw values of ``dtype`` are already what the network takes: float32, unscaled, unshifted."""
    return np.dtype(dtype) == np.float32 and scale == 1.0 and offset == 0.0


def normalized(raw: np.ndarray, scale: float, offset: float, out: np.ndarray | None = None) -> np.ndarray:
    """``raw`` (B, C, Z, Y, X, any dtype) as float32 ``x * scale + offset`` (``raw`` itself when nothing changes).

    Into ``out`` (float32, ``raw``'s shape) when given, else a new array.
    """
    if is_normalized(raw.dtype, scale, offset):
        return raw
    if out is None:
        out = np.empty(raw.shape, dtype=np.float32)
    elif out.shape != raw.shape or out.dtype != np.float32:
        raise ValueError(f"out must be float32 of shape {raw.shape}, got {out.dtype} of shape {out.shape}")
    scale32, offset32 = np.float32(scale), np.float32(offset)
    for b, c, z, rows in slabs(raw.shape):
        source, target = raw[b, c, z, rows], out[b, c, z, rows]
        if scale != 1.0:  # cast to float32 first, then multiplied in float32: as astype then *=
            np.multiply(source, scale32, out=target, dtype=np.float32, casting="unsafe")
        else:
            np.copyto(target, source, casting="unsafe")
        if offset != 0.0:
            np.add(target, offset32, out=target)
    return out


def after_network(values: np.ndarray, *, crop: tuple[slice, ...] | None, channels: Sequence[int] | None,
                  output_dtype: np.dtype, counted: Sequence[tuple[slice, ...]] | None,
                  empty: Callable[[tuple[int, ...], np.dtype], np.ndarray] = np.empty
                  ) -> tuple[np.ndarray, np.ndarray | None]:
    """Crop ``values`` (B, C, Z, Y, X float32), keep ``channels``, count NaN/inf in ``counted``, convert.

    Returns the converted values (a new array, or ``values`` itself when
    there is nothing to crop, select or convert; a new one comes from
    ``empty(shape, dtype)``, e.g. a pool's) and, when ``counted`` names
    a box per block (explicit bounds, in the cropped frame), the NaN/inf count
    of each block's box (int64), else None.
    """
    y = values if crop is None else values[(slice(None), slice(None)) + tuple(crop)]
    kept = range(y.shape[1]) if channels is None else channels
    output_dtype = np.dtype(output_dtype)
    counts = None if counted is None else np.zeros(y.shape[0], dtype=np.int64)
    if crop is None and channels is None and output_dtype == np.float32:
        if counts is not None:
            for b, box in enumerate(counted):
                region = y[(b, slice(None)) + tuple(box)]
                counts[b] = region.size - np.count_nonzero(np.isfinite(region))
        return y, counts
    result = empty((y.shape[0], len(kept)) + y.shape[2:], output_dtype)
    buffer = np.empty(max(SLAB_ELEMENTS, y.shape[-1]), dtype=np.float32) if output_dtype == np.uint8 else None
    with np.errstate(over="ignore", invalid="ignore"):  # inf in a sum, float16 overflow: counted or intended
        for b, c, z, rows in slabs(result.shape):
            source, target = y[b, kept[c], z, rows], result[b, c, z, rows]
            # One sum per slab, while it is in the cache: finite only when every value is (x 255 too, where
            # the contiguous buffer sums faster; a product that overflows is counted, and found finite).
            if buffer is None:
                if counts is not None and not _finite_sum(source):
                    counts[b] += _count_in_slab(source, (z.start, rows.start or 0), counted[b])
                np.copyto(target, source, casting="unsafe")
                continue
            scaled = buffer[:source.size].reshape(source.shape)
            np.multiply(source, np.float32(255.0), out=scaled)  # clip(x, 0, 1) * 255 == clip(x * 255, 0, 255)
            if counts is not None and not _finite_sum(scaled):
                counts[b] += _count_in_slab(source, (z.start, rows.start or 0), counted[b])
            np.clip(scaled, np.float32(0.0), np.float32(255.0), out=scaled)
            np.rint(scaled, out=scaled)
            np.copyto(target, scaled, casting="unsafe")  # whole numbers 0-255 exact; NaN -> 0 (x86, arm64)
    return result, counts


#: Columns of the sum that checks a slab for NaN and inf: rows added elementwise (vectorised), not pairwise.
_SUM_COLUMNS = 4096


def _finite_sum(slab: np.ndarray) -> bool:
    """Whether the float32 sum of ``slab`` is finite: always when every value is (a huge sum may overflow).

    A contiguous slab is summed as rows of :data:`_SUM_COLUMNS` added
    elementwise, then the row: 1.6x faster than numpy's pairwise sum.
    """
    if not slab.flags.c_contiguous or slab.size < _SUM_COLUMNS:
        return math.isfinite(float(np.sum(slab, dtype=np.float32)))
    flat = slab.reshape(-1)
    whole = flat.size - flat.size % _SUM_COLUMNS
    total = np.add.reduce(flat[:whole].reshape(-1, _SUM_COLUMNS), axis=0).sum(dtype=np.float32)
    return math.isfinite(float(total + flat[whole:].sum(dtype=np.float32)))


def _count_in_slab(slab: np.ndarray, begin: tuple[int, int], box: tuple[slice, ...]) -> int:
    """The NaN and inf values of ``slab`` (one channel of one block, from (z, y) ``begin``) inside ``box``.

    ``box`` has explicit bounds (``slice(begin, end)``) in the coordinates of the whole block.
    """
    local = []
    for axis, first in enumerate(begin):
        size = slab.shape[axis]
        part = slice(max(box[axis].start, first) - first, min(box[axis].stop, first + size) - first)
        if part.stop <= part.start:
            return 0
        local.append(part)
    region = slab[tuple(local) + (box[2],)]
    return int(region.size - np.count_nonzero(np.isfinite(region)))
