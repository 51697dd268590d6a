"""Finding a network's geometry by dry runs, never by assumption.

:func:`probe_network` runs the network once on zeros of the block's input
shape and reads off the output: channels, and the context a valid-convolution
network consumes (``(input - output) / 2`` per axis).  For such a network it
then checks the input shape that yields exactly ``block + 2 x halo``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import InvalidOptionError, ModelLoadError, first_line, is_out_of_memory
from ..geometry import Coord
from ..pipeline.infer import Predictor
from .shapes import KnownShape, KnownShapes
from .tensors import LargestTensor, weight_shapes

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NetworkGeometry:
    in_channels: int
    out_channels: int
    input_shape: Coord  # spatial input of one block
    output_shape: Coord  # spatial output for that input
    context: Coord  # voxels a valid network consumes on each side (0 for 'same')
    #: The largest tensor of the first dry run per input voxel (see :mod:`.tensors`); None where not counted.
    largest_per_voxel: float | None = None
    #: The dry run's seeded random batch and the network's output for it, where :func:`probe_network` was asked
    #: to keep them (a warm process's dry run that stands for a timed pass); dropped once used.
    sample: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)
    #: False where the first dry run did not run: its shape was known (:mod:`.shapes`), so it timed nothing.
    ran: bool = field(default=True, compare=False)


def _dry_run(predictor: Predictor, in_channels: int, shape: Coord, sizes: str | None = None,
             counter: LargestTensor | None = None,
             keep: bool = False) -> tuple[int, Coord, tuple[np.ndarray, np.ndarray] | None]:
    logger.info("dry run of the network on an input of %s", "x".join(map(str, shape)))
    predictor.watch = counter
    sample = None
    try:
        if keep:  # seeded random data, as a timed pass runs (kernels may run faster on zeros)
            batch = np.random.default_rng(0).random((1, in_channels) + tuple(shape), dtype=np.float32)
            sample = (batch, predictor(batch).copy())  # a copy: the predictor reuses its output arrays
            out = sample[1].shape
        else:
            out = predictor.output_shape((1, in_channels) + tuple(shape))
    except Exception as err:
        line = first_line(err)
        if is_out_of_memory(err):
            raise InvalidOptionError(
                f"the network ran out of device memory on one block (input {'x'.join(map(str, shape))}): "
                f"use a smaller --block, or --block auto to find the largest that fits"
            ) from err
        if sizes is not None:
            raise InvalidOptionError(
                f"the network does not take an input of {'x'.join(map(str, shape))} ({line}); it takes "
                f"sizes {sizes}: choose --block (and --halo) so that block + 2 x halo is one of them"
            ) from err
        raise ModelLoadError(
            f"the network failed on an input of shape (1, {in_channels}, {', '.join(map(str, shape))}): {line}; "
            f"check that it takes {in_channels} input channel(s) and suits the block and halo"
        ) from err
    finally:
        predictor.watch = None
    if len(out) != 5:
        raise ModelLoadError(
            f"the network returned shape {out} for a 5D input; blockpred needs (batch, channels, z, y, x)"
        )
    return out[1], Coord(out[2:]), sample


def probe_network(
    predictor: Predictor,
    *,
    in_channels: int,
    block: Coord,
    halo: Coord,
    downsampling: Coord,
    first_input: Coord | None = None,
    sizes: str | None = None,
    count: bool = True,
    keep_sample: bool = False,
    known: KnownShapes | None = None,
) -> NetworkGeometry:
    """The geometry of the network on this block and halo (see the module docstring).

    ``first_input`` is the shape of the first dry run; by default ``block + 2 x
    halo`` rounded up to the downsampling, which a 'same' network accepts.  A
    valid network that can say which input shapes it takes passes one here.
    ``sizes``: the input sizes the network was found to take (:meth:`~blockpred.models.discover.Grid.sizes_taken`),
    named in the one line a refused input gets.  ``count``: whether the first dry run counts the largest tensor
    (:attr:`NetworkGeometry.largest_per_voxel`, for CUDA's index limit); the count makes a first pass slower.
    ``keep_sample``: the first dry run runs on seeded random data and keeps it with its output
    (:attr:`NetworkGeometry.sample`; a 'same' network's only).  ``known``: the shapes the network ran at before
    (:mod:`.shapes`): a dry run at one of them is taken from there, and each dry run's shape is kept there.
    """
    if first_input is None:
        first_input = (block + halo * 2).ceil_div(downsampling) * downsampling
    # torch's own path, uncompiled, is counted (another backend's or a compiled graph's tensors are not torch's)
    counter = (LargestTensor(weight_shapes(predictor.module))
               if count and predictor.backend == "torch" and predictor.compile == "off" else None)
    hit = known.get(first_input) if known is not None and not keep_sample else None
    ran = hit is None or (counter is not None and hit.largest_per_voxel is None)
    if not ran:
        logger.info("dry run on an input of %s: known from an earlier run", "x".join(map(str, first_input)))
        out_channels, first_output, sample, per_voxel = hit.out_channels, hit.output_shape, None, hit.largest_per_voxel
    else:
        try:
            out_channels, first_output, sample = _dry_run(predictor, in_channels, first_input, sizes, counter,
                                                          keep_sample)
        except (ModelLoadError, InvalidOptionError):
            if counter is None:
                raise
            counter = None  # the count itself may be what failed: the network is tried as it runs, uncounted
            out_channels, first_output, sample = _dry_run(predictor, in_channels, first_input, sizes,
                                                          keep=keep_sample)
        per_voxel = counter.elements / first_input.prod() if counter is not None and counter.elements else None
        if per_voxel is not None:
            logger.info("largest tensor of the dry run: %d elements, %.1f per input voxel", counter.elements,
                        per_voxel)
    shrink = first_input - first_output
    if any(s < 0 or s % 2 for s in shrink):
        raise ModelLoadError(
            f"the network maps an input of {tuple(first_input)} to {tuple(first_output)}; blockpred needs an output "
            f"equal to the input or smaller by an even number of voxels per axis"
        )
    if ran and known is not None:
        known.put(first_input, KnownShape(out_channels, first_output, per_voxel))
    context = shrink // 2
    if context == Coord((0, 0, 0)):
        return NetworkGeometry(in_channels, out_channels, first_input, first_output, context, per_voxel, sample,
                               ran=ran)
    valid_input = block + (halo + context) * 2
    wanted = block + halo * 2
    try:
        valid = known.get(valid_input) if known is not None else None
        valid_output = valid.output_shape if valid is not None else _dry_run(predictor, in_channels, valid_input)[1]
        if valid is None and known is not None and valid_output == wanted:
            known.put(valid_input, KnownShape(out_channels, valid_output))
    except ModelLoadError as err:
        raise InvalidOptionError(
            f"block {tuple(block)} with halo {tuple(halo)} needs a network input of {tuple(valid_input)}, "
            f"which this valid-convolution network does not accept; try another block size"
        ) from err
    if valid_output != wanted:
        raise InvalidOptionError(
            f"block {tuple(block)} with halo {tuple(halo)}: this valid-convolution network maps {tuple(valid_input)} "
            f"to {tuple(valid_output)}, not {tuple(wanted)}; try another block size"
        )
    return NetworkGeometry(in_channels, out_channels, valid_input, valid_output, context, per_voxel, ran=ran)


def geometry_at(geometry: NetworkGeometry, block: Coord, halo: Coord, downsampling: Coord) -> NetworkGeometry:
    """``geometry``, found by a dry run at a smaller block, at ``block``, not run: a 'same' network maps its input
    (block + 2 x halo, rounded up to the downsampling) to itself, a valid one block + 2 x (halo + context) to
    block + 2 x halo (``blockpred plan`` foresees a block it does not run)."""
    if geometry.context == Coord((0, 0, 0)):
        shape = (block + halo * 2).ceil_div(downsampling) * downsampling
        return replace(geometry, input_shape=shape, output_shape=shape, sample=None)
    return replace(geometry, input_shape=block + (halo + geometry.context) * 2, output_shape=block + halo * 2,
                   sample=None)
