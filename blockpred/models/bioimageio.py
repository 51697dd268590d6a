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
  channel may be missing) map to blockpred's (b, c, z, y, x); y and x alone
  make a 2D package (see :mod:`.planes`); anything else (time, index axes,
  two channel axes) is refused.  The first output is
  predicted; its spatial axes must have the input's scale.
* **preprocessing** (``scale_range``, ``zero_mean_unit_variance``,
  ``fixed_zero_mean_unit_variance``, ``scale_linear``, ``clip``, ``binarize``,
  ``sigmoid``, ``softmax``, ``ensure_dtype``) and the postprocessing steps that
  need no statistics of the output run on the device inside
  :class:`~.bioimageio_ops.PackageNetwork`; blockpred's own normalisation is
  ``none`` (raw values as float32).
* **statistics** (percentiles, mean and standard deviation): blocks have no
  per-sample statistics, so a 3D package's ``per_sample`` and ``per_dataset``
  both mean "over the volume", and so does a 2D package's ``per_dataset``.
  :func:`blockpred.run.package_stats.configure_run` computes them once, in the client,
  on a sample of the input volume (the whole volume up to 16.8 Mvox, else a
  fixed grid of tiles; see :mod:`.bioimageio_stats`), each step's on the
  values the steps before it produced, and puts the numbers in the run's
  ``model_kwargs`` (key :data:`STATISTICS_KEY`), so every worker applies the
  same constants and the run's fingerprint holds them.  A 2D package's
  per-sample statistics are per plane: a table with a row per plane, computed
  over every plane the run touches (see :mod:`.bioimageio_planes`).
* **test tensors**: before a package's first run, its test input must give its
  test output (:mod:`.check`).
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
import sys
import tempfile
import types
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import InvalidOptionError, UntrustedPickleError
from ..geometry import Coord
from .bioimageio_ops import PackageNetwork, build_op, build_plane_op
from .bioimageio_planes import PLANES_KEY, STATISTICS_KEY  # noqa: F401 - STATISTICS_KEY: for callers
from .bioimageio_package import (Package, entry_file, fail, is_package,  # noqa: F401 - is_package: for callers
                                 one_line, read_checked, read_package, weights_entry_file)
from .planes import DEFAULT_BLOCK_2D, lift, stack_axis

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- loading


def load_package(model: str | Path, weights: str | None, kwargs: Mapping[str, Any], trust_pickle: bool,
                 plane: str | None = None):
    """The package as a :class:`~.loaded.LoadedModel` (kind ``"bioimageio"``); see the module docstring.

    A 2D package runs plane by plane, on ``plane`` (``yx`` by default); a 3D one takes no ``plane``.
    """
    from .loaded import describe

    if weights is not None:
        raise InvalidOptionError(f"bioimage.io package {str(model)!r} holds its own weights; drop --weights")
    unknown = sorted(set(kwargs) - {STATISTICS_KEY})
    if unknown:
        raise InvalidOptionError(f"model_kwargs {unknown} do not apply to bioimage.io package {str(model)!r}: "
                                 f"its architecture's arguments come from the package; drop them")
    package = read_package(model)
    if plane is not None and not package.planar:
        raise InvalidOptionError(f"--plane {plane} runs 2D networks plane by plane, but bioimage.io package "
                                 f"{str(model)!r} is 3D (space axes z, y, x); drop --plane")
    plane = (plane or "yx") if package.planar else None

    def lifted(coord, across) -> Coord:  # a 2D package's (rows, cols) as (z, y, x)
        return Coord(coord) if plane is None else lift(coord, plane, across)

    network, weights_sha = _load_network(package, trust_pickle)
    statistics = kwargs.get(STATISTICS_KEY)
    if package.needs_statistics and statistics is None:
        raise fail(model, "normalises with statistics of the input volume, which blockpred run, plan and "
                           "predict compute; this command has no volume to compute them on")
    module = package_network(package, network, statistics or {}, plane)
    module = module.to(device="cpu").eval()
    # The fingerprint of the weights and of the description (its processing, axes, halo) together.
    sha = hashlib.sha256((weights_sha + package.rdf_sha256).encode()).hexdigest()
    loaded = describe(module, name=package.name, kind="bioimageio", sha=sha,
                      default_block=lifted(package.default_block, DEFAULT_BLOCK_2D[0]),
                      # None stated: blockpred's default, except where a fixed input shape leaves no room for one.
                      default_halo=lifted(package.halo, 0) if any(package.halo) or any(package.fixed) else None)
    return replace(loaded, plane=plane)


def package_network(package: Package, network: torch.nn.Module, statistics: Mapping[str, Any],
                    plane: str | None) -> PackageNetwork:
    """``network`` behind the package's processing, with its ``statistics`` (a 2D package's per-plane ones
    under :data:`~.bioimageio_planes.PLANES_KEY`), on ``plane`` planes (a 2D package) or 3D (None)."""
    def lifted(coord, across) -> Coord:  # a 2D package's (rows, cols) as (z, y, x)
        return Coord(coord) if plane is None else lift(coord, plane, across)

    table = statistics.get(PLANES_KEY)
    if table is not None and (plane is None or table.axis != stack_axis(plane)):
        shown = "3D" if plane is None else f"on {plane} planes, stacked along {'zyx'[stack_axis(plane)]}"
        raise fail(package.path, f"its per-plane statistics are of planes along {'zyx'[table.axis]}, but it runs "
                                 f"{shown}")

    def op(step, key: str):
        if not step.per_plane:
            return build_op(step, statistics.get(key))
        if table is None or key not in table.values:
            kind, index = key.split(".")
            raise fail(package.path, f"its {kind}processing step {int(index) + 1} takes statistics per plane, and "
                                     f"none were given")
        return build_plane_op(step, table.values[key], table.first, 2 + table.axis)

    module = PackageNetwork(
        network,
        pre=[op(s, f"pre.{i}") for i, s in enumerate(package.pre)],
        post=[op(s, f"post.{i}") for i, s in enumerate(package.post)],
        in_axes=package.in_axes, out_axes=package.out_axes, batch_one=package.batch_one,
        min_shape=lifted(package.min_shape, 1), step=lifted(package.step, 1),
        fixed=package.fixed if plane is None else tuple(bool(f) for f in lift(package.fixed, plane, False)),
        package=package.name, plane=plane)
    module.in_channels, module.out_channels = package.in_channels, package.out_channels
    module.downsampling, module.padding = lifted(package.downsampling, 1), package.padding
    return module


def package_sha256(package: Package) -> str:
    """The package's fingerprint, as :func:`load_package` gives it (``weights_sha256``), without loading it:
    the weights file, an architecture source and the ``rdf.yaml`` together."""
    entry, located = weights_entry_file(package)
    sha = hashlib.sha256(read_checked(package, entry, located, f"{package.weights_format} weights")).hexdigest()
    if package.weights_format == "pytorch_state_dict":
        arch = entry.architecture
        if not getattr(arch, "import_from", None):
            code = read_checked(package, arch, entry_file(package, arch.source, "architecture source"),
                                "architecture source")
            sha = hashlib.sha256((sha + hashlib.sha256(code.decode().encode()).hexdigest()).encode()).hexdigest()
    return hashlib.sha256((sha + package.rdf_sha256).encode()).hexdigest()


def _load_network(package: Package, trust_pickle: bool) -> tuple[torch.nn.Module, str]:
    from .state_dicts import find_state_dict, load_strict
    from .torchfile import read_torch_file

    entry, located = weights_entry_file(package)
    what = f"{package.weights_format} weights"
    data = read_checked(package, entry, located, what)
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
            raise fail(package.path, f"{what} {str(entry.source)!r} are not a TorchScript archive")
        return loaded.obj.float().eval(), sha
    state = find_state_dict(loaded.obj)
    if state is None:
        raise fail(package.path, f"{what} {str(entry.source)!r} hold a {type(loaded.obj).__name__}, not a state dict")
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
            raise fail(package.path, f"builds its network with {spec}, which cannot be imported ({exc}); "
                                      f"install the library it comes from") from exc
    else:
        source = str(arch.source)
        if not trust_pickle:
            raise fail(package.path, f"defines its architecture in Python file {source!r} of the package, and "
                                      f"building it runs that code; pass --trust-pickle (trust_pickle=True) only if "
                                      f"you trust the package", UntrustedPickleError)
        located = entry_file(package, arch.source, "architecture source")
        code = read_checked(package, arch, located, "architecture source").decode()
        code_sha = hashlib.sha256(code.encode()).hexdigest()
        module_name = f"_blockpred_bioimageio_{code_sha[:16]}"
        namespace = types.ModuleType(module_name)
        namespace.__file__ = source
        sys.modules.setdefault(module_name, namespace)
        exec(compile(code, source, "exec"), sys.modules[module_name].__dict__)  # trusted by the user
        factory = getattr(sys.modules[module_name], name, None)
        spec = f"{source}:{name}"
        if factory is None:
            raise fail(package.path, f"architecture source {source!r} has no {name!r}")
    try:
        network = factory(**dict(arch.kwargs))
    except Exception as exc:
        raise fail(package.path, f"building {spec}(**{dict(arch.kwargs)}) failed: {one_line(exc)}") from exc
    if not isinstance(network, torch.nn.Module):
        raise fail(package.path, f"{spec} must return a torch.nn.Module, returned {type(network).__name__}")
    return network, code_sha
