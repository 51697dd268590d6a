"""Measure a network's receptive-field radius by backpropagation.

:func:`receptive_radius` backpropagates from one output voxel near the centre
and reports, per axis, how far from that voxel the nonzero input gradient
reaches.  A halo at least this large makes blockwise prediction equal to
whole-volume prediction, given blocks (and halos) aligned to the network's
downsampling.  The radius is symmetric, the larger reach of the two sides over
all phases; an aligned block's first voxel always has phase 0, so a halo up to
one pooling step smaller can suffice.

Backpropagating through the network as it is can under-report: max pooling
passes gradient only to the maximum of each window and ReLU none through
negative inputs.  So the measurement runs on a float64 copy in which every max
pooling becomes an average pooling of the same window, every weight and bias is
positive (drawn from a private generator) and the input is positive; a voxel
then gets nonzero gradient exactly when the output depends on it.

With pooling, the reach depends on where the voxel sits relative to the pooling
grid (its phase).  The radius is the maximum over every phase along each axis.
Every layer of a U-Net (box-shaped convolutions and poolings, crops,
concatenation, pointwise activations) makes the reach along one axis depend
only on the voxel's position along that axis, so one backward pass measures a
phase on all three axes at once: ``max(downsampling)`` passes in all.

The reach depends only on the layer structure, not on the number of feature
maps: a copy with one feature map per layer measures the same radius, faster.

:func:`field_radius` measures any network, in bounded memory, from the grid
:func:`~blockpred.models.discover.find_grid` found: one axis at a time, on an
input long along that axis and as thin as the network takes on the others
(the reach along an axis does not depend on the extent of the others), one
backward pass per pooling phase of that axis, in float32 with the gradient
scaled far from underflow (float64 where it still comes near).  A TorchScript
network's max pooling cannot be swapped in its code: its frozen graph is run
node by node (:mod:`.scriptgraph`), each max pooling an average pooling, and
measured as a module is.  Where the graph does not run so, its gradient is taken
at a random input and at two ramps along the axis, rising and falling (with
positive weights every window's maximum then sits at its far, then its near
end: the field's two extremes), and the supports united.  A field that still reaches the border of the
longest input tried (:data:`MAX_SIDE`) is :class:`UnboundedField`: the
network sees the whole input (instance or group normalisation, global
pooling, attention), and no halo makes blocks equal the whole volume.  Layers
that normalise over the whole input (group, instance and layer norm) are
measured as the identity: the field of their convolutions, which a halo can
cover, while their statistics still differ from block to block
(:func:`block_normalisations` names them).  Inside TorchScript code they cannot be swapped: such a network is
:class:`UnboundedField` at once, without measuring (MONAI's BasicUNet went on to 1024-voxel inputs, 3.3-4.6 s).
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from ..geometry import Coord, CoordLike, as_coord
from .scriptgraph import GraphInterpreter, scripted

logger = logging.getLogger(__name__)

__all__ = ["MAX_SIDE", "UnboundedField", "block_normalisations", "field_radius", "receptive_radius"]

#: The longest input along the measured axis :func:`field_radius` tries.
MAX_SIDE = 1024
#: Input voxels :func:`field_radius` runs at most (thin inputs stay far below).
MAX_FIELD_VOXELS = 1 << 22
#: Inputs whose supports are united where max pooling stays (TorchScript): a random one and two ramps
#: (:func:`_probe_input`).
SCRIPTED_INPUTS = 3
#: The gradient the backward pass of :func:`field_radius` starts from (float32 reaches 3.4e38).
GRAD_SCALE = 2.0 ** 64
#: A float32 gradient below this (float32 underflows below 1.2e-38) makes :func:`field_radius` measure in
#: float64: a still fainter dependence could have rounded to 0 and hidden part of the field.
FAINT = 1e-20

_POOL_TO_AVG = {nn.MaxPool1d: nn.AvgPool1d, nn.MaxPool2d: nn.AvgPool2d, nn.MaxPool3d: nn.AvgPool3d}
#: Layers that normalise over the whole input (per sample): their statistics make every output voxel depend on
#: every input voxel.  The field is measured with them as the identity (their convolutions' field), and the
#: caller says that no halo makes blocks exact (:func:`block_normalisations`).
_BLOCK_NORMS = (nn.GroupNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm)
_BLOCK_NORM_NAMES = ("GroupNorm", "LayerNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d")


def block_normalisations(module: nn.Module) -> tuple[str, ...]:
    """The kinds of layer in ``module`` that normalise over the whole input (GroupNorm, InstanceNorm, LayerNorm);
    an instance norm that keeps running statistics (and so, in eval mode, is a per-channel affine map) is not one."""
    found = []
    for sub in module.modules():
        name = getattr(sub, "original_name", None) or type(sub).__name__
        if name.startswith("InstanceNorm") and getattr(sub, "track_running_stats", False):
            continue
        if name in _BLOCK_NORM_NAMES:
            found.append(name)
    return tuple(dict.fromkeys(found))


class _ReachesBorder(Exception):
    def __init__(self, axes: list[int]):
        super().__init__(axes)
        self.axes = axes


class UnboundedField(ValueError):
    """The output depends on inputs at the border of the longest input tried, on ``axes``."""

    def __init__(self, axes: list[int], side: int, reason: str = ""):
        super().__init__(reason or f"the receptive field reaches the border of a {side}-voxel input along "
                         f"{', '.join('zyx'[a] for a in axes)}")
        self.axes = axes
        self.side = side
        #: Why, where nothing was measured (a norm the measurement cannot take out); else "".
        self.reason = reason


def field_radius(module: nn.Module, in_channels: int, grid, *, plane_axis: int | None = None, seed: int = 0,
                 max_side: int = MAX_SIDE) -> Coord:
    """The per-axis receptive-field radius of ``module`` on ``grid`` (a :class:`~.discover.Grid`), thin axis
    by thin axis (see the module docstring).  0 across a 2D network's planes (``plane_axis``).

    Measured in float32 (several times faster than float64 on a CPU); where a gradient comes within
    :data:`FAINT` of float32's underflow, measured again in float64.

    Raises :class:`UnboundedField` where the field reaches the border of a ``max_side`` input, and
    ValueError where the output depends on no input at all.
    """
    try:
        return _field_radius(module, in_channels, grid, plane_axis, seed, max_side, torch.float32)
    except _Faint:
        logger.debug("receptive field of %s: a gradient near float32's underflow; measured in float64",
                     type(module).__name__)
        return _field_radius(module, in_channels, grid, plane_axis, seed, max_side, torch.float64)


def _field_radius(module: nn.Module, in_channels: int, grid, plane_axis: int | None, seed: int, max_side: int,
                  dtype: torch.dtype) -> Coord:
    probe, probe_channels = _structural_copy(module, in_channels, seed, dtype)
    kept = block_normalisations(probe)
    if kept:  # inside TorchScript code, not swapped: its statistics reach every voxel of any input
        raise UnboundedField([a for a in range(3) if a != plane_axis], 0,
                             f"its {', '.join(kept)} normalises over the whole input inside TorchScript code, "
                             f"which the measurement cannot take out")
    graphs = _graph_probe(probe)
    if graphs is not None:  # its TorchScript run node by node, max pooling averaged: measured as an nn.Module
        try:
            radius = _axes_radius(graphs, probe_channels, grid, plane_axis, seed, max_side, 1, dtype)
            logger.debug("receptive field: its TorchScript run node by node, max pooling averaged")
            return radius
        except (_Faint, UnboundedField):
            raise
        except Exception as err:  # noqa: BLE001 - an operation the interpreter lacks: measured as TorchScript
            logger.debug("receptive field: the network's graph did not run node by node (%s)", err)
    return _axes_radius(probe, probe_channels, grid, plane_axis, seed, max_side,
                        SCRIPTED_INPUTS if scripted(probe) else 1, dtype)


def _axes_radius(probe: nn.Module, probe_channels: int, grid, plane_axis: int | None, seed: int, max_side: int,
                 inputs: int, dtype: torch.dtype) -> Coord:
    radius, unbounded = [0, 0, 0], []
    for axis in range(3):
        if axis == plane_axis:
            continue
        step = grid.downsampling[axis]
        # Thin, but no thinner than 8: average pooling (the max pooling's stand-in) refuses an input smaller
        # than its window, padding or not.
        thin = Coord(_taken(grid, a, min(8, grid.base[a])) if a != axis else grid.base[axis] for a in range(3))
        side = _taken(grid, axis, max(32, 4 * step))
        while True:
            shape = Coord(side if a == axis else thin[a] for a in range(3))
            if shape.prod() > MAX_FIELD_VOXELS:
                unbounded.append(axis)
                break
            reach = _axis_reach(probe, probe_channels, shape, axis, step, seed, inputs, dtype)
            if reach is not None:
                radius[axis] = reach
                break
            if side >= max_side:
                unbounded.append(axis)
                break
            side = _taken(grid, axis, min(2 * side, max_side))
    if unbounded:
        raise UnboundedField(unbounded, max_side)
    logger.debug("receptive radius of %s: %s", type(probe).__name__, tuple(radius))
    return Coord(radius)


class _AveragePooled(GraphInterpreter):
    """A frozen TorchScript network run node by node, each max pooling an average pooling of the same window:
    the swap :func:`_structural_copy` makes in an ``nn.Module``, which TorchScript code does not let it make."""

    def _special(self, kind: str, args: list):
        average = _MAX_TO_AVG_OP.get(kind)
        if average is None:
            return NotImplemented
        x, kernel, stride, padding, dilation, ceil_mode = args
        if set(dilation) != {1}:
            raise ValueError(f"cannot measure a network with dilated max pooling ({kind}, dilation {dilation})")
        return average(x, kernel, stride, padding, ceil_mode, True)


_MAX_TO_AVG_OP = {"aten::max_pool1d": torch.ops.aten.avg_pool1d, "aten::max_pool2d": torch.ops.aten.avg_pool2d,
                  "aten::max_pool3d": torch.ops.aten.avg_pool3d}


def _graph_probe(probe: nn.Module) -> nn.Module | None:
    """``probe`` with each TorchScript module in it (itself too) run by :class:`_AveragePooled` on its frozen
    graph, or None where it holds none, or one that does not freeze or takes more than one input.  No trace:
    the Python code around the TorchScript stays Python, and each graph keeps its branches and loops."""
    def graph(script: torch.jit.ScriptModule) -> nn.Module:
        frozen = torch.jit.freeze(script.eval())
        if len(list(frozen.graph.inputs())) != 2:
            raise ValueError("its forward takes more than one input")
        return _AveragePooled(frozen)

    if not scripted(probe):
        return None
    try:
        if isinstance(probe, torch.jit.ScriptModule):
            return graph(probe)
        probe = copy.deepcopy(probe)  # the original stays for the measurement as TorchScript
        swaps = [(parent, name, child) for parent in probe.modules() if not isinstance(parent, torch.jit.ScriptModule)
                 for name, child in parent.named_children() if isinstance(child, torch.jit.ScriptModule)]
        for parent, name, child in swaps:
            setattr(parent, name, graph(child))
    except Exception as err:  # noqa: BLE001 - measured as TorchScript, max pooling kept
        logger.debug("receptive field: the network's TorchScript does not run node by node (%s)", err)
        return None
    return probe


def _taken(grid, axis: int, at_least: int) -> int:
    """The smallest size ``grid`` takes along ``axis`` that is at least ``at_least``."""
    low, step = grid.min_shape[axis], grid.downsampling[axis]
    return low + max(0, -(-(at_least - low) // step)) * step


class _Faint(Exception):
    """A nonzero gradient within :data:`FAINT` of underflow: a fainter one may have rounded to 0."""


def _axis_reach(probe: nn.Module, in_channels: int, shape: Coord, axis: int, phases: int, seed: int,
                inputs: int, dtype: torch.dtype) -> int | None:
    """The reach along ``axis`` of ``phases`` neighbouring output voxels; None where it meets the border.

    The ``inputs`` (:func:`_probe_input`) are the items of one batch (a network in eval mode keeps them
    apart): one forward pass, then one backward pass per phase.  The first runs alone: an input too short
    shows at once.
    """
    others = tuple(a for a in range(3) if a != axis)
    reach = 0
    batches = [[0], list(range(1, inputs))] if inputs > 1 else [[0]]
    while batches:
        batch = batches.pop(0)
        x = torch.cat([_probe_input(k, in_channels, shape, axis, seed, dtype) for k in batch]).requires_grad_()
        try:
            y = probe(x)
        except RuntimeError:
            if len(batch) == 1:
                raise
            batches[:0] = [[k] for k in batch]  # a network that takes one item at a time
            continue
        while isinstance(y, (tuple, list)):
            y = y[0]
        out_shape = Coord(y.shape[2:])
        offset = (shape - out_shape) // 2  # output voxel o sits over input voxel o + offset
        first = out_shape[axis] // 2 // phases * phases  # phase 0 of the pooling grid, near the middle
        if first + phases > out_shape[axis]:
            return None
        for phase in range(phases):
            voxel = [out_shape[a] // 2 for a in range(3)]
            voxel[axis] = first + phase
            # Seeded with GRAD_SCALE: every factor on the way back is at most 1 in magnitude (positive weights
            # that halve what passes, pooling, bounded activations), so the faintest dependence stays far
            # from underflow.
            (grad,) = torch.autograd.grad(y[(slice(None), slice(None), *voxel)].sum() * GRAD_SCALE, x,
                                          retain_graph=phase < phases - 1)
            grad = grad.abs()
            if dtype != torch.float64 and bool(((grad > 0) & (grad < FAINT)).any()):
                raise _Faint()
            supports = grad.sum(dim=(1, 2 + others[0], 2 + others[1])) > 0
            centre = voxel[axis] + offset[axis]
            for support in supports:
                hit = torch.nonzero(support).flatten()
                if hit.numel() == 0:
                    if dtype != torch.float64:
                        raise _Faint()  # or a gradient that underflowed on its way
                    raise ValueError("the output does not depend on the input (no gradient reached it)")
                begin, last = int(hit[0]), int(hit[-1])
                if begin == 0 or last == shape[axis] - 1:
                    return None
                reach = max(reach, centre - begin, last - centre)
    return reach


def _probe_input(k: int, in_channels: int, shape: Coord, axis: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``k``-th positive input of a measurement along ``axis``: a ramp rising along it (k = 1) and one
    falling (k = 2), where every max pooling a network keeps passes its gradient to the window's far and near
    end, and uniform noise otherwise (k = 0, 3, ...)."""
    if k in (1, 2):
        ramp = torch.linspace(0.5, 1.5, shape[axis], dtype=dtype)
        ramp = ramp if k == 1 else ramp.flip(0)
        view = [1, 1, 1, 1, 1]
        view[2 + axis] = shape[axis]
        return ramp.view(view).expand(1, in_channels, *shape).contiguous()
    generator = torch.Generator().manual_seed(seed + k)
    return 0.5 + torch.rand((1, in_channels, *shape), generator=generator, dtype=dtype)


def receptive_radius(
    module: nn.Module,
    in_channels: int,
    shape: CoordLike,
    *,
    phases: CoordLike | None = None,
    seed: int = 0,
    max_voxels: int = 1 << 24,
) -> Coord:
    """The per-axis receptive-field radius (z, y, x) of ``module``, measured from an input of ``shape``.

    ``in_channels`` is the number of input channels; ``shape`` a spatial shape
    the network accepts, the first one tried.  Where the gradient reaches the
    input's border the radius could be cut off, so the shape is doubled on
    those axes (for a 'valid' network with ``valid_input_shape``, grown to one
    that fits) and the measurement repeated, up to ``max_voxels`` (default
    16 Mvox; ValueError beyond).  ``phases`` (default: the module's
    ``downsampling`` attribute, else 1) is how many neighbouring output voxels
    to measure along each axis, one per pooling phase.  ``seed`` seeds the
    positive weights and input; the result does not depend on it.  The module
    itself is not changed; a :class:`UNet3d` or :class:`InfernoUNet` is measured
    on a one-feature-map copy, which has the same radius and runs much faster.
    """
    shape = as_coord(shape)
    phases = as_coord(phases if phases is not None else tuple(getattr(module, "downsampling", (1, 1, 1))))
    probe, probe_channels = _structural_copy(module, in_channels, seed)
    while True:
        try:
            radius = _measure(probe, probe_channels, shape, phases, seed)
        except _ReachesBorder as exc:
            bigger = Coord(2 * s if axis in exc.axes else s for axis, s in enumerate(shape))
            if getattr(module, "padding", None) == "valid" and hasattr(module, "valid_input_shape"):
                bigger = Coord(module.valid_input_shape(bigger))
            if bigger.prod() > max_voxels:
                raise ValueError(
                    f"the receptive field reaches the border of a {tuple(shape)} input on axis "
                    f"{', '.join('zyx'[a] for a in exc.axes)} and a {tuple(bigger)} input exceeds max_voxels "
                    f"({max_voxels}); pass a larger max_voxels to measure it"
                ) from None
            logger.debug("receptive field reaches the border of %s; retrying with %s", tuple(shape), tuple(bigger))
            shape = bigger
            continue
        logger.debug("receptive radius of %s: %s", type(module).__name__, tuple(radius))
        return radius


def _measure(probe: nn.Module, in_channels: int, shape: Coord, phases: Coord, seed: int) -> Coord:
    generator = torch.Generator().manual_seed(seed)
    offsets = [Coord(min(p, n - 1) for n in phases) for p in range(max(phases))]
    radius = [0, 0, 0]
    for offset in offsets:
        x = (0.5 + torch.rand((1, in_channels, *shape), generator=generator, dtype=torch.float64)).requires_grad_()
        y = probe(x)
        if isinstance(y, (tuple, list)):
            y = y[0]
        out_shape = Coord(y.shape[2:])
        out_voxel = out_shape // 2 + offset
        if any(v >= s for v, s in zip(out_voxel, out_shape)):
            raise _ReachesBorder([a for a in range(3) if out_voxel[a] >= out_shape[a]])
        # Output voxel o sits over input voxel o + (input - output) // 2 (0 for 'same' padding).
        centre = out_voxel + (shape - out_shape) // 2
        y[(0, 0, *out_voxel)].backward()
        support = x.grad[0].abs().sum(dim=0) > 0
        at_border = []
        for axis in range(3):
            other = tuple(a for a in range(3) if a != axis)
            hit = torch.nonzero(support.any(dim=other[1]).any(dim=other[0])).flatten()
            if hit.numel() == 0:
                raise ValueError("the output does not depend on the input (no gradient reached it)")
            begin, last = int(hit[0]), int(hit[-1])
            if begin == 0 or last == shape[axis] - 1:
                at_border.append(axis)
            radius[axis] = max(radius[axis], centre[axis] - begin, last - centre[axis])
        if at_border:
            raise _ReachesBorder(at_border)
    return Coord(radius)


def _narrow_copy(module: nn.Module, in_channels: int) -> tuple[nn.Module, int] | None:
    """A one-feature-map copy of a built-in U-Net (same layers, same radius), or None."""
    from .inferno import InfernoUNet
    from .unet import UNet3d

    with torch.device("meta"):  # built without touching the global RNG; the weights are set below
        if isinstance(module, UNet3d):
            # Two outputs: a softmax over one channel would be constant and pass no gradient.
            narrow = UNet3d(in_channels=1, out_channels=2, depth=module.depth, initial_features=1, growth=1,
                            pool_factors=list(module.pool_factors), padding=module.padding,
                            activation=module.activation, final_activation=module.final_activation)
        elif isinstance(module, InfernoUNet):
            narrow = InfernoUNet(1, 1, depth=module.depth, initial_features=1, gain=1)
        else:
            return None
    return narrow.to_empty(device="cpu"), 1


@torch.no_grad()
def _structural_copy(module: nn.Module, in_channels: int, seed: int,
                     dtype: torch.dtype = torch.float64) -> tuple[nn.Module, int]:
    """A ``dtype`` copy with average pooling and positive parameters (see the module docstring), and its channels."""
    narrow = _narrow_copy(module, in_channels)
    if narrow is not None:
        probe, in_channels = narrow
    else:
        probe = copy.deepcopy(module)
    probe = probe.to(dtype).eval()
    for parent in probe.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, _BLOCK_NORMS) and not isinstance(parent, torch.jit.ScriptModule) and not (
                    getattr(child, "track_running_stats", False)):
                setattr(parent, name, nn.Identity())  # its statistics: said by block_normalisations
                continue
            avg = _POOL_TO_AVG.get(type(child))
            if avg is not None and not isinstance(parent, torch.jit.ScriptModule):
                dilation = child.dilation if isinstance(child.dilation, tuple) else (child.dilation,)
                if set(dilation) != {1}:
                    raise ValueError(f"cannot measure a network with dilated max pooling ({child})")
                setattr(parent, name, avg(child.kernel_size, child.stride, child.padding, ceil_mode=child.ceil_mode))
    for name, buffer in probe.named_buffers():
        # Batch norm in eval mode is a per-channel affine map; with its running statistics (a mean far above
        # the positive activations, a tiny variance) ELU would saturate and the gradient underflow to 0.
        if name.endswith("running_mean"):
            buffer.zero_()
        elif name.endswith("running_var"):
            buffer.fill_(1.0)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in probe.named_parameters():
        if param.dim() > 1:  # weights: positive, and shrinking what passes by half, so that no final sigmoid
            fan = param[0].numel()  # saturates (its gradient would round to 0) however many residual sums
            param.copy_((0.5 + torch.rand(param.shape, generator=generator, dtype=param.dtype)) / (2 * fan))
        else:  # biases 0, norms' scales 1: neither adds or removes a dependence
            param.fill_(0.0 if name.endswith("bias") else 1.0)
    return probe, in_channels
