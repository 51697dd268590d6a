"""Run options: one frozen dataclass, filled from a YAML file and then overrides.

Every option of ``blockpred run`` can be written in a YAML file (``configs/``
has examples); CLI flags and keyword arguments of :func:`blockpred.predict`
override the file.  Flexible inputs (``64`` or ``[32, 64, 64]`` or
``"32,64,64"`` for a shape) are normalised once, here, on entry.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import yaml

from .choices import MEMORY_FORMATS, OPTION_CHOICES, PRECISIONS, SHARD_CHOICES  # noqa: F401
from .errors import InputNotFoundError, InvalidOptionError
from .geometry import Box, Coord
from .io.stores import StorageOptions
from .pipeline.hostmem import parse_size
from .normalize import Normalization, parse_output_dtype


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything that decides how a prediction runs.  ``None`` means "derive it"."""

    #: Preset name (tiny, cremi2018, unet32), model file, ``package.module:factory``, a bioimage.io
    #: package (rdf.yaml, its folder or .zip), or (Python API only) a ``torch.nn.Module``.
    model: Any = "tiny"
    #: State-dict file for a factory or preset; loaded with ``weights_only=True``.
    weights: str | None = None
    #: Keyword arguments for a factory, or architecture facts a state dict cannot tell.
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: Allow unpickling a whole checkpoint, or a bioimage.io package's architecture source (runs code from
    #: the file: only for trusted files).  Given on the command line or to predict only: a config file that
    #: sets it, or names a ``package.module:factory`` without it, is refused (see :func:`make_config`).
    trust_pickle: bool = False
    #: Block core shape (z, y, x): what one block writes.  None: measured when the run is long enough
    #: to pay for it, starting from the model's default (else 64^3; see :mod:`blockpred.tuning.defaults`);
    #: "auto": the full search for the fastest that fits the device (see :mod:`blockpred.tuning.autosize`).
    block: Coord | str | None = None
    #: Context read on each side of the core and cropped away.  None: the model's default.
    halo: Coord | None = None
    #: The network's total downsampling; None: what the model reports (1 if unknown).
    downsampling: Coord | None = None
    #: "auto" (first CUDA device, else CPU), "cpu", "cuda" or "cuda:N".
    device: str = "auto"
    #: fp32, tf32, fp16, bf16, or auto: bf16 (fp16 before Ampere) on CUDA where the first block's output at
    #: it is close to fp32's, else tf32; fp32 on the CPU (see :mod:`blockpred.tuning.precision`).
    precision: str = "auto"
    #: Blocks per forward pass; "auto": the fastest that fits, found by trial passes; None: measured
    #: with the block (see :mod:`blockpred.tuning.defaults`), else 1.
    batch_size: int | str | None = None
    #: torch.compile mode: off, default, reduce-overhead (CUDA graphs) or max-autotune.
    compile: str = "off"
    #: The network's activations as contiguous (NCDHW) or channels_last (NDHWC, channels_last_3d), or
    #: auto: the faster of the two for this network and device, measured at the first run and cached
    #: (see blockpred.tuning.memformat); None: the same, measured when the run is long enough to pay for it
    #: (see blockpred.tuning.defaults), else contiguous; with compile, contiguous.
    memory_format: str | None = None
    #: What runs the network: torch, openvino or onnxruntime (the CPU only), or auto: on the CPU the faster of the two (and
    #: of torch's layouts), measured with the memory format when the run is long enough to pay, then cached;
    #: torch where not measured, on CUDA and with --compile (see blockpred.tuning.memformat).
    backend: str = "auto"
    normalize: Normalization = Normalization("auto")
    output_dtype: np.dtype = np.dtype("float32")
    #: Output chunk shape (z, y, x); None: per axis the largest divisor of the block (or shard) <= 128.
    output_chunks: Coord | None = None
    #: zarr v3 shards (z, y, x), "block" (one per block), "off", or "auto": by block when the
    #: output would have more than 100,000 chunks (see :mod:`blockpred.run.layout`).
    shards: Coord | str = "auto"
    #: Output channels to keep (indices into the network's channels); None keeps all.
    channels: tuple[int, ...] | None = None
    #: Sub-volume to predict, in voxels of the input; None: the whole volume.
    roi: Box | None = None
    #: How reads past the volume edge are filled: reflect, edge or constant.
    pad_mode: str = "reflect"
    pad_value: float = 0.0
    #: Output compression: zstd (default), gzip, blosc or raw.
    compression: str = "zstd"
    #: Threads reading (and decompressing) blocks ahead of the device; None: by the CPU cores per worker.
    num_readers: int | None = None
    #: Threads writing (and compressing) finished blocks (HDF5 always uses one); None: as for readers.
    num_writers: int | None = None
    #: Blocks read ahead of the device; with the batch and pending writes this bounds memory.
    prefetch: int = 4
    #: Peak resident memory ("2GB"): a block foreseen over it is refused (run.memcheck), and the trials keep to it.
    memory_limit: int | None = None
    overwrite: bool = False
    progress: bool = True
    #: Progress as JSON lines (start, progress at most every second, end with the summary) to this file,
    #: or ``-`` for stderr (see blockpred.events); None: none.
    progress_json: str | None = None
    #: Run in this process, without dask (one device).  A run with one device and no ``workers`` or
    #: ``scheduler`` does so anyway (see :func:`blockpred.run.prepare.resolve_paths`).
    local: bool = False
    #: Local dask workers: one per visible GPU by default; ``1`` runs one worker through dask.
    workers: int | None = None
    #: Address of a running dask scheduler to join instead of starting a local cluster.
    scheduler: str | None = None
    #: A batch system whose jobs are the workers ("slurm"; see blockpred.cluster.jobqueue), and its job settings; None
    #: where not given: dask-jobqueue's configuration (``~/.config/dask/jobqueue.yaml``) decides.
    cluster: str | None = None
    #: Jobs at most (one dask worker each); the run starts with the first that joins.  [1]
    jobs: int | None = None
    partition: str | None = None
    account: str | None = None
    #: A job's time limit, HH:MM:SS (or anything the batch system takes): jobs that reach it are replaced.
    walltime: str | None = None
    cores: int | None = None
    #: A job's memory, e.g. 16GB.
    memory: str | None = None
    #: GPUs per job (``--gres=gpu:N``); 0 for CPU jobs.  None: 0 with ``device="cpu"``, else 1.
    gpus_per_job: int | None = None
    #: A dask-jobqueue YAML (``jobqueue: slurm: ...``) read over the site's; the options above win over it.
    jobqueue_config: str | None = None
    #: Seconds without any dask worker (none started yet, all lost, the scheduler gone) before the run ends
    #: with what is done kept (a cluster run never waits silently forever).
    no_worker_timeout: float = 300.0
    #: How often a failed task (and so its failed blocks) is retried.
    retries: int = 2
    #: Skip blocks whose input is all one value (they are left at the fill value).
    skip_empty: bool = False
    #: A 3D volume (full size or downsampled) whose nonzero voxels mark where to predict.
    mask: str | None = None
    #: Downsampled levels written below a zarr output once it is predicted (an OME-NGFF multiscale image;
    #: see :mod:`blockpred.run.pyramid`); 0: none.
    pyramid: int = 0
    #: How a pyramid level is made from the one before: mean, mode (labels) or stride.
    pyramid_method: str = "mean"
    #: How to reach object stores (``s3://`` paths of input, output, mask and markers): endpoint_url,
    #: region, anonymous, profile; over the AWS environment variables and config (see blockpred.io.stores).
    storage_options: StorageOptions = StorageOptions()
    #: Test-time augmentation: "off", "flips" (the mean over the 8 flips of z, y, x) or "flips-yx" (4, of y
    #: and x); see blockpred.models.tta.
    tta: str = "off"
    #: The planes a 2D network runs on: "yx" (stacked along z, the default for a 2D network), "zy" or "zx";
    #: None for a 3D network (see blockpred.models.planes).
    plane: str | None = None
    #: An input chunk that is not stored (usually a failed transfer): "warn" reads it as the fill value and
    #: counts it in the summary; "error" fails the block that reads it (not retried).
    missing_chunks: str = "warn"

    def replace(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)


def _field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(RunConfig))


def _whole(item: Any) -> int:
    """A whole number as an int: ``16``, ``16.0`` or ``"16"``; never truncated (16.5 raises ValueError).

    A boolean is not a number here (``True`` would be 1), so it raises TypeError.
    """
    if isinstance(item, (bool, np.bool_)):
        raise TypeError(f"{item!r} is a boolean, not a number")
    if isinstance(item, (int, np.integer)):
        return int(item)
    if isinstance(item, str):
        try:
            return int(item.strip())
        except ValueError:
            item = float(item)  # "16.0" is 16; "abc" raises ValueError
    if isinstance(item, (float, np.floating)):
        if not math.isfinite(item) or not float(item).is_integer():
            raise ValueError(f"{item!r} is not a whole number")
        return int(item)
    raise TypeError(f"{item!r} is not a number")


def _reason(err: Exception) -> str:
    """What :func:`_whole` found wrong, as a clause for a message ("" when it is Python's own)."""
    text = str(err)
    return f": {text}" if "is not a whole number" in text else ""


def parse_shape(value: Any, name: str) -> Coord:
    """``64``, ``"64"``, ``"32,64,64"`` or ``[32, 64, 64]`` as a 3D :class:`Coord`.

    Integral floats (``16.0``) are taken; a fraction (``16.5``) is refused, never truncated.
    """
    try:
        if isinstance(value, str):
            items = [_whole(v) for v in value.replace("x", ",").split(",") if v.strip()]
        elif isinstance(value, (int, float, np.number, bool, np.bool_)):
            items = [_whole(value)]
        else:
            items = [_whole(v) for v in value]
    except (TypeError, ValueError) as err:
        raise InvalidOptionError(f"{name} must be one integer or three (Z,Y,X), got {value!r}{_reason(err)}") from None
    if len(items) == 1:
        items = items * 3
    if len(items) != 3:
        raise InvalidOptionError(f"{name} must be one integer or three (Z,Y,X), got {value!r}")
    return Coord(items)


def parse_roi(value: Any) -> Box:
    """``"z0:z1,y0:y1,x0:x1"`` or ``[[z0, z1], [y0, y1], [x0, x1]]`` as a :class:`Box`."""
    try:
        if isinstance(value, Box):
            return value
        if isinstance(value, str):
            pairs = [tuple(_whole(v) for v in part.split(":")) for part in value.split(",")]
        else:
            pairs = [tuple(_whole(v) for v in pair) for pair in value]
        if len(pairs) != 3 or any(len(p) != 2 for p in pairs):
            raise ValueError
        return Box(Coord(p[0] for p in pairs), Coord(p[1] for p in pairs))
    except (TypeError, ValueError) as err:
        raise InvalidOptionError(
            f"ROI must be z0:z1,y0:y1,x0:x1 with begin <= end, got {value!r}{_reason(err)}") from None


def _count(value: Any, name: str, *, least: int, what: str) -> int:
    """A whole number >= ``least`` (``2``, ``2.0``, ``"2"``); a fraction or a boolean is refused."""
    try:
        number = _whole(value)
    except (TypeError, ValueError) as err:
        raise InvalidOptionError(f"{name} must be a {what}, got {value!r}{_reason(err)}") from None
    if number < least:
        raise InvalidOptionError(f"{name} must be a {what}, got {value!r}")
    return number


def _choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    """One of ``choices``, in any case (``"Flips"`` is ``flips``); anything else is refused in one line."""
    word = str(value).strip().lower()
    if word not in choices:
        raise InvalidOptionError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return word


#: Options that are whole numbers: the least and what the number is.
_COUNTS = {**dict.fromkeys(("batch_size", "num_readers", "num_writers", "prefetch", "workers", "jobs", "cores"),
                           (1, "positive integer")), "retries": (0, "non-negative integer"),
           "pyramid": (0, "non-negative number of levels"), "gpus_per_job": (0, "non-negative number of GPUs")}


def _boolean(value: Any, name: str) -> bool:
    """A real boolean (YAML true/false, Python or numpy bool); anything else is refused, never coerced.

    ``bool("false")`` is True: a quoted ``"false"`` once turned ``overwrite`` and ``trust_pickle`` on.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    kind = {str: "a string", int: "a number", float: "a number"}.get(type(value), f"a {type(value).__name__}")
    word = {"true": "true", "yes": "true", "on": "true", "1": "true",
            "false": "false", "no": "false", "off": "false", "0": "false"}.get(str(value).strip().lower())
    fix = (f"write {name}: {word} without quotes (in Python {name}={word.capitalize()})" if word
           else f"write {name}: true or {name}: false without quotes (in Python True or False)")
    raise InvalidOptionError(f"{name} must be true or false, got {value!r} ({kind}); {fix}")


#: Options that are text, and what it is.  YAML reads ``progress_json: 5`` as a number and ``walltime: 1:00:00`` as
#: 3600 (seconds, in base 60): made into text, they wrote a file named 5 and asked for 3600 minutes.
_TEXT = {**dict.fromkeys(("weights", "mask", "jobqueue_config", "progress_json"), "a path"), "scheduler": "an address",
         "partition": "a name", "account": "a name", "walltime": "a time limit", "memory": "a size"}
#: Options read by a parser of their own.
_PARSERS = {"roi": parse_roi, "normalize": Normalization.parse, "output_dtype": parse_output_dtype,
            "storage_options": StorageOptions.parse, "memory_limit": parse_size}


def _text(value: Any, name: str, where: str) -> str:
    """Text as it is (or a ``PathLike``'s), not empty; anything else is refused, never made into text."""
    value, what = (os.fspath(value) if isinstance(value, os.PathLike) else value), _TEXT[name]
    if isinstance(value, str) and value.strip():
        return value
    kind = type(value).__name__
    found = "an empty string" if isinstance(value, str) else f"{value!r} (a{'n' * (kind[0] in 'aeiou')} {kind})"
    fix = ("; leave it out for the default" if isinstance(value, str) else
           '; quote it: walltime: "4:00:00" (YAML reads an unquoted 4:00:00 as 14400 s)' if name == "walltime" else
           f'; write {name}: "{value}" if you mean {"a file named" if what == "a path" else "the text"} {value}'
           if type(value) in (int, float) else "")
    raise InvalidOptionError(f"{name}{where} must be {what} (text), got {found}{fix}")


def _normalise(name: str, value: Any, where: str = "") -> Any:
    """One option's raw value (from YAML, CLI or Python) in its canonical type; ``where`` (`` in 'run.yaml'``)
    names the config file it comes from, if it does."""
    if name in ("block", "batch_size") and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if name in OPTION_CHOICES:
        return _choice(value, name, OPTION_CHOICES[name])
    if name == "shards":
        if value is False:
            return "off"  # YAML reads a bare `off` as False
        if isinstance(value, str) and value.strip().lower() in (*SHARD_CHOICES, "none"):
            return "off" if value.strip().lower() == "none" else value.strip().lower()
        shape = parse_shape(value, "shards")
        if any(v <= 0 for v in shape):
            raise InvalidOptionError(f"shards must be positive on every axis, or auto, block or off; got {tuple(shape)}")
        return shape
    if name in ("block", "halo", "downsampling", "output_chunks"):
        shape = parse_shape(value, name)
        if name == "halo" and any(v < 0 for v in shape):
            raise InvalidOptionError(f"halo must be non-negative on every axis, got {tuple(shape)}")
        if name != "halo" and any(v <= 0 for v in shape):
            raise InvalidOptionError(f"{name} must be positive on every axis, got {tuple(shape)}")
        return shape
    if name in _PARSERS:
        return _PARSERS[name](value)
    if name in _COUNTS:
        return _count(value, name, least=_COUNTS[name][0], what=_COUNTS[name][1])
    if name == "tta":
        from .models.tta import TTA_MODES

        return _choice(value, name, TTA_MODES)
    if name == "plane":
        from .models.planes import PLANES

        return None if value is None else _choice(value, name, PLANES)
    if name == "no_worker_timeout":
        try:
            seconds = float(value) if not isinstance(value, (bool, np.bool_)) else math.nan
        except (TypeError, ValueError):
            seconds = math.nan
        if not seconds > 0 or math.isinf(seconds):
            raise InvalidOptionError(f"no_worker_timeout must be a positive number of seconds, got {value!r}")
        return seconds
    if name == "channels":
        items = value.split(",") if isinstance(value, str) else value
        try:
            channels = tuple(_whole(v) for v in items)
        except (TypeError, ValueError) as err:
            raise InvalidOptionError(
                f"channels must be a list of channel indices, got {value!r}{_reason(err)}") from None
        twice = sorted({c for c in channels if channels.count(c) > 1})
        if twice:
            raise InvalidOptionError(f"channels must name each channel once, got {value!r} (channel "
                                     f"{', '.join(map(str, twice))} more than once)")
        return channels
    if name == "model_kwargs":
        if isinstance(value, str):
            return parse_model_kwargs(value)
        if not isinstance(value, Mapping):
            raise InvalidOptionError(f"model_kwargs must be a mapping, got {value!r}")
        return dict(value)
    if name in ("trust_pickle", "overwrite", "progress", "local", "skip_empty"):
        return _boolean(value, name)
    if name == "pad_value":
        if isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_)):
            return float(value)
        try:
            return float(str(value))
        except ValueError:
            raise InvalidOptionError(f"pad_value must be a number, got {value!r}") from None
    if name in ("compression", "device"):  # a device may be a torch.device
        return str(value).lower()
    if name == "model":
        # A name or path; the Python API also takes a torch.nn.Module as it is.
        return str(value) if isinstance(value, (str, os.PathLike)) else value
    if name in _TEXT:
        return _text(value, name, where)
    return value


def parse_model_kwargs(text: str) -> dict[str, Any]:
    """``KEY=VALUE,...`` (``--model-kwargs``) as a dict, each value read as YAML: ``n=16,pool=[1,2,2],bn=true``
    gives ``{"n": 16, "pool": [1, 2, 2], "bn": True}``.  Commas inside brackets or quotes belong to the value."""
    items, depth, quote, current = [], 0, "", ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(current)
            current = ""
            continue
        current += char
    items.append(current)
    kwargs: dict[str, Any] = {}
    for item in (i.strip() for i in items):
        key, sep, value = item.partition("=")
        if not item or not sep or not key.strip().isidentifier():
            raise InvalidOptionError(
                f"--model-kwargs must be KEY=VALUE pairs separated by commas, such as in_channels=1,out_channels=1; "
                f"got {item!r} in {text!r}")
        try:
            kwargs[key.strip()] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            raise InvalidOptionError(f"--model-kwargs: the value of {key.strip()!r} ({value!r}) is not a YAML value; "
                                     f"quote a string") from None
    return kwargs


#: The run configs in blockpred's checkout (``configs/``), named by ``--config NAME``.
SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
#: Files there that are not run options (``slurm.yaml`` is dask-jobqueue's, for ``--jobqueue-config``).
_NOT_RUN_CONFIGS = ("slurm",)


def shipped_configs() -> list[str]:
    """The names ``--config`` takes for the configs shipped with blockpred."""
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml") if p.stem not in _NOT_RUN_CONFIGS)


def load_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The options of a YAML file (keys as in :class:`RunConfig`; ``-`` may stand for ``_``).

    A bare name that is no file here (``tiny``, ``cremi2018.yaml``) names a config shipped with
    blockpred, so ``--config tiny`` works from any directory.  The files it names are found beside it.
    """
    path = Path(path)
    if not path.is_file() and path.parent == Path(".") and path.stem in shipped_configs():
        path = SHIPPED_CONFIGS / f"{path.stem}.yaml"
    if not path.is_file():
        what = "is a directory, not a YAML file of run options (block: 64 ...)" if path.is_dir() else "does not exist"
        raise InputNotFoundError(f"config {str(path)!r} {what}; blockpred's own are named "
                                 f"{', '.join(shipped_configs())} (e.g. --config tiny)")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise InvalidOptionError(f"config file {str(path)!r} is not valid YAML{where}") from None
    if not isinstance(raw, Mapping):
        raise InvalidOptionError(f"config file {str(path)!r} must hold a mapping of options, found {type(raw).__name__}")
    options = {str(k).replace("-", "_"): v for k, v in raw.items()}
    return {k: _beside(path.parent, k, v) if k in _READ_FILES else v for k, v in options.items()}


#: Options of a config file that name a file to read: a relative one is found beside the config file (they travel
#: together).  ``progress_json`` is written where the run is (a shipped config writes nothing into blockpred).
_READ_FILES = ("model", "weights", "mask", "jobqueue_config")
#: Endings of a model file or bioimage.io package: a ``model`` with one (or with a ``/``) is a path.
_MODEL_SUFFIXES = (".pt", ".pth", ".ts", ".onnx", ".yaml", ".yml", ".zip")


def _beside(folder: Path, name: str, value: Any) -> Any:
    """``value`` of option ``name`` in a config file in ``folder``, a relative path made one from ``folder``.  A
    ``model`` is a path when it looks like one, or names something in ``folder`` and no preset; else it is a preset
    or ``package.module:factory`` and stays (see :func:`blockpred.models.loading.model_kind`)."""
    if (not isinstance(value, str) or not value.strip() or folder == Path(".") or os.path.isabs(value)
            or value.startswith("~") or "://" in value):
        return value
    if name == "model" and "/" not in value and not value.lower().endswith(_MODEL_SUFFIXES):
        if not os.path.exists(os.path.join(folder, value)):
            return value
        from .models.presets import PRESETS  # torch: only for a file named like a model

        return value if value in PRESETS else os.path.join(folder, value)
    return os.path.join(folder, value)


def make_config(config_file: str | os.PathLike | None = None, **overrides: Any) -> RunConfig:
    """A :class:`RunConfig` from a YAML file (optional) and overrides (``None`` = not given).

    Trust to run code comes from the overrides (the command line, the API call) only: see
    :func:`_check_trust`.
    """
    from_file: dict[str, Any] = load_config_file(config_file) if config_file is not None else {}
    given = {k: v for k, v in overrides.items() if v is not None}
    values = {**from_file, **given}
    if isinstance(from_file.get("model_kwargs"), Mapping) and "model_kwargs" in given:
        # --model-kwargs adds to the config's arguments (and wins where both name one)
        values["model_kwargs"] = {**from_file["model_kwargs"], **_normalise("model_kwargs", given["model_kwargs"])}
    known = set(_field_names())
    unknown = sorted(set(values) - known)
    if unknown:
        raise InvalidOptionError(f"unknown option(s) {', '.join(unknown)}; known options: {', '.join(sorted(known))}")
    if "trust_pickle" in from_file:
        raise InvalidOptionError(
            f"config file {str(config_file)!r} sets trust_pickle, which lets a model file run Python code; trust "
            f"cannot come from a config file: remove it, and pass --trust-pickle on the command line "
            f"(trust_pickle=True to predict) if you trust the model")
    where = {k: f" in {str(config_file)!r}" for k in from_file if k not in given}
    cfg = RunConfig(**{k: _normalise(k, v, where.get(k, "")) for k, v in values.items() if v is not None})
    if "model" in from_file and "model" not in given and not cfg.trust_pickle:
        _check_trust(config_file, cfg.model)
    return cfg


def _check_trust(config_file: str | os.PathLike, model: Any) -> None:
    """Refuse a model named in a config file that runs Python code to be built: a ``package.module:factory``.

    Configs get shared and downloaded; the same factory named by ``--model`` (``model=``) or with
    ``--trust-pickle`` (``trust_pickle=True``) is the user's own choice.  A pickled checkpoint, and a
    bioimage.io package whose architecture is Python source, need ``trust_pickle``, which a file cannot set.
    """
    from .models.loading import model_kind  # torch: only for a model named in a file

    if model_kind(model) == "factory":
        raise InvalidOptionError(
            f"config file {str(config_file)!r} names the model factory {model!r}, which runs Python code; trust "
            f"cannot come from a config file: name it with --model on the command line (model= in predict), "
            f"or pass --trust-pickle")
