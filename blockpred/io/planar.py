"""A 2D image (y, x) seen as a volume one plane deep (1, y, x): :class:`PlanarVolume`.

:func:`blockpred.io.open_volume` returns one for every array of two axes, so
a 2D network predicts a 2D image as it predicts the planes of a volume (see
:mod:`blockpred.models.planes`); its output is a volume one plane deep.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from ..geometry import Box
from .base import Volume


def _flat(box: Box) -> Box:
    return Box(box.begin[1:], box.end[1:])


class PlanarVolume(Volume):
    """``inner`` (an array of axes (y, x)) as (z, y, x) with z of size 1."""

    def __init__(self, inner: Volume):
        self.inner = inner
        self.path = inner.path
        self.shape = (1,) + tuple(inner.shape)
        self.dtype = inner.dtype
        self.chunk_shape = (1,) + tuple(inner.chunk_shape)
        self.voxel_size = None
        self.parallel_writes, self.async_writes = inner.parallel_writes, inner.async_writes
        self.writable, self.counts_missing_chunks = inner.writable, inner.counts_missing_chunks

    def read(self, box: Box) -> np.ndarray:
        self._index(box)  # checked as a (z, y, x) box of this volume
        return self.inner.read(_flat(box))[None]

    def read_with_missing(self, box: Box) -> tuple[np.ndarray, tuple[Box, ...]]:
        self._index(box)
        data, missing = self.inner.read_with_missing(_flat(box))
        return data[None], tuple(Box((0,) + tuple(m.begin), (1,) + tuple(m.end)) for m in missing)

    def write(self, box: Box, data: np.ndarray) -> None:
        self._index(box)
        self.inner.write(_flat(box), self._checked(box, data)[0])

    def write_async(self, box: Box, data: np.ndarray) -> Future:
        self._index(box)
        return self.inner.write_async(_flat(box), self._checked(box, data)[0])

    def _read(self, index: tuple[slice, ...]) -> np.ndarray:  # pragma: no cover - read() goes to the inner volume
        return self.inner._read(index[1:])[None]

    def _write(self, index: tuple[slice, ...], data: np.ndarray) -> None:  # pragma: no cover - as _read
        self.inner._write(index[1:], data[0])

    def close(self) -> None:
        self.inner.close()
