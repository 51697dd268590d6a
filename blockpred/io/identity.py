"""What a volume path is on disk, whatever name reaches it.

Two names may reach one place: a symbolic link (``glink.zarr -> g.zarr``, or a
parent such as ``/data -> /mnt/lab``), a hard link to an HDF5 file, a bind
mount.  Comparing path strings misses all of them, and an ``--overwrite``
that takes the input for another place deletes it.  So places are compared
by what the file system says they are:

* :func:`data_node`: the one file or directory that holds a volume's data
  (an HDF5 file; a zarr or N5 dataset's directory, or the container for its
  root; a precomputed volume's directory; a TIFF file or folder of slices);
* :func:`overlap`: whether one place is another, or lies inside it -- by
  ``(st_dev, st_ino)`` of the place and of each of its real parents, so links
  and bind mounts (which keep the device and inode) are seen through.

Object-store locations have no links: their keys are compared as strings.
"""

from __future__ import annotations

import os
from pathlib import Path

from .base import VolumePath
from .stores import ObjectUrl

Place = Path | ObjectUrl


def data_node(path: VolumePath) -> Place:
    """The file or directory (or object-store prefix) that holds the data of ``path``.

    Removing the volume removes this node; writing it writes below it.
    """
    if path.format in ("hdf5", "precomputed") or not path.dataset:
        return path.container
    return path.container / path.dataset


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _existing(path: Path) -> Path:
    """``path`` itself, or its nearest ancestor that exists (resolved through links)."""
    path = Path(os.path.realpath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _lineage(path: Path) -> list[tuple[int, int]]:
    """The identities of ``path`` (or its nearest existing ancestor) and of all its real parents."""
    node = _existing(path)
    found = []
    for place in (node, *node.parents):
        identity = _identity(place)
        if identity is not None:
            found.append(identity)
    return found


def within(inner: Place, outer: Place) -> bool:
    """True when ``inner`` is ``outer`` or lies inside it (through any links or mounts)."""
    if isinstance(inner, ObjectUrl) or isinstance(outer, ObjectUrl):
        if not (isinstance(inner, ObjectUrl) and isinstance(outer, ObjectUrl)):
            return False
        if (inner.scheme, inner.bucket, inner.options.endpoint_url) != (outer.scheme, outer.bucket,
                                                                       outer.options.endpoint_url):
            return False
        return not outer.key or inner.key == outer.key or inner.key.startswith(outer.key + "/")
    identity = _identity(outer)
    return identity is not None and identity in _lineage(inner)


def overlap(a: Place, b: Place) -> bool:
    """True when ``a`` and ``b`` are one place, or one lies inside the other."""
    return within(a, b) or within(b, a)


def same_file(a: Place, b: Place) -> bool:
    """True when ``a`` and ``b`` are one existing file or directory (or one object-store key)."""
    if isinstance(a, ObjectUrl) or isinstance(b, ObjectUrl):
        return isinstance(a, ObjectUrl) and isinstance(b, ObjectUrl) and within(a, b) and within(b, a)
    first = _identity(a)
    return first is not None and first == _identity(b)


def resolved(place: Place) -> Place:
    """The place with every symbolic link in it resolved (an object-store URL as it is)."""
    if isinstance(place, ObjectUrl):
        return place
    return Path(os.path.realpath(place))


def link_in_the_way(place: Place) -> Path | None:
    """``place`` when it is itself a symbolic link (deleting it would delete through, or fail); else None."""
    if isinstance(place, ObjectUrl) or not os.path.islink(place):
        return None
    return Path(place)


def real_name(path: VolumePath) -> str:
    """The path with its links resolved, as text: a resume through another link to the same input is the same run."""
    path = path.absolute()
    return str(VolumePath(path.format, resolved(path.container), path.dataset))


def refuse_inside(place: str | os.PathLike, what: str, protected: list[tuple[str, VolumePath | Place | None]]) -> None:
    """Refuse to write ``place`` (``what`` names it: ``--progress-json``, the cache directory) where it is, or lies
    inside, one of the ``protected`` volumes' containers (the input, the mask, the output) or places (the output's
    markers).

    One check for every path blockpred writes besides the output itself, made before anything is opened for
    writing: the place is resolved through symbolic links and ``..``, and compared by inode with each
    container and its real parents, so a hard link to an input HDF5 file is that file.
    """
    from ..errors import InvalidOptionError

    target = Path(os.path.abspath(place))
    for role, volume in protected:
        if volume is None or isinstance(volume, ObjectUrl) or getattr(volume, "is_remote", False):
            continue
        container = volume.absolute().container if isinstance(volume, VolumePath) else Path(volume)
        if within(target, container) or _below_new(target, container):
            real = os.path.realpath(target)
            how = "is" if same_file(target, container) else "lies inside"
            through = (f" (it reaches {real})" if real != str(target) else
                       " (a hard link to it)" if how == "is" and real != os.path.realpath(container) else "")
            raise InvalidOptionError(
                f"{what} {str(place)!r}{through} {how} the {role} {str(volume)!r}: blockpred writes it only "
                f"outside the input, the mask and the output; choose a place elsewhere"
            )


def _below_new(inner: Path, outer: Path) -> bool:
    """True when ``outer`` does not exist yet (an output to be made) and ``inner``, resolved, is or lies below it."""
    if os.path.lexists(outer):
        return False
    real, container = os.path.realpath(inner), os.path.realpath(outer)
    return real == container or real.startswith(container.rstrip(os.sep) + os.sep)
