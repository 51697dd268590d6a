"""What a network sees, found once and cached: its grid and its receptive field (:func:`network_field`).

:func:`~.discover.find_grid` finds the downsampling and the input sizes by
dry runs; :func:`~.receptive.field_radius` the receptive-field radius, thin
axis by thin axis.  Both depend on the network's layers and weights alone,
not on the device or the volume, so the result is cached per network
(name, weights, options, input channels, planes) in ``networks.json`` of the
cache directory: only the first run of a network pays (seconds on a CPU).

A valid network's field is its context (found by the grid's dry run); a field
that reaches the border of every input tried is unbounded (the network sees
the whole input), and a network whose field cannot be measured (an output
that passes no gradient, a layer that refuses float64) keeps the reason.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ..cache import JsonFile, default_cache_dir, digest
from ..geometry import Coord
from .discover import Grid, find_grid
from .receptive import UnboundedField, block_normalisations, field_radius

logger = logging.getLogger(__name__)

__all__ = ["FieldCache", "NetworkField", "network_field", "stated_field"]

#: Bumped when the cached entries change meaning.
CACHE_VERSION = 1


@dataclass(frozen=True)
class NetworkField:
    """A network's grid and receptive-field radius (z, y, x), and what finding them cost."""

    grid: Grid
    #: The radius; None when the field is unbounded or could not be measured (``note`` says which).
    radius: Coord | None
    note: str = ""
    #: Seconds the dry runs and the measurement took (0 when cached).
    seconds: float = 0.0
    cached: bool = False

    @property
    def downsampling(self) -> Coord:
        return self.grid.downsampling

    @property
    def normalises_blocks(self) -> bool:
        """Whether a layer normalises over each block (the halo then covers its convolutions' field only)."""
        return self.radius is not None and self.note.startswith("per block")

    @property
    def exact_halo(self) -> Coord | None:
        """The smallest halo on the grid that covers the field (0 for a valid network: it reads its context)."""
        if self.radius is None:
            return None
        if any(self.grid.context):
            return Coord((0, 0, 0))
        return self.radius.ceil_div(self.grid.downsampling) * self.grid.downsampling

    def describe(self) -> str:
        """``radius 7x41x41`` or why there is none."""
        if self.radius is None:
            return self.note
        radius = f"radius {'x'.join(map(str, self.radius))}"
        return f"{radius} ({self.note})" if self.note else radius


def network_field(module: nn.Module, in_channels: int, key: dict, *, hint: Coord | None = None,
                  trusted: bool = False, plane_axis: int | None = None, first_base: Coord | None = None,
                  cache: "FieldCache | None" = None) -> NetworkField:
    """The grid and field of ``module`` (see the module docstring), cached under ``key`` (the model's
    name, weights and options; channels, planes and a trusted downsampling are added here).  ``hint``,
    ``trusted``, ``plane_axis`` and ``first_base`` as for :func:`~.discover.find_grid`."""
    cache = cache if cache is not None else FieldCache()
    full_key = {"version": CACHE_VERSION, "model": key, "in_channels": in_channels, "plane_axis": plane_axis,
                "downsampling": list(hint) if trusted and hint is not None else None}
    found = cache.get(full_key)
    if found is not None:
        return found
    started = time.perf_counter()
    grid = find_grid(module, in_channels, hint=hint, trusted=trusted, plane_axis=plane_axis,
                     first_base=first_base)
    radius, note = None, ""
    norms = block_normalisations(module)
    if any(grid.context):
        radius = grid.context
    else:
        try:
            radius = field_radius(module, in_channels, grid, plane_axis=plane_axis)
        except UnboundedField as err:
            how = f"({err.reason})" if err.reason else f"(inputs up to {err.side} voxels tried)"
            note = (f"unbounded: the output depends on the whole input along {', '.join('zyx'[a] for a in err.axes)} "
                    f"{how}; no halo makes blocks equal the whole volume")
        except (ValueError, RuntimeError, TypeError) as err:  # a layer that will not run in float64, ...
            text = str(err).strip().splitlines()
            note = f"not measured: {text[0] if text else type(err).__name__}"
    if norms and radius is not None:
        note = (f"per block: its {', '.join(norms)} normalises over each block, so blocks differ from the whole "
                f"volume however large the halo")
    seconds = time.perf_counter() - started
    field = NetworkField(grid, radius, note, seconds)
    logger.info("receptive field: %s, downsampling %s (%.2f s)", field.describe(), tuple(grid.downsampling), seconds)
    cache.put(full_key, field)
    return field


class FieldCache:
    """Networks' grids and fields by key in one JSON file of the cache directory (``networks.json``)."""

    def __init__(self, path: Path | None = None):
        self.path = path if path is not None else default_cache_dir() / "networks.json"
        self._file = JsonFile(self.path)

    def get(self, key: dict) -> NetworkField | None:
        entry = self._file.read().get(digest(key))
        try:
            grid = Grid(Coord(entry["downsampling"]), Coord(entry["min_shape"]), Coord(entry["base"]),
                        Coord(entry["context"]), how=tuple(entry["how"]))
            radius = Coord(entry["radius"]) if entry["radius"] is not None else None
            return NetworkField(grid, radius, str(entry["note"]), 0.0, cached=True)
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: dict, field: NetworkField) -> None:
        grid = field.grid
        self._file.merge({digest(key): {
            "key": key, "downsampling": list(grid.downsampling), "min_shape": list(grid.min_shape),
            "base": list(grid.base), "context": list(grid.context), "how": list(grid.how),
            "radius": None if field.radius is None else list(field.radius), "note": field.note,
            "seconds": round(field.seconds, 3),
        }}, "the network's receptive field")


def stated_field(downsampling: Coord, radius: Coord) -> NetworkField:
    """The field a network states (a preset, a module's ``receptive_radius``): taken as it is, nothing run."""
    grid = Grid(downsampling, downsampling, downsampling, Coord((0, 0, 0)), how=("stated",) * 3)
    return NetworkField(grid, radius, cached=True)
