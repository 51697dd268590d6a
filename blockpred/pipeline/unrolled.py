"""A TorchScript network as straight-line code, for converters that take no loops or lists.

``torch.jit.script`` keeps a network's Python lists (skips kept with ``append`` and ``pop``) and its loops over
sizes (MONAI's padding to the skip's size) as they are, and OpenVINO's PyTorch frontend converts neither (its
``aten::pop`` and ``SequenceInsert`` failures).  Two ways around them, each a route of
:mod:`.backends`:

* :func:`unrolled_copy`: the frozen graph is *run* node by node by a small interpreter
  (:class:`GraphInterpreter`) inside ``torch.jit.trace`` at an example: lists are Python lists, loops and
  branches run in Python, and only the tensor operations are recorded, the sizes the network reads among them
  (so its spatial axes stay dynamic).  Instance and group norms are recorded as a centred mean and variance
  whose sums OpenVINO computes as a matrix product (see :func:`_normalised`).
* :func:`lowered_graph`: TorchScript's own passes on the frozen graph, at the input's rank: shapes propagated
  and folded, loops of constant count unrolled, tuples and list idioms lowered, dead code removed.

Both take a module that holds a TorchScript network (or is one: :func:`.converted.scripted`).
"""

from __future__ import annotations

import operator
import warnings
from typing import Any, NamedTuple

import torch

__all__ = ["GraphInterpreter", "UnrolledCopy", "branches", "lowered_graph", "unrolled_copy"]


class GraphInterpreter(torch.nn.Module):
    """Runs a frozen TorchScript module's ``forward`` graph node by node: every ``aten`` and ``prim`` operation
    through ``torch.ops`` at the overload the graph names, lists, tuples, loops and branches in Python."""

    def __init__(self, frozen: torch.jit.ScriptModule, *, meta: bool = False):
        super().__init__()
        # Kept out of the module's children: the trace records the operations run, not the frozen module.
        self.__dict__["_frozen"], self.__dict__["_graph"] = frozen, frozen.graph
        #: Run on the meta device (its constants moved there): the shapes and decisions, no arithmetic.
        self._meta = meta
        #: The last run's decisions, in order: each branch taken, each loop's "go on", each min/max pick, and
        #: whether it was a traced value (one the input's sizes decided, inside a trace).
        self.decisions: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> Any:
        self.decisions = []
        inputs = list(self._graph.inputs())
        env: dict[int, Any] = {inputs[0].unique(): self._frozen, inputs[1].unique(): x}
        self._nodes(self._graph.nodes(), env)
        return _outputs([env[value.unique()] for value in self._graph.outputs()])

    def _block(self, block, env: dict, values: list | None = None) -> list:
        for param, value in zip(block.inputs(), values or []):
            env[param.unique()] = value
        self._nodes(block.nodes(), env)
        return [env[value.unique()] for value in block.outputs()]

    def _nodes(self, nodes, env: dict) -> None:
        for node in nodes:
            args = [env[value.unique()] for value in node.inputs()]
            results = self._node(node, args, env)
            outs = list(node.outputs())
            if len(outs) == 1:
                env[outs[0].unique()] = results
            elif outs:
                for value, result in zip(outs, results, strict=True):
                    env[value.unique()] = result

    def _node(self, node, args: list, env: dict) -> Any:
        kind = node.kind()
        if kind == "prim::Constant":
            return self._moved(node.output().toIValue())
        if kind == "prim::If":
            return _outputs(self._block(list(node.blocks())[0 if self._decide(args[0]) else 1], env))
        if kind == "prim::Loop":
            trips, go, carried = args[0], args[1], list(args[2:])
            body = next(iter(node.blocks()))
            index = 0
            while self._decide(go) and self._decide(index < trips):
                go, *carried = self._block(body, env, [index, *carried])
                index += 1
            return _outputs(carried)
        if kind in ("prim::min", "prim::max") and "Tensor" not in node.schema().split("->")[0]:
            items = list(args[0]) if len(args) == 1 else list(args)
            best = items[0]
            for item in items[1:]:
                if self._decide(item < best if kind == "prim::min" else item > best):
                    best = item
            return best
        if kind == "prim::GetAttr":
            return self._moved(getattr(args[0], node.s("name")))
        if self._meta and kind in _META_SAME:  # their meta kernels import torch._dynamo (1.1 s)
            return torch.empty_like(args[0])
        if self._meta and kind == "aten::cat":
            return _meta_cat(*args)
        if kind == "prim::RaiseException":
            raise RuntimeError(f"the network raised: {args[0] if args else ''}")
        if kind in ("aten::Int", "aten::Float", "aten::ScalarImplicit") and isinstance(args[0], torch.Tensor) \
                and args[0].dim() == 0:
            return args[0]  # a traced size as an int: kept a 0-dim tensor, so the trace keeps it dynamic
        if kind == "aten::instance_norm" and args[5] and torch.jit.is_tracing():
            return _instance_norm(args[0], args[1], args[2], args[7])
        if kind == "aten::group_norm" and torch.jit.is_tracing():
            return _group_norm(args[0], args[1], args[2], args[3], args[4])
        values = _VALUES.get(kind)
        if values is not None:
            return values(args)
        if kind == "aten::slice" and isinstance(args[0], torch.Tensor):  # by indexing, which traces its bounds
            x, dim, start, end, step = args
            end = None if isinstance(end, int) and end >= 2 ** 62 else end
            return x[(slice(None),) * (dim % x.dim()) + (slice(start, end, step),)]
        if kind == "aten::size":  # through the tensor's method, which a trace records (sizes stay dynamic)
            return list(args[0].shape) if len(args) == 1 else args[0].shape[args[1]]
        plain = _PLAIN.get(kind)
        if plain is not None and "Tensor" not in node.schema().split("->")[0]:
            return plain(*args)  # on ints, floats and lists (a traced size is a 0-dim tensor, still such a value)
        return _call(node, args, meta=self._meta)

    def _moved(self, value: Any) -> Any:
        """A constant on the meta device where the run is (a 0-dim one stays: it meets sizes, which are
        numbers)."""
        return value.to("meta") if self._meta and isinstance(value, torch.Tensor) and value.dim() else value

    def _decide(self, value: Any) -> bool:
        """``value`` as a branch's condition, recorded."""
        taken = bool(value)
        self.decisions.append((taken, isinstance(value, torch.Tensor)))
        return taken


#: Operations whose output has their input's shape, which the meta run does not call.
_META_SAME = {"aten::instance_norm", "aten::group_norm", "aten::batch_norm", "aten::layer_norm", "aten::prelu",
              "aten::dropout", "aten::feature_dropout"}


def _meta_cat(tensors: list, dim: int) -> torch.Tensor:
    first = tensors[0]
    shape = list(first.shape)
    dim %= first.dim()
    for tensor in tensors[1:]:
        if [n for i, n in enumerate(tensor.shape) if i != dim] != [n for i, n in enumerate(shape) if i != dim]:
            raise RuntimeError(f"torch.cat: sizes {tuple(tensor.shape)} and {tuple(first.shape)} differ off "
                               f"axis {dim}")
        shape[dim] += tensor.shape[dim]
    return torch.empty(shape, dtype=first.dtype, device="meta")


def _set_item(args: list) -> list:
    args[0][args[1]] = args[2]
    return args[0]


#: Lists, tuples and the values TorchScript passes between operations, in Python: what each such node gives for
#: its arguments (a list it changes is changed in place, as TorchScript's is).
_VALUES = {
    "prim::ListConstruct": list, "prim::TupleConstruct": tuple,
    "prim::ListUnpack": lambda args: tuple(args[0]), "prim::TupleUnpack": lambda args: tuple(args[0]),
    "prim::TupleIndex": lambda args: args[0][args[1]], "aten::__getitem__": lambda args: args[0][args[1]],
    "prim::unchecked_cast": lambda args: args[0], "aten::detach": lambda args: args[0],
    "prim::profile": lambda args: args[0], "prim::Uninitialized": lambda args: None, "aten::warn": lambda args: None,
    # a size the trace kept is a 0-dim tensor already
    "prim::NumToTensor": lambda args: args[0] if isinstance(args[0], torch.Tensor) else torch.tensor(args[0]),
    "prim::dtype": lambda args: args[0].dtype, "prim::device": lambda args: args[0].device,
    "aten::format": lambda args: str(args[0]).format(*args[1:]),
    "aten::__is__": lambda args: args[0] is args[1], "aten::__isnot__": lambda args: args[0] is not args[1],
    "aten::__not__": lambda args: not args[0], "aten::len": lambda args: len(args[0]),
    "aten::append": lambda args: args[0].append(args[1]) or args[0],
    "aten::pop": lambda args: args[0].pop(*args[1:]),
    "aten::insert": lambda args: args[0].insert(args[1], args[2]),
    "aten::_set_item": _set_item,
    "aten::extend": lambda args: args[0].extend(args[1]), "aten::clear": lambda args: args[0].clear(),
}


#: TorchScript's operations on ints, floats, bools and lists, as Python computes them (``torch.ops`` takes no
#: list of a type variable, such as ``aten::mul.left_t``'s).
_PLAIN = {
    "aten::add": operator.add, "aten::sub": operator.sub, "aten::mul": operator.mul, "aten::div": operator.truediv,
    "aten::floordiv": operator.floordiv, "aten::remainder": operator.mod, "aten::neg": operator.neg,
    "aten::eq": operator.eq, "aten::ne": operator.ne, "aten::lt": operator.lt, "aten::le": operator.le,
    "aten::gt": operator.gt, "aten::ge": operator.ge, "aten::__and__": operator.and_, "aten::__or__": operator.or_,
    "prim::min": min, "prim::max": max, "aten::Int": int, "aten::Float": float, "aten::Bool": bool,
    "prim::abs": abs, "aten::list": list,
    "aten::__range_length": lambda low, high, step: max(0, -(-(high - low) // step)) if step > 0
    else max(0, -(-(low - high) // -step)),
    "aten::__derive_index": lambda index, start, step: start + index * step,
}


def _normalised(x: torch.Tensor, dims: int, eps: float) -> torch.Tensor:
    """``x`` less its mean over its last ``dims`` axes, over the square root of its variance there plus ``eps``,
    the variance taken of the centred values, both sums matrix products (:func:`_mean`).  OpenVINO fuses an
    instance or group norm into its MVN: MONAI's BasicUNet (18 norms) came out 1.4e-4 of its output range from
    torch at 2 x 96^3 that way; this way 5.7e-7 at 96^3 (torch's own fp32: 6.9e-7 from fp64 at 2 x 96^3)."""
    centred = x - _mean(x, dims)
    return centred / torch.sqrt(_mean(centred * centred, dims) + eps)


def _mean(x: torch.Tensor, dims: int) -> torch.Tensor:
    """The mean over the last ``dims`` axes, one axis at a time, each a product with a column of ones (kept as
    axes of size 1), its sizes traced.  A sum runs along one axis of at most a few hundred voxels so: OpenVINO's
    own reduction was 800x further from fp64 than torch's on torch-em's first two blocks (64x96x96), a single
    product over all voxels 200x, one axis at a time the same as torch (8.2e-7 of the output range)."""
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


def _outputs(values: list) -> Any:
    return values[0] if len(values) == 1 else tuple(values)


def _call(node, args: list, *, meta: bool = False) -> Any:
    """The operation the node names, at the overload its schema names, positional and keyword arguments as
    the schema has them.  On the meta device a pointwise operation is not called (torch's meta kernels of some
    import torch._dynamo, 1.1 s): its output has its tensors' broadcast shape (its first one, in place)."""
    text = node.schema()
    if text == "(no schema)":
        raise RuntimeError(f"{node.kind()} has no schema: the interpreter cannot run it")
    schema = torch._C.parse_schema(text)
    namespace, name = schema.name.split("::")
    packet = getattr(getattr(torch.ops, namespace), name)
    op = getattr(packet, schema.overload_name or "default")
    if meta and torch.Tag.pointwise in op.tags and isinstance(args[0], torch.Tensor) and args[0].is_meta:
        if schema.is_mutable:
            return args[0]
        shape = torch.broadcast_shapes(*(a.shape for a in args if isinstance(a, torch.Tensor)))
        return torch.empty(shape, dtype=args[0].dtype, device="meta")
    positional, keywords = [], {}
    for argument, value in zip(schema.arguments, args, strict=True):
        if argument.kwarg_only:
            keywords[argument.name] = value
        else:
            positional.append(value)
    return op(*positional, **keywords)


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
    from .converted import traceable

    frozen = traceable(module, example)
    interpreter = GraphInterpreter(frozen).eval()
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
    from .converted import traceable

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
