"""2D networks over 3D volumes, plane by plane: :class:`PlaneNetwork` and :func:`as_planes`.

A 2D network takes (b, c, rows, cols).  blockpred runs it over a volume as
over any network, on (b, c, z, y, x) blocks: the wrapper folds the axis the
planes are stacked along into the batch, runs every plane of every block in
one call, and unfolds the output::

    (b, c, z, y, x) --fold--> (b * z, c, y, x) --network--> (b * z, c', y', x') --unfold--> (b, c', z, y', x')

So a block ``d`` planes deep is a batch of ``d`` planes, its halo along the
stacking axis is 0 (a plane sees no neighbour), and everything else (halo
crop, blocking, resume, workers) is the 3D path unchanged.  ``plane`` names
the two axes of a plane: ``yx`` (the default: planes stacked along z), ``zy``
(stacked along x) or ``zx`` (stacked along y); rows and columns are the two
in volume order.

Which networks are 2D: a bioimage.io package whose space axes are y and x,
or a module with 2D layers (``Conv2d``, ``ConvTranspose2d``; TorchScript's
``original_name`` alike) and no 3D ones.  ``--plane`` makes any network 2D.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..errors import InvalidOptionError, ModelLoadError
from ..geometry import Coord

#: ``--plane`` choices: the two axes a plane spans, rows first.
PLANES = ("yx", "zy", "zx")
#: The spatial axis (0 z, 1 y, 2 x) the planes of each orientation are stacked along.
_STACK = {"yx": 0, "zy": 2, "zx": 1}
#: Start block of a 2D network that names none: planes deep, rows, cols.  One plane of 512^2: its halo
#: is paid in two axes only, so a wide plane wastes little (a halo of 16: 1.13x the voxels at 512^2, 1.27x
#: at 256^2); the batch is then the planes per network call, and the measured defaults and --batch-size
#: auto size it (a 2D U-Net on 2 CPU cores: 3.5 planes/s one plane a pass, 2.0 four planes a pass).
DEFAULT_BLOCK_2D = (1, 512, 512)

_LAYERS_2D = ("Conv2d", "ConvTranspose2d", "MaxPool2d", "AvgPool2d", "BatchNorm2d", "InstanceNorm2d")
_LAYERS_3D = ("Conv3d", "ConvTranspose3d", "MaxPool3d", "AvgPool3d", "BatchNorm3d", "InstanceNorm3d")


def stack_axis(plane: str) -> int:
    """The spatial axis (0 z, 1 y, 2 x) planes of ``plane`` are stacked along."""
    return _STACK[plane]


def lift(in_plane, plane: str, across: int) -> Coord:
    """A (rows, cols) pair as (z, y, x): ``across`` on the stacking axis."""
    rows, cols = (int(v) for v in in_plane)
    values = [rows, cols]
    values.insert(_STACK[plane], int(across))
    return Coord(values)


def in_plane(coord, plane: str) -> tuple[int, int]:
    """The (rows, cols) of a (z, y, x) coordinate."""
    return tuple(int(v) for axis, v in enumerate(coord) if axis != _STACK[plane])  # type: ignore[return-value]


def _order(plane: str) -> tuple[int, ...]:
    """The permutation of (b, c, z, y, x) that puts the stacking axis after the batch, the channels third."""
    stack = 2 + _STACK[plane]
    return (0, stack, 1) + tuple(a for a in (2, 3, 4) if a != stack)


def per_plane(network, x: torch.Tensor, plane: str) -> torch.Tensor:
    """``network`` (b, c, rows, cols) applied to every plane of ``x`` (b, c, z, y, x), in one call."""
    order = _order(plane)
    folded = x.permute(*order)
    b, s = folded.shape[:2]
    y = network(folded.reshape((b * s,) + tuple(folded.shape[2:])))
    if isinstance(y, (tuple, list)):
        y = y[0]
    if y.dim() != 4 or y.shape[0] != b * s:
        raise ModelLoadError(f"the 2D network returned shape {tuple(y.shape)} for {b * s} planes "
                             f"(input {tuple(folded.shape[1:])} each); blockpred needs (planes, channels, rows, cols)")
    y = y.reshape((b, s) + tuple(y.shape[1:]))
    return y.permute(*[order.index(a) for a in range(5)])


class PlaneNetwork(nn.Module):
    """A 2D network behind blockpred's (b, c, z, y, x) interface, plane by plane (see the module docstring)."""

    def __init__(self, network: nn.Module, plane: str = "yx"):
        super().__init__()
        self.network = network
        self.plane = plane
        #: The tensor dimension (2 z, 3 y, 4 x) the planes are stacked along: test-time flips leave it alone.
        self.stack_dim = 2 + _STACK[plane]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return per_plane(self.network, x, self.plane)


def spatial_dims(module: nn.Module) -> int | None:
    """2 or 3 when the module's layers say so (2D layers and no 3D ones: 2), None when they say nothing."""
    names = {getattr(m, "original_name", None) or type(m).__name__ for m in module.modules()}
    if names & set(_LAYERS_3D):
        return 3
    if names & set(_LAYERS_2D):
        return 2
    return None


def check_plane(plane: str | None) -> None:
    if plane is not None and plane not in PLANES:
        raise InvalidOptionError(f"--plane must be one of {', '.join(PLANES)}, got {plane!r}")


def as_planes(loaded, plane: str | None):
    """``loaded`` (a :class:`~.loaded.LoadedModel`) as a network over volumes: a 2D one wrapped plane by
    plane (``plane`` or ``yx``), a 3D one as it is (``plane`` refused: it names the planes of a 2D network)."""
    check_plane(plane)
    dims = spatial_dims(loaded.module)
    if dims == 3 and plane is not None:
        raise InvalidOptionError(f"--plane {plane} runs 2D networks plane by plane, but {loaded.name!r} has 3D "
                                 f"layers; drop --plane")
    if dims != 2 and plane is None:
        return loaded
    plane = plane or "yx"

    def lifted(attr: str, across: int) -> Coord | None:
        value = getattr(loaded.module, attr, None)
        try:
            pair = tuple(int(v) for v in value)
        except (TypeError, ValueError):
            return None
        return lift(pair, plane, across) if len(pair) == 2 else None

    module = PlaneNetwork(loaded.module, plane)
    return replace(
        loaded, module=module, plane=plane,
        downsampling=lifted("downsampling", 1) or Coord((1, 1, 1)),
        default_block=lifted("default_block", DEFAULT_BLOCK_2D[0]) or lift(DEFAULT_BLOCK_2D[1:], plane,
                                                                             DEFAULT_BLOCK_2D[0]),
        default_halo=lifted("default_halo", 0),
        receptive_radius=lifted("receptive_radius", 0),
    )


def check_halo(halo: Coord, plane: str, name: str) -> None:
    """A 2D network's halo is 0 across planes: a plane sees no neighbour."""
    axis = _STACK[plane]
    if halo[axis]:
        shown = ",".join(str(v if a != axis else 0) for a, v in enumerate(halo))
        raise InvalidOptionError(
            f"halo {','.join(map(str, halo))} has {halo[axis]} along {'zyx'[axis]}, but {name!r} is a 2D network run "
            f"on {plane} planes stacked along {'zyx'[axis]}, where it sees no neighbour; give --halo {shown}"
        )
