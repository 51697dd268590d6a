"""An HDF5 file whose writer ended without closing it, made safe to write again: what ``h5clear`` does.

HDF5 has no journal.  A writer killed (``kill -9``, a lost node) leaves two things behind:

* **status flags.**  A file of format 1.10 or newer (superblock version 3, as blockpred makes new files) is
  flagged "open for writing" while a writer has it; the flags outlive a killed writer, and every later open
  for writing is refused ("file is already open for write ... may use h5clear").  A reader opens it as a
  SWMR reader (:mod:`.hdf5_files` does).
* **data past the recorded end.**  The superblock records the end of the allocated space (EOA) when the
  metadata is flushed; chunks written after the last flush lie past it.  A new writer allocates from the
  recorded end, over those chunks, while metadata that may point at them is on disk too: a block written
  after the resume could then be overwritten by the rewrite of another.  Moving the recorded end to the
  file's end (``h5clear --increment=0``) keeps every new allocation past everything the dead writer wrote.

Both are done through the HDF5 library's own calls, the ones ``h5clear`` makes (the file-access property
``clear_status_flags`` and ``H5Fincrement_filesize``), reached with :mod:`ctypes` in the very library h5py
loaded (h5py exposes neither).  Only the caller that knows the writer is gone may call
:func:`clear_status_flags` (:mod:`.hdf5_files` holds the file's writer lock when it does).
"""

from __future__ import annotations

import ctypes
import functools
import os

import h5py
from h5py._objects import phil

#: The HDF5 superblock's signature; it sits at 0, 512, 1024, 2048 ... (after a user block).
_SIGNATURE = b"\x89HDF\r\n\x1a\n"


class RecoveryUnavailable(OSError):
    """The HDF5 library h5py loaded could not be reached here (not on Linux, or an unusual build)."""


def superblock_version(path: str) -> int | None:
    """The version of ``path``'s superblock (0-3; 3 is the format of HDF5 1.10 that SWMR needs), or None when
    no HDF5 signature is found."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            offset = 0
            while offset + len(_SIGNATURE) < size:
                file.seek(offset)
                head = file.read(len(_SIGNATURE) + 1)
                if head[: len(_SIGNATURE)] == _SIGNATURE and len(head) > len(_SIGNATURE):
                    return head[len(_SIGNATURE)]
                offset = 512 if offset == 0 else offset * 2
    except OSError:
        return None
    return None


@functools.cache
def _library() -> ctypes.CDLL:
    """The HDF5 library this process's h5py uses (the same copy: identifiers are only valid there)."""
    candidates = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.split() else ""
                name = os.path.basename(path)
                if name.startswith("libhdf5") and not name.startswith("libhdf5_hl") and ".so" in name:
                    candidates.append(path)
    except OSError as error:
        raise RecoveryUnavailable(f"cannot find the HDF5 library h5py loaded ({error})") from error
    if not candidates:
        raise RecoveryUnavailable("cannot find the HDF5 library h5py loaded in this process")
    library = ctypes.CDLL(candidates[0])
    library.H5Pset.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_void_p]
    library.H5Pset.restype = ctypes.c_int
    library.H5Fget_eoa.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_uint64)]
    library.H5Fget_eoa.restype = ctypes.c_int
    library.H5Fincrement_filesize.argtypes = [ctypes.c_int64, ctypes.c_uint64]
    library.H5Fincrement_filesize.restype = ctypes.c_int
    return library


def clear_status_flags(path: str) -> None:
    """Clear the "open for writing" flags a writer that is gone left in ``path``'s superblock (``h5clear -s``).

    The caller must know that no process writes the file (see the module docstring).
    """
    library = _library()
    with phil:
        access = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
        access.set_file_locking(False, True)  # the caller holds the file's writer lock (a flock HDF5's would meet)
        yes = ctypes.c_uint(1)  # hbool_t: the first byte is read where it is one byte wide
        if library.H5Pset(access.id, b"clear_status_flags", ctypes.byref(yes)) < 0:
            raise RecoveryUnavailable("this HDF5 library does not know the property clear_status_flags")
        h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDWR, fapl=access).close()


def claim_file_end(handle: h5py.File) -> tuple[int, int] | None:
    """Move the recorded end of ``handle``'s file (open for writing) to the file's end where the file is longer
    (``h5clear --increment=0``): (recorded end, file end) when it was moved, else None."""
    library = _library()
    with phil:
        end = ctypes.c_uint64()
        if library.H5Fget_eoa(handle.id.id, ctypes.byref(end)) < 0:
            raise RecoveryUnavailable(f"H5Fget_eoa failed on {handle.filename}")
        size = os.path.getsize(handle.filename)
        if size <= end.value:
            return None
        if library.H5Fincrement_filesize(handle.id.id, 0) < 0:
            raise RecoveryUnavailable(f"H5Fincrement_filesize failed on {handle.filename}")
        return end.value, size

