"""The run's halo: named, the model's, or the network's receptive field (:func:`choose_halo`).

Where neither the options nor the model name a halo, it is the network's
receptive-field radius (:mod:`blockpred.models.field`) rounded up to its
downsampling, so that blockwise output equals whole-volume prediction.  Such a
halo can cost more than it is worth: where it would make the network read
more than :data:`MAX_WASTE` input voxels per output voxel even at the largest
block (:data:`LARGEST_SIDE` per axis; a 2D network's planes :data:`LARGEST_SIDE_2D`
wide), the largest halo that does not is taken, and one line says that the
output will differ at block borders and which halo would make it exact.  A
valid network reads its own context (halo 0); a network whose field is
unbounded or could not be measured gets blockpred's old default (8, on the
grid) and a line saying so.

Every choice says where it came from and whether it covers the field
(:meth:`HaloChoice.note`), for ``plan``, the summary and ``--json``.

A named halo longer than the volume on an axis reads nothing more of it, only
padding, at a cost that grows with the cube of the halo (``--halo 500`` on a
32-voxel axis made a dry run of a gigavoxel): :func:`cut_to_volume` cuts it
where the output stays the same, and refuses it where it may not.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from ..errors import InvalidOptionError
from ..geometry import Coord
from ..models.field import NetworkField

__all__ = ["FALLBACK_HALO", "LARGEST_SIDE", "LARGEST_SIDE_2D", "MAX_WASTE", "HaloChoice", "choose_halo",
           "cut_to_volume", "fallback_halo", "grow_start_block", "waste"]

logger = logging.getLogger(__name__)

#: Input voxels per output voxel a measured default halo may cost at the largest block.
MAX_WASTE = 4.0
#: The largest block side a 3D network is assumed to run (a 3D U-Net's 256^3 block fits an 80 GB GPU) ...
LARGEST_SIDE = 256
#: ... and the widest plane of a 2D one.
LARGEST_SIDE_2D = 1024
#: The halo of a network whose field is not known (per axis; 0 across a 2D network's planes): blockpred's default
#: before fields were measured, rounded up to the downsampling where the grid was found.
FALLBACK_HALO = 8
#: A start block grows until its halo costs at most this factor per axis (1.5: 3.4x in 3D at worst).
START_WASTE_PER_AXIS = 1.5


@dataclass(frozen=True)
class HaloChoice:
    """The halo, where it came from (``named``, ``model``, ``field``, ``valid``, ``fallback``), the network's field
    (None when not measured) and the halo that would cover it (None when unbounded or unknown)."""

    halo: Coord
    source: str
    field: NetworkField | None = None
    exact: Coord | None = None
    #: A measured halo cut to MAX_WASTE: the one line that says so.
    capped: bool = False
    #: The axis a 2D network's planes are stacked along (None: a 3D network).
    plane_axis: int | None = None
    #: The halo a bioimage.io package states, where its measured field was found to reach past it (the halo
    #: is then the field's); None otherwise.
    stated: Coord | None = None

    @property
    def covers(self) -> bool | None:
        """Whether blocks equal whole-volume prediction (None: the field is not known)."""
        if self.field is not None and (self.field.normalises_blocks or (
                self.field.radius is None and self.field.note.startswith("unbounded"))):
            return False
        if self.exact is None:
            return None
        return all(h >= e for h, e in zip(self.halo, self.exact))

    def note(self, label: str = "halo ") -> str:
        """One line: ``halo 5x24x24 from the receptive field (radius 5x23x23, measured in 2.1 s): covered ...``."""
        where = {"named": "named", "model": "the model's", "field": "from the receptive field",
                 "valid": "0: a valid network reads its own context", "fallback": "blockpred's default"}[self.source]
        if self.field is None:
            field = "receptive field not measured"
        else:
            how = ("stated by the model" if "stated" in self.field.grid.how else "cached" if self.field.cached
                   else f"measured in {self.field.seconds:.1f} s")
            field = (f"receptive field {self.field.describe()}, {how}, downsampling "
                     f"{_shape(self.field.downsampling)}")
        cover = {True: "covered: blocks equal whole-volume prediction",
                 False: "NOT covered: block borders differ from whole-volume prediction",
                 None: "coverage unknown"}[self.covers]
        if self.stated is not None:
            where += f", not the {_shape(self.stated)} the package states"
        if self.covers is False and self.exact is not None and not all(h >= e for h, e in zip(self.halo, self.exact)):
            cover += f" (--halo {_flag(self.exact)} covers the field)"
        return f"{label}{_shape(self.halo)} {where} ({field}): {cover}"

    def warning(self) -> str:
        """One line where the output will differ at block borders and the user may not know, else ''."""
        if self.stated is not None:
            return (f"the package states halo {_shape(self.stated)}, but its network's receptive field reaches "
                    f"{_shape(self.field.radius)}: taking halo {_shape(self.halo)}"
                    + (f" (capped; {_shape(self.exact)} would cover it)" if self.capped else
                       ", so blocks equal the whole plane") + f"; --halo {_flag(self.stated)} runs the stated one")
        if self.source == "fallback" and self.field is not None:
            return (f"the network's receptive field is {self.field.note}; halo {_shape(self.halo)} (blockpred's "
                    f"default): blocks may differ from whole-volume prediction at their borders; name --halo to be "
                    f"sure")
        if self.field is None or self.covers is not False:
            return ""
        if self.field.normalises_blocks:
            short = self.exact is not None and not all(h >= e for h, e in zip(self.halo, self.exact))
            halo = (f"--halo {_flag(self.exact)} would cover its convolutions' field (radius "
                    f"{_shape(self.field.radius)}), halo {_shape(self.halo)} does not" if short else
                    f"halo {_shape(self.halo)} covers its convolutions' field (radius {_shape(self.field.radius)})")
            return (f"the network's output depends on the whole block: "
                    f"{self.field.note.removeprefix('per block: ')}; {halo}")
        if self.exact is None:
            return (f"the network's receptive field is {self.field.note}; blocks (halo {_shape(self.halo)}) will "
                    f"differ from whole-volume prediction at their borders")
        if self.source == "named":
            return (f"--halo {_flag(self.halo)} is smaller than the network's receptive field "
                    f"({self.field.describe()}): the output will differ from whole-volume prediction at block "
                    f"borders; --halo {_flag(self.exact)} makes it exact")
        if self.capped:
            return (f"the halo that covers the network's receptive field ({self.field.describe()}), "
                    f"{_shape(self.exact)}, would read over {MAX_WASTE:g}x the input voxels even at block "
                    f"{_shape(_largest(self.plane_axis))}; using halo {_shape(self.halo)}: the output will differ at "
                    f"block borders; --halo {_flag(self.exact)} makes it exact")
        return ""

    def as_dict(self) -> dict:
        field = self.field
        return {
            "halo": list(self.halo), "halo_source": self.source, "halo_covers_field": self.covers,
            "exact_halo": None if self.exact is None else list(self.exact),
            "stated_halo": None if self.stated is None else list(self.stated),
            "receptive_radius": None if field is None or field.radius is None else list(field.radius),
            "receptive_field": None if field is None else field.describe(),
            "downsampling": None if field is None else list(field.downsampling),
            "field_seconds": None if field is None else round(field.seconds, 3),
            "field_cached": None if field is None else field.cached,
        }


def fallback_halo(plane_axis: int | None = None, downsampling: Coord | None = None) -> Coord:
    """:data:`FALLBACK_HALO` on every axis but a 2D network's stacking axis, rounded up to ``downsampling``."""
    step = downsampling if downsampling is not None else Coord((1, 1, 1))
    return Coord(0 if axis == plane_axis else -(-FALLBACK_HALO // d) * d for axis, d in enumerate(step))


def choose_halo(*, named: Coord | None, model_halo: Coord | None, field: NetworkField | None,
                downsampling: Coord, plane_axis: int | None = None, valid: bool = False,
                checked: bool = False) -> HaloChoice:
    """The halo of a run (see the module docstring).  ``valid``: the model says it is a valid network (it reads
    its own context), which counts where its field was not found.  ``checked``: the model's halo is a bioimage.io
    package's statement, held against the measured field: where the field reaches past it, the field's halo is
    taken (under the same cap), and both are said."""
    exact = field.exact_halo if field is not None else None
    if named is not None:
        return HaloChoice(named, "named", field, exact, plane_axis=plane_axis)
    if model_halo is not None and checked and exact is not None and field is not None \
            and not field.normalises_blocks and any(m < e for m, e in zip(model_halo, exact)):
        halo = _affordable(exact, downsampling, plane_axis).maximum(model_halo)
        return HaloChoice(halo, "field", field, exact, capped=halo != exact, plane_axis=plane_axis,
                          stated=model_halo)
    if model_halo is not None:
        return HaloChoice(model_halo, "model", field, exact, plane_axis=plane_axis)
    if (field is not None and any(field.grid.context)) or (field is None and valid):
        return HaloChoice(Coord((0, 0, 0)), "valid", field, Coord((0, 0, 0)), plane_axis=plane_axis)
    if exact is None:  # the grid's rounding only where the grid was found (an unfound one keeps the plain 8)
        halo = fallback_halo(plane_axis, downsampling if field is not None else None)
        return HaloChoice(halo, "fallback", field, None, plane_axis=plane_axis)
    halo = _affordable(exact, downsampling, plane_axis)
    return HaloChoice(halo, "field", field, exact, capped=halo != exact, plane_axis=plane_axis)


def cut_to_volume(choice: HaloChoice, volume_shape: Coord, downsampling: Coord) -> HaloChoice:
    """A named halo cut, on the axes where it is longer than the volume, to the halo that covers the network's
    receptive field; refused where that may change the output.

    On such an axis every block already reads the whole volume, and the rest is padding, whose values at a
    place do not depend on the halo (:func:`blockpred.pipeline.padding.source_indices`).  Any halo that covers
    the network's receptive field gives the same output (to float rounding: the network runs on another input
    shape), so there it is cut to the one that covers the field (on the same phase of the downsampling grid),
    with one line.  Where the field is not known, not bounded, or
    normalised per block, a shorter halo may change the output: one line names the longest halo the volume can
    use.
    """
    halo = choice.halo
    if choice.source != "named" or all(h <= n for h, n in zip(halo, volume_shape)):
        return choice
    field = choice.field
    if choice.exact is None or field is None or field.normalises_blocks:
        why = ("the network's receptive field is not measured" if field is None else
               "the network normalises over each block" if field.normalises_blocks else
               f"the network's receptive field is {field.note}")
        raise InvalidOptionError(
            f"--halo {_flag(halo)} is longer than the volume ({_shape(volume_shape)}) on axis "
            f"{'zyx'[next(a for a in range(3) if halo[a] > volume_shape[a])]}: blocks would read padding only "
            f"beyond it, and {why}, so blockpred cannot cut it without changing the output; use --halo "
            f"{_flag(halo.minimum(volume_shape))} or less"
        )
    cut = Coord(h if h <= n or h <= e else e + (h - e) % d
                for h, n, e, d in zip(halo, volume_shape, choice.exact, downsampling))
    if cut == halo:  # no longer than the field needs
        return choice
    logger.warning("--halo %s is longer than the volume (%s): blocks would read padding only beyond it; using halo "
                   "%s, which gives the same output (it covers the network's receptive field, %s)", _flag(halo),
                   _shape(volume_shape), _flag(cut), field.describe())
    return dataclasses.replace(choice, halo=cut)


def waste(block: Coord, halo: Coord) -> float:
    """Input voxels read per output voxel at ``block`` with ``halo``."""
    return (block + halo * 2).prod() / block.prod()


def _largest(plane_axis: int | None) -> Coord:
    return Coord(1 if axis == plane_axis else LARGEST_SIDE_2D if plane_axis is not None else LARGEST_SIDE
                 for axis in range(3))


def _affordable(exact: Coord, step: Coord, plane_axis: int | None) -> Coord:
    """``exact``, or cut step by step on the axis that costs most until it reads at most MAX_WASTE."""
    largest = _largest(plane_axis)
    halo = list(exact)
    while waste(largest, Coord(halo)) > MAX_WASTE:
        axis = max(range(3), key=lambda a: (largest[a] + 2 * halo[a]) / largest[a])
        halo[axis] = max(0, halo[axis] - step[axis])
    return Coord(halo)


def grow_start_block(block: Coord, halo: Coord, step: Coord, plane_axis: int | None = None) -> Coord:
    """The start block grown, per axis, until its halo costs at most :data:`START_WASTE_PER_AXIS` (up to the
    largest block): a measured halo of 44 on a 64^3 block would read 6.9x what it writes."""
    largest = _largest(plane_axis)
    grown = []
    for b, h, s, top in zip(block, halo, step, largest):
        while (b + 2 * h) / b > START_WASTE_PER_AXIS and b < top:
            b = min(-(-(2 * b) // s) * s, max(top, s))
        grown.append(b)
    return Coord(grown)


def _shape(coord: Coord) -> str:
    return "x".join(map(str, coord))


def _flag(coord: Coord) -> str:
    return ",".join(map(str, coord))
