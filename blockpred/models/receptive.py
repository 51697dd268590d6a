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
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from ..geometry import Coord, CoordLike, as_coord

logger = logging.getLogger(__name__)

__all__ = ["receptive_radius"]

_POOL_TO_AVG = {nn.MaxPool1d: nn.AvgPool1d, nn.MaxPool2d: nn.AvgPool2d, nn.MaxPool3d: nn.AvgPool3d}


class _ReachesBorder(Exception):
    def __init__(self, axes: list[int]):
        super().__init__(axes)
        self.axes = axes


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
def _structural_copy(module: nn.Module, in_channels: int, seed: int) -> tuple[nn.Module, int]:
    """A float64 copy with average pooling and positive parameters (see the module docstring), and its channels."""
    narrow = _narrow_copy(module, in_channels)
    if narrow is not None:
        probe, in_channels = narrow
    else:
        probe = copy.deepcopy(module)
    probe = probe.to(torch.float64).eval()
    for parent in probe.modules():
        for name, child in list(parent.named_children()):
            avg = _POOL_TO_AVG.get(type(child))
            if avg is not None:
                dilation = child.dilation if isinstance(child.dilation, tuple) else (child.dilation,)
                if set(dilation) != {1}:
                    raise ValueError(f"cannot measure a network with dilated max pooling ({child})")
                setattr(parent, name, avg(child.kernel_size, child.stride, child.padding, ceil_mode=child.ceil_mode))
    generator = torch.Generator().manual_seed(seed + 1)
    for param in probe.parameters():
        fan = param[0].numel() if param.dim() > 1 else 1
        param.copy_((0.5 + torch.rand(param.shape, generator=generator, dtype=param.dtype)) / fan)
    return probe, in_channels
