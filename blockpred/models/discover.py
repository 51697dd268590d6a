"""A network's grid, found by dry runs: its downsampling per axis and the input sizes it takes.

Nothing about a user's network is assumed.  :func:`find_grid` runs it on
zeros of small shapes (no gradient, on the CPU or wherever its weights are)
and reads off:

* a **base** shape it takes: the first of a few cubes (32, 48, 54, 64, 81, 96,
  108, 128; for a 2D network one plane of 64 ... 512) whose output is the input
  or smaller by an even number of voxels per axis;
* the **context** a valid network consumes per side (``(input - output) / 2``
  at the base), 0 for a 'same' one;
* the **downsampling** per axis: the step between input sizes it takes.  Two
  views of one fact are combined.  Its layers' outputs (forward hooks on an
  ``nn.Module``; a TorchScript network's graph run node by node, see
  :mod:`.scriptgraph`) show the coarsest feature map: a base
  of 64 whose deepest map is 8 says 8.  The sizes it takes say the same for
  a network that concatenates its skip connections (67 fails where 64 and 72
  run), but not for one that pads odd sizes itself (MONAI's ``BasicUNet``),
  which takes any size yet is shift-equivariant only by its pooling.  So the
  hooks' step is checked by a dry run at base + step, and where there is no
  such view (a graph the interpreter cannot run) or the check fails, the step is the smallest ``k`` such
  that base + ``k`` runs, ``k`` = 1, 2, ... up to :data:`MAX_STEP`;
* the **smallest** input per axis (the base shrunk by steps, bisected): the
  sizes a network takes are ``min + k * step``.

Only the outputs of leaf layers are hooked: a container's output may be
arranged otherwise (a wrapper that returns channels last).

A ``hint`` (a package's ``step``, a module's ``downsampling`` attribute) is
checked like the hooks' step; a ``trusted`` one (``--downsampling``) is taken
as it is.  A 2D network wrapped plane by plane
(:class:`~blockpred.models.planes.PlaneNetwork`) has step and minimum 1 across
its planes, found without a dry run.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ModelLoadError, is_out_of_memory
from ..geometry import Coord
from .scriptgraph import feature_sizes, scripted

logger = logging.getLogger(__name__)

__all__ = ["Grid", "find_grid", "MAX_STEP"]

#: The largest step (downsampling) looked for by trying sizes one by one.
MAX_STEP = 64
#: Cube sides tried for the base shape of a 3D network, and plane sides for a 2D one: multiples of powers of 2
#: and of 3 (a network that pools by 3 three times takes multiples of 27 only: 54, 81, 108).
BASE_SIDES_3D = (32, 48, 54, 64, 81, 96, 108, 128)
BASE_SIDES_2D = (64, 81, 96, 108, 128, 162, 192, 243, 256, 384, 512)


@dataclass(frozen=True, slots=True)
class Grid:
    """What dry runs found of a network (see the module docstring); spatial (z, y, x) throughout."""

    downsampling: Coord
    #: The smallest input per axis it takes (the other axes at ``base``).
    min_shape: Coord
    #: A shape it takes on every axis at once.
    base: Coord
    #: Voxels a valid network consumes on each side (0 for 'same').
    context: Coord
    #: Dry runs made and the seconds they took.
    dry_runs: int = 0
    seconds: float = 0.0
    #: How the downsampling was found, per axis ("hooks", "graph", "sizes", "named", "planes").
    how: tuple[str, ...] = field(default=())

    @property
    def padding(self) -> str:
        return "valid" if any(self.context) else "same"

    def sizes_taken(self) -> str:
        """The input sizes the network takes, per axis, for a message: ``z 1, 2, 3 ...; y 8, 16, 24 ...``."""
        parts = []
        for axis, (low, step) in enumerate(zip(self.min_shape, self.downsampling)):
            parts.append(f"{'zyx'[axis]} {low}, {low + step}, {low + 2 * step} ...")
        return "; ".join(parts)

    def takes(self, shape: Coord) -> bool:
        """Whether ``shape`` is one of the sizes taken (``min + k * step`` on every axis)."""
        return all(s >= low and (s - low) % step == 0
                   for s, low, step in zip(shape, self.min_shape, self.downsampling))


class _DryRuns:
    """The network on zeros of a shape, without gradient: the output's spatial shape, or why it failed."""

    def __init__(self, module: nn.Module, in_channels: int, plane_axis: int | None):
        self.module = module
        self.in_channels = in_channels
        self.plane_axis = plane_axis
        self.count = 0
        self.seconds = 0.0
        self.last_error = ""
        params = next(iter(module.parameters()), None)
        self.device = params.device if params is not None else torch.device("cpu")
        self.dtype = params.dtype if params is not None and params.is_floating_point() else torch.float32
        self._feature_sizes: list[tuple[int, ...]] | None = None
        #: Where the feature sizes came from: forward hooks, or the TorchScript graph run node by node.
        self.view = "hooks"

    def __call__(self, shape: Coord, record: bool = False) -> Coord | None:
        """The output's spatial shape for input ``shape``; None when the network refuses it.  ``record``: the
        layers' output shapes too (hooks, or the TorchScript graph run node by node: :meth:`_watch`)."""
        handles = self._hook() if record else []
        started = time.perf_counter()
        try:
            with torch.no_grad():
                x = torch.zeros((1, self.in_channels, *shape), device=self.device, dtype=self.dtype)
                y = _first_tensor(self.module(x))
            if record and not self._feature_sizes:
                self._watch(x)
        except Exception as err:  # noqa: BLE001 - a refused shape is an answer; out of memory is not
            if is_out_of_memory(err):
                raise ModelLoadError(
                    f"the network ran out of memory on a dry run at input {'x'.join(map(str, shape))} while "
                    f"blockpred looked for the input sizes it takes; name --block and --downsampling"
                ) from err
            text = str(err).strip()
            self.last_error = text.splitlines()[0] if text else type(err).__name__
            return None
        finally:
            self.count += 1
            self.seconds += time.perf_counter() - started
            for handle in handles:
                handle.remove()
        if y is None or y.dim() != 5:
            self.last_error = f"it returned {'no tensor' if y is None else tuple(y.shape)} for a 5D input"
            return None
        out = Coord(y.shape[2:])
        shrink = shape - out
        if any(s < 0 or s % 2 for s in shrink):
            self.last_error = (f"it maps {'x'.join(map(str, shape))} to {'x'.join(map(str, out))}, neither the "
                               f"input nor smaller by an even number of voxels per axis")
            return None
        return out

    def _hook(self) -> list:
        """Forward hooks that note the spatial shape of every layer's output (an ``nn.Module``'s only)."""
        self._feature_sizes = []
        inner = getattr(self.module, "network", None) if self.plane_axis is not None else self.module
        handles = []
        if inner is None:
            return handles
        dims = 2 if self.plane_axis is not None else 3

        def note(_module, _inputs, output):
            tensor = _first_tensor(output)
            if tensor is not None and tensor.dim() == dims + 2:
                self._feature_sizes.append(tuple(int(v) for v in tensor.shape[2:]))

        for sub in inner.modules():
            if isinstance(sub, torch.jit.ScriptModule) or next(sub.children(), None) is not None:
                continue  # TorchScript runs no Python hooks; a container's output may be permuted (channels last)
            try:
                handles.append(sub.register_forward_hook(note))
            except (RuntimeError, NotImplementedError):
                continue
        return handles

    def _watch(self, x: torch.Tensor) -> None:
        """The shapes of a TorchScript network's maps at ``x``, which no hook sees: its frozen graph run node by
        node (:func:`.scriptgraph.feature_sizes`, two passes).  So its pooling is read as an ``nn.Module``'s is,
        where a search of sizes took up to 48 dry runs (torch-em's UNet3d: 2.9 s) and found 1 for a network
        that pads odd sizes itself (MONAI's BasicUNet).  A graph the interpreter cannot run leaves the search."""
        inner = getattr(self.module, "network", None) if self.plane_axis is not None else self.module
        if inner is None or not scripted(inner):
            return
        if self.plane_axis is not None:  # the 2D network sees one plane: (1, channels, rows, columns)
            x = x.movedim(2 + self.plane_axis, 2)[:, :, 0]
        try:
            self._feature_sizes, self.view = feature_sizes(inner, x), "graph"
        except Exception as err:  # noqa: BLE001 - an operation the interpreter lacks: the sizes are searched
            logger.debug("the network's graph did not run node by node (%s): its sizes are searched", err)
        finally:
            self.count += 2

    def coarsest(self, base: Coord) -> Coord | None:
        """The base over the smallest feature map the hooks saw, per axis (None: no hook, or no clean ratio).

        Maps of one voxel on every axis are left out: global pooling (squeeze-and-excitation) says nothing
        of the grid.
        """
        sizes = [s for s in (self._feature_sizes or []) if any(v > 1 for v in s)]
        if not sizes:
            return None
        if self.plane_axis is not None:
            plane = [a for a in range(3) if a != self.plane_axis]
            smallest = [base[a] for a in range(3)]
            for rows, cols in sizes:
                smallest[plane[0]] = min(smallest[plane[0]], rows)
                smallest[plane[1]] = min(smallest[plane[1]], cols)
        else:
            smallest = [min(s[a] for s in sizes) for a in range(3)]
        if any(m < 1 or b % m for b, m in zip(base, smallest)):
            return None
        return Coord(b // m for b, m in zip(base, smallest))


def _first_tensor(value) -> torch.Tensor | None:
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    if isinstance(value, dict) and value:
        value = next(iter(value.values()))
    return value if isinstance(value, torch.Tensor) else None


def find_grid(module: nn.Module, in_channels: int, *, hint: Coord | None = None, trusted: bool = False,
              plane_axis: int | None = None, first_base: Coord | None = None) -> Grid:
    """The grid of ``module`` found by dry runs (see the module docstring).

    ``hint``: a step to check first (or, ``trusted``, to take); ``plane_axis``:
    the axis a 2D network's planes are stacked along; ``first_base``: a shape
    to try before the cubes (a package's smallest input).  Raises
    :class:`ModelLoadError` when the network takes none of the base shapes,
    naming the last failure.
    """
    runs = _DryRuns(module, in_channels, plane_axis)
    hint = hint if hint is not None else Coord((1, 1, 1))
    base, output = _find_base(runs, hint, plane_axis, first_base)
    context = (base - output) // 2
    steps, how = [], []
    coarse = runs.coarsest(base) if not any(context) else None  # a valid network's maps do not divide
    for axis in range(3):
        if axis == plane_axis:
            steps.append(1)
            how.append("planes")
        elif trusted:
            steps.append(hint[axis])
            how.append("named")
        else:
            step, found = _step(runs, base, output, axis, hint[axis], None if coarse is None else coarse[axis],
                                runs.view)
            steps.append(step)
            how.append(found)
    downsampling = Coord(steps)
    minimum = Coord(_smallest(runs, base, output, axis, downsampling[axis]) if axis != plane_axis else 1
                    for axis in range(3))
    grid = Grid(downsampling, minimum, base, context, runs.count, runs.seconds, tuple(how))
    logger.info("network grid: downsampling %s (%s), sizes %s, context %s; %d dry runs in %.2f s",
                tuple(downsampling), "/".join(how), grid.sizes_taken(), tuple(context), runs.count, runs.seconds)
    return grid


def _find_base(runs: _DryRuns, hint: Coord, plane_axis: int | None,
               first: Coord | None = None) -> tuple[Coord, Coord]:
    sides = BASE_SIDES_2D if plane_axis is not None else BASE_SIDES_3D
    shapes = [Coord(1 if axis == plane_axis else math.ceil(side / h) * h for axis, h in enumerate(hint))
              for side in sides]
    if first is not None:
        shapes.insert(0, Coord(1 if axis == plane_axis else max(int(v), 1) for axis, v in enumerate(first)))
    tried = []
    for shape in dict.fromkeys(shapes):
        tried.append(shape)
        out = runs(shape, record=True)
        if out is not None:
            return shape, out
    shown = ", ".join("x".join(map(str, s)) for s in (tried[0], tried[-1]))
    raise ModelLoadError(
        f"the network took none of the inputs tried ({shown} and sizes between, {runs.in_channels} channel(s)): "
        f"{runs.last_error}; check its input channels, or name --block and --downsampling"
    )


def _with(shape: Coord, axis: int, size: int) -> Coord:
    return Coord(size if a == axis else s for a, s in enumerate(shape))


def _takes(runs: _DryRuns, base: Coord, output: Coord, axis: int, size: int) -> bool:
    """A dry run with ``axis`` at ``size``: taken when the output keeps the base's shrink on every axis."""
    out = runs(_with(base, axis, size))
    return out is not None and out == _with(output, axis, size - (base[axis] - output[axis]))


def _step(runs: _DryRuns, base: Coord, output: Coord, axis: int, hint: int, coarse: int | None,
          view: str = "hooks") -> tuple[int, str]:
    """The downsampling along ``axis``: the layers' (``view``: "hooks" or "graph"; with the hint) where base + it
    runs, else the smallest size step that runs."""
    candidates = []
    if coarse is not None and coarse > 1:
        candidates.append((math.lcm(coarse, hint), view))
    if hint > 1:
        candidates.append((hint, "hint"))
    for step, how in candidates:
        if _takes(runs, base, output, axis, base[axis] + step):
            return step, how
    for step in range(1, MAX_STEP + 1):
        if _takes(runs, base, output, axis, base[axis] + step):
            if coarse is not None and coarse > 1 and step % coarse:
                logger.info("axis %s: its layers pool by %d but sizes step by %d; taking %d",
                            "zyx"[axis], coarse, step, math.lcm(step, coarse))
                return math.lcm(step, coarse), "sizes"
            return step, "sizes"
    raise ModelLoadError(
        f"the network takes input {'x'.join(map(str, base))} but no size from {base[axis] + 1} to "
        f"{base[axis] + MAX_STEP} along {'zyx'[axis]} ({runs.last_error}); name --downsampling"
    )


def _smallest(runs: _DryRuns, base: Coord, output: Coord, axis: int, step: int) -> int:
    """The smallest size along ``axis`` taken, on the base's residue of ``step``: sizes taken are taken from
    some size up, so a bisection over the multiples of the step below the base finds it."""
    low_k, high_k = (base[axis] - 1) // step, 0  # base - high_k * step is taken; base - low_k * step >= 1
    if low_k == 0:
        return base[axis]
    while high_k < low_k:
        middle = (high_k + low_k + 1) // 2
        if _takes(runs, base, output, axis, base[axis] - middle * step):
            high_k = middle
        else:
            low_k = middle - 1
    return base[axis] - high_k * step
