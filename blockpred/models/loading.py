"""Turn the user's ``--model`` (and ``--weights``) into a ready network: :func:`load_model`.

``model`` is, in the order tried:

1. a preset name (``tiny``, ``cremi2018``, ``unet32``; see :mod:`.presets`):
   the built-in :class:`UNet3d` with seeded weights, or with ``weights``
   (a file named like a preset is reached as ``./tiny``);
2. an existing file:

   * a TorchScript archive -> ``torch.jit.load`` (TorchScript runs no Python);
   * a state dict (bare, or under ``"state_dict"`` / ``"model_state_dict"``,
     ``module.`` prefixes of DataParallel stripped) read with
     ``torch.load(weights_only=True)``: an inferno ``UNet`` layout builds an
     :class:`InfernoUNet` with depth, widths and channels read from the tensor
     shapes; a blockpred :class:`UNet3d` layout builds a ``UNet3d`` likewise.
     What shapes cannot tell (an inferno net's output activation; a UNet3d's
     padding and activations unless the shapes match a preset) comes from
     ``model_kwargs``, and is asked for when missing;
   * a pickled Python object (an inferno trainer checkpoint, ``torch.save(model)``):
     refused with :class:`UntrustedPickleError` unless ``trust_pickle``, because
     unpickling runs code.  With trust it is unpickled, with every class of
     the ``inferno`` package (never imported: its last release does not
     install) or of a module that cannot be imported replaced by a
     :class:`_Placeholder`.  The model is the trainer's ``_model``/``model`` or
     the object itself; one made of real, importable classes runs as it is, one
     with placeholders is rebuilt from its state dict as above;

3. ``package.module:factory`` -> ``factory(**model_kwargs)``.  ``weights`` is
   optional here: a factory may build a trained network itself.

``weights`` (presets and factories) must be a state dict file, loaded strictly.
Every module returned is in eval mode, float32, on the CPU.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import logging
import pickle
import pickletools
import re
import types
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ..errors import InputNotFoundError, InvalidOptionError, ModelLoadError, UntrustedPickleError
from ..geometry import Coord
from .inferno import InfernoUNet
from .presets import PRESETS
from .unet import UNet3d, _normalise_pool_factors

logger = logging.getLogger(__name__)

__all__ = ["LoadedModel", "file_sha256", "load_model", "state_dict_sha256"]

_FACTORY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
#: The keys a state dict may be wrapped under.
_WRAPPER_KEYS = ("state_dict", "model_state_dict", "model", "net", "network")
_ACCEPTS = (
    "blockpred accepts a preset name ({presets}), a TorchScript archive, an inferno UNet or blockpred UNet3d "
    "state dict, a pickled inferno checkpoint (with --trust-pickle), or package.module:factory (with --weights "
    "for any other architecture)"
)


@dataclass(frozen=True)
class LoadedModel:
    """A network ready to predict, and what blockpred knows about it.

    ``name`` is the preset name, file path, ``package.module:factory`` or module
    class name; ``kind`` one of ``"preset"``, ``"torchscript"``, ``"factory"``,
    ``"inferno-state-dict"``, ``"state-dict"``, ``"pickle"`` or ``"module"``.
    ``in_channels`` / ``out_channels`` are None when unknown (the caller finds
    them by a dry run or from the volume); ``downsampling`` is (1, 1, 1) and
    ``padding`` None when unknown.  ``default_block`` / ``default_halo`` are
    set by presets and by modules that carry such attributes.
    ``weights_sha256`` fingerprints the weights: the hash of the weights file's
    bytes, or of the state dict's tensors when there is no file.
    """

    module: nn.Module
    name: str
    kind: str
    in_channels: int | None
    out_channels: int | None
    downsampling: Coord
    padding: str | None
    default_block: Coord | None
    default_halo: Coord | None
    weights_sha256: str


def load_model(
    model: str | nn.Module,
    *,
    weights: str | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    trust_pickle: bool = False,
) -> LoadedModel:
    """Load ``model`` (a preset, a file or ``package.module:factory``; see the module docstring).

    ``model`` may also be an ``nn.Module`` (the Python API's ``predict(model=net)``):
    it is put in eval mode and cast to float32 on the CPU in place, and ``weights``,
    if given, are loaded into it strictly (kind ``"module"``).
    """
    kwargs = dict(model_kwargs or {})
    if isinstance(model, nn.Module):
        return _load_module(model, weights, kwargs, trust_pickle)
    model = str(model)
    if model in PRESETS:
        return _load_preset(model, weights, kwargs, trust_pickle)
    path = Path(model)
    if _is_file(path):
        if weights is not None:
            raise InvalidOptionError(
                f"weights apply to presets and factories, but model {model!r} is a file that holds its own; "
                f"drop --weights or pass a preset or factory as the model"
            )
        return _load_file(path, kwargs, trust_pickle)
    if _is_dir(path):
        raise ModelLoadError(f"model {model!r} must be a file, found a directory; " + _accepts())
    if _FACTORY_RE.match(model):
        return _load_factory(model, weights, kwargs, trust_pickle)
    raise InputNotFoundError(f"model {model!r} does not exist (no such file, and not a preset); " + _accepts())


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # e.g. a name too long to be a path
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def _accepts() -> str:
    return _ACCEPTS.format(presets=", ".join(PRESETS))


# ---------------------------------------------------------------------- presets


def _load_preset(name: str, weights: str | None, kwargs: dict, trust_pickle: bool) -> LoadedModel:
    if kwargs:
        raise InvalidOptionError(
            f"model_kwargs apply to factories and state-dict files, but {name!r} is a preset (got {sorted(kwargs)}); "
            f"use package.module:factory for a custom architecture"
        )
    preset = PRESETS[name]
    module = preset.build()
    if weights is None:
        sha = state_dict_sha256(module.state_dict())
    else:
        sha = _load_weights_into(module, weights, trust_pickle, f"preset {name!r}")
    return _describe(module, name=name, kind="preset", sha=sha,
                     default_block=preset.default_block, default_halo=preset.default_halo)


# ---------------------------------------------------------------------- modules and factories


def _load_module(module: nn.Module, weights: str | None, kwargs: dict, trust_pickle: bool) -> LoadedModel:
    if kwargs:
        raise InvalidOptionError(f"model_kwargs do not apply to a ready {type(module).__name__} module; drop them")
    module = _ready(module)
    if weights is None:
        sha = state_dict_sha256(module.state_dict())
    else:
        sha = _load_weights_into(module, weights, trust_pickle, f"module {type(module).__name__}")
    return _describe(module, name=type(module).__name__, kind="module", sha=sha,
                     default_block=None, default_halo=None)


def _load_factory(spec: str, weights: str | None, kwargs: dict, trust_pickle: bool) -> LoadedModel:
    module_name, _, attr_path = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelLoadError(
            f"model factory {spec!r} needs module {module_name!r}, which cannot be imported ({exc}); "
            f"install it or put it on PYTHONPATH"
        ) from exc
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ModelLoadError(
                f"model factory {spec!r}: module {module_name!r} has no attribute {attr_path!r}; check the name"
            ) from None
    if not callable(target):
        raise ModelLoadError(f"model factory {spec!r} must be callable, found {type(target).__name__}")
    try:
        module = target(**kwargs)
    except Exception as exc:
        raise ModelLoadError(
            f"model factory {spec!r} failed with model_kwargs {kwargs!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(module, nn.Module):
        raise ModelLoadError(
            f"model factory {spec!r} must return a torch.nn.Module, returned {type(module).__name__}"
        )
    module = _ready(module)
    if weights is None:
        sha = state_dict_sha256(module.state_dict())
    else:
        sha = _load_weights_into(module, weights, trust_pickle, f"factory {spec!r}")
    return _describe(module, name=spec, kind="factory", sha=sha)


def _load_weights_into(module: nn.Module, weights: str, trust_pickle: bool, what: str) -> str:
    """Load the state dict in file ``weights`` into ``module`` strictly; return the file's sha256."""
    path = Path(weights)
    if not path.is_file():
        raise InputNotFoundError(f"weights file {weights!r} for {what} does not exist")
    loaded = _read_torch_file(path, trust_pickle=trust_pickle)
    if loaded.kind == "torchscript":
        raise ModelLoadError(
            f"weights file {weights!r} must be a state dict, found a TorchScript archive; pass it as the model instead"
        )
    state = _find_state_dict(loaded.obj)
    if state is None:
        found = _find_module(loaded.obj)
        if found is None:
            raise ModelLoadError(f"weights file {weights!r} must hold a state dict, found {type(loaded.obj).__name__}")
        state = found.state_dict()
    _load_strict(module, state, f"weights file {weights!r}", what)
    return file_sha256(path)


# ---------------------------------------------------------------------- files


def _load_file(path: Path, kwargs: dict, trust_pickle: bool) -> LoadedModel:
    loaded = _read_torch_file(path, trust_pickle=trust_pickle)
    sha = file_sha256(path)
    if loaded.kind == "torchscript":
        if kwargs:
            raise InvalidOptionError(f"model_kwargs do not apply to TorchScript archive {str(path)!r}; drop them")
        return _describe(_ready(loaded.obj), name=str(path), kind="torchscript", sha=sha)

    state = _find_state_dict(loaded.obj)
    if state is not None:
        module, kind = _module_from_state_dict(state, kwargs, path, hints={})
        return _describe(module, name=str(path), kind=kind, sha=sha)

    found = _find_module(loaded.obj)
    if found is None:
        raise ModelLoadError(
            f"{str(path)!r} holds a {type(loaded.obj).__name__} with no model or state dict in it; " + _accepts()
        )
    if not _has_placeholders(found):
        # Every class in it could be imported (the user trusted the file): run it as it is.
        if kwargs:
            raise InvalidOptionError(f"model_kwargs do not apply to the pickled module in {str(path)!r}; drop them")
        return _describe(_ready(found), name=str(path), kind="pickle", sha=sha)
    logger.info("%s: rebuilding %s from its state dict", path, type(found).__qualname__)
    module, _ = _module_from_state_dict(
        _strip_prefix(found.state_dict()), kwargs, path, hints=_hints_from_pickled(found)
    )
    return _describe(module, name=str(path), kind="pickle", sha=sha)


def _find_state_dict(obj) -> dict[str, torch.Tensor] | None:
    """The state dict in ``obj``: itself, or under one of :data:`_WRAPPER_KEYS`."""
    if isinstance(obj, Mapping) and obj:
        if all(isinstance(k, str) for k in obj) and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return _strip_prefix(dict(obj))
        for key in _WRAPPER_KEYS:
            if key in obj:
                found = _find_state_dict(obj[key])
                if found is not None:
                    return found
    return None


def _find_module(obj, depth: int = 0) -> nn.Module | None:
    """The model in an unpickled object: a trainer's ``_model``/``model``, a dict's, or the object itself."""
    if depth > 4:
        return None
    if isinstance(obj, Mapping):
        candidates = [obj[k] for k in ("_model", "model", "net", "network") if k in obj]
    else:
        attrs = getattr(obj, "__dict__", {})
        candidates = [attrs[k] for k in ("_model", "model") if k in attrs]
    for candidate in candidates:
        found = _find_module(candidate, depth + 1)
        if found is not None:
            return found
    if isinstance(obj, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return obj.module
    if isinstance(obj, nn.Module):
        return obj
    return None


def _strip_prefix(state: dict) -> dict:
    """Drop the ``module.`` prefix ``DataParallel`` puts on every key."""
    if state and all(k.startswith("module.") for k in state):
        return {k[len("module."):]: v for k, v in state.items()}
    return state


def _hints_from_pickled(module: nn.Module) -> dict:
    """Constructor arguments a pickled inferno UNet reveals beyond its tensor shapes."""
    hints = {}
    output = getattr(module, "_modules", {}).get("_output")
    children = getattr(output, "_modules", {}) if output is not None else {}
    activation = children.get("1")
    if activation is not None and not _is_placeholder(activation):
        hints["final_activation"] = activation
    return hints


# ---------------------------------------------------------------------- state dicts


def _module_from_state_dict(state: dict, kwargs: dict, path: Path, hints: dict) -> tuple[nn.Module, str]:
    if "_initial_conv.conv.weight" in state and "_conv_bottom_op.0.conv.weight" in state:
        config = {**_infer_inferno_config(state, path), **hints, **kwargs}
        if "final_activation" not in config:
            if "_output.0.conv.weight" in state:
                raise ModelLoadError(
                    f"{str(path)!r} is an inferno UNet whose output has an activation (keys '_output.0.*') that "
                    f"its tensors cannot name; pass model_kwargs {{'final_activation': 'Sigmoid'}} (or the torch.nn "
                    f"activation it was trained with)"
                )
            config["final_activation"] = None
        module = _build(InfernoUNet, config, path)
        _load_strict(module, state, repr(str(path)), f"an inferno UNet {_show(config)}")
        return _ready(module), "inferno-state-dict"
    if "output.weight" in state and "bottom.0.weight" in state:
        config = {**_infer_unet3d_config(state, path), **kwargs}
        missing = [k for k in ("padding", "activation", "final_activation") if k not in config]
        if missing:
            raise ModelLoadError(
                f"{str(path)!r} is a blockpred UNet3d state dict whose {', '.join(missing)} its tensors cannot "
                f"tell; pass them in model_kwargs, or load it as --model <preset> --weights {str(path)!r}"
            )
        module = _build(UNet3d, config, path)
        _load_strict(module, state, repr(str(path)), f"a UNet3d {_show(config)}")
        return _ready(module), "state-dict"
    keys = list(state)
    shown = ", ".join(repr(k) for k in keys[:4]) + (", ..." if len(keys) > 4 else "")
    raise ModelLoadError(
        f"{str(path)!r} holds a state dict blockpred does not recognise (keys {shown}); " + _accepts()
    )


def _show(config: dict) -> str:
    return "(" + ", ".join(f"{k}={v!r}" for k, v in config.items()) + ")"


def _build(cls, config: dict, path: Path) -> nn.Module:
    try:
        return cls(**config)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"cannot build {cls.__name__} for {str(path)!r} from {_show(config)}: {exc}") from exc


def _weight(state: dict, key: str, path: Path) -> torch.Tensor:
    tensor = state.get(key)
    if tensor is None:
        raise ModelLoadError(f"{str(path)!r} looks like a known state dict but lacks {key!r} (truncated or edited?)")
    if tensor.dim() != 5:
        raise ModelLoadError(
            f"{str(path)!r}: {key!r} must be a 3D convolution weight (5 dimensions), found shape "
            f"{tuple(tensor.shape)}; blockpred runs 3D networks only"
        )
    return tensor


def _levels(state: dict, prefix: str) -> int:
    """How many consecutive indices ``prefix<i>.`` the keys use."""
    indices = {int(m.group(1)) for k in state if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    count = 0
    while count in indices:
        count += 1
    return count


def _infer_inferno_config(state: dict, path: Path) -> dict:
    first = _weight(state, "_initial_conv.conv.weight", path)
    initial_features, in_channels = int(first.shape[0]), int(first.shape[1])
    depth = _levels(state, "_conv_down_ops.")
    if depth < 1:
        raise ModelLoadError(f"{str(path)!r} looks like an inferno UNet but has no '_conv_down_ops.0.*' weights")
    second = int(_weight(state, "_conv_down_ops.0.conv.weight", path).shape[0])
    if second % initial_features:
        raise ModelLoadError(
            f"{str(path)!r}: inferno UNet levels must grow by an integer gain, found {initial_features} -> {second} "
            f"feature maps"
        )
    key = "_output.0.conv.weight" if "_output.0.conv.weight" in state else "_output.conv.weight"
    out_channels = int(_weight(state, key, path).shape[0])
    return dict(in_channels=in_channels, out_channels=out_channels, dim=3, depth=depth,
                initial_features=initial_features, gain=second // initial_features)


def _infer_unet3d_config(state: dict, path: Path) -> dict:
    depth = _levels(state, "encoders.")
    first = _weight(state, "encoders.0.0.weight" if depth else "bottom.0.weight", path)
    initial_features, in_channels = int(first.shape[0]), int(first.shape[1])
    next_features = int(_weight(state, "encoders.1.0.weight" if depth > 1 else "bottom.0.weight", path).shape[0])
    growth = next_features // initial_features if depth else 2
    # upsamplers run deepest first; a transposed conv's kernel is its level's pool factor.
    pool_factors = [None] * depth
    for j in range(depth):
        kernel = _weight(state, f"upsamplers.{j}.weight", path).shape[2:]
        pool_factors[depth - 1 - j] = tuple(int(v) for v in kernel)
    config = dict(in_channels=in_channels, out_channels=int(_weight(state, "output.weight", path).shape[0]),
                  depth=depth, initial_features=initial_features, growth=growth,
                  pool_factors=pool_factors if depth else 2)
    for preset in PRESETS.values():
        unet = preset.unet_kwargs
        same_shape = all(unet[k] == config[k] for k in ("in_channels", "out_channels", "depth", "initial_features",
                                                         "growth"))
        if same_shape and _pool_list(unet["pool_factors"], depth) == pool_factors:
            logger.info("%s has the shapes of preset %r; taking its padding and activations", path, preset.name)
            config.update({k: unet[k] for k in ("padding", "activation", "final_activation")})
            break
    return config


def _pool_list(pool_factors, depth: int) -> list[tuple[int, ...]]:
    return [tuple(f) for f in _normalise_pool_factors(pool_factors, depth)]


def _load_strict(module: nn.Module, state: Mapping, source: str, what: str) -> None:
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())
        if len(detail) > 400:
            detail = detail[:400] + "..."
        raise ModelLoadError(f"{source} does not fit {what}: {detail}") from exc


# ---------------------------------------------------------------------- finishing


def _ready(module: nn.Module) -> nn.Module:
    """Eval mode, float32, on the CPU."""
    return module.to(device="cpu", dtype=torch.float32).eval()


def _describe(module: nn.Module, *, name: str, kind: str, sha: str,
              default_block: Coord | None = None, default_halo: Coord | None = None) -> LoadedModel:
    def int_attr(attr: str) -> int | None:
        value = getattr(module, attr, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def coord_attr(attr: str) -> Coord | None:
        value = getattr(module, attr, None)
        try:
            coord = Coord(value)
        except (TypeError, ValueError):
            return None
        return coord if len(coord) == 3 else None

    padding = getattr(module, "padding", None)
    loaded = LoadedModel(
        module=module,
        name=name,
        kind=kind,
        in_channels=int_attr("in_channels"),
        out_channels=int_attr("out_channels"),
        downsampling=coord_attr("downsampling") or Coord((1, 1, 1)),
        padding=padding if padding in ("same", "valid") else None,
        default_block=default_block or coord_attr("default_block"),
        default_halo=default_halo or coord_attr("default_halo"),
        weights_sha256=sha,
    )
    logger.info("loaded model %s (%s): %s -> %s channels, downsampling %s", name, kind,
                loaded.in_channels, loaded.out_channels, tuple(loaded.downsampling))
    return loaded


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def state_dict_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """The sha256 of a state dict: every key, dtype, shape and the tensor bytes, in key order."""
    digest = hashlib.sha256()
    for key in sorted(state):
        tensor = state[key].detach().to("cpu").contiguous()
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


# ---------------------------------------------------------------------- reading files safely


@dataclass(frozen=True)
class _TorchFile:
    kind: str  # "torchscript" | "weights" (weights_only load) | "pickle" (trusted unpickling)
    obj: Any


def _read_torch_file(path: Path, *, trust_pickle: bool) -> _TorchFile:
    """Read a model file without running code from it unless ``trust_pickle``.

    TorchScript archives go to ``torch.jit.load``; everything else first to
    ``torch.load(weights_only=True)``.  When that fails, the file's pickle
    opcodes are scanned (never executed) for the globals it references: if it
    names classes or functions beyond tensor data, it is a pickled Python
    object, refused without trust; otherwise the file is corrupt.
    """
    if _is_torchscript(path):
        try:
            return _TorchFile("torchscript", torch.jit.load(str(path), map_location="cpu"))
        except Exception as exc:
            raise ModelLoadError(f"{str(path)!r} looks like a TorchScript archive but cannot be loaded (corrupt?): "
                                 f"{_one_line(exc)}") from exc
    try:
        return _TorchFile("weights", torch.load(path, map_location="cpu", weights_only=True))
    except Exception as exc:
        code_globals = [g for g in (_pickle_globals(path) or []) if not _is_data_global(g)]
        code_globals.sort(key=lambda g: g.startswith("torch."))  # the foreign classes first
        if not code_globals:
            raise ModelLoadError(
                f"{str(path)!r} is not a TorchScript archive, state dict or checkpoint (corrupt?): {_one_line(exc)}"
            ) from exc
        shown = ", ".join(code_globals[:3]) + (", ..." if len(code_globals) > 3 else "")
        if not trust_pickle:
            raise UntrustedPickleError(
                f"{str(path)!r} is a pickled Python object (it references {shown}); unpickling runs arbitrary "
                f"code: pass --trust-pickle only if you trust where it came from"
            ) from None
        logger.warning("unpickling %s (trusted by the user; it references %s)", path, shown)
        try:
            with warnings.catch_warnings():
                # Legacy files compare pickled torch source with today's; the differences are noise here.
                warnings.simplefilter("ignore", torch.serialization.SourceChangeWarning)
                warnings.filterwarnings("ignore", message="Couldn't retrieve source code")
                obj = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_placeholder_pickle)
        except Exception as exc2:
            raise ModelLoadError(f"cannot unpickle {str(path)!r} (corrupt?): {_one_line(exc2)}") from exc2
        return _TorchFile("pickle", obj)


def _one_line(exc: BaseException) -> str:
    """The first sentence of an exception's message, on one line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = text.split(". ")[0]
    return text if len(text) <= 200 else text[:200] + "..."


def _is_torchscript(path: Path) -> bool:
    """A TorchScript archive is a zip file with a ``constants.pkl`` record (as ``torch.load`` checks)."""
    if not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name == "constants.pkl" or name.endswith("/constants.pkl") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


#: Opcodes that push a string, which STACK_GLOBAL may use as module or name.
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}


def _pickle_globals(path: Path) -> list[str] | None:
    """The ``module.name`` globals the file's pickle references, read with pickletools (nothing runs).

    None when the file holds no readable pickle.  A zip (torch's format since
    1.6) holds it as ``<archive>/data.pkl``; the legacy format is a few pickles
    in a row followed by raw tensor bytes.
    """
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                names = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
                if not names:
                    return None
                stream = io.BytesIO(archive.read(min(names, key=len)))
            return _scan_pickles(stream, max_pickles=1)
        with open(path, "rb") as stream:
            return _scan_pickles(stream, max_pickles=5)
    except (OSError, zipfile.BadZipFile, RuntimeError):
        return None


def _scan_pickles(stream, max_pickles: int) -> list[str] | None:
    found: list[str] = []
    for index in range(max_pickles):
        if not stream.read(1):
            break
        stream.seek(-1, io.SEEK_CUR)
        memo: dict[int, Any] = {}
        strings: list[str] = []
        try:
            for op, arg, _ in pickletools.genops(stream):
                name = op.name
                if name in _STRING_OPS:
                    strings.append(arg if isinstance(arg, str) else str(arg))
                elif name == "MEMOIZE" and strings:
                    memo[len(memo)] = strings[-1]
                elif name in ("BINGET", "LONG_BINGET", "GET") and isinstance(memo.get(arg), str):
                    strings.append(memo[arg])
                elif name == "GLOBAL":
                    module, _, attr = str(arg).partition(" ")
                    found.append(f"{module}.{attr}")
                elif name == "STACK_GLOBAL" and len(strings) >= 2:
                    found.append(f"{strings[-2]}.{strings[-1]}")
        except Exception:  # noqa: BLE001 - any parse failure means "not (or no more) pickle"
            if index == 0:
                return None
            break
    return list(dict.fromkeys(found))


_DATA_GLOBALS = {
    "collections.OrderedDict", "_codecs.encode", "builtins.set", "builtins.frozenset", "builtins.bytearray",
    "builtins.slice", "builtins.complex", "__builtin__.set", "__builtin__.frozenset", "__builtin__.bytearray",
    "torch.Size", "torch.device", "torch._tensor._rebuild_from_type_v2",
}


def _is_data_global(qualified: str) -> bool:
    """Whether a pickled global only rebuilds tensors or containers (what ``weights_only`` allows)."""
    if qualified in _DATA_GLOBALS:
        return True
    module, _, name = qualified.rpartition(".")
    if module == "torch._utils" and name.startswith("_rebuild"):
        return True
    if module == "torch" and (name.endswith("Storage") or isinstance(getattr(torch, name, None), torch.dtype)):
        return True
    return False


class _Placeholder(nn.Module):
    """Stands in for a class that is not imported while unpickling a trusted checkpoint.

    Every placeholder is an ``nn.Module`` subclass: a pickled module (an inferno
    ``UNet``, ``ConvELU3D``...) keeps its ``_parameters`` and ``_modules``, so its
    ``state_dict()`` works, while any other object (a trainer, a callback) just
    keeps its attributes.  Placeholders accept any constructor arguments and
    state, and refuse to run.
    """

    _placeholder_for = "?"

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.__dict__["_placeholder_args"] = (args, kwargs)

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
            state = {**(state[0] or {}), **(state[1] or {})}  # (__dict__, __slots__) state
        if not isinstance(state, dict):
            state = {"_placeholder_state": state}
        super().__setstate__(state)
        for attr in ("_parameters", "_buffers", "_modules"):
            self.__dict__.setdefault(attr, {})
        self.__dict__.setdefault("training", False)

    def __setitem__(self, key, value):  # for pickled dict subclasses
        self.__dict__.setdefault("_placeholder_items", {})[key] = value

    def append(self, value):  # for pickled list subclasses
        self.__dict__.setdefault("_placeholder_list", []).append(value)

    def extend(self, values):
        for value in values:
            self.append(value)

    def forward(self, *args, **kwargs):
        raise ModelLoadError(f"{self._placeholder_for} was not imported while unpickling and cannot run")

    def extra_repr(self) -> str:
        return f"placeholder for {self._placeholder_for}"


_placeholder_classes: dict[tuple[str, str], type] = {}


def _placeholder_class(module: str, name: str) -> type:
    key = (module, name)
    if key not in _placeholder_classes:
        _placeholder_classes[key] = type(
            name.rpartition(".")[2], (_Placeholder,),
            {"__module__": module, "__qualname__": name, "_placeholder_for": f"{module}.{name}"},
        )
    return _placeholder_classes[key]


def _is_placeholder(obj) -> bool:
    return isinstance(obj, _Placeholder)


def _has_placeholders(module: nn.Module) -> bool:
    return any(isinstance(m, _Placeholder) for m in module.modules())


class _PlaceholderUnpickler(pickle.Unpickler):
    """An unpickler that never imports ``inferno`` and tolerates modules that are not installed."""

    def find_class(self, module: str, name: str):
        if module == "inferno" or module.startswith("inferno."):
            return _placeholder_class(module, name)
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            logger.warning("unpickling: %s.%s cannot be imported; using a placeholder", module, name)
            return _placeholder_class(module, name)


def _placeholder_load(file, **kwargs):
    return _PlaceholderUnpickler(file, **kwargs).load()


#: The ``pickle_module`` handed to ``torch.load`` for trusted files.
_placeholder_pickle = types.ModuleType("blockpred_placeholder_pickle")
_placeholder_pickle.Unpickler = _PlaceholderUnpickler
_placeholder_pickle.load = _placeholder_load
_placeholder_pickle.Pickler = pickle.Pickler
_placeholder_pickle.dump = pickle.dump
_placeholder_pickle.__version__ = pickle.format_version
