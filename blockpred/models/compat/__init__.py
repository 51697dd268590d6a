"""Stand-ins for packages that published models import and that no longer install.

inferno (inferno-pytorch) built many EM networks of 2017-2020; its last release (0.1.7) does not install on
Python 3, so a user's ``model.py`` that imports ``inferno.extensions.layers.convolutional`` cannot be imported as
written.  :func:`inferno_stand_in` makes the package :mod:`inferno` of this folder importable as ``inferno`` where
no inferno is (an installed one, or one on ``PYTHONPATH``, always wins): its building blocks with inferno's names,
arguments and attribute names, so that state dicts trained with inferno load strictly and compute the same
(:func:`inferno_stand_in`, around the import and the building of a user's model).
It is written from inferno's published source (its conv-activation family, ``Upsample``, ``Concatenate``,
``BatchNormND``, ``SELU``); nothing else of inferno is provided.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

_HERE = str(Path(__file__).parent)
_told = False


class _InfernoFinder(importlib.abc.MetaPathFinder):
    """Finds ``inferno`` and its modules in this folder, after every other finder has looked."""

    def find_spec(self, name, path=None, target=None):
        if name != "inferno" and not name.startswith("inferno."):
            return None
        return importlib.machinery.PathFinder.find_spec(name, path if name != "inferno" else [_HERE])


_FINDER = _InfernoFinder()


@contextlib.contextmanager
def inferno_stand_in() -> Iterator[None]:
    """Inside, where inferno is not importable, this folder's stand-in is importable as ``inferno`` (a user's model
    file imported and built there gets its layers); after, the process is as it was: the stand-in's modules leave
    ``sys.modules`` (the layers built keep their classes), so ``import inferno`` elsewhere fails as before.  A model
    that imported the stand-in is told so in one line, once a process."""
    global _told
    provide = _FINDER not in sys.meta_path and "inferno" not in sys.modules and importlib.util.find_spec("inferno") is None
    if provide:
        sys.meta_path.append(_FINDER)  # last: every other finder looks first
    try:
        yield
    finally:
        if provide:
            sys.meta_path.remove(_FINDER)
            used = [name for name in sys.modules if name == "inferno" or name.startswith("inferno.")]
            if used and not _told:
                _told = True
                logger.warning("the model imports inferno, which is not installed (its last release does not install "
                               "on Python 3): its layers come from blockpred's inferno compatibility module "
                               "(blockpred.models.compat)")
            for name in used:
                del sys.modules[name]
