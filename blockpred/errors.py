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


class InvalidVolumeError(BlockpredError, ValueError):
    """A volume has the wrong number of axes, an unsupported dtype or format."""


class InvalidOptionError(BlockpredError, ValueError):
    """An option (block, halo, ROI, precision, normalisation...) is invalid."""


class StorageAccessError(BlockpredError, PermissionError):
    """An object store refused a request (credentials) or could not be reached (endpoint)."""


class ModelLoadError(BlockpredError, ValueError):
    """A model file is corrupt, of an unknown kind, or does not fit the volume."""


class UntrustedPickleError(ModelLoadError):
    """A model file needs unpickling (which runs arbitrary code) without trust."""


class BlockFailedError(RuntimeError):
    """A block failed while running; names the block and chains the cause."""

    exit_code = 1

    def __init__(self, block_index, message: str):
        super().__init__(message)
        self.block_index = block_index
        self.failed = [block_index]  # every failed block's index, when several failed

    def __reduce__(self):  # picklable across dask workers, with the fields above
        return (_rebuild_block_failed, (self.block_index, self.args[0], self.failed))


def _rebuild_block_failed(block_index, message, failed):
    error = BlockFailedError(block_index, message)
    error.failed = failed
    return error


class ClusterError(BlockpredError, RuntimeError):
    """The local dask cluster failed at run time (workers that could not start); nothing of the output is lost."""

    exit_code = 1
