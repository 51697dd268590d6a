"""A TorchScript network as straight-line code, for converters that take no loops or lists.

``torch.jit.script`` keeps a network's Python lists (skips kept with ``append`` and ``pop``) and its loops over
sizes (MONAI's padding to the skip's size) as they are, and OpenVINO's PyTorch frontend converts neither (its
``aten::pop`` and ``SequenceInsert`` failures).  Two ways around them, each a route of
:mod:`.backends`:

* :func:`unrolled_copy`: the frozen graph is *run* node by node by the interpreter of
  :mod:`blockpred.models.scriptgraph` inside ``torch.jit.trace`` at an example: lists are Python lists, loops and
  branches run in Python, and only the tensor operations are recorded, the sizes the network reads among them
  (so its spatial axes stay dynamic).  Instance and group norms are recorded as a centred mean and variance
  whose sums OpenVINO computes one axis at a time (see :func:`_normalised`).
* :func:`lowered_graph`: TorchScript's own passes on the frozen graph, at the input's rank: shapes propagated
  and folded, loops of constant count unrolled, tuples and list idioms lowered, dead code removed.

Both take a module that holds a TorchScript network (or is one: :func:`~blockpred.models.scriptgraph.scripted`).
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch

from ..models.scriptgraph import GraphInterpreter, traceable

__all__ = ["UnrolledCopy", "branches", "lowered_graph", "unrolled_copy"]


class _Tracing(GraphInterpreter):
    """The interpreter inside ``torch.jit.trace``: instance and group norms recorded as a centred mean and
    variance (:func:`_normalised`), which OpenVINO does not fuse into its less exact MVN."""

    def _special(self, kind: str, args: list) -> Any:
        if kind == "aten::instance_norm" and args[5] and torch.jit.is_tracing():
            return _instance_norm(args[0], args[1], args[2], args[7])
        if kind == "aten::group_norm" and torch.jit.is_tracing():
            return _group_norm(args[0], args[1], args[2], args[3], args[4])
        return NotImplemented


def _normalised(x: torch.Tensor, dims: int, eps: float) -> torch.Tensor:
    """``x`` less its mean over its last ``dims`` axes, over the square root of its variance there plus ``eps``,
    the variance taken of the centred values, both sums taken one axis at a time (:func:`_mean`).  OpenVINO fuses
    an instance or group norm into its MVN: MONAI's BasicUNet (18 norms) came out 1.4e-4 of its output range from
    torch at 2 x 96^3 that way; this way 5.7e-7 at 96^3 (torch's own fp32: 6.9e-7 from fp64 at 2 x 96^3)."""
    centred = x - _mean(x, dims)
    return centred * torch.rsqrt(_mean(centred * centred, dims) + eps)


def _mean(x: torch.Tensor, dims: int) -> torch.Tensor:
    """The mean over the last ``dims`` axes (kept as axes of size 1), one axis at a time, its sizes traced, so that
    a sum runs along one axis of at most a few hundred voxels: OpenVINO's own reduction over all voxels was 800x
    further from fp64 than torch's on torch-em's first two blocks (64x96x96), one axis at a time the same as torch.

    An instance norm's (2 or 3 spatial axes, the channels before them) is an adaptive average pooling per axis,
    which OpenVINO runs on its blocked layout of the convolution's output: torch-em's UNet3d at 160x224x224 took
    4.80 s a pass so, against 5.96 s where each axis was a product with a column of ones (its input reordered
    first), and its output was as close to fp64 (7.5e-6 and 6.1e-6 of the range at 96x160x160; torch's own fp32
    5.0e-6).  Other shapes (a group norm's groups) sum so, by :func:`_column_mean`."""
    if x.dim() == dims + 2 and dims in (2, 3):
        pool = torch.nn.functional.adaptive_avg_pool3d if dims == 3 else torch.nn.functional.adaptive_avg_pool2d
        sizes = list(x.shape[2:])
        for axis in range(dims - 1, -1, -1):
            sizes[axis] = 1
            x = pool(x, sizes)
        return x
    return _column_mean(x, dims)


def _column_mean(x: torch.Tensor, dims: int) -> torch.Tensor:
    """:func:`_mean` with each axis a product with a column of ones."""
    for axis in range(x.dim() - 1, x.dim() - 1 - dims, -1):
        moved = x.transpose(axis, -1)
        column = moved.new_ones((moved.shape[-1], 1))
        x = (torch.matmul(moved, column) / moved.shape[-1]).transpose(axis, -1)
    return x


def _affine(x: torch.Tensor, weight, bias) -> torch.Tensor:
    shape = (1, -1) + (1,) * (x.dim() - 2)
    if weight is not None:
        x = x * weight.reshape(shape)
    return x + bias.reshape(shape) if bias is not None else x


def _instance_norm(x: torch.Tensor, weight, bias, eps: float) -> torch.Tensor:
    """``aten::instance_norm`` on the input's own statistics, as :func:`_normalised` computes them."""
    return _affine(_normalised(x, x.dim() - 2, eps), weight, bias)


def _group_norm(x: torch.Tensor, groups: int, weight, bias, eps: float) -> torch.Tensor:
    """``aten::group_norm``, as :func:`_normalised` computes it (over a group's channels and every spatial
    axis)."""
    grouped = x.reshape((x.shape[0], groups, -1) + tuple(x.shape[2:]))
    return _affine(_normalised(grouped, x.dim() - 1, eps).reshape(x.shape), weight, bias)


class UnrolledCopy(NamedTuple):
    """What :func:`unrolled_copy` made."""

    #: The network traced through its TorchScript code: no loop, list or branch left.
    module: torch.jit.ScriptModule
    #: The frozen TorchScript network it was traced from (:func:`branches` runs it at another shape).
    frozen: torch.jit.ScriptModule
    #: The branches, loop steps and min/max picks taken at the example.
    taken: tuple[bool, ...]
    #: Whether any of them was decided by the input's sizes: then the copy computes the network only at the
    #: shapes where the network takes them too (MONAI's BasicUNet pads a skip where a size is odd).
    size_bound: bool


def unrolled_copy(module: torch.nn.Module, example: torch.Tensor) -> UnrolledCopy:
    """``module`` traced through its TorchScript code at ``example``: no loop, no list, no branch left (each
    taken as at ``example``), the sizes it reads traced."""
    frozen = traceable(module, example)
    interpreter = _Tracing(frozen).eval()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's notes on values it records as constants
        traced = torch.jit.trace(interpreter, example, check_trace=False)
    # The sizes it reads, once each: the trace records every read (MONAI's BasicUNet: 4541 nodes, 1234 after).
    torch._C._jit_pass_cse(traced.graph)
    torch._C._jit_pass_dce(traced.graph)
    decisions = interpreter.decisions
    return UnrolledCopy(traced, frozen, tuple(taken for taken, _ in decisions), any(t for _, t in decisions))


def branches(frozen: torch.jit.ScriptModule, shape: tuple[int, ...]) -> tuple[bool, ...]:
    """The branches, loop steps and min/max picks the network takes at an input of ``shape``
    (:attr:`UnrolledCopy.taken` there), found on the meta device: shapes only, no arithmetic (0.02-0.06 s for
    MONAI's BasicUNet; the first in a process imports torch's meta kernels, 0.3-0.4 s)."""
    interpreter = GraphInterpreter(frozen, meta=True)
    with torch.no_grad():
        interpreter(torch.empty(tuple(shape), device="meta"))
    return tuple(taken for taken, _ in interpreter.decisions)


def lowered_graph(module: torch.nn.Module, example: torch.Tensor) -> torch.jit.ScriptModule:
    """``module`` frozen, its graph rewritten in place by TorchScript's passes at ``example``'s rank: shapes
    propagated, constants folded, loops of constant count unrolled, list idioms and tuples lowered."""
    frozen = traceable(module, example)
    graph = frozen.graph
    inputs = list(graph.inputs())
    inputs[1].setType(torch._C.TensorType.create_from_tensor(example).with_sizes([None] * example.dim()))
    for run in (torch._C._jit_pass_inline, _shapes,
                torch._C._jit_pass_constant_propagation, torch._C._jit_pass_constant_loop_unrolling,
                torch._C._jit_pass_constant_propagation, torch._C._jit_pass_lower_all_tuples,
                torch._C._jit_pass_peephole_list_idioms, torch._C._jit_pass_remove_mutation,
                torch._C._jit_pass_constant_propagation, torch._C._jit_pass_dce):
        run(graph)
    return frozen


def _shapes(graph) -> None:
    """Shapes propagated from the graph's (complete) input type."""
    torch._C._jit_pass_propagate_shapes_on_graph(graph)
