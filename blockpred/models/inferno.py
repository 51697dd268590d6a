"""A U-Net that loads weights trained with inferno's ``UNet``, strictly.

``inferno.extensions.models.UNet`` (inferno-pytorch) is the U-Net many EM
segmentation projects trained around 2018-2020.  :class:`InfernoUNet` is an
independent implementation whose ``state_dict()`` has the same key names, order
and tensor shapes, so inferno-trained weights load with ``strict=True``, and
whose forward pass computes the same function.  blockpred does not depend on
inferno (its last release does not install).

The architecture, for ``depth`` poolings, ``f = initial_features`` and ``g = gain``:

* ``_initial_conv``: 3x3x3 conv ``in_channels -> f`` + ELU at full resolution;
* ``_conv_down_ops[0]``: one 3x3x3 conv + ELU, ``f -> f*g`` (the initial conv
  already counts as the level's first convolution);
  ``_conv_down_ops[i]``, ``i >= 1``: two, ``f*g**i -> f*g**(i+1)``;
  each followed by 2x max pooling (``_downsample_ops``);
* ``_conv_bottom_op``: two convs at ``f*g**depth``;
* ``_upsample_ops``: trilinear 2x interpolation (``align_corners=False``), no weights;
* ``_conv_up_ops[i]``: two convs on ``cat([skip, upsampled])``, down to
  ``f*g**(depth-1-i)`` feature maps, and to ``f`` for the last one;
* ``_output``: 1x1x1 conv ``f -> out_channels``, followed by ``final_activation``
  if one is given (then the conv is ``_output.0``, else ``_output`` itself).

Every 3x3x3 convolution is zero-padded ("same"), so the output has the input's
shape, which must be divisible by ``2**depth`` on every axis.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F

from ..geometry import Coord

logger = logging.getLogger(__name__)

__all__ = ["InfernoUNet", "resolve_activation"]


def resolve_activation(final_activation) -> nn.Module | None:
    """``final_activation`` as a module: a ``torch.nn`` class name, a module, or None.

    Names are matched case-insensitively among ``torch.nn``'s activation modules
    (``"Sigmoid"``, ``"softmax"``, ``"Tanh"``...); ``"none"`` means None.  Softmax
    runs over the channel axis (inferno's ``nn.Softmax()`` picks it implicitly).
    """
    if final_activation is None or isinstance(final_activation, nn.Module):
        return final_activation
    if not isinstance(final_activation, str):
        raise ValueError(f"final_activation must be a torch.nn activation name, a module or None, got {final_activation!r}")
    if final_activation.lower() == "none":
        return None
    names = {name.lower(): name for name in nn.modules.activation.__all__}
    name = names.get(final_activation.lower())
    if name is None:
        raise ValueError(
            f"final_activation must name a torch.nn activation (e.g. 'Sigmoid', 'Softmax'), got {final_activation!r}"
        )
    try:
        if name in ("Softmax", "LogSoftmax", "Softmin"):
            return getattr(nn, name)(dim=1)
        return getattr(nn, name)()
    except TypeError as exc:
        raise ValueError(f"final_activation {final_activation!r} needs arguments; pass a module instead ({exc})") from exc


class _ConvELU(nn.Module):
    """A zero-padded convolution, optionally followed by ELU; its weights are ``conv.*``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, elu: bool = True):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size, padding=(kernel_size - 1) // 2)
        self.activation = nn.ELU() if elu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if self.activation is not None:
            x = self.activation(x)
        return x


class _Upsample2x(nn.Module):
    """Trilinear 2x interpolation (no weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=2.0, mode="trilinear", align_corners=False)


def _two_convs(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(_ConvELU(in_channels, out_channels, 3), _ConvELU(out_channels, out_channels, 3))


class InfernoUNet(nn.Module):
    """inferno's 3D ``UNet``, with its parameter names and defaults.

    * ``in_channels``, ``out_channels``: channels of the input and output.
    * ``dim`` (default 3): only 3 is supported (inferno requires it; blockpred runs 3D).
    * ``depth`` (default 4, inferno's): the number of 2x poolings.
    * ``initial_features`` (default 64, inferno's): feature maps of the initial conv.
    * ``gain`` (default 2, inferno's): factor between the feature maps of levels.
    * ``final_activation`` (default None, inferno's): a ``torch.nn`` activation
      name such as ``"Sigmoid"`` (see :func:`resolve_activation`), a module, or None.
    * ``p_dropout`` (default None): accepted for compatibility and ignored;
      inferno never applies dropout in this network's forward pass.

    Weights are initialised as PyTorch does by default (inferno used orthogonal
    initialisation; this only matters for training).  Attributes:
    ``in_channels``, ``out_channels``, ``depth``, ``initial_features``, ``gain``,
    ``downsampling`` (``2**depth`` per axis) and ``padding`` (``"same"``).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        dim: int = 3,
        depth: int = 4,
        initial_features: int = 64,
        gain: int = 2,
        final_activation=None,
        p_dropout=None,
    ):
        super().__init__()
        if dim != 3:
            raise ValueError(f"InfernoUNet supports dim=3 only (blockpred predicts 3D volumes), got dim={dim!r}")
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels), ("depth", depth),
                            ("initial_features", initial_features), ("gain", gain)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        activation = resolve_activation(final_activation)

        self.in_channels = in_channels
        self.out_channels = out_channels
        self.dim = dim
        self.depth = depth
        self.initial_features = initial_features
        self.gain = gain
        self.p_dropout = p_dropout
        self.padding = "same"
        self.downsampling = Coord((2**depth,) * 3)
        self._factor = 2**depth

        def features(level: int) -> int:
            return initial_features * gain**level

        # Registration order fixes the state_dict order; it follows inferno's.
        self._conv_down_ops = nn.ModuleList(
            _ConvELU(initial_features, features(1), 3) if i == 0 else _two_convs(features(i), features(i + 1))
            for i in range(depth)
        )
        self._downsample_ops = nn.ModuleList(nn.MaxPool3d(kernel_size=2, stride=2) for _ in range(depth))
        self._upsample_ops = nn.ModuleList(_Upsample2x() for _ in range(depth))
        self._conv_bottom_op = _two_convs(features(depth), features(depth))
        self._conv_up_ops = nn.ModuleList(
            _two_convs(2 * features(depth - i), initial_features if i == depth - 1 else features(depth - i - 1))
            for i in range(depth)
        )
        self._initial_conv = _ConvELU(in_channels, initial_features, 3)
        output_conv = _ConvELU(initial_features, out_channels, 1, elu=False)
        self._output = output_conv if activation is None else nn.Sequential(output_conv, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 5 or x.shape[1] != self.in_channels:
            raise ValueError(
                "InfernoUNet expects a (batch, " + str(self.in_channels) + ", z, y, x) tensor, got shape "
                + str(list(x.shape))
            )
        for axis in range(2, 5):
            if x.shape[axis] % self._factor != 0:
                raise ValueError(
                    "input shape " + str(list(x.shape[2:])) + " must be divisible by " + str(self._factor)
                    + " (2**depth) on every axis"
                )
        x = self._initial_conv(x)
        skips: list[torch.Tensor] = []
        for conv, pool in zip(self._conv_down_ops, self._downsample_ops):
            x = conv(x)
            skips.append(x)
            x = pool(x)
        x = self._conv_bottom_op(x)
        level = len(skips)
        for upsample, conv in zip(self._upsample_ops, self._conv_up_ops):
            level -= 1
            x = conv(torch.cat([skips[level], upsample(x)], dim=1))
        return self._output(x)
