"""The torch side of a bioimage.io package: its processing steps and :class:`PackageNetwork`.

A package's network takes its own axis order and wants its own preprocessing;
blockpred hands every network raw blocks as (b, c, z, y, x) float32 (its
normalisation set to ``none``).  :class:`PackageNetwork` wraps the package's
network so it fits that device path unchanged::

    raw (b, c, z, y, x) -> preprocessing -> axes to the package's order -> network
      -> axes back to (b, c, z, y, x) -> postprocessing

A 2D package's network runs on every plane of the block at once (its planes
folded into the batch, see :mod:`.planes`), between the same steps.

Every step is elementwise with constants fixed at load time (statistics of the
volume are computed once by the client, see :mod:`.bioimageio`), so a step may
run on a block, a batch or a sample of voxels with the same numbers.  Constants
are scalars or one per channel, broadcast as (1, C, 1, 1, 1).

A 2D package's per-sample statistics are per plane (see :mod:`.bioimageio_planes`):
such a step (:class:`PlaneNormalize`, :class:`PlaneClip`) holds a table of
constants, one row per plane of the volume, and :meth:`PackageNetwork.forward`
takes ``planes``, the volume plane each input plane of each block reads (the
worker knows it from the block's read box; see
:attr:`blockpred.pipeline.DeviceSteps.planes`), and gives each plane its row.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ..errors import ModelLoadError
from .planes import per_plane, stack_axis

TORCH_DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "uint8": torch.uint8, "int8": torch.int8,
    "uint16": torch.uint16, "int16": torch.int16, "uint32": torch.uint32, "int32": torch.int32,
    "uint64": torch.uint64, "int64": torch.int64, "bool": torch.bool,
}


def _per_channel(values: float | Sequence[float]) -> torch.Tensor:
    """A scalar or one value per channel, shaped to broadcast over (b, c, z, y, x)."""
    flat = torch.tensor([float(values)] if isinstance(values, (int, float)) else [float(v) for v in values],
                        dtype=torch.float32)
    return flat.reshape(1, -1, 1, 1, 1)


class Normalize(nn.Module):
    """``(x - sub) / div``: scale_range, zero_mean_unit_variance and its fixed form (``div`` holds the eps)."""

    def __init__(self, sub, div):
        super().__init__()
        self.register_buffer("sub", _per_channel(sub))
        self.register_buffer("div", _per_channel(div))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.sub) / self.div


class Linear(nn.Module):
    """``x * gain + offset``: scale_linear."""

    def __init__(self, gain, offset):
        super().__init__()
        self.register_buffer("gain", _per_channel(gain))
        self.register_buffer("offset", _per_channel(offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain + self.offset


class Clip(nn.Module):
    def __init__(self, low: float | None, high: float | None):
        super().__init__()
        self.low, self.high = low, high

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x, min=self.low, max=self.high)


class Binarize(nn.Module):
    """1 where ``x > threshold``, else 0 (float32)."""

    def __init__(self, threshold):
        super().__init__()
        self.register_buffer("threshold", _per_channel(threshold))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x > self.threshold).to(torch.float32)


class Sigmoid(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x.float())


class Softmax(nn.Module):
    """Softmax over the channel axis."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x.float(), dim=1)


class Cast(nn.Module):
    """ensure_dtype: cast (values as the cast leaves them); ``back`` returns to float32 (postprocessing)."""

    def __init__(self, dtype: str, back: bool = False):
        super().__init__()
        self.dtype_name, self.back = dtype, back

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = TORCH_DTYPES[self.dtype_name]
        if x.dtype == dtype:
            return x
        x = x.to(dtype)
        return x.to(torch.float32) if self.back else x


class PackageNetwork(nn.Module):
    """A package's network behind blockpred's (b, c, z, y, x) float32 interface (see the module docstring).

    ``in_axes`` / ``out_axes``: the package's axes as blockpred axis indices
    (0 batch, 1 channel, 2-4 z, y, x) in the package's order; a missing batch
    axis (or a batch fixed at 1) runs the blocks of a batch one at a time, a
    missing channel axis means one channel.  ``min_shape`` / ``step`` /
    ``fixed``: the spatial input shapes the package accepts (``min + k * step``,
    or exactly ``min`` where ``fixed``), checked before the network runs.
    ``plane`` (a 2D package): the planes its network runs on; ``in_axes`` /
    ``out_axes`` then index (b, c, rows, cols).
    """

    def __init__(self, network: nn.Module, *, pre: Sequence[nn.Module], post: Sequence[nn.Module],
                 in_axes: Sequence[int], out_axes: Sequence[int], batch_one: bool,
                 min_shape: Sequence[int], step: Sequence[int], fixed: Sequence[bool], package: str,
                 plane: str | None = None):
        super().__init__()
        self.network = network
        self.pre = nn.Sequential(*pre)
        self.post = nn.Sequential(*post)
        self.in_axes, self.out_axes = tuple(in_axes), tuple(out_axes)
        self.batch_one = batch_one or 0 not in self.in_axes
        self.min_shape, self.step, self.fixed = tuple(min_shape), tuple(step), tuple(fixed)
        self.package = package
        self.plane = plane
        if plane is not None:  # test-time flips leave the stacking axis alone (see .tta)
            self.stack_dim = 2 + stack_axis(plane)

    def __deepcopy__(self, memo):
        """As the default, but without autograd: a TorchScript network copied with it has non-leaf
        parameters, which every later ``.to()`` warns about (the Predictor copies its module)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        with torch.no_grad():
            for key, value in self.__dict__.items():
                new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    @property
    def planes_along(self) -> int | None:
        """The spatial axis (0 z, 1 y, 2 x) along which this network takes per-plane constants, else None."""
        for op in list(self.pre) + list(self.post):
            if isinstance(op, _PlaneOp):
                return op.dim - 2
        return None

    def forward(self, x: torch.Tensor, planes: torch.Tensor | None = None) -> torch.Tensor:
        """The package on ``x`` (b, c, z, y, x); ``planes`` (b, planes deep), for a network with per-plane
        constants: the volume plane each input plane reads (None: the first planes of its table, in order)."""
        self._check_shape(tuple(x.shape[2:]))
        x = _steps(self.pre, x, planes)
        y = self._batched(x) if self.plane is None else per_plane(self._batched, x, self.plane)
        return _steps(self.post, y, planes)

    def _batched(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_one and x.shape[0] > 1:
            return torch.cat([self._network(x[i:i + 1]) for i in range(x.shape[0])])
        return self._network(x)

    def _network(self, x: torch.Tensor) -> torch.Tensor:
        rank = x.dim()
        missing = [a for a in range(rank) if a not in self.in_axes]  # size 1 here (batch run one at a time)
        x = x.permute(*self.in_axes, *missing)
        x = x.reshape(x.shape[:len(self.in_axes)])
        y = self.network(x)
        if isinstance(y, (tuple, list)):
            y = y[0]  # the package's first output
        missing = [a for a in range(rank) if a not in self.out_axes]
        y = y.reshape(tuple(y.shape) + (1,) * len(missing))
        order = list(self.out_axes) + missing
        return y.permute(*[order.index(a) for a in range(rank)])

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        bad = [axis for axis, (n, low, step, fixed) in enumerate(zip(shape, self.min_shape, self.step, self.fixed))
               if (n != low if fixed else n < low or (n - low) % step)]
        if bad:
            rule = ", ".join(f"{'zyx'[a]} {'exactly ' if self.fixed[a] else ''}{self.min_shape[a]}"
                             + ("" if self.fixed[a] else f" + k*{self.step[a]}") for a in range(3))
            raise ValueError(f"bioimage.io package {self.package!r} accepts network inputs of {rule}, "
                             f"not {'x'.join(map(str, shape))}: choose --block (block + 2 x halo) to fit")


def _steps(ops: nn.Sequential, x: torch.Tensor, planes: torch.Tensor | None) -> torch.Tensor:
    for op in ops:
        x = op(x, planes) if isinstance(op, _PlaneOp) else op(x)
    return x


# ---------------------------------------------------------------------- steps


@dataclass(frozen=True)
class Step:
    """One processing step, before its statistics are known."""

    kind: str  # normalize | linear | clip | binarize | sigmoid | softmax | cast
    params: Mapping[str, Any] = field(default_factory=dict)
    #: None, "percentiles" (params lo_q, hi_q) or "meanstd": statistics the step needs.
    stat: str | None = None
    per_channel: bool = False
    #: Statistics of the raw input (a postprocessing step's reference_tensor), not of the step's own input.
    of_raw_input: bool = False
    #: A 2D package's per-sample statistics (axes y and x, without batch): one set per plane of the volume.
    per_plane: bool = False


def build_op(step: Step, statistics: Mapping[str, Any] | None) -> torch.nn.Module:
    """The torch module of ``step``, its statistics (if it needs them) given."""
    p = step.params
    if step.kind == "cast":
        return Cast(p["dtype"], back=p["back"])
    if step.kind == "sigmoid":
        return Sigmoid()
    if step.kind == "softmax":
        return Softmax()
    if step.kind == "binarize":
        return Binarize(p["threshold"])
    if step.kind == "linear":
        return Linear(p["gain"], p["offset"])
    if step.stat is not None and statistics is None:
        raise ModelLoadError(f"a {step.kind} step needs statistics of the volume, and none were given")
    if step.kind == "clip":
        low = p["low"] if p.get("lo_q") is None else statistics["lo"]
        high = p["high"] if p.get("hi_q") is None else statistics["hi"]
        scalar = lambda v: v if v is None or not isinstance(v, list) or len(v) != 1 else v[0]  # noqa: E731
        low, high = scalar(low), scalar(high)
        if isinstance(low, list) or isinstance(high, list):
            return _ClipPerChannel(low, high)
        return Clip(low, high)
    if step.stat == "percentiles":
        lo, hi = np.asarray(statistics["lo"]), np.asarray(statistics["hi"])
        return Normalize(lo.tolist(), (hi - lo + p["eps"]).tolist())
    if step.stat == "meanstd":
        mean, std = np.asarray(statistics["mean"]), np.asarray(statistics["std"])
        return Normalize(mean.tolist(), (std + p["eps"]).tolist())
    return Normalize(p["sub"], p["div"])


class _ClipPerChannel(torch.nn.Module):
    def __init__(self, low, high):
        super().__init__()
        self.register_buffer("low", _per_channel(low) if low is not None else None)
        self.register_buffer("high", _per_channel(high) if high is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x, min=self.low, max=self.high)


# ---------------------------------------------------------------------- per-plane steps


class _PlaneOp(nn.Module):
    """A step whose constants are a table of rows ``first``, ``first + 1`` ... (one per plane of the volume,
    one column per channel, or one for all), the planes stacked along tensor dimension ``dim`` (2 + axis)."""

    def __init__(self, first: int, dim: int):
        super().__init__()
        self.first, self.dim = int(first), int(dim)

    def _rows(self, table: torch.Tensor, x: torch.Tensor, planes: torch.Tensor | None) -> torch.Tensor:
        """``table``'s row of each plane of ``x``, shaped to broadcast over it: (b, C, planes) on ``dim``.

        ``planes`` (b, depth): volume plane indices; rows outside the table take its nearest row (a plane
        a block reads past the ROI, or a constant-padded one: its prediction is not written)."""
        depth = x.shape[self.dim]
        if planes is None:
            planes = torch.arange(self.first, self.first + depth, device=x.device).expand(x.shape[0], depth)
        elif tuple(planes.shape) != (x.shape[0], depth):
            raise ValueError(f"per-plane constants for {tuple(planes.shape)} planes, but the input has "
                             f"{x.shape[0]} x {depth}")
        index = (planes.to(device=table.device, dtype=torch.int64) - self.first).clamp(0, table.shape[0] - 1)
        rows = table[index].permute(0, 2, 1)  # (b, C, depth)
        shape = [x.shape[0], table.shape[1], 1, 1, 1]
        shape[self.dim] = depth
        return rows.reshape(shape)


def _table(values) -> torch.Tensor:
    """(planes, C) float32, from (planes, C) values (or (planes,): one column)."""
    array = np.asarray(values, dtype=np.float64)
    return torch.from_numpy(array.reshape(array.shape[0], -1).astype(np.float32))


class PlaneNormalize(_PlaneOp):
    """``(x - sub[plane]) / div[plane]``: a per-plane scale_range or zero_mean_unit_variance."""

    def __init__(self, sub, div, first: int, dim: int):
        super().__init__(first, dim)
        self.register_buffer("sub", _table(sub))
        self.register_buffer("div", _table(div))

    def forward(self, x: torch.Tensor, planes: torch.Tensor | None = None) -> torch.Tensor:
        return (x - self._rows(self.sub, x, planes)) / self._rows(self.div, x, planes)


class PlaneClip(_PlaneOp):
    """clip at per-plane percentiles (a side without a percentile: its fixed bound, or none)."""

    def __init__(self, low, high, first: int, dim: int):
        super().__init__(first, dim)
        self.register_buffer("low", None if low is None else _table(low))
        self.register_buffer("high", None if high is None else _table(high))

    def forward(self, x: torch.Tensor, planes: torch.Tensor | None = None) -> torch.Tensor:
        low = None if self.low is None else self._rows(self.low, x, planes)
        high = None if self.high is None else self._rows(self.high, x, planes)
        return torch.clamp(x, min=low, max=high)


def build_plane_op(step: Step, table: Mapping[str, Any], first: int, dim: int) -> _PlaneOp:
    """The torch module of a per-plane ``step``: ``table`` holds its statistics as (planes, C) arrays
    (see :func:`build_op` for the same step with one set of constants)."""
    p = step.params
    planes = len(next(iter(table.values())))
    if step.kind == "clip":
        def side(stat: str, quantile: str, fixed: str):
            if p.get(quantile) is not None:
                return np.asarray(table[stat], dtype=np.float64)
            return None if p[fixed] is None else np.full((planes, 1), p[fixed], dtype=np.float64)

        return PlaneClip(side("lo", "lo_q", "low"), side("hi", "hi_q", "high"), first, dim)
    if step.stat == "percentiles":
        lo, hi = np.asarray(table["lo"], dtype=np.float64), np.asarray(table["hi"], dtype=np.float64)
        return PlaneNormalize(lo, hi - lo + p["eps"], first, dim)
    mean, std = np.asarray(table["mean"], dtype=np.float64), np.asarray(table["std"], dtype=np.float64)
    return PlaneNormalize(mean, std + p["eps"], first, dim)
