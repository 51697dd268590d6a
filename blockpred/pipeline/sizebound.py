"""A converted copy that computes its network only at some input shapes, and the copies made for the others.

A traced copy (:mod:`.unrolled`) takes each branch of the network as it was taken at the example it was traced
at.  Where a branch was decided by the input's sizes (MONAI's BasicUNet pads a skip only where a size is odd), the
copy computes the network only at the shapes that take the same branches: at another, it fails or, worse,
computes something else.  :class:`SizeBound` runs such a copy only at those shapes:

* at a shape it has not seen, the network's graph runs on the meta device (:func:`.unrolled.branches`: shapes
  only, no arithmetic), and the branches it takes name the copy that computes it there;
* that copy is the first one where the branches are the same, else one made at this shape and checked against
  torch (the runtime's ``make``, which caches it); where it does not check, torch runs at that shape;
* the shapes seen and the branches each takes are remembered (the runtime's ``remember``: the route's record),
  so a later run finds them without the meta run.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np
import torch

from ..cache import digest
from .unrolled import branches

logger = logging.getLogger(__name__)

__all__ = ["SizeBound", "shape_key"]

#: What runs a batch (a float32 array, batch first) and gives the network's output for it.
Runner = Callable[[np.ndarray], np.ndarray]


def shape_key(shape) -> str:
    """A batch's shape as the record names it: ``1x1x96x160x160``."""
    return "x".join(str(int(n)) for n in shape)


def branches_key(taken: tuple[bool, ...]) -> str:
    """The branches a run took, as a short name."""
    return digest("".join("1" if t else "0" for t in taken))


class SizeBound:
    """The copies of a size-bound network, each run at the shapes whose branches it took (see the module).

    ``frozen``: the frozen TorchScript network, or what makes it (from a batch: a cached copy has none yet);
    ``first``: the branches the first copy took (:func:`branches_key`) and its runner; ``shapes``: what is known
    of each shape's branches; ``make(x, branches)``: the copy for those branches (read from the cache, or made at
    ``x``'s shape and checked against torch), or None where it does not check; ``remember(shapes)``: keeps
    ``shapes``.
    """

    def __init__(self, *, module: torch.nn.Module,
                 frozen: torch.jit.ScriptModule | Callable[[np.ndarray], torch.jit.ScriptModule],
                 first: tuple[str, Runner], shapes: dict[str, str],
                 make: Callable[[np.ndarray, str], Runner | None], remember: Callable[[dict[str, str]], None]):
        self._module = module
        self._frozen = frozen
        self._runners: dict[str, Runner] = {first[0]: first[1]}  # by branches
        self._shapes = dict(shapes)
        self._by_shape: dict[str, Runner] = {}  # each shape run so far, its runner
        self._make = make
        self._remember = remember
        self._lock = threading.Lock()
        self.first = first[0]

    @property
    def shapes(self) -> dict[str, str]:
        """Each shape seen, by :func:`shape_key`, and the branches it takes."""
        return dict(self._shapes)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        runner = self._by_shape.get(shape_key(x.shape))
        if runner is None:
            with self._lock:
                runner = self._runner(x)
        return runner(x)

    def _runner(self, x: np.ndarray) -> Runner:
        key = shape_key(x.shape)
        found = self._shapes.get(key)
        if found is None:
            if not isinstance(self._frozen, torch.jit.ScriptModule):
                self._frozen = self._frozen(x)
            try:
                found = branches_key(branches(self._frozen, tuple(x.shape)))
            except Exception as err:  # noqa: BLE001 - an operation without a meta kernel: torch at this shape
                logger.warning("the branches the network takes at an input of %s are not known (%s): running "
                               "torch at that shape", key, err)
                self._by_shape[key] = self._torch  # not remembered: a later run looks again
                return self._torch
            self._shapes[key] = found
            self._remember(dict(self._shapes))
        if found not in self._runners:
            made = self._make(x, found)
            if made is None:
                logger.warning("the network takes other branches at an input of %s than its converted copy, and "
                               "the copy made for them does not equal torch: running torch at that shape", key)
                made = self._torch
            self._runners[found] = made
        self._by_shape[key] = self._runners[found]
        return self._by_shape[key]

    def _torch(self, x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            out = self._module(torch.from_numpy(x))
        return (out[0] if isinstance(out, (tuple, list)) else out).float().numpy()
