"""Per-plane statistics of a 2D bioimage.io package: computed once per run, stored with it, applied per plane.

A 2D package's step whose axes are y and x (or y, x and channel) without
the batch axis takes per-*sample* statistics, and a 2D network's samples are
the planes of the volume (see :mod:`.planes`).  So each plane gets its own
constants:

* **Which planes**: every plane the run's ROI spans along the stacking axis
  (all of them without an ROI), each plane *whole* (the volume's full plane,
  not the ROI's part of it, and never the mask): a plane normalises alike
  whatever the ROI, so a run over an ROI writes what the whole run writes
  there.  A block that reads a plane outside those (the reflected planes of
  a block deeper than the planes left, or planes before or past the ROI that
  fill a block's depth) takes the nearest plane's constants: those planes'
  predictions are never written.
* **Computed** once per run, before it, and **stored with the run** for a
  resume: :mod:`blockpred.run.package_stats`.  The table travels to the
  workers with the model (in ``model_kwargs``, as a :class:`PlaneStatistics`)
  and the run's fingerprint holds its sha256 (:meth:`PlaneStatistics.__str__`
  is its fingerprint form).
* **Applied** per plane by :class:`~.bioimageio_ops.PlaneNormalize` and
  :class:`~.bioimageio_ops.PlaneClip`: the worker names the volume plane of
  each input plane of each block (:attr:`blockpred.pipeline.DeviceSteps.planes`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

logger = logging.getLogger(__name__)

#: Where the client hands the volume's statistics to the workers, in ``model_kwargs``.
STATISTICS_KEY = "bioimageio_statistics"
#: Where a package's per-plane table sits in the statistics (``model_kwargs[STATISTICS_KEY]``).
PLANES_KEY = "planes"


class Processing(NamedTuple):
    """A package's steps (what :func:`.bioimageio_stats.compute_statistics` needs of it), small to ship."""

    pre: tuple
    post: tuple


@dataclass(frozen=True, eq=False)
class PlaneStatistics:
    """The per-plane steps' statistics of planes ``first`` ... ``first + num_planes - 1`` along ``axis``.

    ``values``: step key (``pre.I`` / ``post.I``) -> statistic (``mean``, ``std``, ``lo``, ``hi``) ->
    float64 array (planes, columns): one column per channel, or one for all channels.
    """

    axis: int
    first: int
    values: Mapping[str, Mapping[str, np.ndarray]] = field(repr=False)
    sha256: str

    @classmethod
    def of(cls, axis: int, first: int, rows: Sequence[Mapping[str, Mapping[str, Sequence[float]]]]
           ) -> "PlaneStatistics":
        """From one ``{key: {statistic: [per column]}}`` per plane, in plane order."""
        keys = sorted(rows[0]) if rows else []
        values = {key: {name: np.asarray([row[key][name] for row in rows], dtype=np.float64)
                        for name in sorted(rows[0][key])} for key in keys}
        return cls(int(axis), int(first), values, _digest(int(axis), int(first), values))

    @property
    def num_planes(self) -> int:
        return len(next(iter(next(iter(self.values.values())).values()))) if self.values else 0

    @property
    def end(self) -> int:
        return self.first + self.num_planes

    def __str__(self) -> str:
        """The table's fingerprint form: what a run's fingerprint holds of it (see
        :func:`blockpred.pipeline.markers.as_json`)."""
        return f"sha256:{self.sha256}"

    def __eq__(self, other) -> bool:
        return isinstance(other, PlaneStatistics) and other.sha256 == self.sha256

    def __hash__(self) -> int:
        return hash(self.sha256)

    def to_json(self) -> str:
        return json.dumps(_plain(self.axis, self.first, self.values) | {"sha256": self.sha256})

    @classmethod
    def from_json(cls, text: str) -> "PlaneStatistics":
        """The table stored by :meth:`to_json`; ``ValueError`` when it is not one, or its sha256 does not match."""
        data = json.loads(text)
        try:
            axis, first = int(data["axis"]), int(data["first"])
            values = {key: {name: np.asarray(array, dtype=np.float64) for name, array in stats.items()}
                      for key, stats in data["values"].items()}
            stated = str(data["sha256"])
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"not a table of plane statistics ({err})") from None
        if _digest(axis, first, values) != stated:
            raise ValueError("its values do not match its sha256")
        return cls(axis, first, values, stated)


def _plain(axis: int, first: int, values) -> dict:
    return {"axis": axis, "first": first,
            "values": {key: {name: np.asarray(array).tolist() for name, array in sorted(stats.items())}
                       for key, stats in sorted(values.items())}}


def _digest(axis: int, first: int, values) -> str:
    return hashlib.sha256(json.dumps(_plain(axis, first, values), sort_keys=True).encode()).hexdigest()














def table_of(model_kwargs: Mapping[str, Any]) -> PlaneStatistics | None:
    """The per-plane table in a run's ``model_kwargs``, if any."""
    statistics = model_kwargs.get(STATISTICS_KEY) or {}
    table = statistics.get(PLANES_KEY) if isinstance(statistics, Mapping) else None
    return table if isinstance(table, PlaneStatistics) else None




