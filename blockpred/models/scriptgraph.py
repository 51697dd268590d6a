"""A TorchScript network's graph, run node by node in Python.

``torch.jit.script`` keeps a network's loops, branches and lists in its graph, and TorchScript runs no Python
hooks.  :class:`GraphInterpreter` runs the frozen graph (:func:`traceable`) one node at a time: every ``aten`` and
``prim`` operation through ``torch.ops`` at the overload the graph names, lists, tuples, loops and branches in
Python.  So the network can be traced through (:mod:`blockpred.pipeline.unrolled`: straight-line copies for
converters), run on the meta device for its shapes alone, watched (:func:`feature_sizes`: the spatial shapes of
the maps it computes, which the grid's dry runs read where they would read hooks, :mod:`.discover`), and run with
an operation swapped (its max pooling averaged for the receptive field, :mod:`.receptive`).
"""

from __future__ import annotations

import operator
import warnings
from typing import Any

import torch

__all__ = ["GraphInterpreter", "feature_sizes", "scripted", "traceable"]


def scripted(module: torch.nn.Module) -> bool:
    """Whether ``module`` is or holds a TorchScript module."""
    return any(isinstance(m, torch.jit.ScriptModule) for m in module.modules())


def traceable(module: torch.nn.Module, example: torch.Tensor) -> torch.nn.Module:
    """``module`` as a converter takes it: a TorchScript module (or one that holds one) traced through a plain
    call at ``example`` and frozen, so that its branches on the input's rank (F.interpolate's) become constants;
    any other as it is."""
    if not scripted(module):
        return module
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on shape checks it records as constants
        return torch.jit.freeze(torch.jit.trace(_Call(module).eval(), example, check_trace=False).eval())


class _Call(torch.nn.Module):
    """``module(x)`` as a plain module, so that a trace goes through a TorchScript module's code."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def feature_sizes(module: torch.nn.Module, example: torch.Tensor) -> list[tuple[int, ...]]:
    """The spatial shapes of the maps a TorchScript ``module`` computes at ``example`` (each operation's tensor
    output of ``example``'s rank; no weight or constant): its frozen graph run by the interpreter, as hooks
    would see an ``nn.Module``'s layers.  Two passes at ``example``'s shape (the trace and the run)."""
    frozen = traceable(module, example)
    interpreter = _Watched(frozen, example.dim())
    with torch.no_grad():
        interpreter(example)
    return interpreter.sizes


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
        special = self._special(kind, args)
        if special is not NotImplemented:
            return special
        values = _VALUES.get(kind)
        if values is not None:
            return values(args)
        if kind == "aten::slice" and isinstance(args[0], torch.Tensor):  # by indexing, which traces its bounds
            x, dim, start, end, step = args
            end = None if isinstance(end, int) and end >= 2 ** 62 else end
            return x[(slice(None),) * (dim % x.dim()) + (slice(start, end, step),)]
        if kind == "aten::slice" and isinstance(args[0], list):  # a list's items, traced sizes among them
            items, start, end, step = args
            return items[start:None if isinstance(end, int) and end >= 2 ** 62 else end:step]
        if kind == "aten::size":  # through the tensor's method, which a trace records (sizes stay dynamic)
            return list(args[0].shape) if len(args) == 1 else args[0].shape[args[1]]
        plain = _PLAIN.get(kind)
        if plain is not None and "Tensor" not in node.schema().split("->")[0]:
            return plain(*args)  # on ints, floats and lists (a traced size is a 0-dim tensor, still such a value)
        return _call(node, args, meta=self._meta)

    def _special(self, kind: str, args: list) -> Any:
        """A subclass's own way with an operation (NotImplemented: the plain way)."""
        return NotImplemented

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


class _Watched(GraphInterpreter):
    """The interpreter, noting the spatial shape of every operation's tensor output of rank ``rank``."""

    def __init__(self, frozen: torch.jit.ScriptModule, rank: int):
        super().__init__(frozen)
        self.rank = rank
        self.sizes: list[tuple[int, ...]] = []

    def _node(self, node, args: list, env: dict) -> Any:
        result = super()._node(node, args, env)
        if isinstance(result, torch.Tensor) and result.dim() == self.rank \
                and node.kind() not in ("prim::Constant", "prim::GetAttr"):
            self.sizes.append(tuple(int(v) for v in result.shape[2:]))
        return result
