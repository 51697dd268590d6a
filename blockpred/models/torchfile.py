"""Read a model file safely: :func:`read_torch_file`.

The rule: **loading a model never runs code from a file the user did not say
to trust** (``--trust-pickle``, ``trust_pickle=True``).  A file is read as the
first of these that applies:

* a TorchScript archive (a zip with a ``constants.pkl`` record) ->
  ``torch.jit.load``, which runs no Python;
* anything else -> ``torch.load(weights_only=True)``, which rebuilds tensors
  and containers only;
* when that fails, the file's pickle opcodes are scanned with
  :mod:`pickletools` (nothing is executed) for the globals they reference.
  Globals beyond tensor data mean a pickled Python object: refused with
  :class:`UntrustedPickleError` unless trusted; no such globals mean the file
  is corrupt.  A trusted file is unpickled with every class of the ``inferno``
  package (never imported: its last release does not install) or of a module
  that cannot be imported replaced by a :class:`_Placeholder`, an
  ``nn.Module`` that keeps its state and refuses to run.

:func:`file_sha256` and :func:`state_dict_sha256` fingerprint the weights read.
"""

from __future__ import annotations

import hashlib
import io
import logging
import pickle
import pickletools
import types
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ..errors import ModelLoadError, UntrustedPickleError

logger = logging.getLogger(__name__)

__all__ = ["TorchFile", "file_sha256", "has_placeholders", "is_placeholder", "read_torch_file", "state_dict_sha256"]


@dataclass(frozen=True)
class TorchFile:
    """What :func:`read_torch_file` found in a file, and how it was read."""

    kind: str  # "torchscript" | "weights" (weights_only load) | "pickle" (trusted unpickling)
    obj: Any


def read_torch_file(path: Path, *, trust_pickle: bool) -> TorchFile:
    """Read a model file without running code from it unless ``trust_pickle``.

    TorchScript archives go to ``torch.jit.load``; everything else first to
    ``torch.load(weights_only=True)``.  When that fails, the file's pickle
    opcodes are scanned (never executed) for the globals it references: if it
    names classes or functions beyond tensor data, it is a pickled Python
    object, refused without trust; otherwise the file is corrupt.
    """
    if _is_torchscript(path):
        try:
            return TorchFile("torchscript", torch.jit.load(str(path), map_location="cpu"))
        except Exception as exc:
            raise ModelLoadError(f"{str(path)!r} looks like a TorchScript archive but cannot be loaded (corrupt?): "
                                 f"{_one_line(exc)}") from exc
    try:
        return TorchFile("weights", torch.load(path, map_location="cpu", weights_only=True))
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
        return TorchFile("pickle", obj)


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


# ---------------------------------------------------------------------- trusted unpickling


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


def is_placeholder(obj) -> bool:
    """Whether ``obj`` stands in for a class that was not imported."""
    return isinstance(obj, _Placeholder)


def has_placeholders(module: nn.Module) -> bool:
    """Whether ``module`` or any of its submodules is a placeholder (and so cannot run)."""
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


# ---------------------------------------------------------------------- fingerprints


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
