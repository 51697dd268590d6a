"""Reading a bioimage.io model package: its description checked and mapped to what blockpred needs.

:func:`read_package` parses a package (``rdf.yaml``/``bioimageio.yaml``, its
folder, or a ``.zip``) offline with ``bioimage.io``'s spec library and returns
a :class:`Package`: axes mapped to (batch, channel, z, y, x), pre- and
postprocessing as steps, halo and shape constraints, and where the weights
are (checked against their stated sha256).  Loading the network from it is
:mod:`.bioimageio`'s job; see that module's docstring for the rules.
"""

from __future__ import annotations

import hashlib
import logging
import math
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InputNotFoundError, InvalidOptionError, ModelLoadError
from ..geometry import Coord
from .bioimageio_ops import Step

logger = logging.getLogger(__name__)

#: Where the client hands the volume's statistics to the workers, in ``model_kwargs``.

#: The default block of a package whose sizes allow it (then at least the package's minimum input);
#: a 2D package's planes are this wide (see :mod:`.planes` for how deep its blocks are).
DEFAULT_BLOCK = 64
DEFAULT_PLANE = 512
_YAML_NAMES = ("rdf.yaml", "bioimageio.yaml")
_AXIS_INDEX = {"batch": 0, "channel": 1, "z": 2, "y": 3, "x": 4}
#: A 2D package's axes: (batch, channel, rows, cols), its y and x the rows and columns of a plane.
_AXIS_INDEX_2D = {"batch": 0, "channel": 1, "y": 2, "x": 3}
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


@dataclass(frozen=True)
class Package:
    """What blockpred needs from a package, checked; the weights not yet loaded."""

    path: str
    name: str
    descr: Any = field(repr=False)
    #: True for a 2D network (space axes y and x): sizes, step and halo below are then (rows, cols).
    planar: bool
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
        sizes, wanted = [], DEFAULT_PLANE if self.planar else DEFAULT_BLOCK
        for low, step, fixed, halo in zip(self.min_shape, self.step, self.fixed, self.halo):
            if fixed:
                sizes.append(low - 2 * halo)
            else:
                sizes.append(math.ceil(max(wanted, low - 2 * halo) / step) * step)
        return Coord(sizes)


def fail(path, message: str, error=ModelLoadError):
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
        raise fail(path, f"reading packages needs bioimageio.spec ({exc}); pip install bioimageio.spec") from exc
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
        raise fail(path, f"cannot be read: {one_line(exc)}") from exc
    if isinstance(descr, InvalidDescr):
        raise fail(path, f"is not a valid bioimage.io description: {one_line(descr.get_reason() or 'invalid')}")
    if getattr(descr, "type", None) != "model":
        raise fail(path, f"must describe a model, found a {getattr(descr, 'type', '?')!r} resource")
    if source.suffix == ".zip":
        with zipfile.ZipFile(source) as archive:
            name = next(n for n in archive.namelist() if "/" not in n and _is_yaml_name(n))
            rdf = archive.read(name)
    else:
        rdf = source.read_bytes()
    return descr, hashlib.sha256(rdf).hexdigest()


def one_line(value) -> str:
    text = str(value).strip()
    first = text.splitlines()[0] if text else type(value).__name__
    return " ".join(first.split())[:300]


def read_package(model: str | Path) -> Package:
    """Parse and check the package (axes, shapes, halo, processing, that its weights are there); load nothing."""
    path = Path(model)
    descr, rdf_sha = _load_descr(path)
    if len(descr.inputs) != 1:
        raise fail(path, f"has {len(descr.inputs)} inputs; blockpred predicts networks with one input")
    tensor_in, tensor_out = descr.inputs[0], descr.outputs[0]
    spatial_in = {str(a.id): a for a in tensor_in.axes if a.type == "space"}
    planar = set(spatial_in) == {"y", "x"}
    space = "yx" if planar else "zyx"
    in_axes, in_channels, batch_one = _map_axes(path, tensor_in, "input", planar)
    out_axes, out_channels, _ = _map_axes(path, tensor_out, "output", planar)
    sizes = []  # (min, step, fixed) per axis (z,) y, x
    for name in space:
        size = spatial_in[name].size
        if isinstance(size, int):
            sizes.append((size, 1, True))
        elif hasattr(size, "step"):
            if size.min % size.step:
                raise fail(path, f"input axis {name} takes sizes {size.min} + k*{size.step}; blockpred needs "
                                  f"sizes that are multiples of the step (min a multiple of step)", InvalidOptionError)
            sizes.append((size.min, size.step, False))
        else:
            raise fail(path, f"input axis {name} takes its size from another axis; blockpred needs a fixed "
                              f"size or min + k*step per spatial axis")
    mins, steps, fixed = zip(*sizes)
    halo, padding = {}, "same"
    for axis in tensor_out.axes:
        if axis.type != "space":
            continue
        name, source_axis = str(axis.id), spatial_in[str(axis.id)]
        if getattr(axis, "scale", 1.0) != getattr(source_axis, "scale", 1.0):
            raise fail(path, f"output axis {name} has scale {axis.scale}, the input {source_axis.scale}; "
                              f"blockpred needs outputs on the input's grid")
        halo[name] = int(getattr(axis, "halo", 0) or 0)
        size = axis.size
        offset = getattr(size, "offset", 0) if hasattr(size, "axis_id") else None
        if offset is None or offset:
            padding = "valid" if offset and offset < 0 else None
    halo = Coord(halo[name] for name in space)
    package = Package(
        path=str(path), name=str(descr.name), descr=descr, planar=planar, in_axes=in_axes, out_axes=out_axes, batch_one=batch_one,
        in_channels=in_channels, out_channels=out_channels, min_shape=Coord(mins), step=Coord(steps),
        fixed=tuple(fixed), halo=halo, padding=padding,
        pre=tuple(_steps(path, tensor_in.preprocessing, tensor_in, in_channels, "preprocessing", str(tensor_in.id))),
        post=tuple(_steps(path, tensor_out.postprocessing, tensor_out, out_channels, "postprocessing",
                          str(tensor_in.id), in_channels=in_channels)),
        weights_format=_weights_format(path, descr), rdf_sha256=rdf_sha,
    )
    if any(f and b <= 0 for f, b in zip(package.fixed, package.default_block)):
        raise fail(path, f"its fixed input {tuple(package.min_shape)} is not larger than twice its halo "
                          f"{tuple(halo)}")
    weights_entry_file(package)  # the weights are in the package (an architecture source: when it is built)
    return package


def _map_axes(path, tensor, what: str, planar: bool) -> tuple[tuple[int, ...], int, bool]:
    """The tensor's axes as blockpred axis indices ((b, c, z, y, x), or (b, c, y, x) when ``planar``),
    its channel count, and whether its batch is one."""
    order, channels, batch_one = [], 1, False
    index, space = (_AXIS_INDEX_2D, "yx") if planar else (_AXIS_INDEX, "zyx")
    for axis in tensor.axes:
        kind, name = axis.type, str(axis.id)
        key = kind if kind in ("batch", "channel") else name if kind == "space" else None
        if key is None or key not in index or index[key] in order:
            shown = ", ".join(f"{a.type}:{a.id}" for a in tensor.axes)
            raise fail(path, f"{what} axes ({shown}) cannot be mapped to blockpred's (batch, channel, z, y, x): "
                              f"{'a second ' + kind + ' axis' if key in index else f'{kind} axis {name!r}'}; "
                              f"blockpred runs 3D networks with space axes z, y, x and 2D ones with y, x")
        order.append(index[key])
        if kind == "channel":
            channels = len(axis.channel_names)
        if kind == "batch" and getattr(axis, "size", None) == 1:
            batch_one = True
    missing = [n for n in space if index[n] not in order]
    if missing:
        raise fail(path, f"{what} has no space axis {', '.join(missing)}; blockpred runs 3D networks (z, y, x) "
                          f"and 2D ones (y, x)")
    return tuple(order), channels, batch_one


def _reduction(path, kwargs, tensor, what: str) -> tuple[bool, bool]:
    """Whether a step's statistics are per channel (its axes leave the channel out) and per plane (a 2D
    package's axes y and x without the batch: per sample, and blockpred's samples are the planes).

    A 3D package must reduce over all of z, y and x: statistics per slice of a block do not exist.
    No axes: all of the tensor's axes, the batch included, so over the volume.
    """
    axes = getattr(kwargs, "axes", None)
    if axes is None:
        return False, False
    axes = {str(a) for a in axes}
    space = {str(a.id) for a in tensor.axes if a.type == "space"}
    if not space <= axes:
        raise fail(path, f"{what} reduces over axes {sorted(axes)}: statistics per slice do not exist "
                          f"blockwise; blockpred computes them over the volume (all of {', '.join(sorted(space))})"
                          + (", or per plane (y and x without the batch)" if space == {"y", "x"} else ""),
                   InvalidOptionError)
    channel = next((str(a.id) for a in tensor.axes if a.type == "channel"), None)
    batch = next((str(a.id) for a in tensor.axes if a.type == "batch"), "batch")
    return channel is not None and channel not in axes, space == {"y", "x"} and batch not in axes


def _along(path, kwargs, tensor, channels: int, what: str, *names: str) -> list:
    """Per-channel values of an ``...AlongAxis`` kwargs (the axis must be the channel axis)."""
    axis = str(kwargs.axis)
    channel = next((str(a.id) for a in tensor.axes if a.type == "channel"), None)
    values = [getattr(kwargs, n) for n in names]
    if axis != channel or any(isinstance(v, list) and len(v) != channels for v in values):
        raise fail(path, f"{what} has values along axis {axis!r}; blockpred applies them along the channel "
                          f"axis only, one per channel ({channels})", InvalidOptionError)
    return values


def _steps(path, descrs, tensor, channels: int, what: str, input_id: str, in_channels: int | None = None) -> list:
    steps, post = [], what == "postprocessing"
    for index, p in enumerate(descrs):
        kind, kw = p.id, getattr(p, "kwargs", None)
        where = f"{what} step {index + 1} ({kind})"
        if kind not in _PRE_STEPS:
            raise fail(path, f"{where} is not supported; blockpred applies {', '.join(_PRE_STEPS)}",
                        InvalidOptionError)
        if kind == "ensure_dtype":
            steps.append(Step("cast", {"dtype": str(kw.dtype), "back": post}))
        elif kind == "sigmoid":
            steps.append(Step("sigmoid"))
        elif kind == "softmax":
            axis = str(getattr(kw, "axis", "channel"))
            if axis != next((str(a.id) for a in tensor.axes if a.type == "channel"), "channel"):
                raise fail(path, f"{where} runs along axis {axis!r}; blockpred only along the channel axis",
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
                raise fail(path, f"{where} clips at percentiles of the network's output, which exist only "
                                  f"after the whole run", InvalidOptionError)
            else:
                per_channel, per_plane = _reduction(path, kw, tensor, where)
                steps.append(Step("clip", {"low": kw.min, "high": kw.max, "lo_q": kw.min_percentile,
                                           "hi_q": kw.max_percentile}, stat="percentiles",
                                  per_channel=per_channel, per_plane=per_plane))
        elif kind in ("scale_range", "zero_mean_unit_variance"):
            reference = getattr(kw, "reference_tensor", None)
            raw = reference is not None and str(reference) == input_id
            if reference is not None and not raw and str(reference) != str(tensor.id):
                raise fail(path, f"{where} refers to tensor {str(reference)!r}, which is not the input",
                            InvalidOptionError)
            if post and not raw:
                raise fail(path, f"{where} needs statistics of the network's output, which exist only after "
                                  f"the whole run", InvalidOptionError)
            per_channel, per_plane = _reduction(path, kw, tensor, where)
            if raw and post and per_channel and in_channels != channels:
                raise fail(path, f"{where} scales {channels} output channels by statistics of "
                                  f"{in_channels} input channels", InvalidOptionError)
            if kind == "scale_range":
                steps.append(Step("normalize", {"lo_q": kw.min_percentile, "hi_q": kw.max_percentile, "eps": kw.eps},
                                  stat="percentiles", per_channel=per_channel, of_raw_input=raw, per_plane=per_plane))
            else:
                steps.append(Step("normalize", {"eps": kw.eps}, stat="meanstd", per_channel=per_channel,
                                  per_plane=per_plane))
        if not post and steps[-1].stat and not steps[-1].per_plane and any(s.per_plane for s in steps[:-1]):
            raise fail(path, f"{where} takes statistics of the volume after a step with statistics per plane; "
                              f"blockpred computes the volume's first, so a step over the volume must come before "
                              f"the steps per plane", InvalidOptionError)
    return steps


def _weights_format(path, descr) -> str:
    weights = descr.weights
    for name in ("torchscript", "pytorch_state_dict"):
        if getattr(weights, name, None) is not None:
            return name
    found = [name for name in type(weights).model_fields if getattr(weights, name, None) is not None]
    raise fail(path, f"has weights as {', '.join(found) or 'nothing'}; blockpred runs torchscript or "
                      f"pytorch_state_dict weights")


def entry_file(package: Package, source, what: str):
    """The file a package entry names, as a readable path (Path or a path inside the zip)."""
    text = str(source)
    if text.startswith(("http://", "https://")):
        raise fail(package.path, f"names its {what} at {text}; blockpred reads packages offline: download "
                                  f"the package (the .zip) and pass that", InputNotFoundError)
    located = source.absolute() if hasattr(source, "absolute") else Path(text)
    try:
        present = located.is_file()
    except OSError:
        present = False
    if not present:
        raise fail(package.path, f"names {what} {text!r}, which is not in the package", InputNotFoundError)
    return located


def weights_entry_file(package: Package):
    entry = getattr(package.descr.weights, package.weights_format)
    return entry, entry_file(package, entry.source, f"{package.weights_format} weights")


def read_checked(package: Package, entry, located, what: str) -> bytes:
    data = located.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    stated = getattr(entry, "sha256", None)
    if stated is not None and str(stated) != digest:
        raise fail(package.path, f"{what} {str(entry.source)!r} has sha256 {digest[:12]}..., the package says "
                                  f"{str(stated)[:12]}...: the file is corrupt or was changed; get the package again")
    return data
