"""bioimage.io model packages: ``--model path/to/rdf.yaml`` (or a package ``.zip``, or its folder).

A package is parsed with ``bioimageio.spec`` (imported here, on first use:
it takes a second), format 0.5, or 0.4 converted to 0.5 on load, **offline**:
its IO checks are off (no download, no remote hashing); what the checks would
do locally is done here: the weights (and an architecture source) must be
files inside the package, and a sha256 the package states must match.

What blockpred takes from a package:

* **weights**: TorchScript first, else ``pytorch_state_dict`` with its
  architecture.  An architecture from an installed library
  (``import_from`` + ``callable``) is imported like ``package.module:factory``;
  one given as a Python ``source`` file inside the package is code from the
  package, run only with ``trust_pickle`` (``--trust-pickle``).  State dicts
  load with ``weights_only=True`` (as every blockpred file; see
  :mod:`.torchfile`).  Other formats (ONNX, TensorFlow, Keras) are refused.
* **axes**: one input; batch, channel, z, y, x in any order (batch and
  channel may be missing) map to blockpred's (b, c, z, y, x); anything else
  (time, index axes, two channel axes, 2D) is refused.  The first output is
  predicted; its spatial axes must have the input's scale.
* **preprocessing** (``scale_range``, ``zero_mean_unit_variance``,
  ``fixed_zero_mean_unit_variance``, ``scale_linear``, ``clip``, ``binarize``,
  ``sigmoid``, ``softmax``, ``ensure_dtype``) and the postprocessing steps that
  need no statistics of the output run on the device inside
  :class:`~.bioimageio_ops.PackageNetwork`; blockpred's own normalisation is
  ``none`` (raw values as float32).
* **statistics** (percentiles, mean and standard deviation): blocks have no
  per-sample statistics, so ``per_sample`` and ``per_dataset`` both mean "over
  the volume".  :func:`.bioimageio_stats.configure_run` computes them once, in
  the client, on a sample of the input volume (the whole volume up to 16.8
  Mvox, else a fixed grid of tiles; see :mod:`.bioimageio_stats`), each step's on the
  values the steps before it produced, and puts the numbers in the run's
  ``model_kwargs`` (key :data:`STATISTICS_KEY`), so every worker applies the
  same constants and the run's fingerprint holds them.
* **halo** of the output's spatial axes: the model's default halo (none
  stated: blockpred's default, 8 for a 'same' network).
* **input shapes**: ``min + k * step`` becomes a downsampling of ``step``
  (``min`` must be a multiple of ``step``; else refused) and the default block
  is large enough for ``min``; a fixed size makes the default block that size
  minus twice the halo, and is the only block accepted.
* **name**: the package's ``name``; ``weights_sha256`` fingerprints the
  weights file, the ``rdf.yaml`` (its processing, axes, halo) and an
  architecture source together, so caches and resume markers tell apart two
  packages that differ in any of them.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import math
import sys
import tempfile
import types
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import InputNotFoundError, InvalidOptionError, ModelLoadError, UntrustedPickleError
from ..geometry import Coord
from . import bioimageio_ops as ops
from .bioimageio_ops import Step, build_op

logger = logging.getLogger(__name__)

#: Where the client hands the volume's statistics to the workers, in ``model_kwargs``.
STATISTICS_KEY = "bioimageio_statistics"
#: The default block of a package whose sizes allow it (then at least the package's minimum input).
DEFAULT_BLOCK = 64
_YAML_NAMES = ("rdf.yaml", "bioimageio.yaml")
_AXIS_INDEX = {"batch": 0, "channel": 1, "z": 2, "y": 3, "x": 4}
_PRE_STEPS = ("binarize", "clip", "ensure_dtype", "fixed_zero_mean_unit_variance", "scale_linear", "scale_range",
              "sigmoid", "softmax", "zero_mean_unit_variance")


def _is_yaml_name(name: str) -> bool:
    return name in _YAML_NAMES or name.endswith(".bioimageio.yaml")


def is_package(model: Any) -> bool:
    """Whether ``model`` names a bioimage.io package: an ``rdf.yaml``/``bioimageio.yaml``, a folder holding
    one, or a ``.zip`` holding one.  Cheap: nothing is imported or parsed."""
    if not isinstance(model, (str, Path)):
        return False
    path = Path(model)
    try:
        if path.is_dir():
            return any((path / n).is_file() for n in _YAML_NAMES)
        if not path.is_file():
            return False
        if path.suffix in (".yaml", ".yml"):
            return True
        if path.suffix == ".zip" and zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                return any(_is_yaml_name(n) for n in archive.namelist() if "/" not in n)
    except OSError:
        return False
    return False


# ---------------------------------------------------------------------- reading a package


@dataclass(frozen=True)
class Package:
    """What blockpred needs from a package, checked; the weights not yet loaded."""

    path: str
    name: str
    descr: Any = field(repr=False)
    in_axes: tuple[int, ...]
    out_axes: tuple[int, ...]
    batch_one: bool
    in_channels: int
    out_channels: int
    min_shape: Coord
    step: Coord
    fixed: tuple[bool, bool, bool]
    halo: Coord
    padding: str | None
    pre: tuple[Step, ...]
    post: tuple[Step, ...]
    weights_format: str  # torchscript | pytorch_state_dict
    rdf_sha256: str

    @property
    def needs_statistics(self) -> bool:
        return any(s.stat for s in self.pre + self.post)

    @property
    def downsampling(self) -> Coord:
        return Coord(1 if f else s for f, s in zip(self.fixed, self.step))

    @property
    def default_block(self) -> Coord:
        sizes = []
        for low, step, fixed, halo in zip(self.min_shape, self.step, self.fixed, self.halo):
            if fixed:
                sizes.append(low - 2 * halo)
            else:
                sizes.append(math.ceil(max(DEFAULT_BLOCK, low - 2 * halo) / step) * step)
        return Coord(sizes)


def _fail(path, message: str, error=ModelLoadError):
    return error(f"bioimage.io package {str(path)!r}: {message}")


def _yaml_source(path: Path) -> Path:
    if path.is_dir():
        return next(path / n for n in _YAML_NAMES if (path / n).is_file())
    return path


def _load_descr(path: Path):
    """The package's description as format 0.5, offline, and the sha256 of its YAML."""
    try:
        from bioimageio.spec import InvalidDescr, load_description
    except ImportError as exc:  # pragma: no cover - a dependency
        raise _fail(path, f"reading packages needs bioimageio.spec ({exc}); pip install bioimageio.spec") from exc
    from loguru import logger as loguru_logger

    # bioimageio.spec logs through loguru, some of it (axis ids normalised ...) attributed to pydantic's modules
    # and printed to stderr: silenced, as blockpred's command prints one line per problem.
    loguru_logger.disable("pydantic")
    source = _yaml_source(path)
    try:
        with warnings.catch_warnings():  # format conversions warn (0.4 -> 0.5 channel sizes ...) on stderr
            warnings.simplefilter("ignore")
            descr = load_description(source, perform_io_checks=False, format_version="latest")
    except Exception as exc:  # noqa: BLE001 - unreadable YAML, a bad zip ...
        raise _fail(path, f"cannot be read: {_one_line(exc)}") from exc
    if isinstance(descr, InvalidDescr):
        raise _fail(path, f"is not a valid bioimage.io description: {_one_line(descr.get_reason() or 'invalid')}")
    if getattr(descr, "type", None) != "model":
        raise _fail(path, f"must describe a model, found a {getattr(descr, 'type', '?')!r} resource")
    if source.suffix == ".zip":
        with zipfile.ZipFile(source) as archive:
            name = next(n for n in archive.namelist() if "/" not in n and _is_yaml_name(n))
            rdf = archive.read(name)
    else:
        rdf = source.read_bytes()
    return descr, hashlib.sha256(rdf).hexdigest()


def _one_line(value) -> str:
    text = str(value).strip()
    first = text.splitlines()[0] if text else type(value).__name__
    return " ".join(first.split())[:300]


def read_package(model: str | Path) -> Package:
    """Parse and check the package (axes, shapes, halo, processing, that its weights are there); load nothing."""
    path = Path(model)
    descr, rdf_sha = _load_descr(path)
    if len(descr.inputs) != 1:
        raise _fail(path, f"has {len(descr.inputs)} inputs; blockpred predicts networks with one input")
    tensor_in, tensor_out = descr.inputs[0], descr.outputs[0]
    in_axes, in_channels, batch_one = _map_axes(path, tensor_in, "input")
    out_axes, out_channels, _ = _map_axes(path, tensor_out, "output")
    spatial_in = {str(a.id): a for a in tensor_in.axes if a.type == "space"}
    sizes = []  # (min, step, fixed) per axis z, y, x
    for name in "zyx":
        size = spatial_in[name].size
        if isinstance(size, int):
            sizes.append((size, 1, True))
        elif hasattr(size, "step"):
            if size.min % size.step:
                raise _fail(path, f"input axis {name} takes sizes {size.min} + k*{size.step}; blockpred needs "
                                  f"sizes that are multiples of the step (min a multiple of step)", InvalidOptionError)
            sizes.append((size.min, size.step, False))
        else:
            raise _fail(path, f"input axis {name} takes its size from another axis; blockpred needs a fixed "
                              f"size or min + k*step per spatial axis")
    mins, steps, fixed = zip(*sizes)
    halo, padding = {}, "same"
    for axis in tensor_out.axes:
        if axis.type != "space":
            continue
        name, source_axis = str(axis.id), spatial_in[str(axis.id)]
        if getattr(axis, "scale", 1.0) != getattr(source_axis, "scale", 1.0):
            raise _fail(path, f"output axis {name} has scale {axis.scale}, the input {source_axis.scale}; "
                              f"blockpred needs outputs on the input's grid")
        halo[name] = int(getattr(axis, "halo", 0) or 0)
        size = axis.size
        offset = getattr(size, "offset", 0) if hasattr(size, "axis_id") else None
        if offset is None or offset:
            padding = "valid" if offset and offset < 0 else None
    halo = Coord(halo[name] for name in "zyx")
    package = Package(
        path=str(path), name=str(descr.name), descr=descr, in_axes=in_axes, out_axes=out_axes, batch_one=batch_one,
        in_channels=in_channels, out_channels=out_channels, min_shape=Coord(mins), step=Coord(steps),
        fixed=tuple(fixed), halo=halo, padding=padding,
        pre=tuple(_steps(path, tensor_in.preprocessing, tensor_in, in_channels, "preprocessing", str(tensor_in.id))),
        post=tuple(_steps(path, tensor_out.postprocessing, tensor_out, out_channels, "postprocessing",
                          str(tensor_in.id), in_channels=in_channels)),
        weights_format=_weights_format(path, descr), rdf_sha256=rdf_sha,
    )
    if any(f and b <= 0 for f, b in zip(package.fixed, package.default_block)):
        raise _fail(path, f"its fixed input {tuple(package.min_shape)} is not larger than twice its halo "
                          f"{tuple(halo)}")
    _weights_entry_file(package)  # the weights are in the package (an architecture source: when it is built)
    return package


def _map_axes(path, tensor, what: str) -> tuple[tuple[int, ...], int, bool]:
    """The tensor's axes as blockpred axis indices, its channel count, and whether its batch is one."""
    order, channels, batch_one = [], 1, False
    for axis in tensor.axes:
        kind, name = axis.type, str(axis.id)
        key = kind if kind in ("batch", "channel") else name if kind == "space" else None
        if key is None or key not in _AXIS_INDEX or _AXIS_INDEX[key] in order:
            shown = ", ".join(f"{a.type}:{a.id}" for a in tensor.axes)
            raise _fail(path, f"{what} axes ({shown}) cannot be mapped to blockpred's (batch, channel, z, y, x): "
                              f"{'a second ' + kind + ' axis' if key in _AXIS_INDEX else f'{kind} axis {name!r}'}; "
                              f"blockpred runs 3D networks with space axes z, y, x")
        order.append(_AXIS_INDEX[key])
        if kind == "channel":
            channels = len(axis.channel_names)
        if kind == "batch" and getattr(axis, "size", None) == 1:
            batch_one = True
    missing = [n for n in "zyx" if _AXIS_INDEX[n] not in order]
    if missing:
        raise _fail(path, f"{what} has no space axis {', '.join(missing)}; blockpred runs 3D networks (z, y, x)")
    return tuple(order), channels, batch_one


def _per_channel(path, kwargs, tensor, what: str) -> bool:
    """Whether statistics are per channel: the axes to reduce leave out the channel axis (all z, y, x in)."""
    axes = getattr(kwargs, "axes", None)
    if axes is None:
        return False
    axes = {str(a) for a in axes}
    if not {"z", "y", "x"} <= axes:
        raise _fail(path, f"{what} reduces over axes {sorted(axes)}: statistics per slice do not exist "
                          f"blockwise; blockpred computes them over the volume (all of z, y, x)", InvalidOptionError)
    channel = next((str(a.id) for a in tensor.axes if a.type == "channel"), None)
    return channel is not None and channel not in axes


def _along(path, kwargs, tensor, channels: int, what: str, *names: str) -> list:
    """Per-channel values of an ``...AlongAxis`` kwargs (the axis must be the channel axis)."""
    axis = str(kwargs.axis)
    channel = next((str(a.id) for a in tensor.axes if a.type == "channel"), None)
    values = [getattr(kwargs, n) for n in names]
    if axis != channel or any(isinstance(v, list) and len(v) != channels for v in values):
        raise _fail(path, f"{what} has values along axis {axis!r}; blockpred applies them along the channel "
                          f"axis only, one per channel ({channels})", InvalidOptionError)
    return values


def _steps(path, descrs, tensor, channels: int, what: str, input_id: str, in_channels: int | None = None) -> list:
    steps, post = [], what == "postprocessing"
    for index, p in enumerate(descrs):
        kind, kw = p.id, getattr(p, "kwargs", None)
        where = f"{what} step {index + 1} ({kind})"
        if kind not in _PRE_STEPS:
            raise _fail(path, f"{where} is not supported; blockpred applies {', '.join(_PRE_STEPS)}",
                        InvalidOptionError)
        if kind == "ensure_dtype":
            steps.append(Step("cast", {"dtype": str(kw.dtype), "back": post}))
        elif kind == "sigmoid":
            steps.append(Step("sigmoid"))
        elif kind == "softmax":
            axis = str(getattr(kw, "axis", "channel"))
            if axis != next((str(a.id) for a in tensor.axes if a.type == "channel"), "channel"):
                raise _fail(path, f"{where} runs along axis {axis!r}; blockpred only along the channel axis",
                            InvalidOptionError)
            steps.append(Step("softmax"))
        elif kind == "binarize":
            threshold = kw.threshold if not hasattr(kw, "axis") else _along(path, kw, tensor, channels, where,
                                                                             "threshold")[0]
            steps.append(Step("binarize", {"threshold": threshold}))
        elif kind == "scale_linear":
            gain, offset = (kw.gain, kw.offset) if not hasattr(kw, "axis") else _along(
                path, kw, tensor, channels, where, "gain", "offset")
            steps.append(Step("linear", {"gain": gain, "offset": offset}))
        elif kind == "fixed_zero_mean_unit_variance":
            mean, std = (kw.mean, kw.std) if not hasattr(kw, "axis") else _along(
                path, kw, tensor, channels, where, "mean", "std")
            std = [s + 1e-6 for s in std] if isinstance(std, list) else std + 1e-6
            steps.append(Step("normalize", {"sub": mean, "div": std}))
        elif kind == "clip":
            if kw.min_percentile is None and kw.max_percentile is None:
                steps.append(Step("clip", {"low": kw.min, "high": kw.max}))
            elif post:
                raise _fail(path, f"{where} clips at percentiles of the network's output, which exist only "
                                  f"after the whole run", InvalidOptionError)
            else:
                steps.append(Step("clip", {"low": kw.min, "high": kw.max, "lo_q": kw.min_percentile,
                                           "hi_q": kw.max_percentile}, stat="percentiles",
                                  per_channel=_per_channel(path, kw, tensor, where)))
        elif kind in ("scale_range", "zero_mean_unit_variance"):
            reference = getattr(kw, "reference_tensor", None)
            raw = reference is not None and str(reference) == input_id
            if reference is not None and not raw and str(reference) != str(tensor.id):
                raise _fail(path, f"{where} refers to tensor {str(reference)!r}, which is not the input",
                            InvalidOptionError)
            if post and not raw:
                raise _fail(path, f"{where} needs statistics of the network's output, which exist only after "
                                  f"the whole run", InvalidOptionError)
            per_channel = _per_channel(path, kw, tensor, where)
            if raw and post and per_channel and in_channels != channels:
                raise _fail(path, f"{where} scales {channels} output channels by statistics of "
                                  f"{in_channels} input channels", InvalidOptionError)
            if kind == "scale_range":
                steps.append(Step("normalize", {"lo_q": kw.min_percentile, "hi_q": kw.max_percentile, "eps": kw.eps},
                                  stat="percentiles", per_channel=per_channel, of_raw_input=raw))
            else:
                steps.append(Step("normalize", {"eps": kw.eps}, stat="meanstd", per_channel=per_channel))
    return steps


def _weights_format(path, descr) -> str:
    weights = descr.weights
    for name in ("torchscript", "pytorch_state_dict"):
        if getattr(weights, name, None) is not None:
            return name
    found = [name for name in type(weights).model_fields if getattr(weights, name, None) is not None]
    raise _fail(path, f"has weights as {', '.join(found) or 'nothing'}; blockpred runs torchscript or "
                      f"pytorch_state_dict weights")


def _entry_file(package: Package, source, what: str):
    """The file a package entry names, as a readable path (Path or a path inside the zip)."""
    text = str(source)
    if text.startswith(("http://", "https://")):
        raise _fail(package.path, f"names its {what} at {text}; blockpred reads packages offline: download "
                                  f"the package (the .zip) and pass that", InputNotFoundError)
    located = source.absolute() if hasattr(source, "absolute") else Path(text)
    try:
        present = located.is_file()
    except OSError:
        present = False
    if not present:
        raise _fail(package.path, f"names {what} {text!r}, which is not in the package", InputNotFoundError)
    return located


def _weights_entry_file(package: Package):
    entry = getattr(package.descr.weights, package.weights_format)
    return entry, _entry_file(package, entry.source, f"{package.weights_format} weights")


def _read_checked(package: Package, entry, located, what: str) -> bytes:
    data = located.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    stated = getattr(entry, "sha256", None)
    if stated is not None and str(stated) != digest:
        raise _fail(package.path, f"{what} {str(entry.source)!r} has sha256 {digest[:12]}..., the package says "
                                  f"{str(stated)[:12]}...: the file is corrupt or was changed; get the package again")
    return data


# ---------------------------------------------------------------------- loading


def load_package(model: str | Path, weights: str | None, kwargs: Mapping[str, Any], trust_pickle: bool):
    """The package as a :class:`~.loaded.LoadedModel` (kind ``"bioimageio"``); see the module docstring."""
    from .loaded import describe

    if weights is not None:
        raise InvalidOptionError(f"bioimage.io package {str(model)!r} holds its own weights; drop --weights")
    unknown = sorted(set(kwargs) - {STATISTICS_KEY})
    if unknown:
        raise InvalidOptionError(f"model_kwargs {unknown} do not apply to bioimage.io package {str(model)!r}: "
                                 f"its architecture's arguments come from the package; drop them")
    package = read_package(model)
    network, weights_sha = _load_network(package, trust_pickle)
    statistics = kwargs.get(STATISTICS_KEY)
    if package.needs_statistics and statistics is None:
        raise _fail(model, "normalises with statistics of the input volume, which blockpred run, plan and "
                           "predict compute; this command has no volume to compute them on")
    statistics = statistics or {}
    module = ops.PackageNetwork(
        network,
        pre=[build_op(s, statistics.get(f"pre.{i}")) for i, s in enumerate(package.pre)],
        post=[build_op(s, statistics.get(f"post.{i}")) for i, s in enumerate(package.post)],
        in_axes=package.in_axes, out_axes=package.out_axes, batch_one=package.batch_one,
        min_shape=package.min_shape, step=package.step, fixed=package.fixed, package=package.name)
    module.in_channels, module.out_channels = package.in_channels, package.out_channels
    module.downsampling, module.padding = package.downsampling, package.padding
    module = module.to(device="cpu").eval()
    # The fingerprint of the weights and of the description (its processing, axes, halo) together.
    sha = hashlib.sha256((weights_sha + package.rdf_sha256).encode()).hexdigest()
    return describe(module, name=package.name, kind="bioimageio", sha=sha,
                     default_block=package.default_block,
                     # None stated: blockpred's default, except where a fixed input shape leaves no room for one.
                     default_halo=package.halo if any(package.halo) or any(package.fixed) else None)


def _load_network(package: Package, trust_pickle: bool) -> tuple[torch.nn.Module, str]:
    from .state_dicts import find_state_dict, load_strict
    from .torchfile import read_torch_file

    entry, located = _weights_entry_file(package)
    what = f"{package.weights_format} weights"
    data = _read_checked(package, entry, located, what)
    sha = hashlib.sha256(data).hexdigest()
    if package.weights_format == "pytorch_state_dict":
        network, code_sha = _architecture(package, entry.architecture, trust_pickle)  # before the weights are read
        sha = hashlib.sha256((sha + code_sha).encode()).hexdigest() if code_sha else sha
    with tempfile.TemporaryDirectory(prefix="blockpred-bioimageio-") as tmp:
        file = Path(tmp) / Path(str(entry.source)).name  # read_torch_file reads files; a zip's are in memory
        file.write_bytes(data)
        loaded = read_torch_file(file, trust_pickle=trust_pickle)
    if package.weights_format == "torchscript":
        if loaded.kind != "torchscript":
            raise _fail(package.path, f"{what} {str(entry.source)!r} are not a TorchScript archive")
        return loaded.obj.float().eval(), sha
    state = find_state_dict(loaded.obj)
    if state is None:
        raise _fail(package.path, f"{what} {str(entry.source)!r} hold a {type(loaded.obj).__name__}, not a state dict")
    load_strict(network, state, f"weights of package {package.path!r}", f"architecture {entry.architecture.callable}")
    return network.float().eval(), sha


def _architecture(package: Package, arch, trust_pickle: bool) -> tuple[torch.nn.Module, str]:
    """The state dict's network: from an installed library, or (trusted) from the package's source file;
    and the sha256 of that source ("" for a library)."""
    name, code_sha = str(arch.callable), ""
    if getattr(arch, "import_from", None):
        spec = f"{arch.import_from}:{name}"
        try:
            factory = getattr(importlib.import_module(arch.import_from), name)
        except (ImportError, AttributeError) as exc:
            raise _fail(package.path, f"builds its network with {spec}, which cannot be imported ({exc}); "
                                      f"install the library it comes from") from exc
    else:
        source = str(arch.source)
        if not trust_pickle:
            raise _fail(package.path, f"defines its architecture in Python file {source!r} of the package, and "
                                      f"building it runs that code; pass --trust-pickle (trust_pickle=True) only if "
                                      f"you trust the package", UntrustedPickleError)
        located = _entry_file(package, arch.source, "architecture source")
        code = _read_checked(package, arch, located, "architecture source").decode()
        code_sha = hashlib.sha256(code.encode()).hexdigest()
        module_name = f"_blockpred_bioimageio_{code_sha[:16]}"
        namespace = types.ModuleType(module_name)
        namespace.__file__ = source
        sys.modules.setdefault(module_name, namespace)
        exec(compile(code, source, "exec"), sys.modules[module_name].__dict__)  # trusted by the user
        factory = getattr(sys.modules[module_name], name, None)
        spec = f"{source}:{name}"
        if factory is None:
            raise _fail(package.path, f"architecture source {source!r} has no {name!r}")
    try:
        network = factory(**dict(arch.kwargs))
    except Exception as exc:
        raise _fail(package.path, f"building {spec}(**{dict(arch.kwargs)}) failed: {_one_line(exc)}") from exc
    if not isinstance(network, torch.nn.Module):
        raise _fail(package.path, f"{spec} must return a torch.nn.Module, returned {type(network).__name__}")
    return network, code_sha
