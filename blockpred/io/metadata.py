"""Volume metadata that cannot be read: one line naming the file and what is wrong with it.

zarr-python, numcodecs and tensorstore report a damaged ``.zarray``,
``zarr.json`` or N5 ``attributes.json`` in their own words -- a
``JSONDecodeError``, a ``TypeError`` from a constructor, a ``KeyError``, a
codec that is not installed -- and name neither the file nor the volume.  The
backends catch those where they read metadata (never where they read chunks:
a chunk that does not decode fails its block) and raise
:func:`unreadable`'s error instead, which finds the file at fault and says
what is wrong with it::

    cannot read the metadata of 'in.zarr': in.zarr/.zarray is not valid JSON at line 1 column 18
    (Expecting value); fix or restore it

A volume whose metadata is damaged still counts as there (``volume_exists``)
when it holds no other volume, so ``--overwrite`` replaces it as any other
(see :func:`other_nodes`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import InvalidOptionError, InvalidVolumeError
from . import stores
from .stores import ObjectUrl

Place = Path | ObjectUrl

#: What zarr-python, numcodecs and tensorstore raise for metadata they cannot parse (a list where an object belongs
#: is an AttributeError; unknown codecs are ValueErrors and KeyErrors, JSONDecodeError a ValueError).
PARSE_ERRORS = (ValueError, TypeError, KeyError, AttributeError)
#: zarr's metadata files, in the order a damaged one is looked for: what a node is, then its attributes.
ZARR_FILES = ("zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata")
N5_FILES = ("attributes.json",)

_FIX = "fix or restore it"
_FIX_CODEC = "install the package that provides it, or fix or restore the file"
_JSON_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true or false",
               type(None): "null"}


class UnreadableMetadataError(InvalidVolumeError):
    """A volume's metadata file is not JSON, or not metadata its backend (with the codecs installed here) reads."""

    def __init__(self, message: str, file: Place | None = None, problem: str = ""):
        super().__init__(message)
        #: The file at fault, and what is wrong with it ("is not valid JSON at ...").
        self.file, self.problem = file, problem


def unreadable(volume: str, directory: Place, error: BaseException, names=ZARR_FILES,
               kind: str = "zarr") -> UnreadableMetadataError | None:
    """The one-line error for ``error``, raised while reading the metadata in ``directory``.

    The file at fault is the first of ``names`` there that is no JSON object;
    when each is one, ``error`` came from their contents and the first of them
    is named.  None when none of ``names`` is there: ``error`` is about
    something else.
    """
    present = [(directory / name, raw) for name in names if (raw := read(directory / name)) is not None]
    for file, raw in present:
        problem = json_problem(raw)
        if problem is not None:
            return metadata_error(volume, file, problem)
    if not present:
        return None
    problem, fix = describe(error, kind)
    return metadata_error(volume, present[0][0], problem, fix)


def metadata_error(volume: str, file: Place, problem: str, fix: str = _FIX) -> UnreadableMetadataError:
    """``cannot read the metadata of VOLUME: FILE PROBLEM; FIX``."""
    return UnreadableMetadataError(f"cannot read the metadata of {volume!r}: {file} {problem}; {fix}", file, problem)


def check_removable(volume: str, directory: Place, error: UnreadableMetadataError, names=ZARR_FILES,
                    kind: str = "zarr") -> None:
    """A volume whose metadata cannot be read (``error``) is removed only when it holds no other node.

    Raises ``error`` on an object store (nothing there says what the prefix
    holds) and :class:`InvalidOptionError` when other nodes are below it.
    """
    others = other_nodes(directory, names)
    if others is None:
        raise error
    if others:
        raise InvalidOptionError(
            f"{volume!r} holds the {kind} nodes {others}, and its own {error.file} {error.problem}; blockpred removes "
            f"one volume at a time: restore that file, or remove {volume!r} yourself"
        )


def read(file: Place) -> bytes | None:
    """The bytes of a metadata file (a local file or an object), or None when there is none."""
    if isinstance(file, ObjectUrl):
        return stores.read_bytes(file)
    try:
        return file.read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def json_problem(raw: bytes) -> str | None:
    """What keeps ``raw`` from being a JSON object (``"is not valid JSON at line 1 column 18 (...)"``), or None."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as error:
        return f"is not valid JSON at line {error.lineno} column {error.colno} ({error.msg})"
    except UnicodeDecodeError:
        return "is not text (it holds bytes that are not UTF-8)"
    if not isinstance(value, dict):
        return f"is not a JSON object (it holds {_JSON_KINDS.get(type(value), 'a value')})"
    return None


def parse_object(raw: bytes, volume: str, file: Place) -> dict:
    """``raw`` as the JSON object it must be; raises :class:`UnreadableMetadataError` naming ``file`` if not."""
    problem = json_problem(raw)
    if problem is not None:
        raise metadata_error(volume, file, problem)
    return json.loads(raw)


def describe(error: BaseException, kind: str = "zarr") -> tuple[str, str]:
    """What is wrong with metadata that is JSON but that ``error`` refused, and how to fix it."""
    codec = _codec_name(error)
    if codec is not None:
        return f"names the codec {codec!r}, which is not installed", _FIX_CODEC
    if isinstance(error, KeyError):
        return f"lacks the key {error.args[0]!r}" if error.args else f"is not valid {kind} metadata", _FIX
    text = str(error).split("\n", 1)[0]
    missing = re.search(r"missing \d+ required (?:keyword-only |positional )?arguments?: (.*)$", text)
    if missing:
        keys = missing.group(1).replace(" and ", ", ")
        return f"lacks the key{'s' if ',' in keys else ''} {keys}", _FIX
    return f"is not valid {kind} metadata ({_detail(text)})", _FIX


def _codec_name(error: BaseException) -> str | None:
    """The codec id an unknown-codec error of numcodecs or zarr names, or None for any other error."""
    if type(error).__name__ != "UnknownCodecError":  # by name: this module imports neither numcodecs nor zarr
        return None
    codec_id = getattr(error, "codec_id", None)  # numcodecs' (zarr v2); zarr's own (v3) chains the KeyError
    if codec_id is None and isinstance(error.__cause__, KeyError) and error.__cause__.args:
        codec_id = error.__cause__.args[0]
    return None if codec_id is None else str(codec_id).strip("'\"")


def _detail(text: str) -> str:
    """An error's first line without tensorstore's spec and preamble: what was found wrong in the file."""
    text = text.split(" [tensorstore_spec=", 1)[0]
    match = re.search(r'(?:attributes\.json|zarr\.json|\.zarray)": (.*)$', text)
    return match.group(1) if match else text


def tensorstore_problem(error: BaseException) -> tuple[str, str]:
    """What tensorstore found wrong with an N5 ``attributes.json``, and how to fix it."""
    detail = _detail(str(error).split("\n", 1)[0])
    compression = re.search(r'"compression": .*"([^"]+)" is not registered', detail)
    if compression:
        return f"names the compression {compression.group(1)!r}, which tensorstore does not know", _FIX
    return f"is not valid N5 metadata ({detail})", _FIX


def other_nodes(directory: Place, names=ZARR_FILES) -> list[str] | None:
    """The folders right below ``directory`` that hold metadata of their own (other volumes or groups).

    Folders named by a number are left out: they are the scales of an
    OME-NGFF image (``0``, ``1``, ...) or chunk folders, part of the volume.
    None on an object store, where listing a prefix lists every chunk: there
    nothing tells whether a volume with damaged metadata holds others.
    """
    if isinstance(directory, ObjectUrl):
        return None
    try:
        children = sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.isdigit())
    except OSError:
        return []
    return [child.name for child in children if any((child / name).is_file() for name in names)]
