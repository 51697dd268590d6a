"""zarr-python on a tensorstore KvStore: one S3 client for zarr's metadata and tensorstore's chunks.

zarr-python reads and writes a container's metadata (groups, arrays, OME
attributes) through :class:`KvZarrStore`, a zarr ``Store`` over the same
tensorstore kvstore (:func:`blockpred.io.stores.bucket_kvstore`) the chunks
go through: no s3fs, one set of credentials and retries.
"""

from __future__ import annotations

import asyncio
import functools
from typing import AsyncIterator

from .stores import ObjectUrl, _exact_range, _key_range, bucket_kvstore, check_reachable, storage_error


def zarr_store(url: ObjectUrl, *, read_only: bool = False):
    """A zarr-python store (:class:`KvZarrStore`) rooted at ``url``."""
    return _store_class()(url, read_only=read_only)


@functools.cache
def _store_class():
    """:class:`KvZarrStore`, defined on first use: importing this module imports neither zarr nor tensorstore."""
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
    from zarr.core.buffer import default_buffer_prototype

    def _slice(byte_range) -> slice | None:
        if byte_range is None:
            return None
        if isinstance(byte_range, RangeByteRequest):
            return slice(byte_range.start, byte_range.end)
        if isinstance(byte_range, OffsetByteRequest):
            return slice(byte_range.offset, None)
        if isinstance(byte_range, SuffixByteRequest):
            return slice(-byte_range.suffix, None)
        raise TypeError(f"unexpected byte range {byte_range!r}")

    class KvZarrStore(Store):
        """A zarr-python store over a tensorstore KvStore (s3, gcs; any kvstore driver works).

        zarr-python uses it for metadata (finding arrays and OME-NGFF groups,
        creating and removing them); chunks go through tensorstore's own
        drivers.  Every call is one or a few object-store requests.
        """

        supports_writes = True
        supports_deletes = True
        supports_listing = True
        supports_partial_writes = False

        def __init__(self, url: ObjectUrl, *, read_only: bool = False):
            super().__init__(read_only=read_only)
            self.url = url
            self._root = url.key + "/" if url.key else ""
            self._kv = bucket_kvstore(url)

        def with_read_only(self, read_only: bool = False) -> "KvZarrStore":
            return type(self)(self.url, read_only=read_only)

        def __eq__(self, other: object) -> bool:
            return isinstance(other, type(self)) and other.url == self.url and other.read_only == self.read_only

        def __str__(self) -> str:
            return str(self.url)

        def __repr__(self) -> str:
            return f"KvZarrStore({str(self.url)!r})"

        async def _call(self, future, key: str, writing: bool = False):
            check_reachable(self.url)
            try:
                return await future
            except ValueError as error:
                raise storage_error(self.url / key, error, writing=writing) from error

        async def get(self, key: str, prototype=None, byte_range=None):
            prototype = prototype or default_buffer_prototype()
            result = await self._call(self._kv.read(self._root + key), key)
            if result.state != "value":
                return None
            data = bytes(result.value)
            part = _slice(byte_range)
            return prototype.buffer.from_bytes(data if part is None else data[part])

        async def get_partial_values(self, prototype, key_ranges):
            return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

        async def exists(self, key: str) -> bool:
            result = await self._call(self._kv.read(self._root + key), key)
            return result.state == "value"

        async def set(self, key: str, value) -> None:
            self._check_writable()
            await self._call(self._kv.write(self._root + key, value.to_bytes()), key, writing=True)

        async def set_if_not_exists(self, key: str, value) -> None:
            if not await self.exists(key):
                await self.set(key, value)

        async def delete(self, key: str) -> None:
            self._check_writable()
            full = self._root + key
            await self._call(self._kv.delete_range(_exact_range(full)), key, writing=True)

        async def delete_dir(self, prefix: str) -> None:
            self._check_writable()
            prefix = prefix.strip("/")
            await self._call(self._kv.delete_range(_key_range(self._root + (prefix + "/" if prefix else ""))),
                             prefix, writing=True)

        async def _keys(self, prefix: str) -> list[str]:
            full = self._root + prefix
            keys = await self._call(self._kv.list(_key_range(full), strip_prefix_length=len(self._root.encode())),
                                    prefix)
            return sorted(k.decode() for k in keys)

        async def list(self) -> AsyncIterator[str]:
            for key in await self._keys(""):
                yield key

        async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
            for key in await self._keys(prefix):
                yield key

        async def list_dir(self, prefix: str) -> AsyncIterator[str]:
            prefix = prefix.strip("/")
            start = prefix + "/" if prefix else ""
            seen = set()
            for key in await self._keys(start):
                child = key[len(start):].split("/", 1)[0]
                if child and child not in seen:
                    seen.add(child)
                    yield child

    return KvZarrStore
