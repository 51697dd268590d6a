"""Object stores: ``s3://bucket/key`` (and ``gs://``) locations, how to reach them, and a zarr store on them.

A volume's container is a local :class:`pathlib.Path` or an :class:`ObjectUrl`
(``s3://bucket/path/vol.zarr``).  An :class:`ObjectUrl` carries the
:class:`StorageOptions` that reach it, so the options travel with the path to
every place that opens it: input, output, mask, markers, dask workers.

Everything on an object store goes through tensorstore's kvstore drivers
(``s3``, ``gcs``): the chunks (:mod:`.tensorstore_io`), and also the metadata
zarr-python reads and writes (:class:`~.kvzarr.KvZarrStore`, a zarr store over a
tensorstore KvStore), N5's ``attributes.json`` and the done markers.  One
client, one credential chain and one endpoint for data and metadata, and no
second S3 library (s3fs pins aiobotocore and botocore versions).

Endpoint, region and credentials (s3):

* endpoint: ``endpoint_url`` option, else ``AWS_ENDPOINT_URL_S3``, else
  ``AWS_ENDPOINT_URL``, else AWS itself;
* region: ``region`` option, else ``AWS_REGION``, else ``AWS_DEFAULT_REGION``,
  else the bucket's (tensorstore asks AWS);
* credentials: ``anonymous=true`` signs nothing (public buckets); a
  ``profile`` option reads that profile from the AWS config files; with
  ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` set (and
  ``AWS_SESSION_TOKEN``, when set) those are used; else the default AWS chain
  (``AWS_PROFILE``, ``~/.aws/credentials`` and ``config``, web identity, ECS,
  EC2 instance metadata, then anonymous).  The chain is asked only when
  needed: tensorstore's AWS libraries print an error line for each source it
  tries and lacks (``E1123 ... AuthCredentialsProvider ... ~/.aws/config``),
  which named environment credentials avoid.

``gs://`` goes to tensorstore's ``gcs`` driver with Google's default
credentials; it takes none of the options above and is untested here.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..errors import InputNotFoundError, InvalidOptionError, StorageAccessError

#: URL schemes blockpred reads and writes, and the tensorstore kvstore driver of each.
DRIVERS = {"s3": "s3", "gs": "gcs"}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
#: Retries of a failed S3 request: about a minute in all, so a wrong endpoint fails within it.
_S3_RETRIES = {"max_retries": 10, "initial_delay": "0.5s", "max_delay": "8s"}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True, slots=True)
class StorageOptions:
    """How to reach an object store: the escape hatch over the AWS environment variables and config."""

    #: S3-compatible server (MinIO, Ceph, moto ...), e.g. ``http://127.0.0.1:9000``.
    endpoint_url: str | None = None
    #: Region used in request signatures, e.g. ``eu-central-1``.
    region: str | None = None
    #: Sign no request (public buckets), as ``aws s3 --no-sign-request``.
    anonymous: bool = False
    #: Profile of the AWS config and credentials files.
    profile: str | None = None

    _ALIASES = {"endpoint": "endpoint_url", "region_name": "region", "aws_region": "region", "anon": "anonymous",
                "no_sign_request": "anonymous", "no_sign": "anonymous", "aws_profile": "profile"}

    @classmethod
    def parse(cls, value: "StorageOptions | Mapping[str, Any] | Iterable[str] | None") -> "StorageOptions":
        """Options from a mapping (YAML, ``predict(storage_options=...)``) or ``KEY=VALUE`` strings (CLI)."""
        if value is None:
            return cls()
        if isinstance(value, StorageOptions):
            return value
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, Mapping):
            pairs = {}
            for item in value:
                key, sep, text = str(item).partition("=")
                if not sep or not key.strip():
                    raise InvalidOptionError(
                        f"a storage option must be KEY=VALUE (e.g. endpoint_url=http://127.0.0.1:9000), got {item!r}")
                pairs[key.strip()] = text.strip()
            value = pairs
        known = [f.name for f in fields(cls)]
        values: dict[str, Any] = {}
        for raw_key, raw in value.items():
            key = str(raw_key).strip().lower().replace("-", "_")
            key = cls._ALIASES.get(key, key)
            if key not in known:
                raise InvalidOptionError(f"unknown storage option {raw_key!r}; known: {', '.join(known)}")
            if key == "anonymous":
                if isinstance(raw, bool):
                    values[key] = raw
                elif str(raw).strip().lower() in _TRUE + _FALSE:
                    values[key] = str(raw).strip().lower() in _TRUE
                else:
                    raise InvalidOptionError(f"storage option anonymous must be true or false, got {raw!r}")
            else:
                values[key] = None if raw is None or str(raw).strip() == "" else str(raw).strip()
        if values.get("endpoint_url") and not re.match(r"^https?://", values["endpoint_url"]):
            raise InvalidOptionError(
                f"storage option endpoint_url must be an http:// or https:// URL, got {values['endpoint_url']!r}")
        if values.get("anonymous") and values.get("profile"):
            raise InvalidOptionError("storage options anonymous and profile exclude each other; keep one")
        return cls(**values)


@dataclass(frozen=True, slots=True)
class ObjectUrl:
    """``scheme://bucket/key``: a container or object on an object store, with the options to reach it.

    It answers the few :class:`pathlib.Path` questions blockpred asks of a
    container (``name``, ``suffix``, ``stem``, ``parent``, ``with_name``,
    ``/``), so a URL container works where a local one does.
    """

    scheme: str
    bucket: str
    #: ``/``-separated, no leading or trailing ``/``; "" is the bucket's root.
    key: str = ""
    options: StorageOptions = StorageOptions()

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"

    def __repr__(self) -> str:
        return f"ObjectUrl({str(self)!r})"

    def __truediv__(self, key: str) -> "ObjectUrl":
        return ObjectUrl(self.scheme, self.bucket, join_key(self.key, key), self.options)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        name = self.name
        dot = name.rfind(".")
        return name[dot:] if 0 < dot < len(name) - 1 else ""

    @property
    def stem(self) -> str:
        return self.name[: len(self.name) - len(self.suffix)] if self.suffix else self.name

    @property
    def parent(self) -> "ObjectUrl":
        return ObjectUrl(self.scheme, self.bucket, self.key.rpartition("/")[0], self.options)

    def with_name(self, name: str) -> "ObjectUrl":
        return self.parent / name

    def absolute(self) -> "ObjectUrl":
        return self


def join_key(*parts: str) -> str:
    """``a/b`` + ``c/`` -> ``a/b/c``: the parts joined by single slashes, none at either end."""
    return "/".join(p for part in parts for p in str(part).split("/") if p)


def is_url(text: str) -> bool:
    """True for ``scheme://...`` (any scheme; :func:`parse_url` says which are supported)."""
    return _URL.match(str(text)) is not None


def parse_url(text: str, options: StorageOptions | None = None) -> ObjectUrl:
    """``s3://bucket/a/b`` -> ``ObjectUrl("s3", "bucket", "a/b")``; raises for other schemes or no bucket."""
    match = _URL.match(str(text))
    if match is None:
        raise InvalidOptionError(f"{text!r} is not a URL; object stores are named as s3://bucket/path")
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme not in DRIVERS:
        raise InvalidOptionError(
            f"URL scheme {scheme!r} of {text!r} is not supported; name a local path, s3://bucket/path or gs://bucket/path")
    bucket, _, key = rest.partition("/")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{1,220}", bucket):
        raise InvalidOptionError(f"{text!r} must name a bucket, as {scheme}://BUCKET/path/vol.zarr; got {bucket!r}")
    return ObjectUrl(scheme, bucket, join_key(key), options or StorageOptions())


# ------------------------------------------------------------------------- tensorstore kvstore specs


def kvstore_spec(url: ObjectUrl, key: str = "") -> dict:
    """The tensorstore kvstore spec of the prefix ``key`` under ``url`` (a directory: it ends in ``/``)."""
    path = join_key(url.key, key)
    spec: dict[str, Any] = {"driver": DRIVERS[url.scheme], "bucket": url.bucket, "path": path + "/" if path else ""}
    if url.scheme == "s3":
        spec.update(_s3_access(url.options))
    return spec


def _s3_access(options: StorageOptions) -> dict:
    """Endpoint, region, credentials and retries of an s3 spec (see the module docstring)."""
    env = os.environ
    access: dict[str, Any] = {"aws_credentials": aws_credentials(options), "s3_request_retries": _retries()}
    endpoint = options.endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        access["endpoint"] = endpoint.rstrip("/")
    region = options.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        access["aws_region"] = region
    elif endpoint:
        access["aws_region"] = "us-east-1"  # an S3-compatible server signs with some region; this is the usual one
    return access


def _retries() -> dict:
    """Retries of a failed S3 request: :data:`_S3_RETRIES`, or ``BLOCKPRED_S3_RETRIES`` of them (0 and up)."""
    retries = dict(_S3_RETRIES)
    text = os.environ.get("BLOCKPRED_S3_RETRIES", "").strip()
    if text:
        if not text.isdigit():
            raise InvalidOptionError(f"BLOCKPRED_S3_RETRIES must be a number of retries (0 or more), got {text!r}")
        retries["max_retries"] = int(text)
    return retries


def aws_credentials(options: StorageOptions) -> dict:
    """The ``aws_credentials`` of an s3 spec: a named source, else the default AWS chain."""
    if options.anonymous:
        return {"type": "anonymous"}
    if options.profile:
        return {"type": "profile", "profile": options.profile}
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        # First in the AWS chain anyway; named, the chain's other sources are never tried (nor logged as missing).
        return {"type": "environment"}
    return {"type": "default"}


def context():
    """The tensorstore context of every volume and store (thread pools and limits); tensorstore imported here."""
    import tensorstore as ts

    return ts.Context()


@functools.lru_cache(maxsize=64)
def _open_kvstore(spec_json: str):
    import tensorstore as ts

    return ts.KvStore.open(json.loads(spec_json), context=context()).result()


def bucket_kvstore(url: ObjectUrl):
    """The tensorstore KvStore of ``url``'s bucket (keys are full object keys); one per bucket and options."""
    return _open_kvstore(json.dumps(kvstore_spec(ObjectUrl(url.scheme, url.bucket, "", url.options)), sort_keys=True))


def _key_range(prefix: str):
    """The keys starting with ``prefix``."""
    import tensorstore as ts

    return ts.KvStore.KeyRange(prefix.encode(), _successor(prefix.encode())) if prefix else ts.KvStore.KeyRange()


def _exact_range(key: str):
    """The one key ``key``."""
    import tensorstore as ts

    return ts.KvStore.KeyRange(key.encode(), key.encode() + b"\x00")


def _successor(prefix: bytes) -> bytes:
    """The smallest key above every key that starts with ``prefix`` (b"" when there is none: no bound)."""
    while prefix and prefix[-1] == 0xFF:
        prefix = prefix[:-1]
    return prefix[:-1] + bytes([prefix[-1] + 1]) if prefix else b""


# ------------------------------------------------------------------------- blocking helpers (N5, markers)


def read_bytes(url: ObjectUrl) -> bytes | None:
    """The object at ``url``, or None when there is none."""
    check_reachable(url)
    try:
        result = bucket_kvstore(url).read(url.key).result()
    except ValueError as error:
        raise storage_error(url, error) from error
    return bytes(result.value) if result.state == "value" else None


def write_bytes(url: ObjectUrl, data: bytes) -> None:
    check_reachable(url)
    try:
        bucket_kvstore(url).write(url.key, data).result()
    except ValueError as error:
        raise storage_error(url, error, writing=True) from error


#: The generation of a key that holds no object: a write conditional on it creates, never replaces.
NO_OBJECT = b"\x02"


def read_versioned(url: ObjectUrl) -> tuple[bytes | None, bytes]:
    """The object at ``url`` (None when there is none) and its generation, for :func:`write_if`."""
    check_reachable(url)
    try:
        result = bucket_kvstore(url).read(url.key).result()
    except ValueError as error:
        raise storage_error(url, error) from error
    return (bytes(result.value) if result.state == "value" else None), bytes(result.stamp.generation)


def write_if(url: ObjectUrl, data: bytes | None, generation: bytes) -> bytes | None:
    """Write (``data``) or delete (None) the object at ``url`` only if it is still at ``generation``.

    :data:`NO_OBJECT` creates it only if there is none (S3's conditional put).
    Returns the new generation, or None when the condition failed (someone else
    wrote or deleted it meanwhile).
    """
    check_reachable(url)
    try:
        stamp = bucket_kvstore(url).write(url.key, data, if_equal=generation).result()
    except ValueError as error:
        raise storage_error(url, error, writing=True) from error
    return bytes(stamp.generation) if stamp.generation else None


def list_keys(url: ObjectUrl) -> list[str]:
    """The keys below ``url`` (as a prefix ``key/``), relative to it, in no particular order."""
    check_reachable(url)
    prefix = url.key + "/" if url.key else ""
    try:
        keys = bucket_kvstore(url).list(_key_range(prefix), strip_prefix_length=len(prefix.encode())).result()
    except ValueError as error:
        raise storage_error(url, error) from error
    return [k.decode() for k in keys]


def delete_prefix(url: ObjectUrl) -> None:
    """Delete every object below ``url`` (``key/...``) and the object ``key`` itself; nothing else."""
    if not url.key:
        raise ValueError(f"refusing to delete the whole bucket {url}")
    check_reachable(url)
    try:
        kv = bucket_kvstore(url)
        kv.delete_range(_key_range(url.key + "/")).result()
        kv.delete_range(_exact_range(url.key)).result()
    except ValueError as error:
        raise storage_error(url, error, writing=True) from error


def remove_tree(location: Path | ObjectUrl) -> None:
    """Remove a directory tree, or every object below a URL (see :func:`delete_prefix`); none there is fine."""
    if isinstance(location, ObjectUrl):
        delete_prefix(location)
    elif location.exists():
        shutil.rmtree(location)


def bucket_exists(url: ObjectUrl) -> bool:
    """False when the bucket does not exist (a read of a missing bucket looks like a missing key)."""
    try:
        bucket_kvstore(url).list(_key_range(url.key or "x")).result()
    except ValueError as error:
        if "NoSuchBucket" in str(error) or "NOT_FOUND" in str(error):
            return False
        raise storage_error(url, error) from error
    return True


#: After a request to an object store failed for want of a connection (every retry of it, about a minute),
#: requests to that store fail at once for this many seconds: a run whose store went away ends in about a
#: minute, not a minute per marker object, lock refresh and flush.
UNREACHABLE_S = 60.0
_UNREACHABLE: dict[tuple, float] = {}


def _endpoint_key(url: ObjectUrl) -> tuple:
    return (url.scheme, _s3_access(url.options).get("endpoint") if url.scheme == "s3" else None)


def check_reachable(url: ObjectUrl) -> None:
    """Raise :class:`StorageAccessError` at once while ``url``'s store was found unreachable a moment ago."""
    since = _UNREACHABLE.get(_endpoint_key(url))
    if since is not None:
        ago = time.monotonic() - since
        if ago < UNREACHABLE_S:
            raise StorageAccessError(f"cannot reach the object store of {str(url)!r} ({_endpoint_text(url)}): it did "
                                     f"not answer {ago:.0f} s ago, after every retry; not asked again yet")
        _UNREACHABLE.pop(_endpoint_key(url), None)


def note_failure(url: ObjectUrl, error: BaseException) -> None:
    """A request to ``url``'s store failed with ``error``: a store that could not be reached is not asked for a while."""
    text = str(error)
    if "CURL error" in text or "Could not connect" in text:
        _UNREACHABLE[_endpoint_key(url)] = time.monotonic()


def storage_error(url: ObjectUrl, error: Exception, *, writing: bool = False) -> Exception:
    """A one-line :class:`BlockpredError` for what tensorstore reported about ``url``."""
    text = str(error)
    note_failure(url, error)
    first = text.split(" [", 1)[0].split("\n", 1)[0]
    if "NoSuchBucket" in text:
        return InputNotFoundError(f"bucket {url.bucket!r} of {str(url)!r} does not exist; check the URL and the "
                                  f"endpoint ({_endpoint_text(url)})")
    if "PERMISSION_DENIED" in text or "UNAUTHENTICATED" in text:
        how = "write to" if writing else "read"
        return StorageAccessError(
            f"access denied to {how} {str(url)!r} ({first}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            f"(or AWS_PROFILE), or pass --storage-option anonymous=true for a public bucket")
    if "CURL error" in text or "Could not connect" in text or "ABORTED" in text:
        return StorageAccessError(f"cannot reach the object store of {str(url)!r} ({_endpoint_text(url)}): {first}; "
                                  f"check --storage-option endpoint_url or AWS_ENDPOINT_URL")
    return StorageAccessError(f"object store request for {str(url)!r} failed: {first}")


def _endpoint_text(url: ObjectUrl) -> str:
    if url.scheme != "s3":
        return "Google Cloud Storage"
    endpoint = _s3_access(url.options).get("endpoint")
    return f"endpoint {endpoint}" if endpoint else "AWS S3"
