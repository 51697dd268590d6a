"""Built-in networks with seeded weights and documented block and halo defaults.

A :class:`Preset` names a :class:`~blockpred.models.unet.UNet3d` architecture,
the seed of its weights, and the ``default_block`` (spatial core shape written
per block, a multiple of the network's downsampling) and ``default_halo``
(context read on each side of the core) blockpred uses when the user gives none.

The receptive-field radii below were measured with
:func:`blockpred.models.receptive.receptive_radius` on a one-feature-map copy of
each network (the radius depends on the layer structure only), maximised over
every pooling phase.  A halo is a multiple of the downsampling so that every
block's pooling grid lines up with the whole volume's; a halo at least the
radius then makes the core of each block equal to whole-volume prediction.

Seeded weights are drawn from a private :class:`torch.Generator` on a network
first built on the ``meta`` device, so building a preset never touches (or is
affected by) the global RNG, and two builds have identical weights.  They are
random: presets are for testing and benchmarking the pipeline, not for
meaningful predictions (load trained weights with ``weights=``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch

from ..geometry import Coord
from .unet import UNet3d

logger = logging.getLogger(__name__)

__all__ = ["Preset", "PRESETS", "build_preset", "get_preset"]


@dataclass(frozen=True, slots=True)
class Preset:
    """A named :class:`UNet3d` architecture with seeded weights and blockwise defaults."""

    name: str
    description: str
    unet_kwargs: Mapping[str, Any]
    default_block: Coord
    default_halo: Coord
    receptive_radius: Coord
    seed: int = 0

    def build(self) -> UNet3d:
        """The network in eval mode, float32 on the CPU, with this preset's seeded weights."""
        with torch.device("meta"):
            module = UNet3d(**self.unet_kwargs)
        _materialise(module)
        module.reset_parameters(generator=torch.Generator().manual_seed(self.seed))
        return module.eval()


def _materialise(module: torch.nn.Module) -> None:
    """Real (uninitialised) CPU tensors for a module built on the meta device, in place.

    What ``module.to_empty(device="cpu")`` does, without its detour through
    ``torch._refs``, which imports sympy: 0.4 s of every command's start-up.
    """
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                sub._parameters[name] = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                                           requires_grad=param.requires_grad)
        for name, buffer in sub._buffers.items():
            if buffer is not None:
                sub._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype)


TINY = Preset(
    name="tiny",
    description="1 -> 2 channels, 4 features, one 2x pooling: fast enough for tests on two CPU cores",
    unet_kwargs=MappingProxyType(dict(
        in_channels=1, out_channels=2, depth=1, initial_features=4, growth=2, pool_factors=2,
        padding="same", activation="elu", final_activation="sigmoid",
    )),
    # 64^3 written, 84^3 read: a CPU forward pass takes a fraction of a second.
    default_block=Coord((64, 64, 64)),
    # Measured radius 9; 10 is the next multiple of the downsampling (2), so
    # blockwise output equals whole-volume output.
    default_halo=Coord((10, 10, 10)),
    receptive_radius=Coord((9, 9, 9)),
)
"""``tiny``: depth 1, 4 and 8 feature maps, 2x pooling, ELU, sigmoid, 'same' padding.

4,730 parameters, 2,200 multiply-accumulates per voxel.  Receptive-field
radius (9, 9, 9); default halo (10, 10, 10) covers it; default block 64^3.
"""

CREMI2018 = Preset(
    name="cremi2018",
    description=(
        "1 -> 3 channels (affinities), 12 features x5 per level, three (1, 3, 3) poolings, ELU, sigmoid: "
        "the CREMI-era network of the published 8.8-12.7 Mvox/s benchmarks"
    ),
    unet_kwargs=MappingProxyType(dict(
        in_channels=1, out_channels=3, depth=3, initial_features=12, growth=5, pool_factors=(1, 3, 3),
        padding="same", activation="elu", final_activation="sigmoid",
    )),
    # (32, 270, 270) = 2.3 Mvox written per block; with the halo a block reads
    # (60, 540, 540) = 17.5 Mvox, whose full-resolution activations (12 and 24
    # maps) peak at about 6 GB in float32.  Larger blocks amortise the halo
    # better (it makes each block read 7.5x what it writes) where memory allows.
    default_block=Coord((32, 270, 270)),
    # Measured radius (14, 132, 132); y/x halos must be multiples of 27 for the
    # pooling grid to line up, and 135 = 5 * 27 covers the radius.
    default_halo=Coord((14, 135, 135)),
    receptive_radius=Coord((14, 132, 132)),
)
"""``cremi2018``: 12, 60, 300, 1500 feature maps on four levels, (1, 3, 3) poolings, ELU, sigmoid, 'same'.

87,753,495 parameters (350 MB in float32; the 1500-map bottom level holds 83%
of them), 295,548 multiply-accumulates (0.59 MFLOP) per voxel.  The layout of
the MALA network (Funke et al., 2018) with 'same' padding.  Receptive-field
radius (14, 132, 132); default halo (14, 135, 135) covers it; default block
(32, 270, 270).
"""

UNET32 = Preset(
    name="unet32",
    description="1 -> 1 channel (boundary map), 32 features x2 per level, four isotropic 2x poolings, ELU, sigmoid",
    unet_kwargs=MappingProxyType(dict(
        in_channels=1, out_channels=1, depth=4, initial_features=32, growth=2, pool_factors=2,
        padding="same", activation="elu", final_activation="sigmoid",
    )),
    # 128^3 written; with the halo a block reads 192^3 = 7.1 Mvox, whose
    # full-resolution activations (32 and 64 maps) peak at about 6 GB in float32.
    default_block=Coord((128, 128, 128)),
    # Measured radius 107.  Covering it (112, the next multiple of 16) would read
    # 352^3 per 128^3 written (20x) and need about 30 GB, so the default halo, 32,
    # is SMALLER than the radius: block seams differ slightly from whole-volume
    # prediction.  Pass a halo of 112 where exactness matters.
    default_halo=Coord((32, 32, 32)),
    receptive_radius=Coord((107, 107, 107)),
)
"""``unet32``: 32, 64, 128, 256, 512 feature maps, four 2x poolings, ELU, sigmoid, 'same'.

One output channel (a boundary or foreground map; ``cremi2018`` covers the
3-channel affinity case).  22,575,329 parameters, 226,784 multiply-accumulates
(0.45 MFLOP) per voxel.  Receptive-field radius (107, 107, 107); the default
halo (32, 32, 32) is smaller (see above); default block 128^3.
"""

#: Every preset by name.
PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in (TINY, CREMI2018, UNET32)})


def get_preset(name: str) -> Preset:
    """The preset called ``name``; KeyError naming the known presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"no preset named {name!r}; known presets: {', '.join(PRESETS)}") from None


def build_preset(name: str) -> UNet3d:
    """Shorthand for ``get_preset(name).build()``."""
    return get_preset(name).build()
