"""The built-in 3D U-Net, :class:`UNet3d`.

Layout, for ``depth`` poolings (level ``l`` has ``initial_features * growth**l``
feature maps)::

    input -> [conv conv] ------------------------------ cat -> [conv conv] -> 1x1x1 conv -> final activation
                 | pool (pool_factors[0])                ^ transposed conv (kernel = stride = pool_factors[0])
                 v                                       |
             [conv conv] -------------------- cat -> [conv conv]
                 | pool (pool_factors[1])      ^
                 v                             |
                ...         [conv conv]       ...          (the bottom level, ``depth``)

Every convolution is 3x3x3 followed by the activation.  Skip connections are
concatenated in the order ``[skip, upsampled]``.  With ``padding="same"`` the
convolutions are zero-padded, the output has the input's spatial shape, and
that shape must be a multiple of :attr:`UNet3d.downsampling`.  With
``padding="valid"`` every convolution shrinks its input by 2 per axis, skip
connections are cropped centrally, and only the shapes listed by
:meth:`UNet3d.valid_input_shape` fit; the output is centred on the input.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import torch
from torch import nn

from ..geometry import Coord, CoordLike, as_coord

logger = logging.getLogger(__name__)

__all__ = ["UNet3d"]

_PADDINGS = ("same", "valid")
_ACTIVATIONS = {"elu": nn.ELU, "relu": nn.ReLU}
_FINAL_ACTIVATIONS = ("sigmoid", "softmax", "none")
#: How much one "valid" 3x3x3 convolution shrinks each axis.
_CONV_SHRINK = 2


def _conv_block(in_channels: int, out_channels: int, padding: str, activation: str) -> nn.Sequential:
    """Two 3x3x3 convolutions, each followed by the activation."""
    pad = 1 if padding == "same" else 0
    act = _ACTIVATIONS[activation]
    return nn.Sequential(
        nn.Conv3d(in_channels, out_channels, kernel_size=3, padding=pad),
        act(),
        nn.Conv3d(out_channels, out_channels, kernel_size=3, padding=pad),
        act(),
    )


def _normalise_pool_factors(pool_factors, depth: int) -> list[Coord]:
    """``pool_factors`` as one (z, y, x) :class:`Coord` per level.

    Accepts an int (the same isotropic factor on every level), a flat (z, y, x)
    triple of ints (the same on every level), or a list with one entry per level,
    each an int or a (z, y, x) triple.  A flat list of three ints is always one
    triple, never three isotropic levels, so ``(1, 3, 3)`` is unambiguous.
    """
    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if is_int(pool_factors):
        factors = [as_coord(pool_factors)] * depth
    else:
        items = list(pool_factors)
        if len(items) == 3 and all(is_int(v) for v in items):
            factors = [Coord(items)] * depth
        elif len(items) == depth and not all(is_int(v) for v in items):
            factors = [as_coord(v) for v in items]
        else:
            raise ValueError(
                f"pool_factors must be an int, one (z, y, x) triple, or a list of {depth} entries (one per level, "
                f"each an int or a triple), got {pool_factors!r}"
            )
    for f in factors:
        if len(f) != 3 or any(v < 1 for v in f):
            raise ValueError(f"every pool factor must be 3 positive ints (z, y, x), got {tuple(f)} in {pool_factors!r}")
    return factors


class UNet3d(nn.Module):
    """A 3D U-Net with configurable depth, widths, anisotropic pooling and padding.

    All arguments are keyword-only:

    * ``in_channels``, ``out_channels``: channels of the input and the output.
    * ``depth`` (default 3): the number of poolings; ``depth + 1`` resolution levels.
    * ``initial_features`` (default 32): feature maps on the first level.
    * ``growth`` (default 2): factor between the feature maps of consecutive levels.
    * ``pool_factors`` (default 2): the max-pooling factor of each level, as an
      int (isotropic, every level), a (z, y, x) triple (every level) or a list
      with one int or triple per level (three plain ints are always one triple).  EM volumes are often anisotropic:
      ``[(1, 2, 2), (1, 2, 2), (2, 2, 2)]`` pools only in-plane at first.
    * ``padding`` (default ``"same"``): ``"same"`` keeps the shape (input must be a
      multiple of :attr:`downsampling`); ``"valid"`` shrinks it (see
      :meth:`valid_input_shape`).
    * ``activation`` (default ``"elu"``): ``"elu"`` or ``"relu"`` after every 3x3x3 convolution.
    * ``final_activation`` (default ``"sigmoid"``): ``"sigmoid"``, ``"softmax"``
      (over channels) or ``"none"`` after the final 1x1x1 convolution.
      Sigmoid suits boundary maps and affinities, the usual outputs in EM.

    Attributes: ``in_channels``, ``out_channels``, ``depth``, ``padding``,
    ``pool_factors`` (tuple of :class:`Coord`) and ``downsampling`` (the product
    of the pool factors per axis).
    """

    def __init__(
        self,
        *,
        in_channels: int,
        out_channels: int,
        depth: int = 3,
        initial_features: int = 32,
        growth: int = 2,
        pool_factors: int | CoordLike | Sequence[CoordLike] = 2,
        padding: str = "same",
        activation: str = "elu",
        final_activation: str = "sigmoid",
    ):
        super().__init__()
        for name, value, low in (
            ("in_channels", in_channels, 1),
            ("out_channels", out_channels, 1),
            ("depth", depth, 0),
            ("initial_features", initial_features, 1),
            ("growth", growth, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if padding not in _PADDINGS:
            raise ValueError(f"padding must be one of {_PADDINGS}, got {padding!r}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {tuple(_ACTIVATIONS)}, got {activation!r}")
        if final_activation not in _FINAL_ACTIVATIONS:
            raise ValueError(f"final_activation must be one of {_FINAL_ACTIVATIONS}, got {final_activation!r}")

        factors = _normalise_pool_factors(pool_factors, depth)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.depth = depth
        self.initial_features = initial_features
        self.growth = growth
        self.padding = padding
        self.activation = activation
        self.final_activation = final_activation
        self.pool_factors = tuple(factors)
        downsampling = Coord((1, 1, 1))
        for f in factors:
            downsampling = downsampling * f
        self.downsampling = downsampling
        # Plain ints for the TorchScript-compatible shape check in forward().
        self._downsampling_zyx = [int(v) for v in downsampling]
        self._pool_zyx = [[int(v) for v in f] for f in factors]
        self._same = padding == "same"

        features = [initial_features * growth**level for level in range(depth + 1)]
        self.encoders = nn.ModuleList(
            _conv_block(in_channels if level == 0 else features[level - 1], features[level], padding, activation)
            for level in range(depth)
        )
        self.pools = nn.ModuleList(nn.MaxPool3d(kernel_size=tuple(f), stride=tuple(f)) for f in factors)
        self.bottom = _conv_block(in_channels if depth == 0 else features[depth - 1], features[depth], padding, activation)
        # Decoder modules are listed from the deepest level up, in the order forward() runs them.
        self.upsamplers = nn.ModuleList(
            nn.ConvTranspose3d(features[level + 1], features[level], kernel_size=tuple(factors[level]),
                               stride=tuple(factors[level]))
            for level in reversed(range(depth))
        )
        self.decoders = nn.ModuleList(
            _conv_block(2 * features[level], features[level], padding, activation) for level in reversed(range(depth))
        )
        self.output = nn.Conv3d(features[0], out_channels, kernel_size=1)
        if final_activation == "sigmoid":
            self.final = nn.Sigmoid()
        elif final_activation == "softmax":
            self.final = nn.Softmax(dim=1)
        else:
            self.final = nn.Identity()

    # ------------------------------------------------------------------ shapes

    def output_shape(self, input_shape: CoordLike) -> Coord:
        """The spatial output shape for ``input_shape``; ValueError if it does not fit.

        "same": the input shape, which must be a multiple of :attr:`downsampling`.
        "valid": every level's shape must stay positive and divisible by its pool factor.
        """
        shape = as_coord(input_shape)
        if self.padding == "same":
            if not shape.is_multiple_of(self.downsampling) or any(v < 1 for v in shape):
                raise ValueError(
                    f"input shape {tuple(shape)} must be a multiple of the network's downsampling "
                    f"{tuple(self.downsampling)} ('same' padding); pad or choose a block that is a multiple"
                )
            return shape
        return Coord(self._valid_output_1d(s, axis) for axis, s in enumerate(shape))

    def _valid_output_1d(self, size: int, axis: int) -> int:
        if not self._fits_valid(size, axis):
            raise ValueError(self._valid_error(size, axis))
        for factor in self.pool_factors:
            size = (size - 2 * _CONV_SHRINK) // factor[axis]
        size -= 2 * _CONV_SHRINK
        for factor in reversed(self.pool_factors):
            size = size * factor[axis] - 2 * _CONV_SHRINK
        return size

    def _valid_error(self, size: int, axis: int) -> str:
        return (
            f"input size {size} on axis {'zyx'[axis]} does not fit this 'valid' U-Net "
            f"(pool factors {[tuple(f) for f in self.pool_factors]}); use valid_input_shape() to get one that does"
        )

    def valid_input_shape(self, min_output_shape: CoordLike) -> Coord:
        """The smallest input shape whose output is at least ``min_output_shape``.

        For "same" padding this is ``min_output_shape`` rounded up to a multiple of
        :attr:`downsampling`.
        """
        target = as_coord(min_output_shape)
        if self.padding == "same":
            return target.maximum(1).ceil_div(self.downsampling) * self.downsampling
        shape = []
        for axis, want in enumerate(target):
            bottom = 1  # the bottom level's output size; the output grows with it
            while self._output_from_bottom(bottom, axis) < want:
                bottom += 1
            size = bottom + 2 * _CONV_SHRINK
            for f in reversed(self.pool_factors):
                size = size * f[axis] + 2 * _CONV_SHRINK
            shape.append(size)
        return Coord(shape)

    def _output_from_bottom(self, bottom: int, axis: int) -> int:
        size = bottom
        for f in reversed(self.pool_factors):
            size = size * f[axis] - 2 * _CONV_SHRINK
            if size < 1:
                return 0
        return size

    def macs_per_voxel(self) -> float:
        """Multiply-accumulates per output voxel ("same" padding, ignoring borders).

        A convolution on level ``l`` runs on ``1 / prod(pool factors above l)`` of
        the voxels; multiply by 2 for FLOPs.
        """
        total = 0.0
        scale = 1
        levels = [*self.encoders, self.bottom]
        pools = [*self.pool_factors, Coord((1, 1, 1))]
        for level, (block, factor) in enumerate(zip(levels, pools)):
            total += sum(m.weight[0].numel() * m.out_channels for m in block if isinstance(m, nn.Conv3d)) / scale
            if level < self.depth:
                scale *= factor.prod()
        for up, dec, factor in zip(self.upsamplers, self.decoders, reversed(self.pool_factors)):
            scale //= factor.prod()
            # A transposed conv with kernel = stride touches every output voxel once.
            total += up.in_channels * up.out_channels / scale
            total += sum(m.weight[0].numel() * m.out_channels for m in dec if isinstance(m, nn.Conv3d)) / scale
        total += self.output.in_channels * self.output.out_channels
        return total

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """(Re-)initialise every weight as PyTorch does by default, drawing from ``generator``.

        PyTorch's default for convolutions is Kaiming-uniform with ``a = sqrt(5)``
        for weights and uniform in ``+-1/sqrt(fan_in)`` for biases.  A private
        generator makes seeded weights without touching the global RNG.
        """
        for module in self.modules():
            if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)):
                nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=generator)
                fan_in, _ = nn.init._calculate_fan_in_and_fan_out(module.weight)
                bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
                nn.init.uniform_(module.bias, -bound, bound, generator=generator)

    # ------------------------------------------------------------------ forward

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 5:
            raise ValueError("UNet3d expects a (batch, channel, z, y, x) tensor, got " + str(x.dim()) + " dimensions")
        if x.shape[1] != self.in_channels:
            raise ValueError("UNet3d expects " + str(self.in_channels) + " input channels, got " + str(x.shape[1]))
        for axis in range(3):
            if self._same:
                if x.shape[2 + axis] % self._downsampling_zyx[axis] != 0:
                    raise ValueError(
                        "input shape " + str(list(x.shape[2:])) + " must be a multiple of the network's downsampling "
                        + str(self._downsampling_zyx) + " ('same' padding); pad or choose a block that is a multiple"
                    )
            elif not self._fits_valid(x.shape[2 + axis], axis):
                raise ValueError(
                    "input shape " + str(list(x.shape[2:])) + " does not fit this 'valid' U-Net on axis "
                    + "zyx"[axis] + "; use valid_input_shape() to get one that does"
                )

    def _fits_valid(self, size: int, axis: int) -> bool:
        """Whether ``size`` passes every 'valid' level (see :meth:`output_shape`)."""
        shrink = 4  # two 'valid' 3x3x3 convolutions per level (a local: TorchScript compiles this)
        for factor in self._pool_zyx:
            size -= shrink
            if size < 1 or size % factor[axis] != 0:
                return False
            size = size // factor[axis]
        size -= shrink
        if size < 1:
            return False
        for i in range(len(self._pool_zyx)):
            size = size * self._pool_zyx[len(self._pool_zyx) - 1 - i][axis] - shrink
            if size < 1:
                return False
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        skips: list[torch.Tensor] = []
        for encoder, pool in zip(self.encoders, self.pools):
            x = encoder(x)
            skips.append(x)
            x = pool(x)
        x = self.bottom(x)
        level = len(skips)
        for upsampler, decoder in zip(self.upsamplers, self.decoders):
            level -= 1
            x = upsampler(x)
            skip = skips[level]
            if not self._same:
                skip = _crop_to(skip, x)
            x = decoder(torch.cat([skip, x], dim=1))
        return self.final(self.output(x))


def _crop_to(skip: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``skip`` cropped centrally to the spatial shape of ``like``."""
    dz = (skip.shape[2] - like.shape[2]) // 2
    dy = (skip.shape[3] - like.shape[3]) // 2
    dx = (skip.shape[4] - like.shape[4]) // 2
    return skip[:, :, dz : dz + like.shape[2], dy : dy + like.shape[3], dx : dx + like.shape[4]]
