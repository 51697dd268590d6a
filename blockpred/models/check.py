"""Does a model compute what it says?  A bioimage.io package's own test tensors, run as the package defines them.

A package carries a test input and the output its network gave on it
(``test_tensor`` of its input and output; ``test_inputs`` / ``test_outputs``
in format 0.4).  :func:`check_model` loads the model as a run does and, for
a package, runs the test input *exactly as the package defines it*, as
``bioimageio.core``'s ``test_model`` does: the whole tensor in one call (no
blocks, no halo, no padding), its preprocessing with the statistics of the
test input itself (per sample, or per plane for a 2D package's per-sample
steps: each sample of the batch is a plane), the network, the
postprocessing; then compares the package's first output with its test
output.  A 3D test input of several samples runs sample by sample, each with
its own statistics.

The tolerance is the package's own (format 0.5:
``config.bioimageio.reproducibility_tolerance``, the first entry for this
weights format and output), else bioimageio.core's default (:data:`DEFAULT_TOLERANCE`).  A value
mismatches when ``|got - expected| > absolute + relative * |expected|``; the
check passes when mismatches are at most the tolerance's mismatched elements
per million (none by default).

:func:`check_package_once` is what a run does before a package's first run
(a new run, not a resume): the check, once per package (the sha256 of its
weights, description and test tensors) per cache directory (:func:`blockpred.cache.default_cache_dir`), a failure raised
as :class:`~blockpred.errors.PackageTestFailedError` (one line, exit code 2)
before anything is written.
"""

from __future__ import annotations

import hashlib
import io
import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from ..cache import JsonFile, default_cache_dir
from ..errors import InvalidOptionError, PackageTestFailedError

logger = logging.getLogger(__name__)

#: The cache of packages whose test output was reproduced, by package sha256 (in the cache directory).
CACHE_FILE = "package_tests.json"


@dataclass(frozen=True, slots=True)
class Tolerance:
    """``|got - expected| <= absolute + relative * |expected|``, all but ``mismatched_per_million`` values."""

    relative: float
    absolute: float
    mismatched_per_million: float = 0.0
    #: True: the package states it; False: blockpred's default.
    stated: bool = False

    def __str__(self) -> str:
        text = f"|diff| <= {self.absolute:g} + {self.relative:g} x |expected|"
        if self.mismatched_per_million:
            text += f" (up to {self.mismatched_per_million:g} values per million outside)"
        return text + (" (the package's reproducibility_tolerance)" if self.stated
                       else " (bioimageio.core's default: the package states no tolerance)")


#: The tolerance of a package that states none: bioimageio.core's ``test_model`` defaults.
DEFAULT_TOLERANCE = Tolerance(relative=1e-4, absolute=1.5e-4)


@dataclass(frozen=True, slots=True)
class CheckResult:
    """What :func:`check_model` found; ``str()`` is its one line."""

    #: The model's name and kind (as :func:`blockpred.models.load_model` says).
    name: str
    kind: str
    #: What was compared ("test output 'pred' (1, 2, 64, 64) from test input 'raw' (1, 1, 64, 64)"), "" for nothing.
    compared: str
    #: The largest |got - expected| (None: nothing compared, or the outputs could not be compared).
    max_abs_diff: float | None
    tolerance: Tolerance | None
    #: True or False; None when there is nothing to compare.
    passed: bool | None
    seconds: float
    #: Values outside the tolerance, of how many.
    num_mismatched: int = 0
    num_values: int = 0
    #: The package's path (for the failure's line).
    path: str = ""
    #: Why the outputs could not be compared (the network refused the test input, other shapes), else "".
    problem: str = ""

    def __str__(self) -> str:
        if self.passed is None:
            return (f"{self.name} ({self.kind}): nothing to compare: only a bioimage.io package carries test "
                    f"tensors ({self.seconds:.2f} s)")
        if self.passed:
            return (f"{self.name} ({self.kind}): {self.compared}: max |diff| {self.max_abs_diff:.3g}, within "
                    f"{self.tolerance} ({self.seconds:.2f} s)")
        found = self.problem or (f"max |diff| {self.max_abs_diff:.3g}, {self.num_mismatched} of {self.num_values} "
                                 f"values outside {self.tolerance}")
        return (f"bioimage.io package {self.path!r} does not reproduce its own {self.compared}: {found}; its files "
                f"are damaged or were changed (get the package again), or its test output was made by other "
                f"software (bioimageio.core's test_model tells which); blockpred does not run it")


def check_model(model, weights: str | None = None, *, trust_pickle: bool = False, plane: str | None = None,
                model_kwargs: Mapping[str, Any] | None = None) -> CheckResult:
    """Load ``model`` as a run does and, for a bioimage.io package, reproduce its test output (see the module
    docstring).  A model that cannot be loaded raises (a :class:`~blockpred.errors.BlockpredError`); a test
    output not reproduced is a result with ``passed=False``, not an error."""
    from .bioimageio import STATISTICS_KEY, _load_network, is_package, read_package
    from .loading import load_model
    from .planes import check_plane

    started = time.perf_counter()
    if not is_package(model):
        loaded = load_model(model, weights=weights, model_kwargs=dict(model_kwargs or {}), trust_pickle=trust_pickle,
                            plane=plane)
        return CheckResult(loaded.name, loaded.kind, "", None, None, None, time.perf_counter() - started)
    if weights is not None:
        raise InvalidOptionError(f"bioimage.io package {str(model)!r} holds its own weights; drop --weights")
    unknown = sorted(set(model_kwargs or {}) - {STATISTICS_KEY})
    if unknown:
        raise InvalidOptionError(f"model_kwargs {unknown} do not apply to bioimage.io package {str(model)!r}: "
                                 f"its architecture's arguments come from the package; drop them")
    check_plane(plane)
    package = read_package(model)
    if plane is not None and not package.planar:
        raise InvalidOptionError(f"--plane {plane} runs 2D networks plane by plane, but bioimage.io package "
                                 f"{str(model)!r} is 3D (space axes z, y, x); drop --plane")
    network, _ = _load_network(package, trust_pickle)
    return _compare(package, network.to("cpu"), started)


def check_package_once(model, *, trust_pickle: bool = False) -> CheckResult | None:
    """Before a package's first run: :func:`check_model`, unless this package (its weights, description and test
    tensors) passed before in this cache directory; a failure raises :class:`PackageTestFailedError` with the
    result's line.
    Returns the result, or None when the cache says it passed."""
    from .bioimageio import package_sha256, read_package

    package = read_package(model)
    sha = hashlib.sha256("".join([package_sha256(package)] + [
        hashlib.sha256(_test_tensor_bytes(package, tensor.test_tensor, what)).hexdigest()
        for tensor, what in ((package.descr.inputs[0], "test input"), (package.descr.outputs[0], "test output"))
    ]).encode()).hexdigest()  # the package and its test tensors
    cache = JsonFile(default_cache_dir() / CACHE_FILE)
    if sha in cache.read():
        logger.info("bioimage.io package %s reproduced its test output before (cached in %s)", model, cache.path)
        return None
    result = check_model(model, trust_pickle=trust_pickle)
    if not result.passed:
        raise PackageTestFailedError(str(result))
    logger.info("%s", result)
    entries = cache.read()
    entries[sha] = {"name": result.name, "compared": result.compared, "max_abs_diff": result.max_abs_diff,
                    "tolerance": str(result.tolerance), "torch": torch.__version__, "checked": time.time()}
    cache.write(entries, "the package's passed test")
    return result


# ---------------------------------------------------------------------- the package's test


def _compare(package, network: torch.nn.Module, started: float) -> CheckResult:
    descr = package.descr
    tensor_in, tensor_out = descr.inputs[0], descr.outputs[0]
    test_in = _test_tensor(package, tensor_in.test_tensor, "test input")
    expected = _test_tensor(package, tensor_out.test_tensor, "test output")
    compared = (f"test output {str(tensor_out.id)!r} {tuple(expected.shape)} from test input {str(tensor_in.id)!r} "
                f"{tuple(test_in.shape)}" + (f" (the first of {len(descr.outputs)} outputs)" if len(descr.outputs) > 1
                                             else ""))
    tolerance = package_tolerance(package)

    def result(**fields) -> CheckResult:
        return CheckResult(package.name, "bioimageio", compared, tolerance=tolerance,
                           seconds=time.perf_counter() - started, path=package.path, **fields)

    try:
        got = _run(package, network, test_in)
    except Exception as err:  # noqa: BLE001 - the package's network on its own input: said in the line
        from .bioimageio_package import one_line

        return result(max_abs_diff=None, passed=False, problem=f"its network failed on it: {one_line(err)}")
    if got.shape != expected.shape:
        return result(max_abs_diff=None, passed=False, problem=f"its network's output has shape {tuple(got.shape)}, "
                                                               f"the test output {tuple(expected.shape)}")
    want = expected.astype(np.float64)
    diff = np.abs(got.astype(np.float64) - want)
    inside = diff <= tolerance.absolute + tolerance.relative * np.abs(want)  # NaN: outside
    mismatched = int(diff.size - np.count_nonzero(inside))
    largest = float(np.max(diff)) if diff.size else 0.0
    passed = mismatched * 1e6 <= tolerance.mismatched_per_million * max(1, diff.size)
    return result(max_abs_diff=largest, passed=passed, num_mismatched=mismatched, num_values=int(diff.size))


def package_tolerance(package) -> Tolerance:
    """The package's reproducibility tolerance for its first output and weights, else :data:`DEFAULT_TOLERANCE`."""
    config = getattr(getattr(package.descr, "config", None), "bioimageio", None)
    if config is None or "reproducibility_tolerance" not in getattr(config, "model_fields_set", ()):
        return DEFAULT_TOLERANCE
    output = package.descr.outputs[0]
    data = output.data[0] if isinstance(output.data, (list, tuple)) else output.data
    dtype = str(getattr(data, "type", "float32"))
    for entry in config.reproducibility_tolerance:
        formats = [str(f) for f in (entry.weights_formats or ())]
        if formats and package.weights_format not in formats:
            continue
        ids = entry.output_ids
        if ids == "any_discrete_output" and not dtype.startswith(("int", "uint", "bool")):
            continue
        if ids == "any_continuous_output" and not dtype.startswith("float"):
            continue
        if not isinstance(ids, str) and ids and str(output.id) not in {str(i) for i in ids}:
            continue
        return Tolerance(float(entry.relative_tolerance), float(entry.absolute_tolerance),
                         float(entry.mismatched_elements_per_million), stated=True)
    return DEFAULT_TOLERANCE


def _test_tensor_bytes(package, descr, what: str) -> bytes:
    from .bioimageio_package import entry_file, fail, read_checked

    if descr is None:
        raise fail(package.path, f"has no {what}")
    return read_checked(package, descr, entry_file(package, descr.source, what), what)


def _test_tensor(package, descr, what: str) -> np.ndarray:
    from .bioimageio_package import fail

    data = _test_tensor_bytes(package, descr, what)
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError) as err:
        raise fail(package.path, f"{what} {str(descr.source)!r} is not a .npy array ({err})") from err


def _run(package, network: torch.nn.Module, test_in: np.ndarray) -> np.ndarray:
    """The package on its test input, in the test output's axes: as the module docstring says."""
    from .bioimageio import package_network
    from .bioimageio_planes import PLANES_KEY, PlaneStatistics
    from .bioimageio_stats import compute_statistics

    rank = 4 if package.planar else 5
    if test_in.ndim != len(package.in_axes):
        raise ValueError(f"the test input has {test_in.ndim} axes, the package's input {len(package.in_axes)}")
    x = _to_blockpred(test_in, package.in_axes, rank).astype(np.float32)
    # A 2D package's samples are planes: its batch becomes z, one call.  A 3D package's run one by one.
    samples = [np.ascontiguousarray(x.transpose(1, 0, 2, 3)[None])] if package.planar else [x[i:i + 1] for i in
                                                                                             range(x.shape[0])]
    outputs = []
    for sample in samples:
        channels = sample.shape[1]
        statistics = compute_statistics(package, sample[0].reshape(channels, -1))
        if any(step.per_plane for step in package.pre + package.post):
            rows = [compute_statistics(package, sample[0, :, i].reshape(channels, -1), per_plane=True,
                                       given=statistics) for i in range(sample.shape[2])]
            statistics[PLANES_KEY] = PlaneStatistics.of(0, 0, rows)
        module = package_network(package, network, statistics, "yx" if package.planar else None).eval()
        with torch.inference_mode():
            outputs.append(module(torch.from_numpy(sample)).float().numpy())
    y = outputs[0][0].transpose(1, 0, 2, 3) if package.planar else np.concatenate(outputs)
    return _from_blockpred(y, package.out_axes)


def _to_blockpred(array: np.ndarray, axes: tuple[int, ...], rank: int) -> np.ndarray:
    """An array in a package's axes (blockpred axis indices, in the package's order) in blockpred's order
    (b, c, z, y, x), or (b, c, y, x) for a 2D package: the axes it lacks of size 1."""
    missing = [a for a in range(rank) if a not in axes]
    order = list(axes) + missing
    return array.reshape(array.shape + (1,) * len(missing)).transpose([order.index(a) for a in range(rank)])


def _from_blockpred(array: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """:func:`_to_blockpred` undone: the package's axes, in its order (the others are of size 1)."""
    missing = [a for a in range(array.ndim) if a not in axes]
    moved = array.transpose(list(axes) + missing)
    return moved.reshape(moved.shape[:len(axes)])


__all__ = ["CheckResult", "Tolerance", "check_model", "check_package_once", "DEFAULT_TOLERANCE"]
