"""The input shapes a network has run at, and what came out: a dry run at a known shape is not run again.

A run's dry run (:func:`blockpred.tuning.network.probe_network`) tells the
network's output channels and shape at the block's input, and counts its
largest tensor.  None of that depends on the device, the precision or the
data, so each shape a network ran at is kept per network (its name, weights
and arguments) in ``shapes.json``, and a later run at that shape takes it from
there: on a GPU a first pass at a new shape is a kernel choice, seconds to
minutes of a run's start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..cache import JsonFile, default_cache_dir, digest
from ..geometry import Coord

CACHE_VERSION = 1


@dataclass(frozen=True)
class KnownShape:
    """A dry run's outcome at one input shape."""

    out_channels: int
    output_shape: Coord
    #: The largest tensor per input voxel, where the dry run counted it.
    largest_per_voxel: float | None = None


class KnownShapes:
    """The shapes one network (``model_key``, with ``in_channels``) ran at, in one JSON file of the cache directory.

    What :meth:`put` adds is kept here until :meth:`save`, which the run calls once it has passed every check:
    a refused run writes nothing."""

    def __init__(self, model_key: dict, in_channels: int, path: Path | None = None):
        self._key = {"version": CACHE_VERSION, "model": model_key, "in_channels": in_channels}
        self._file = JsonFile(path if path is not None else default_cache_dir() / "shapes.json")
        self._new: dict[str, dict] = {}

    def get(self, input_shape: Coord) -> KnownShape | None:
        name = digest({**self._key, "input_shape": list(input_shape)})
        entry = self._new.get(name) or self._file.read().get(name)
        try:
            largest = entry["largest_per_voxel"]
            return KnownShape(int(entry["out_channels"]), Coord(entry["output_shape"]),
                              None if largest is None else float(largest))
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, input_shape: Coord, known: KnownShape) -> None:
        key = {**self._key, "input_shape": list(input_shape)}
        self._new[digest(key)] = {"key": key, "out_channels": known.out_channels,
                                  "output_shape": list(known.output_shape),
                                  "largest_per_voxel": known.largest_per_voxel}

    def save(self) -> None:
        """Write what :meth:`put` added."""
        if self._new:
            self._file.merge(self._new, "the network's output at a shape")
            self._new = {}
