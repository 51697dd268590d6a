"""Reads and writes through tensorstore: the hot path of the zarr and N5 backends.

tensorstore decodes and encodes chunks on its own thread pool (no GIL, no
asyncio loop), so a reader or writer thread of the pipeline only starts an
operation and waits.  Every volume of a process shares one
:class:`tensorstore.Context`, so their concurrency limits (one data-copy
thread per core) hold for the process, not per volume.

An input read in boxes that cut its chunks (a block with a halo) keeps
decoded chunks in a cache of :data:`READ_CACHE_BYTES`: a block's halo reaches
into the chunks its neighbours read too, so without one every chunk on a
block's edge is decoded again for each block it borders (input chunks 64^3,
block 64x256x256, halo 8,16,16: 108 chunks decoded a block where its own
region spans 16; reading the 64 blocks of a 1024x512x512 uint8 volume in order
took 33 ms of CPU a block uncached, 10-11 ms with 64 or 256 MiB of cache).
Blocks run in order (and a dask task takes consecutive blocks), so a block's
neighbour along the last axis was read just before it.  Reads on the chunk
grid (no halo) find nothing to share and skip the cache's copy (8.5 against
10.4 ms a block).  The input does not change during a run: cached chunks are
not checked again against the store (``recheck_cached_data`` ``open``).  A
volume opened for writing has no cache: its chunks are written once.

A write returns when its data is *committed* (on disk); :meth:`write_async`
returns the commit future instead, so a block is marked done only after the
data it wrote is durable.

Missing chunks.  tensorstore reads a chunk that is not stored as the fill
value, as zarr allows; :meth:`TensorstoreVolume.read_with_missing` reads
through a second handle opened with ``fill_missing_data_reads: false`` (only
when first asked, so outputs never open it), on which such a read raises.
A read that finds every chunk stored costs what a plain read costs; only one
that raised is read again, chunk by chunk, to name the missing chunks and fill
them as a plain read would.  tensorstore honours the option for zarr (v2, v3,
sharded v3: per inner chunk) and N5, and for unsharded precomputed volumes;
sharded precomputed volumes read missing shards as the fill value regardless,
so they say :attr:`~blockpred.io.base.Volume.counts_missing_chunks` False.
"""

from __future__ import annotations

import functools
import itertools
import threading
from concurrent.futures import Future

import numpy as np
import tensorstore as ts

from ..geometry import Box, Coord
from .base import Volume, VolumePath
from .stores import ObjectUrl, context, kvstore_spec


@functools.cache
def kvstore(path: VolumePath, key: str = "") -> dict:
    """The tensorstore kvstore spec of ``key`` (a ``/``-separated path) inside ``path``'s container.

    The one place a volume's location becomes a tensorstore kvstore: every
    backend that reads or writes through tensorstore asks here.  A local
    container gives the ``file`` driver; an object-store URL (``s3://``,
    ``gs://``) gives its driver, with the endpoint, region and credentials of
    :func:`blockpred.io.stores.kvstore_spec`.
    """
    if isinstance(path.container, ObjectUrl):
        return kvstore_spec(path.container, key)
    directory = path.container.absolute()
    for part in key.strip("/").split("/"):
        if part:
            directory = directory / part
    return {"driver": "file", "path": str(directory) + "/"}


#: Reader threads open a volume's strict handle once.
_opening = threading.Lock()

#: Bytes of decoded chunks a volume opened for reading keeps (see the module docstring).
READ_CACHE_BYTES = 256 << 20


def read_cache(spec: dict) -> dict:
    """``spec`` with the chunk cache of an input read across its chunks (a context resource of its own)."""
    return {**spec, "cache_pool": {"total_bytes_limit": READ_CACHE_BYTES}, "recheck_cached_data": "open"}


def open_store(spec: dict, *, writable: bool) -> ts.TensorStore:
    """Open an existing array; raises ``ValueError`` when tensorstore cannot (the message says why)."""
    return ts.open(spec, read=True, write=writable, open=True, context=context()).result()


class TensorstoreVolume(Volume):
    """A volume whose reads and writes go through a tensorstore handle ``self._store`` (full-rank)."""

    _store: ts.TensorStore
    counts_missing_chunks = True
    #: The handle on which a missing chunk raises (:meth:`_strict_for`), once opened.
    _strict: ts.TensorStore | None = None

    def _read(self, index: tuple[slice, ...]) -> np.ndarray:
        return self._store[index].read().result()

    def read_with_missing(self, box: Box) -> tuple[np.ndarray, tuple[Box, ...]]:
        if not self.counts_missing_chunks:
            return super().read_with_missing(box)
        index = self._index(box)
        try:
            return self._strict_for(index)[index].read().result(), ()
        except ValueError as error:
            if not _is_missing(error):
                raise
        return self._read_by_chunk(index)

    def _strict_for(self, index: tuple[slice, ...]) -> ts.TensorStore:
        """The same view of the same array, on which reading a missing chunk raises; opened by the first
        read, with :func:`read_cache` when that read cuts chunks of a volume opened for reading."""
        if self._strict is None:  # every block reads through here: the lock only until the handle is open
            with _opening:
                if self._strict is None:
                    self._strict = self._open_strict(cached=not self.writable and not self._on_chunk_grid(index))
        return self._strict

    def _on_chunk_grid(self, index: tuple[slice, ...]) -> bool:
        """Whether ``index`` begins and ends on the read chunk grid (or at the array's end) on every axis."""
        domain = self._store[index].domain
        layout = self._store.chunk_layout
        limit = self._store.domain.exclusive_max
        return all((b - o) % c == 0 and ((e - o) % c == 0 or e == m)
                   for b, e, c, o, m in zip(domain.inclusive_min, domain.exclusive_max, layout.read_chunk.shape,
                                            layout.grid_origin, limit))

    def _open_strict(self, cached: bool) -> ts.TensorStore:
        spec = self._store.spec().to_json()  # without context resources: a cache is asked for anew
        spec["fill_missing_data_reads"] = False
        if cached:
            spec = read_cache(spec)
        if isinstance(self.path.container, ObjectUrl):  # a spec leaves out the credentials and retries: ours again
            access = kvstore_spec(self.path.container)
            spec["kvstore"].update({k: v for k, v in access.items() if k not in ("driver", "bucket", "path")})
        return ts.open(spec, read=True, open=True, context=context()).result()

    def _read_by_chunk(self, index: tuple[slice, ...]) -> tuple[np.ndarray, tuple[Box, ...]]:
        """A read that found a chunk missing, again chunk by chunk: the data (missing ones filled) and their boxes."""
        domain = self._store[index].domain
        begin, end = list(domain.inclusive_min), list(domain.exclusive_max)
        layout = self._strict.chunk_layout  # opened by the read that found a chunk missing
        shape, origin = layout.read_chunk.shape, layout.grid_origin
        limit = self._store.domain.exclusive_max
        cells = itertools.product(*(range((b - o) // c, -(-(e - o) // c))
                                    for b, e, c, o in zip(begin, end, shape, origin)))
        reads = []
        for cell in cells:
            first = [o + i * c for i, c, o in zip(cell, shape, origin)]
            part = tuple(slice(max(f, b), min(f + c, e)) for f, c, b, e in zip(first, shape, begin, end))
            chunk = Box(Coord(first), Coord(min(f + c, m) for f, c, m in zip(first, shape, limit)))
            reads.append((part, chunk, self._strict[part].read()))
        data = np.empty(tuple(e - b for b, e in zip(begin, end)), dtype=self.dtype)
        missing = []
        for part, chunk, pending in reads:
            local = tuple(slice(s.start - b, s.stop - b) for s, b in zip(part, begin))
            try:
                data[local] = pending.result()
            except ValueError as error:
                if not _is_missing(error):
                    raise
                data[local] = self._store[part].read().result()  # the fill value, as a plain read gives it
                missing.append(chunk)
        return data, tuple(missing)

    def _write(self, index: tuple[slice, ...], data: np.ndarray) -> None:
        self._store[index].write(data).result()

    def _write_async(self, index: tuple[slice, ...], data: np.ndarray) -> Future:
        return _as_future(self._store[index].write(data).commit)


def _is_missing(error: BaseException) -> bool:
    """True for tensorstore's error for a chunk that is not stored (``NOT_FOUND: chunk ... is missing``)."""
    return "NOT_FOUND" in str(error)


def _as_future(pending: ts.Future) -> Future:
    """A :class:`concurrent.futures.Future` that completes with ``pending`` (a tensorstore future)."""
    future: Future = Future()
    future.set_running_or_notify_cancel()

    def done(finished: ts.Future) -> None:
        try:
            finished.result()
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits
            future.set_exception(error)
        else:
            future.set_result(None)

    pending.add_done_callback(done)
    return future
