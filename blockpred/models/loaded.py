"""What blockpred knows of a loaded network (:class:`LoadedModel`), read from the module's attributes.

Every loader (presets, files, factories, bioimage.io packages) ends here, so
none of them needs another's module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn

from ..geometry import Coord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A network ready to predict, and what blockpred knows about it.

    ``name`` is the preset name, file path, ``package.module:factory``, module
    class name or a bioimage.io package's name; ``kind`` one of ``"preset"``,
    ``"torchscript"``, ``"factory"``, ``"inferno-state-dict"``, ``"state-dict"``,
    ``"pickle"``, ``"module"`` or ``"bioimageio"``.
    ``in_channels`` / ``out_channels`` are None when unknown (the caller finds
    them by a dry run or from the volume); ``downsampling`` is (1, 1, 1) and
    ``padding`` None when unknown.  ``default_block`` / ``default_halo`` are
    set by presets and by modules that carry such attributes.
    ``weights_sha256`` fingerprints the weights: the hash of the weights file's
    bytes, or of the state dict's tensors when there is no file.  A 2D network
    is wrapped to run plane by plane (``plane`` says on which planes); its
    block, halo and downsampling are then (z, y, x) as for any network.
    """

    module: nn.Module
    name: str
    kind: str
    in_channels: int | None
    out_channels: int | None
    downsampling: Coord
    padding: str | None
    default_block: Coord | None
    default_halo: Coord | None
    weights_sha256: str
    #: For a 2D network: the planes it runs on (``yx``, ``zy``, ``zx``; see :mod:`.planes`); None for a 3D one.
    plane: str | None = None
    #: The receptive-field radius the network states (presets; a module's ``receptive_radius`` attribute),
    #: taken with its ``downsampling`` as they are; None: found by :func:`~.field.network_field`.
    receptive_radius: Coord | None = None


def describe(module: nn.Module, *, name: str, kind: str, sha: str,
             default_block: Coord | None = None, default_halo: Coord | None = None,
             receptive_radius: Coord | None = None) -> LoadedModel:
    """The module as a :class:`LoadedModel`: channels, downsampling, padding, defaults from its attributes."""
    def int_attr(attr: str) -> int | None:
        value = getattr(module, attr, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def coord_attr(attr: str) -> Coord | None:
        value = getattr(module, attr, None)
        try:
            coord = Coord(value)
        except (TypeError, ValueError):
            return None
        return coord if len(coord) == 3 else None

    padding = getattr(module, "padding", None)
    loaded = LoadedModel(
        module=module,
        name=name,
        kind=kind,
        in_channels=int_attr("in_channels"),
        out_channels=int_attr("out_channels"),
        downsampling=coord_attr("downsampling") or Coord((1, 1, 1)),
        padding=padding if padding in ("same", "valid") else None,
        default_block=default_block or coord_attr("default_block"),
        default_halo=default_halo or coord_attr("default_halo"),
        weights_sha256=sha,
        receptive_radius=receptive_radius or coord_attr("receptive_radius"),
    )
    logger.info("loaded model %s (%s): %s -> %s channels, downsampling %s", name, kind,
                loaded.in_channels, loaded.out_channels, tuple(loaded.downsampling))
    return loaded
