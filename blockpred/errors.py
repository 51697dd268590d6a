"""The errors blockpred raises.

A problem the user can fix (a missing file, a bad option, an existing output)
raises a :class:`BlockpredError` subclass that also inherits the builtin it
resembles, so ``except FileNotFoundError`` still works.  The CLI prints such an
error as one line and exits with code 2; anything else is a bug or a runtime
failure.  Messages say what must hold, what was found, and where.
"""

from __future__ import annotations


class BlockpredError(Exception):
    """Base class of every error caused by the user's input or options."""

    exit_code = 2


class InputNotFoundError(BlockpredError, FileNotFoundError):
    """An input path, a dataset inside a container, or a model file is missing."""


class OutputExistsError(BlockpredError, FileExistsError):
    """The output exists and ``overwrite`` was not given."""


class OutputLockedError(BlockpredError, FileExistsError):
    """Another run holds the output (see :mod:`blockpred.io.ownership`)."""


class OutputAccessError(BlockpredError, OSError):
    """The output (or its markers) cannot be created, written or deleted: permissions, a full disk."""


class RunFailedError(BlockpredError):
    """A step after the blocks failed (the pyramid, say): what was done is kept; the message says how to go on."""

    exit_code = 1


class InvalidVolumeError(BlockpredError, ValueError):
    """A volume has the wrong number of axes, an unsupported dtype or format."""


class InvalidOptionError(BlockpredError, ValueError):
    """An option (block, halo, ROI, precision, normalisation...) is invalid."""


class MemoryBudgetError(InvalidOptionError):
    """A block (or ``--memory-limit``) the memory cannot hold, foreseen before the network runs at it (see
    :mod:`blockpred.run.memcheck`)."""


class StorageAccessError(BlockpredError, PermissionError):
    """An object store refused a request (credentials) or could not be reached (endpoint)."""


class ModelLoadError(BlockpredError, ValueError):
    """A model file is corrupt, of an unknown kind, or does not fit the volume."""


class UntrustedPickleError(ModelLoadError):
    """A model file needs unpickling (which runs arbitrary code) without trust."""


class PackageTestFailedError(ModelLoadError):
    """A bioimage.io package does not reproduce its own test output from its test input (see
    :mod:`blockpred.models.check`)."""


class OwnershipLostError(RuntimeError):
    """This run no longer holds its output's lock: another run took it over (see :mod:`blockpred.io.ownership`)."""

    exit_code = 1


class BlockFailedError(RuntimeError):
    """A block failed while running; names the block and chains the cause.

    :attr:`permanent` failures (a full disk, a permission refused, a chunk
    that does not decode, a lost output lock) are not retried: a retry would
    only fail again, after recomputing the block.
    """

    exit_code = 1

    def __init__(self, block_index, message: str, *, permanent: bool | None = None):
        super().__init__(message)
        self.block_index = block_index
        self.failed = [block_index]  # every failed block's index, when several failed
        self._permanent = permanent

    @property
    def permanent(self) -> bool:
        if self._permanent is None:
            return is_permanent(self.__cause__)
        return self._permanent

    def __reduce__(self):  # picklable across dask workers, with the fields above
        return (_rebuild_block_failed, (self.block_index, self.args[0], self.failed, self.permanent))


def _rebuild_block_failed(block_index, message, failed, permanent=False):
    error = BlockFailedError(block_index, message, permanent=permanent)
    error.failed = failed
    return error


#: errno values of faults a retry does not cure: no space, no quota, no permission, a read-only file system.
PERMANENT_ERRNOS = frozenset({28, 122, 13, 1, 30})  # ENOSPC, EDQUOT, EACCES, EPERM, EROFS
#: The same, as the text of errors that carry no errno (tensorstore's), and chunks that do not decode.
_OS_TEXTS = ("no space left on device", "disk quota exceeded", "permission denied", "operation not permitted",
             "read-only file system")
_PERMANENT_TEXTS = _OS_TEXTS + ("data_loss", "error decoding", "decompress", "corrupt",
                                # an object store that did not answer any of a request's retries (about a minute)
                                "retry attempts failed", "cannot reach the object store")


#: CUDA errors after which the device is unusable in the process ("sticky" errors): every later call fails too.
_DEVICE_LOST_TEXTS = ("an illegal memory access was encountered", "unspecified launch failure",
                      "device-side assert triggered", "misaligned address", "an illegal instruction was encountered")


def _causes(error: BaseException | None):
    """``error`` and the errors it was raised from (eight at most)."""
    seen = 0
    while error is not None and seen < 8:
        yield error
        error, seen = error.__cause__ or error.__context__, seen + 1


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s text, or its class's name where it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def is_device_lost(error: BaseException | None) -> bool:
    """True when ``error`` (or an error it was raised from) is a CUDA error that leaves the device unusable here."""
    return any(words in str(cause).lower() for cause in _causes(error) for words in _DEVICE_LOST_TEXTS)


#: What a lost device's one line adds: the known cause and the way past it.
DEVICE_LOST_HINT = ("the GPU is unusable in this process after such an error; a block whose tensors pass 2^31 "
                    "elements is a known cause (cuDNN indexes with 32 bits): run again with a smaller --block")


def is_permanent(error: BaseException | None) -> bool:
    """True when ``error`` (or an error it was raised from) is a fault a retry would only repeat: a full disk, a
    refused permission, a chunk that does not decode, a lost device (:func:`is_device_lost`) ..."""
    for cause in _causes(error):
        if isinstance(cause, (OwnershipLostError, MissingChunkError)):
            return True
        if isinstance(cause, OSError) and cause.errno in PERMANENT_ERRNOS:
            return True
        if any(words in str(cause).lower() for words in _PERMANENT_TEXTS + _DEVICE_LOST_TEXTS):
            return True
    return False


class MissingChunkError(RuntimeError):
    """A block read an input chunk that is not stored, with ``--missing-chunks error``."""


def os_reason(error: BaseException) -> tuple[str, str]:
    """What an OS-level failure was, in a few words, and how to get past it.

    Works for an :class:`OSError` and for errors that carry only text
    (tensorstore's ``ValueError``); the errno decides the advice.
    """
    import errno as codes

    number = getattr(error, "errno", None)
    text = str(error)
    if number is None:
        for candidate, words in ((codes.ENOSPC, "No space left on device"), (codes.EDQUOT, "Disk quota exceeded"),
                                 (codes.EACCES, "Permission denied"), (codes.EPERM, "Operation not permitted"),
                                 (codes.EROFS, "Read-only file system")):
            if words in text:
                number = candidate
                break
    if number in (codes.ENOSPC, codes.EDQUOT):
        return ("no space left on the device" if number == codes.ENOSPC else "the disk quota is used up",
                "free space there or choose another output")
    if number in (codes.EACCES, codes.EPERM):
        where = getattr(error, "filename", None)
        return ("permission denied" + (f" on {where}" if where else ""),
                "check the permissions there, or choose another output")
    if number == codes.EROFS:
        return "the file system is read-only", "choose an output on a writable file system"
    reason = getattr(error, "strerror", None) or text.split("\n", 1)[0].split(" [", 1)[0]
    where = getattr(error, "filename", None)
    return (reason + (f" ({where})" if where and str(where) not in reason else ""),
            "check the path and the file system")


def os_fault(error: BaseException | None) -> tuple[str, str] | None:
    """:func:`os_reason` for the first of ``error`` and its causes that is a fault of the file system a retry
    does not cure (a full disk, a quota, a refused permission, a read-only file system), else None."""
    for cause in _causes(error):
        number = getattr(cause, "errno", None) if isinstance(cause, OSError) else None
        text = str(cause).lower()
        if number in PERMANENT_ERRNOS or any(words in text for words in _OS_TEXTS):
            return os_reason(cause)
    return None


def output_error(error: BaseException, doing: str, output: str) -> "OutputAccessError":
    """One line for an OS-level failure while ``doing`` something to ``output``: what failed and how to fix it."""
    reason, fix = os_reason(error)
    return OutputAccessError(f"cannot {doing} {output!r}: {reason}; {fix}")


class ClusterError(BlockpredError, RuntimeError):
    """The dask cluster failed at run time (workers that could not start or all went away); nothing done is lost."""

    exit_code = 1


class NoWorkersError(ClusterError):
    """A dask run had no worker for its ``no_worker_timeout``: finished blocks are kept, the same command resumes."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what SLURM, Kubernetes and ``kill`` send first), raised in the main thread as Ctrl-C is: the
    run ends the same way -- its cluster closed, its lock released, its end event written, one line."""

    signal_number = 15

    def __init__(self, message: str = "terminated (SIGTERM)"):
        super().__init__(message)


class HungUp(Terminated):
    """SIGHUP (a closed terminal, a lost SSH session, ``kill -HUP``), ended as SIGTERM is, with exit code 129."""

    signal_number = 1

    def __init__(self, message: str = "hung up (SIGHUP)"):
        super().__init__(message)


def one_line(err: BaseException) -> str:
    """An error as the one line the user sees: blockpred's own say what to do; others are named, with the cure."""
    if isinstance(err, BlockpredError):
        return str(err)
    if isinstance(err, BlockFailedError):
        named = err.__cause__ is not None and os_fault(err.__cause__) is None  # a full disk needs no class name
        cause = f" ({type(err.__cause__).__name__})" if named else ""
        return f"{err}{cause}; every other block is kept: run the same command again to compute only what is missing"
    if isinstance(err, OwnershipLostError):
        return str(err)
    if isinstance(err, OSError):
        reason, fix = os_reason(err)
        return f"{reason}; {fix}"
    text = str(err).split("\n", 1)[0]
    where = _raised_at(err)
    return (f"{type(err).__name__}: {text} (an unexpected error{f', raised at {where}' if where else ''}: run again "
            f"with --debug for its traceback, and report it)")


def _raised_at(err: BaseException) -> str:
    """The file (from its package on) and line an error was raised at, from its traceback (a dask worker's too:
    its error comes back with its frames): a rare error that does not come again still says where it was."""
    import traceback

    frames = traceback.extract_tb(err.__traceback__) if err.__traceback__ is not None else []
    if not frames:
        return ""
    path = frames[-1].filename.replace("\\", "/")
    for marker in ("/site-packages/", "/blockpred/"):
        if marker in path:
            path = ("blockpred/" if marker == "/blockpred/" else "") + path.rsplit(marker, 1)[1]
            break
    else:
        path = "/".join(path.split("/")[-2:])  # the standard library's: json/decoder.py
    return f"{path}:{frames[-1].lineno}"


#: Messages of allocation failures that are not :class:`torch.OutOfMemoryError`.
_OOM_MESSAGES = ("out of memory", "cudnn_status_alloc_failed", "can't allocate memory", "not enough memory")


def is_out_of_memory(error: BaseException) -> bool:
    """True for a device (or host) allocation failure, whatever layer raised it.

    ``torch.OutOfMemoryError`` (and ``torch.cuda.OutOfMemoryError``, the same class) is told by its class, found
    in the error's classes by name so that nothing here imports torch.
    """
    if isinstance(error, MemoryError) or any(
            cls.__name__ == "OutOfMemoryError" and cls.__module__.startswith("torch") for cls in type(error).__mro__):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error).lower() for m in _OOM_MESSAGES)
