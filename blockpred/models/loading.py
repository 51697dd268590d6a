"""Turn the user's ``--model`` (and ``--weights``) into a ready network: :func:`load_model`.

``model`` is, in the order tried:

1. a preset name (``tiny``, ``cremi2018``, ``unet32``; see :mod:`.presets`):
   the built-in :class:`UNet3d` with seeded weights, or with ``weights``
   (a file named like a preset is reached as ``./tiny``);
2. an existing file, read by :func:`.torchfile.read_torch_file` (which never
   runs code from a file the user did not say to trust):

   * a TorchScript archive -> ``torch.jit.load`` (TorchScript runs no Python);
   * a state dict (bare, or under ``"state_dict"`` / ``"model_state_dict"``,
     ``module.`` prefixes of DataParallel stripped) read with
     ``torch.load(weights_only=True)``: an inferno ``UNet`` layout builds an
     :class:`InfernoUNet` with depth, widths and channels read from the tensor
     shapes; a blockpred :class:`UNet3d` layout builds a ``UNet3d`` likewise
     (see :mod:`.state_dicts`).
     What shapes cannot tell (an inferno net's output activation; a UNet3d's
     padding and activations unless the shapes match a preset) comes from
     ``model_kwargs``, and is asked for when missing;
   * a pickled Python object (an inferno trainer checkpoint, ``torch.save(model)``):
     refused with :class:`~blockpred.errors.UntrustedPickleError` unless
     ``trust_pickle``, because unpickling runs code.  With trust it is
     unpickled, with every class of the ``inferno`` package (never imported:
     its last release does not install) or of a module that cannot be imported
     replaced by a placeholder (see :mod:`.torchfile`).  The model is the
     trainer's ``_model``/``model`` or the object itself; one made of real,
     importable classes runs as it is, one with placeholders is rebuilt from
     its state dict as above;

3. ``package.module:factory`` -> ``factory(**model_kwargs)``.  ``weights`` is
   optional here: a factory may build a trained network itself.

A bioimage.io package (an ``rdf.yaml``/``bioimageio.yaml``, its folder, or a
``.zip`` holding one) is recognised before 2 and loaded by :mod:`.bioimageio`
(kind ``"bioimageio"``): its network wrapped with its pre- and postprocessing.

``weights`` (presets and factories) must be a state dict file, loaded strictly.
Every module returned is in eval mode, float32, on the CPU.  ``file_sha256`` and
``state_dict_sha256`` (which fingerprint the weights) live in :mod:`.torchfile`
and are re-exported here.
"""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ..errors import InputNotFoundError, InvalidOptionError, ModelLoadError
from .bioimageio import is_package
from .compat import inferno_stand_in
from .loaded import LoadedModel, describe
from .planes import as_planes, check_plane
from .presets import PRESETS
from .state_dicts import build_from_state_dict, find_state_dict, load_strict, strip_prefix
from .torchfile import file_sha256, has_placeholders, is_placeholder, read_torch_file, state_dict_sha256

logger = logging.getLogger(__name__)

__all__ = ["LoadedModel", "file_sha256", "load_model", "model_kind", "state_dict_sha256"]

_FACTORY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_ACCEPTS = (
    "blockpred accepts a preset name ({presets}), a TorchScript archive, an inferno UNet or blockpred UNet3d "
    "state dict, a pickled inferno checkpoint (with --trust-pickle), package.module:factory (with --weights "
    "for any other architecture), or a bioimage.io package (rdf.yaml or .zip)"
)


def load_model(
    model: str | nn.Module,
    *,
    weights: str | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    trust_pickle: bool = False,
    plane: str | None = None,
) -> LoadedModel:
    """Load ``model`` (a preset, a file or ``package.module:factory``; see the module docstring).

    A 2D network comes wrapped to run plane by plane, on ``plane`` (``yx``
    by default); ``plane`` names a 2D network (see :mod:`.planes`).

    ``model`` may also be an ``nn.Module`` (the Python API's ``predict(model=net)``):
    it is put in eval mode and cast to float32 on the CPU in place, and ``weights``,
    if given, are loaded into it strictly (kind ``"module"``).
    """
    check_plane(plane)
    kind = model_kind(model)
    if kind == "bioimageio":  # a bioimage.io package (rdf.yaml, its folder or .zip): see .bioimageio
        from .bioimageio import load_package

        return load_package(Path(model), weights, dict(model_kwargs or {}), trust_pickle, plane)
    return as_planes(_load(model, kind, weights, dict(model_kwargs or {}), trust_pickle), plane)


def _load(model: str | nn.Module, kind: str, weights: str | None, kwargs: dict, trust_pickle: bool) -> LoadedModel:
    if kind == "module":
        return _load_module(model, weights, kwargs, trust_pickle)
    model = str(model)
    if kind == "preset":
        return _load_preset(model, weights, kwargs, trust_pickle)
    path = Path(model)
    if kind == "file":
        if weights is not None:
            raise InvalidOptionError(
                f"weights apply to presets and factories, but model {model!r} is a file that holds its own; "
                f"drop --weights or pass a preset or factory as the model"
            )
        return _load_file(path, kwargs, trust_pickle)
    if kind == "directory":
        raise ModelLoadError(f"model {model!r} must be a file, found a directory; " + _accepts())
    if kind == "factory":
        return _load_factory(model, weights, kwargs, trust_pickle)
    raise InputNotFoundError(f"model {model!r} does not exist (no such file, and not a preset); " + _accepts())


def model_kind(model: str | nn.Module) -> str:
    """What :func:`load_model` takes ``model`` for, in its order, loading nothing: ``"module"``,
    ``"preset"``, ``"bioimageio"``, ``"file"``, ``"directory"``, ``"factory"`` or ``"missing"``.

    (:func:`blockpred.config.make_config` asks it whether a config file names a factory.)
    """
    if isinstance(model, nn.Module):
        return "module"
    model = str(model)
    if model in PRESETS:
        return "preset"
    path = Path(model)
    if is_package(path):
        return "bioimageio"
    if _is_file(path):
        return "file"
    if _is_dir(path):
        return "directory"
    return "factory" if _FACTORY_RE.match(model) else "missing"


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
    return describe(module, name=name, kind="preset", sha=sha, default_block=preset.default_block,
                    default_halo=preset.default_halo, receptive_radius=preset.receptive_radius)


# ---------------------------------------------------------------------- modules and factories


def _load_module(module: nn.Module, weights: str | None, kwargs: dict, trust_pickle: bool) -> LoadedModel:
    if kwargs:
        raise InvalidOptionError(f"model_kwargs do not apply to a ready {type(module).__name__} module; drop them")
    module = _ready(module)
    if weights is None:
        sha = state_dict_sha256(module.state_dict())
    else:
        sha = _load_weights_into(module, weights, trust_pickle, f"module {type(module).__name__}")
    return describe(module, name=type(module).__name__, kind="module", sha=sha,
                     default_block=None, default_halo=None)


def _load_factory(spec: str, weights: str | None, kwargs: dict, trust_pickle: bool) -> LoadedModel:
    module_name, _, attr_path = spec.partition(":")
    with inferno_stand_in():  # a published model's inferno layers, where inferno itself is not importable
        return _build_factory(spec, module_name, attr_path, weights, kwargs, trust_pickle)


def _build_factory(spec: str, module_name: str, attr_path: str, weights: str | None, kwargs: dict,
                   trust_pickle: bool) -> LoadedModel:
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if missing and missing != module_name and not module_name.startswith(missing + "."):
            # The user's module was found; something it imports was not.
            top = missing.split(".")[0]
            fix = (f"install {top!r}" if top != "inferno" else "inferno's last release (inferno-pytorch 0.1.7) "
                   "does not install on Python 3, and blockpred's stand-in provides its layers only "
                   "(inferno.extensions.layers): put a package 'inferno' on PYTHONPATH that provides the names "
                   "the module imports")
            raise ModelLoadError(
                f"model factory {spec!r}: module {module_name!r} imports {missing!r}, which is not installed "
                f"({exc}); {fix}"
            ) from exc
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
        hint = ("; pass its arguments with --model-kwargs KEY=VALUE,... (model_kwargs in a config or predict)"
                if isinstance(exc, TypeError) and "argument" in str(exc) else "")
        raise ModelLoadError(
            f"model factory {spec!r} failed with model_kwargs {kwargs!r}: {type(exc).__name__}: {exc}{hint}"
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
    return describe(module, name=spec, kind="factory", sha=sha)


def _load_weights_into(module: nn.Module, weights: str, trust_pickle: bool, what: str) -> str:
    """Load the state dict in file ``weights`` into ``module`` strictly; return the file's sha256."""
    path = Path(weights)
    if not path.is_file():
        raise InputNotFoundError(f"weights file {weights!r} for {what} does not exist")
    loaded = read_torch_file(path, trust_pickle=trust_pickle)
    if loaded.kind == "torchscript":
        raise ModelLoadError(
            f"weights file {weights!r} must be a state dict, found a TorchScript archive; pass it as the model instead"
        )
    state = find_state_dict(loaded.obj)
    if state is None:
        found = _find_module(loaded.obj)
        if found is None:
            raise ModelLoadError(f"weights file {weights!r} must hold a state dict, found {type(loaded.obj).__name__}")
        state = found.state_dict()
    load_strict(module, state, f"weights file {weights!r}", what)
    return file_sha256(path)


# ---------------------------------------------------------------------- files


def _load_file(path: Path, kwargs: dict, trust_pickle: bool) -> LoadedModel:
    loaded = read_torch_file(path, trust_pickle=trust_pickle)
    sha = file_sha256(path)
    if loaded.kind == "torchscript":
        if kwargs:
            raise InvalidOptionError(f"model_kwargs do not apply to TorchScript archive {str(path)!r}; drop them")
        return describe(_ready(loaded.obj), name=str(path), kind="torchscript", sha=sha)

    state = find_state_dict(loaded.obj)
    if state is not None:
        module, kind = _module_from_state_dict(state, kwargs, path, hints={})
        return describe(module, name=str(path), kind=kind, sha=sha)

    found = _find_module(loaded.obj)
    if found is None:
        raise ModelLoadError(
            f"{str(path)!r} holds a {type(loaded.obj).__name__} with no model or state dict in it; " + _accepts()
        )
    if not has_placeholders(found):
        # Every class in it could be imported (the user trusted the file): run it as it is.
        if kwargs:
            raise InvalidOptionError(f"model_kwargs do not apply to the pickled module in {str(path)!r}; drop them")
        return describe(_ready(found), name=str(path), kind="pickle", sha=sha)
    logger.info("%s: rebuilding %s from its state dict", path, type(found).__qualname__)
    module, _ = _module_from_state_dict(
        strip_prefix(found.state_dict()), kwargs, path, hints=_hints_from_pickled(found)
    )
    return describe(module, name=str(path), kind="pickle", sha=sha)


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


def _hints_from_pickled(module: nn.Module) -> dict:
    """Constructor arguments a pickled inferno UNet reveals beyond its tensor shapes."""
    hints = {}
    output = getattr(module, "_modules", {}).get("_output")
    children = getattr(output, "_modules", {}) if output is not None else {}
    activation = children.get("1")
    if activation is not None and not is_placeholder(activation):
        hints["final_activation"] = activation
    return hints


# ---------------------------------------------------------------------- state dicts


def _module_from_state_dict(state: dict, kwargs: dict, path: Path, hints: dict) -> tuple[nn.Module, str]:
    built = build_from_state_dict(state, kwargs, path, hints)
    if built is None:
        keys = list(state)
        shown = ", ".join(repr(k) for k in keys[:4]) + (", ..." if len(keys) > 4 else "")
        raise ModelLoadError(
            f"{str(path)!r} holds a state dict blockpred does not recognise (keys {shown}); " + _accepts()
        )
    module, kind = built
    return _ready(module), kind


# ---------------------------------------------------------------------- finishing


def _ready(module: nn.Module) -> nn.Module:
    """Eval mode, float32, on the CPU."""
    return module.to(device="cpu", dtype=torch.float32).eval()
