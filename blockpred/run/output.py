"""Creating a run's output and markers once every check has passed, and what may stand at its path.

:func:`create_output` runs under the output's lock: it clears what an
``overwrite`` replaces (moved aside in one rename first, markers invalidated
before anything they vouch for is deleted), writes the markers and creates
the empty volume, and undoes its own work when that fails.  The checks
:func:`prepare <blockpred.run.prepare.prepare>` makes before (a free place, the
inodes the output's files need) are here too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from ..errors import (
    BlockpredError,
    InvalidOptionError,
    OutputExistsError,
    is_permanent,
    os_reason,
    output_error,
)
from ..io import (
    VolumePath,
    create_volume,
    identity,
    move_aside,
    moved_aside,
    open_volume,
    remove_volume,
    stores,
    supports_sharding,
    volume_exists,
)
from ..io.metadata import UnreadableMetadataError
from ..io.stores import ObjectUrl
from ..pipeline.blocking import BlockPlan
from ..pipeline.markers import DoneMarkers, markers_path
from .layout import OutputLayout
from .package_stats import store_with_run
from .prepared import Prepared

logger = logging.getLogger(__name__)


def create_output(p: Prepared, source, owner: str = "") -> DoneMarkers:
    """Every check has passed and this run holds the output's lock (``owner``, its token): write.

    The state :func:`prepare` saw is checked again under the lock: a resume
    continues the same markers, and an output that appeared meanwhile (made by
    another run) is refused unless ``overwrite``.  Replacing an output goes in
    an order a kill at any moment cannot turn into a wrong resume: the old
    markers are invalidated first (see :meth:`DoneMarkers.invalidate`), then
    the old output is deleted, then the new markers are written, then the
    empty output -- so an output without markers is never one of ours
    half-made.  What this call creates is removed again if creating fails
    (a full disk, a refused permission), and the error is one line.
    """
    cfg, plan = p.cfg, p.layout.plan
    path, target = markers_path(p.target_path), str(p.target_path)
    current = DoneMarkers.open(path)
    if p.resumed:
        if current is None or current.token != p.previous.token:
            raise OutputExistsError(f"output {target!r} changed while this run was starting (another run wrote it); "
                                    f"run the same command again")
        why = _why_not_open(p.target_path)
        if why is not None:
            if current.finished().any():
                raise OutputExistsError(f"output {target!r} cannot be opened ({why}), but its markers say blocks of it "
                                        f"are done; repair it, or pass --overwrite to start again")
            # Killed while it was being created (markers first, then the volume): nothing of it is vouched for.
            logger.warning("output %s was left half-created by a run that was cut short; creating it again", target)
            remove_volume(p.target_path)
            _create_sink(p, source)
        store_with_run(path, cfg.model_kwargs)  # kept by the run it resumes; written if that one was cut short
        return dataclasses.replace(current, owner=owner)
    exists = volume_exists(p.target_path)
    if exists and not cfg.overwrite:
        raise OutputExistsError(f"output {target!r} appeared while this run was starting (made by another run); run "
                                f"the same command again to resume it, or pass --overwrite to replace it")
    try:
        _clear(p.target_path, path, exists)
    except BlockpredError:
        raise
    except OSError as err:
        raise output_error(err, "delete the old output", target) from None
    try:
        markers = DoneMarkers.create(path, plan, p.fingerprint, p.masked.left_out() if p.masked is not None else None)
        store_with_run(path, cfg.model_kwargs)  # a 2D package's per-plane statistics: read back by a resume
        _create_sink(p, source)
    except Exception as err:
        _undo_create(p.target_path, path)
        if not isinstance(err, BlockpredError) and (isinstance(err, OSError) or is_permanent(err)):
            raise output_error(err, "create the output", target) from None
        raise
    return dataclasses.replace(markers, owner=owner)


def _create_sink(p: Prepared, source) -> None:
    """The empty output volume of ``p`` (its markers exist already)."""
    cfg, plan, output = p.cfg, p.layout.plan, p.layout.output
    sink = create_volume(
        p.target_path,
        spatial_shape=source.spatial_shape,
        num_channels=p.out_channels,
        dtype=cfg.output_dtype,
        chunk_shape=output.chunks,
        shard_shape=output.shards,
        compression=cfg.compression,
        voxel_size=source.voxel_size,
    )
    sink.close()
    # Blocks are whole chunks (shards, for a sharded array): no two tasks ever write one chunk.
    if not plan.block_shape.is_multiple_of(sink.spatial_chunk_shape):
        raise AssertionError(f"block {tuple(plan.block_shape)} does not tile chunks {sink.chunk_shape} of {p.target_path}")


def _why_not_open(target: VolumePath) -> str | None:
    """Why the volume at ``target`` does not open (one being created when its run was killed may not); None if it does."""
    try:
        open_volume(target).close()
    except UnreadableMetadataError as err:
        return f"{err.file} {err.problem}"
    except (BlockpredError, OSError, ValueError, KeyError) as err:
        return str(err).split("\n", 1)[0]
    return None


def _clear(target: VolumePath, markers: Path | ObjectUrl, exists: bool) -> None:
    """The old output and its markers gone, in an order no interruption turns into a wrong resume.

    A local directory volume is first moved aside in one rename (nothing is
    left at the path; a failed rename changes nothing), then its markers are
    invalidated, then it is deleted.  Anything else (an HDF5 dataset, an
    object store) has its markers invalidated first and is deleted in place.
    What an earlier, interrupted deletion left aside is deleted too: this run
    holds the output's lock, so nobody else is using it.
    """
    try:
        aside = move_aside(target) if exists else None
    except NotImplementedError:
        DoneMarkers.invalidate(markers)  # first: from here nothing vouches for the chunks about to go
        remove_volume(target)
        return
    DoneMarkers.invalidate(markers)
    for old in moved_aside(target):
        try:
            stores.remove_tree(old)
        except OSError as err:
            reason, _ = os_reason(err)
            logger.warning("the old output %s was moved to %s but could not be deleted (%s); delete it by hand",
                           target, old, reason)
        else:
            if old != aside:
                logger.warning("deleted %s, left by an earlier deletion of %s that was cut short", old, target)


def _undo_create(target: VolumePath, markers: Path | ObjectUrl) -> None:
    """Remove what a failed :func:`create_output` made (markers first); what cannot go stays, unvouched for."""
    for undo in (lambda: DoneMarkers.invalidate(markers), lambda: remove_volume(target)):
        try:
            undo()
        except Exception as err:  # noqa: BLE001 - the creation's own error is the one to report
            logger.debug("could not undo a failed output creation: %s", err)


def check_place_free(target: VolumePath) -> None:
    """Nothing but a volume of ours is ever written over: files at the output's place that are no volume stay.

    A place under a symbolic link to nothing is refused as well: nothing can be created through it.
    """
    if target.is_remote:
        return  # object stores are checked by their backend
    node = identity.data_node(target)
    _check_no_dangling_link(target, node)
    if target.format == "hdf5":
        return  # an HDF5 dataset name holds a dataset or nothing here
    if node.is_file() or (node.is_dir() and any(node.iterdir())):
        raise OutputExistsError(
            f"output {str(target)!r} holds files that are not a volume blockpred can open ({node}); choose another "
            f"output, or move them away (--overwrite replaces volumes only)"
        )


def _check_no_dangling_link(target: VolumePath, node: Path) -> None:
    """Refuse an output at (or below) a symbolic link to a place that does not exist: nothing can be made there."""
    for place in (node, *node.parents):
        if os.path.islink(place) and not os.path.exists(place):
            where = "is a symbolic link" if place == node else f"lies under the symbolic link {place}"
            raise InvalidOptionError(
                f"output {str(target)!r} {where} to {os.readlink(place)}, a place that does not exist; remove the "
                f"link, or name the real path"
            )


def check_inodes(target: VolumePath, plan: BlockPlan, output: OutputLayout, files: int) -> None:
    """A local output needs a file per chunk (or shard) still to write (``files``, counted by
    :func:`blockpred.run.plan.count_left`): refuse one the file system cannot hold.

    A file system that reports no inode limit (``f_files`` 0, as btrfs does) is not checked.
    """
    if target.is_remote or target.format == "hdf5":
        return
    place = identity.resolved(identity.data_node(target))
    while not place.exists() and place != place.parent:
        place = place.parent
    info = os.statvfs(place)
    if info.f_files > 0 and files > info.f_favail:
        raise InvalidOptionError(
            f"output {str(target)!r} needs {files:,} files (one per {'shard' if output.shards else 'chunk'}) but the "
            f"file system of {place} has {info.f_favail:,} free inodes; write fewer, larger files "
            f"({_fewer_files(target, plan.block_shape, output)}), or choose another file system"
        )


def _fewer_files(target: VolumePath, block, output: OutputLayout) -> str:
    """What writes fewer files: one shard per block where that is not so yet, else larger blocks."""
    if output.shards is not None and output.shards != block:
        return "--shards block: one file per block"
    if output.shards is not None:
        return "a larger --block: one shard file per block"
    if supports_sharding(target):
        return "--shards block: one file per block" if output.chunks != block else \
            "a larger --block with --shards block: one file per block"
    return "larger --output-chunks, with a --block they divide; or a zarr v3 output with --shards block"
