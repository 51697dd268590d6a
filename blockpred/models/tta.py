"""Test-time augmentation: the network's mean over axis flips of its input, each output flipped back.

``--tta flips`` averages the 8 flips of z, y and x (4, of y and x, for a
block one plane deep); ``--tta flips-yx`` the 4 flips of y and x (anisotropic
data, whose z differs in kind).  A 2D network run plane by plane (see
:mod:`.planes`) is flipped within its planes only: 4 passes.  The wrapper sits around the network inside
the run's predictor, so every flipped pass sees the same padded block, and a
block's halo is symmetric: a flipped block is the flipped volume's block at
the mirrored place, and the cropped output stays exactly the whole volume's
(the mean of the flipped whole-volume predictions), as without TTA.  It
costs a pass per flip: 8x (or 4x) the network's time.
"""

from __future__ import annotations

from itertools import combinations

import torch
from torch import nn

#: ``--tta`` choices: no augmentation, flips of z, y and x, flips of y and x.
TTA_MODES = ("off", "flips", "flips-yx")
#: The spatial dimensions each mode flips, in a (batch, channel, z, y, x) tensor.
_AXES = {"flips": (2, 3, 4), "flips-yx": (3, 4)}


class FlipAverage(nn.Module):
    """``net`` averaged over the flips of ``axes`` (each subset of them flipped on the way in and back out)."""

    def __init__(self, net: nn.Module, axes: tuple[int, ...]):
        super().__init__()
        self.net = net
        self.flips = [dims for k in range(len(axes) + 1) for dims in combinations(axes, k)]

    def forward(self, x: torch.Tensor, planes: torch.Tensor | None = None) -> torch.Tensor:
        """``planes`` (a network with per-plane constants, see :attr:`blockpred.pipeline.DeviceSteps.planes`):
        passed on as they are (a 2D network's stacking axis is never flipped)."""
        flips = [dims for dims in self.flips if all(x.shape[d] > 1 for d in dims)]  # flipping one plane: no change
        total = None
        for dims in flips:
            flipped = x.flip(dims) if dims else x
            y = self.net(flipped) if planes is None else self.net(flipped, planes)
            y = (y.flip(dims) if dims else y).float()
            total = y if total is None else total.add_(y)
        return total.div_(len(flips))


def with_tta(module: nn.Module, mode: str) -> nn.Module:
    """``module`` itself for ``off``, else wrapped in :class:`FlipAverage` for ``mode`` (a 2D network's
    planes flipped within the plane)."""
    if mode == "off":
        return module
    return FlipAverage(module, _axes(mode, module))


def _axes(mode: str, module: nn.Module | None) -> tuple[int, ...]:
    stack = getattr(module, "stack_dim", None)  # a 2D network's planes are stacked along it
    return tuple(a for a in _AXES[mode] if a != stack)


def passes(mode: str, depth: int = 2, module: nn.Module | None = None) -> int:
    """Network passes per block under ``mode`` (a block ``depth`` planes deep, of ``module``)."""
    if mode == "off":
        return 1
    axes = _axes(mode, module)
    if depth == 1:
        axes = tuple(a for a in axes if a != 2)
    return 2 ** len(axes)
