"""Downsampling one block of a volume by integer factors per spatial axis.

The last three axes are (z, y, x); any leading axes (channels) are kept.  A
window of ``factor`` voxels becomes one voxel; where the block ends inside a
window (the volume's far edge), the window holds only the voxels that exist,
so the output has ``ceil(shape / factor)`` voxels per axis and never sees
made-up values.

* ``mean``: the mean of the window, accumulated in float64; integer outputs
  are rounded half to even and clipped to the dtype's range.  For predictions
  (probabilities, affinities, blockpred's uint8 0-255 scale) this is what a
  viewer should show at a coarser scale.
* ``mode``: the most frequent value of the window, the smallest on a tie; for
  label volumes (no new values are made up).
* ``stride``: the window's first voxel; the cheapest, also keeps labels.
"""

from __future__ import annotations

import numpy as np

from ..choices import PYRAMID_METHODS as METHODS
from ..errors import InvalidOptionError
from ..geometry import Coord


def check_method(method: str) -> str:
    name = str(method).strip().lower()
    if name not in METHODS:
        raise InvalidOptionError(f"pyramid method must be one of {', '.join(METHODS)}, got {method!r}")
    return name


def downsample(data: np.ndarray, factor: Coord, method: str) -> np.ndarray:
    """``data`` (..., z, y, x) reduced by ``factor`` (z, y, x) per axis with ``method``; same dtype."""
    factor = Coord(factor)
    if data.ndim < 3 or len(factor) != 3 or any(f < 1 for f in factor):
        raise ValueError(f"need (..., z, y, x) data and 3 factors >= 1, got shape {data.shape} and {tuple(factor)}")
    if factor == Coord((1, 1, 1)):
        return data.copy()
    if method == "stride":
        return np.ascontiguousarray(data[..., :: factor[0], :: factor[1], :: factor[2]])
    spatial = Coord(data.shape[-3:])
    out_shape = spatial.ceil_div(factor)
    padded = out_shape * factor
    if padded != spatial:
        pad = [(0, 0)] * (data.ndim - 3) + [(0, p - s) for p, s in zip(padded, spatial)]
        data = np.pad(data, pad)  # zeros: mean divides by the real counts, mode masks them out
    lead = data.shape[:-3]
    windows = data.reshape(lead + (out_shape[0], factor[0], out_shape[1], factor[1], out_shape[2], factor[2]))
    n = len(lead)
    if method == "mean":
        return _mean(windows, n, spatial, factor, out_shape, data.dtype)
    if method == "mode":
        return _mode(windows, n, spatial, factor, out_shape, data.dtype)
    raise InvalidOptionError(f"pyramid method must be one of {', '.join(METHODS)}, got {method!r}")


def _axis_counts(spatial: Coord, factor: Coord, out_shape: Coord) -> list[np.ndarray]:
    """Per axis, how many real voxels each output voxel's window holds."""
    return [np.minimum(f, s - np.arange(o) * f) for s, f, o in zip(spatial, factor, out_shape)]


def _mean(windows: np.ndarray, n: int, spatial: Coord, factor: Coord, out_shape: Coord,
          dtype: np.dtype) -> np.ndarray:
    sums = windows.sum(axis=(n + 1, n + 3, n + 5), dtype=np.float64)
    cz, cy, cx = _axis_counts(spatial, factor, out_shape)
    if spatial == out_shape * factor:
        sums /= float(factor.prod())
    else:
        sums /= cz[:, None, None] * cy[None, :, None] * cx[None, None, :]
    if np.dtype(dtype).kind in "ui":
        info = np.iinfo(dtype)
        return np.clip(np.rint(sums), info.min, info.max).astype(dtype)
    return sums.astype(dtype)


def _mode(windows: np.ndarray, n: int, spatial: Coord, factor: Coord, out_shape: Coord,
          dtype: np.dtype) -> np.ndarray:
    lead = windows.shape[:n]
    order = tuple(range(n)) + (n, n + 2, n + 4, n + 1, n + 3, n + 5)
    k = factor.prod()
    values = windows.transpose(order).reshape(int(np.prod(lead, dtype=np.int64)), out_shape.prod(), k)
    values = values.astype(np.float64)
    if spatial != out_shape * factor:
        # Voxels past the edge become NaN: NaN equals nothing, so they never count.
        valid = np.ones(tuple(out_shape) + tuple(factor), dtype=bool)
        for axis, (s, f, o) in enumerate(zip(spatial, factor, out_shape)):
            inside = (np.arange(o)[:, None] * f + np.arange(f)[None, :]) < s
            shape = [1] * 6
            shape[axis], shape[axis + 3] = o, f
            valid &= inside.reshape(shape)
        values[:, ~valid.reshape(-1, k)] = np.nan
    values.sort(axis=2)  # NaN last; the first of the most frequent is then the smallest
    counts = (values[..., :, None] == values[..., None, :]).sum(axis=3)
    chosen = np.take_along_axis(values, counts.argmax(axis=2)[..., None], axis=2)
    return chosen.reshape(lead + tuple(out_shape)).astype(dtype)
