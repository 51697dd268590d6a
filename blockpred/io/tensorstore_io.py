"""Reads and writes through tensorstore: the hot path of the zarr and N5 backends.

tensorstore decodes and encodes chunks on its own thread pool (no GIL, no
asyncio loop), so a reader or writer thread of the pipeline only starts an
operation and waits.  Every volume of a process shares one
:class:`tensorstore.Context`, so their concurrency limits (one data-copy
thread per core) hold for the process, not per volume.  No chunk cache is
configured: blocks are read once and written once.

A write returns when its data is *committed* (on disk); :meth:`write_async`
returns the commit future instead, so a block is marked done only after the
data it wrote is durable.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future

import numpy as np
import tensorstore as ts

from .base import Volume, VolumePath
from .stores import ObjectUrl, kvstore_spec


@functools.cache
def context() -> ts.Context:
    """The process-wide tensorstore context (thread pools and limits shared by every volume)."""
    return ts.Context()


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


def open_store(spec: dict, *, writable: bool) -> ts.TensorStore:
    """Open an existing array; raises ``ValueError`` when tensorstore cannot (the message says why)."""
    return ts.open(spec, read=True, write=writable, open=True, context=context()).result()


class TensorstoreVolume(Volume):
    """A volume whose reads and writes go through a tensorstore handle ``self._store`` (full-rank)."""

    _store: ts.TensorStore

    def _read(self, index: tuple[slice, ...]) -> np.ndarray:
        return self._store[index].read().result()

    def _write(self, index: tuple[slice, ...], data: np.ndarray) -> None:
        self._store[index].write(data).result()

    def _write_async(self, index: tuple[slice, ...], data: np.ndarray) -> Future:
        return _as_future(self._store[index].write(data).commit)


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
