"""Arrays in, arrays out: :func:`blockpred.predict` on a numpy, dask or zarr array, through the paths' machinery.

The pipeline reads and writes volumes by path (a job travels to dask workers as paths), so an array input is
given one, and the run is the run of that path:

* a zarr array on a local disk (its store a ``LocalStore``) is read in place, at its own path: nothing is
  copied, and nothing is written to it;
* any other array (numpy, dask, a zarr array in memory or on another store) is copied, slab by slab, into a zarr
  in a temporary folder (:mod:`tempfile`'s: ``$TMPDIR``, else ``/tmp``), which takes the array's size compressed.

Without an output named, the prediction goes to a zarr in that temporary folder and is read back whole: a numpy
array, channels first as the output is stored, ``(c, z, y, x)``.  It must fit in memory: where this process's
resident memory and the prediction are over the run's host budget (``memory_limit``, else what the process holds
and half the memory available: :class:`blockpred.tuning.hostbudget.HostBudget`), the run stops with one line that
says to name an output -- before anything is copied (at one channel, or the channels the options keep), and again
once the network's channels are known, before any block runs.

The temporary folder is removed when :func:`predict_array` returns or raises.  Its paths are this machine's, so a
run that needs one refuses workers elsewhere (``scheduler``, ``cluster``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import RunConfig, make_config
from ..errors import InvalidOptionError, MemoryBudgetError
from ..geometry import Box, Coord
from ..io import SUPPORTED_INPUT_DTYPES, VolumePath, open_volume
from ..pipeline.hostmem import resident_bytes
from ..tuning.hostbudget import HostBudget
from ..tuning.passmemory import size_text
from .prepare import resolve_paths

logger = logging.getLogger(__name__)

#: What ``blockpred.predict`` takes as its input (for the one line that refuses anything else).
TAKES = "a path to a volume (a str or pathlib.Path) or a numpy, dask or zarr array of (z, y, x) or (c, z, y, x)"
#: The chunk of a copied array, per spatial axis at most (the channel axis is one chunk).
COPY_CHUNK = 64
#: The boxes a copy writes, at most (a dask array computes one at a time): 16 Mvox per channel.
COPY_BOX = Coord((64, 512, 512))
#: What a returned prediction is called in the summary.
RETURNED = "numpy array"


@dataclass(frozen=True)
class ArrayInput:
    """An array given as the input: ``kind`` is ``numpy``, ``dask`` or ``zarr``; ``path`` is a zarr array's own,
    where it is read in place (its store a local disk's), else None (the array is copied)."""

    array: Any
    kind: str
    path: VolumePath | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.array.shape)

    @property
    def spatial_shape(self) -> Coord:
        return Coord(self.shape[-3:])

    def __str__(self) -> str:
        where = f" at {str(self.path)!r}" if self.path is not None else ""
        return f"{self.kind} array {'x'.join(map(str, self.shape))} {np.dtype(self.array.dtype)}{where}"


def array_input(value: Any) -> ArrayInput | None:
    """The array ``value`` checked (3 or 4 axes, none empty, a dtype blockpred reads), or None for a path (a str,
    an ``os.PathLike``, a :class:`~blockpred.io.VolumePath`).  Anything else is refused in one line
    (:class:`InvalidOptionError`) that names what is taken."""
    if isinstance(value, (str, os.PathLike, VolumePath)):
        return None
    kind = _kind(value)
    if kind is None:
        shown = " ".join(repr(value).split())
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        convert = "; convert it with numpy.asarray(...) first" if hasattr(value, "__array__") else ""
        raise InvalidOptionError(f"input must be {TAKES}, got {shown} (of type {type(value).__name__}){convert}")
    given = ArrayInput(value, kind, _local_path(value) if kind == "zarr" else None)
    _check(given)
    return given


def _kind(value: Any) -> str | None:
    if isinstance(value, np.ndarray):
        return "numpy"
    # An array of a library not imported cannot have been made: neither is imported for the check.
    zarr = sys.modules.get("zarr")
    if zarr is not None and isinstance(value, zarr.Array):
        return "zarr"
    dask_array = sys.modules.get("dask.array")
    if dask_array is not None and isinstance(value, dask_array.Array):
        return "dask"
    return None


def _local_path(array) -> VolumePath | None:
    """Where a zarr array lies on a local disk (read in place there), else None (in memory, a zip, an object store)."""
    from zarr.storage import LocalStore

    store = array.store
    if not isinstance(store, LocalStore):
        return None
    return VolumePath("zarr", Path(os.path.abspath(store.root)), array.path)


def _check(given: ArrayInput) -> None:
    """One line where blockpred cannot predict the array (what :func:`blockpred.io.check_input_volume` says of a
    volume), before anything is copied."""
    array, kind = given.array, given.kind
    if any(not np.isfinite(s) for s in array.shape):  # a dask array of chunks not yet known
        raise InvalidOptionError(f"the input {kind} array has unknown chunk sizes (shape {array.shape}); call "
                                 f"array.compute_chunk_sizes() first")
    shape = given.shape
    if len(shape) not in (3, 4):
        fix = "add a z axis (array[None])" if len(shape) == 2 else "drop its axes of size 1 (numpy.squeeze)"
        raise InvalidOptionError(f"the input {kind} array has {len(shape)} axes {shape}; blockpred needs (z, y, x) or "
                                 f"(c, z, y, x): {fix}, or reorder them")
    if 0 in shape:
        raise InvalidOptionError(f"the input {kind} array has shape {shape}: an empty axis; there is nothing to "
                                 f"predict")
    if np.dtype(array.dtype) not in SUPPORTED_INPUT_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_INPUT_DTYPES)
        raise InvalidOptionError(f"the input {kind} array has dtype {np.dtype(array.dtype)}; supported input dtypes: "
                                 f"{names}; convert it with array.astype('float32')")


def predict_array(given: ArrayInput, output, config, options: dict, return_summary: bool, run: Callable) -> Any:
    """:func:`blockpred.predict` of an array: ``run(cfg, source_path, target_path, on_prepared=, shown=)`` runs the
    paths and returns the summary.  Returns the summary where ``output`` is named, else the prediction as a numpy
    array (and the summary with it, as ``(array, summary)``, with ``return_summary``)."""
    cfg = make_config(config, **options)
    returned = output is None
    if returned and cfg.pyramid:
        raise InvalidOptionError(f"pyramid={cfg.pyramid} writes levels below an output, but none is named (the "
                                 f"prediction is returned as an array); name an output, or drop pyramid")
    needs_folder = returned or given.path is None
    if needs_folder and (cfg.scheduler is not None or cfg.cluster is not None):
        held = [what for what, there in (("the input array's copy", given.path is None),
                                         ("the returned prediction", returned)) if there]
        raise InvalidOptionError(
            f"{' and '.join(held)} {'go' if len(held) > 1 else 'goes'} through a temporary folder on this machine, "
            f"which workers elsewhere (scheduler, cluster) do not see; write the array to zarr on a shared disk and "
            f"pass its path{' and an output' if returned else ''} (see docs/data.md)")
    if returned:
        check_fits(given, len(cfg.channels) if cfg.channels else 1, cfg, at_least=not cfg.channels)
    with _scratch(needs_folder) as folder:
        source = given.path if given.path is not None else _copy(given, folder / "input.zarr")
        target = VolumePath("zarr", folder / "prediction.zarr", "") if returned else output
        cfg, source_path, target_path = resolve_paths(source, target, config, options)
        on_prepared = (lambda p: check_fits(given, p.out_channels, cfg)) if returned else None
        summary = run(cfg, source_path, target_path, on_prepared=on_prepared,
                      shown=(str(given), RETURNED if returned else str(target_path)))
        if not returned:
            return summary
        with open_volume(target_path) as volume:
            prediction = volume.read(volume.box)
    return (prediction, summary) if return_summary else prediction


def check_fits(given: ArrayInput, channels: int, cfg: RunConfig, at_least: bool = False) -> None:
    """One line (:class:`MemoryBudgetError`) where the prediction of ``given`` at ``channels``, returned as an array,
    and what this process holds are over the run's host budget; nothing where the memory cannot be told."""
    resolved, held = HostBudget(cfg.memory_limit).resolve(), resident_bytes()
    if resolved is None or held is None:
        return
    limit, what = resolved
    size = channels * given.spatial_shape.prod() * np.dtype(cfg.output_dtype).itemsize
    if held + size <= limit:
        return
    shape = "x".join(map(str, (channels, *given.spatial_shape)))
    raise MemoryBudgetError(
        f"the prediction returned as an array must fit in memory, but it takes {'at least ' if at_least else ''}"
        f"{_size(size)} ({shape} {np.dtype(cfg.output_dtype)}), and with the {size_text(held)} this process "
        f"holds that is over {what}; name an output, as blockpred.predict(array, 'prediction.zarr'), to write it "
        f"to disk instead")


def _size(size: int) -> str:
    return size_text(size) if size >= 2**20 else f"{size / 2**10:.0f} KiB"


@contextlib.contextmanager
def _scratch(needed: bool) -> Iterator[Path | None]:
    """A temporary folder (None where not ``needed``), removed with all it holds on the way out, run or fail."""
    if not needed:
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="blockpred-array-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if folder.exists():
            logger.warning("the temporary folder %s could not be removed; remove it by hand", folder)


def _copy(given: ArrayInput, path: Path) -> VolumePath:
    """``given`` as a new zarr array at ``path`` (chunks of up to :data:`COPY_CHUNK` per spatial axis), written
    box by box: a dask array computes one box at a time."""
    import zarr

    shape = given.shape
    lead = shape[:-3]
    spatial = given.spatial_shape
    chunks = Coord(min(COPY_CHUNK, s) for s in spatial)
    copy = zarr.create_array(str(path), shape=shape, dtype=given.array.dtype, chunks=lead + tuple(chunks),
                             fill_value=0)
    for index in np.ndindex(*spatial.ceil_div(COPY_BOX)):
        begin = Coord(index) * COPY_BOX
        box = Box(begin, (begin + COPY_BOX).minimum(spatial))
        at = (slice(None),) * len(lead) + box.to_slices()
        copy[at] = np.asarray(given.array[at])
    return VolumePath("zarr", path, "")
