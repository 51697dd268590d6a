"""The ``blockpred`` command: arguments -> config -> run.

Exit codes: 0 success; 1 a block failed while running (the message names it);
2 bad input or options (one line saying what is wrong and how to fix it; nothing
is written); 129, 130, 143 ended by SIGHUP, Ctrl-C, SIGTERM.  The process around
it (standard streams, log lines, signals, the exit) is :mod:`blockpred.process`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from . import __version__
from .errors import one_line
from .process import SIGNAL_EXIT_CODES, StandardStreams, end_on_signals, exit_now, log_to_stderr, process_start_time

logger = logging.getLogger("blockpred")


#: The model group's description (``--help``), by which a test finds its options.
MODEL_GROUP = "the network and how it runs: the same options for run, plan, serve and bench"


def _add_network_options(g) -> None:
    """Which network, beyond the model's name: every command that loads one (check-model too) takes these."""
    g.add_argument("--weights", help="state-dict file for a factory or preset (loaded with weights_only=True)")
    g.add_argument("--model-kwargs", metavar="KEY=VALUE,...",
                   help="arguments of a factory (or a state dict's architecture), e.g. in_channels=1,out_channels=1; "
                        "values read as YAML (1, 0.5, true, [1,2,2]); over the config's model_kwargs")
    g.add_argument("--trust-pickle", action="store_true", default=None,
                   help="allow unpickling a whole checkpoint, or running a bioimage.io package's architecture "
                        "source; this runs code from the file, so only for trusted files")
    g.add_argument("--plane", choices=("yx", "zy", "zx"),
                   help="the planes a 2D network predicts, one at a time: yx (stacked along z), zy or zx [yx for a "
                        "2D network; a 3D network takes none]")


def _words(choices: tuple[str, ...]):
    """An argparse type: a comma-separated list of ``choices`` (bench's --precision and --backend: a row each)."""
    def parse(text: str) -> tuple[str, ...]:
        words = tuple(w.strip().lower() for w in text.split(",") if w.strip())
        wrong = [w for w in words if w not in choices]
        if not words or wrong:
            raise argparse.ArgumentTypeError(f"must be a comma-separated list of {', '.join(choices)}, got {text!r}"
                                             + (f" ({', '.join(map(repr, wrong))} is none of them)" if wrong else ""))
        return tuple(dict.fromkeys(words))
    return parse


def add_model_options(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    """The network and how it runs: one group for run, plan, serve and bench, so that bench times what run runs.

    ``several`` (bench): --precision and --backend take a comma-separated list, a row of the table each.
    """
    from .choices import COMPILE_MODES, RUN_BACKENDS, RUN_PRECISIONS

    rows = "; a comma-separated list times each" if several else ""
    g = parser.add_argument_group("model and device", MODEL_GROUP)
    g.add_argument("--model", help="preset (tiny, cremi2018, unet32), model file, package.module:factory, or a "
                   "bioimage.io package (rdf.yaml, its folder, or .zip) [tiny]")
    _add_network_options(g)
    g.add_argument("--downsampling", help="the network's total downsampling Z,Y,X, for networks that cannot tell")
    g.add_argument("--normalize", help="auto, none, minmax:LO,HI or meanstd:MEAN,STD [auto]")
    g.add_argument("--tta", choices=("off", "flips", "flips-yx"),
                   help="test-time augmentation: the mean over the 8 flips of z, y and x (flips) or the 4 of y and "
                        "x (flips-yx); exact under the halo crop; 8x (4x) the compute [off]")
    g.add_argument("--device", help="auto, cpu, cuda or cuda:N [auto]")
    g.add_argument("--precision", **({"type": _words(RUN_PRECISIONS), "metavar": "PRECISION,..."} if several else
                                     {"choices": RUN_PRECISIONS}),
                   help="auto: bf16 (fp16 before Ampere) on CUDA if the first block at it stays within 10%% at any "
                        f"voxel and 1%% on average of fp32's output range, else tf32; fp32 on the CPU{rows} [auto]")
    g.add_argument("--compile", choices=COMPILE_MODES,
                   help="torch.compile the network; reduce-overhead replays CUDA graphs [off]")
    g.add_argument("--memory-format", choices=("contiguous", "channels_last", "auto"),
                   help="activation layout; channels_last is channels_last_3d; auto: the faster of the two for "
                        "this network and device, measured at the first run and cached [measured when the run "
                        "is long enough to pay, else contiguous]")
    g.add_argument("--backend", **({"type": _words(RUN_BACKENDS), "metavar": "BACKEND,..."} if several else
                                   {"choices": RUN_BACKENDS}),
                   help="what runs the network: openvino or onnxruntime (pip install -e '.[onnx]') run it on the "
                        "CPU (converted once, cached); auto: on the CPU the faster of torch and openvino, measured "
                        f"with the memory format when the run is long enough to pay, then cached{rows}"
                        f"{', with its largest difference from torch at fp32' if several else ''} [auto]")
    g.add_argument("--memory-limit", metavar="SIZE",
                   help="peak memory of this process (each local worker), e.g. 2GB or 1.5GiB: a block foreseen over "
                        "it is refused before it runs, and the CPU's block and batch trials keep to it; not --memory, "
                        "a SLURM job's memory [what it holds and half the available memory per worker]")


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    add_model_options(parser)
    g = parser.add_argument_group("blocks")
    g.add_argument("--block", help="block core Z,Y,X (or one number): what one block writes; auto: the fastest "
                   "that fits the device, by a full trial search (cached) [measured from the model's default when "
                   "the run is long enough to pay, a few seconds once per network and device]")
    g.add_argument("--halo", help="context Z,Y,X read around each block and cropped [model's default]")
    g.add_argument("--roi", help="sub-volume z0:z1,y0:y1,x0:x1 to predict [whole volume]")
    g.add_argument("--pad-mode", choices=("reflect", "edge", "constant"), help="padding past the volume edge [reflect]")
    g = parser.add_argument_group("pipeline")
    g.add_argument("--batch-size", help="blocks per forward pass; auto: the fastest that fits [measured with the "
                   "block, else 1]")
    g.add_argument("--readers", dest="num_readers", type=int,
                   help="reader threads per worker [half its CPU cores, 2 to 8]")
    g.add_argument("--writers", dest="num_writers", type=int,
                   help="writer threads per worker [half its CPU cores, 2 to 8]")
    g.add_argument("--prefetch", type=int, help="blocks read ahead of the device [4]")
    g = parser.add_argument_group("workers (dask)")
    g.add_argument("--workers", type=int, help="local dask workers; 1 runs one worker through dask [one per "
                   "visible GPU; with one GPU or none, the run goes in this process, without dask]")
    g.add_argument("--scheduler", help="address of a running dask scheduler to join (multi-node)")
    g.add_argument("--local", action="store_true", default=None,
                   help="run in this process, without dask [the default with one device and no --workers/--scheduler]")
    g.add_argument("--retries", type=int, help="retries of a failed task [2]")
    g.add_argument("--no-worker-timeout", type=float, metavar="SECONDS",
                   help="end the run (finished blocks kept) after this long without any dask worker [300]")
    g.add_argument("--mask", help="volume (full size or downsampled) whose nonzero voxels mark where to predict")
    g.add_argument("--missing-chunks", choices=("warn", "error"),
                   help="an input chunk that is not stored: warn (read it as the fill value, count it in the "
                        "summary) or error (fail the block that reads it) [warn]")
    g.add_argument("--skip-empty", action="store_true", default=None,
                   help="skip blocks whose input is all one value (left at the fill value)")
    g = parser.add_argument_group("batch cluster: workers as SLURM jobs (pip install -e \".[slurm]\")")
    g.add_argument("--cluster", choices=("slurm",), help="submit the workers as jobs of this batch system")
    g.add_argument("--jobs", type=int, help="jobs at most, one dask worker each; the run starts with the first [1]")
    g.add_argument("--partition", help="the jobs' partition (dask-jobqueue: queue) [the site's config]")
    g.add_argument("--account", help="the jobs' account (account) [the site's config]")
    g.add_argument("--walltime", help="a job's time limit, HH:MM:SS (walltime); jobs that reach it are replaced "
                   "[the site's config, else 00:30:00]")
    g.add_argument("--cores", type=int, help="CPU cores per job (cores) [the site's config]")
    g.add_argument("--memory", help="memory per job, e.g. 16GB (memory); not --memory-limit, the budget of "
                   "blockpred's own blocks and trials [the site's config]")
    g.add_argument("--gpus-per-job", type=int, help="GPUs per job (--gres=gpu:N); 0 for CPU jobs "
                   "[0 with --device cpu, else 1]")
    g.add_argument("--jobqueue-config", metavar="FILE",
                   help="a dask-jobqueue YAML (jobqueue: slurm: ...) over the site's; the flags above win")
    g = parser.add_argument_group("input and output")
    g.add_argument("--output-dtype", choices=("float32", "float16", "uint8"), help="[float32]")
    g.add_argument("--output-chunks", help="output chunk shape Z,Y,X [largest divisor of the block <= 128]")
    g.add_argument("--shards", help="zarr v3 shard shape Z,Y,X, block (one per block), off, or auto: by block "
                                    "above 100,000 output chunks [auto]")
    g.add_argument("--channels", help="output channels to keep, e.g. 0,2 [all]")
    g.add_argument("--compression", choices=("zstd", "gzip", "blosc", "raw"), help="[zstd]")
    g.add_argument("--pyramid", help="downsampled levels to write below a zarr output once it is predicted "
                   "(OME-NGFF multiscales, for viewers) [0]")
    g.add_argument("--pyramid-method", choices=("mean", "mode", "stride"),
                   help="how each level is made from the one before: mean, mode (labels) or stride [mean]")
    g.add_argument("--storage-option", dest="storage_options", action="append", metavar="KEY=VALUE",
                   help="for s3:// paths, over the AWS environment and config: endpoint_url=URL, region=NAME, "
                        "anonymous=true (no signing), profile=NAME; repeatable")
    g.add_argument("--overwrite", action="store_true", default=None, help="replace an existing output")
    g.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar")
    g.add_argument("--progress-json", metavar="FILE",
                   help="progress as JSON lines to FILE (- for stderr): a start event with the plan, progress "
                        "at most every second, an end event with the summary or the error")


#: The model group's options (:func:`add_model_options`), as keywords of :func:`blockpred.predict`.
MODEL_KEYS = ("model", "weights", "model_kwargs", "trust_pickle", "plane", "downsampling", "normalize", "tta", "device",
              "precision", "compile", "memory_format", "backend", "memory_limit")
#: Every option of run (and of plan and serve), as keywords of :func:`blockpred.predict`.
_RUN_KEYS = MODEL_KEYS + (
    "block", "halo", "roi", "pad_mode", "batch_size", "num_readers", "num_writers", "prefetch", "output_dtype",
    "output_chunks", "shards", "channels", "compression", "overwrite", "progress", "workers", "scheduler", "local",
    "retries", "skip_empty", "mask", "pyramid", "pyramid_method", "storage_options", "missing_chunks",
    "no_worker_timeout", "cluster", "jobs", "partition", "account", "walltime", "cores", "memory", "gpus_per_job",
    "jobqueue_config", "progress_json")


class _UsageError(SystemExit):
    """A usage error, its one line printed: exit code 2, as argparse's own."""

    def __init__(self, line: str):
        super().__init__(2)
        self.line = line


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other bad input (exit code 2), and a flag is
    never guessed from its beginning (``--over`` is not ``--overwrite``): the parser and, as their
    ``parser_class``, every subcommand's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message: str):
        line = f"{message} (see '{self.prog} --help')"
        print(f"blockpred: error: {line}", file=sys.stderr)
        raise _UsageError(line)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="blockpred", description="Blockwise 3D U-Net prediction for large volumes.")
    parser.add_argument("--version", action="version", version=f"blockpred {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (and log what happens) instead of one line")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="predict a volume", description="Predict INPUT block by block into OUTPUT.")
    run.add_argument("input", help="vol.zarr[/dataset], vol.n5/dataset, file.h5:/dataset, stack.tif (OME-TIFF) or a "
                     "folder of TIFF/PNG slices")
    run.add_argument("output", nargs="?", help="where to write [a sibling 'prediction' dataset, or vol.prediction.zarr]")
    run.add_argument("--config", help="YAML file with any of the options below (flags override it), or the name of "
                     "one shipped with blockpred (tiny, cremi2018, unet32, cluster-run)")
    run.add_argument("--json", action="store_true", help="print the final summary as one JSON object")
    _add_run_options(run)

    plan = sub.add_parser("plan", help="what `run` would do and how long it would take; runs and writes nothing",
                          description="Check and plan INPUT -> OUTPUT as `run` would, and print the plan: blocks, "
                                      "halo overhead, output files and the expected runtime on 1..N GPUs.")
    plan.add_argument("input", help="vol.zarr[/dataset], vol.n5/dataset, file.h5:/dataset, stack.tif or a folder "
                      "of slices")
    plan.add_argument("output", nargs="?", help="where `run` would write [as for run]")
    plan.add_argument("--config", help="YAML file with any of the run options (flags override it)")
    plan.add_argument("--assume-mvox-per-s", type=float,
                      help="throughput per GPU for the runtime [the last one measured for this network]")
    plan.add_argument("--gpus", default="1,2,4,8", help="GPU counts for the runtime [1,2,4,8]")
    _add_run_options(plan)

    bench = sub.add_parser("bench", help="model throughput, device load, and runtime extrapolation",
                           description="Time forward passes on device-resident data at what `run` would choose for "
                                       "the volume (--input, else a synthetic one); extrapolate runtimes.")
    add_model_options(bench, several=True)
    g = bench.add_argument_group("what is timed")
    g.add_argument("--input", help="the volume `run` would predict: the block, batch, precision and layout are what "
                   "run chooses for it, and --pipeline predicts it [a synthetic uint8 volume of --volume-shape]")
    g.add_argument("--volume-shape", help="the synthetic volume's shape Z,Y,X, without --input [128,256,256]")
    g.add_argument("--block", help="block core Z,Y,X, or auto (as `run --block auto`) [what `run` would choose]")
    g.add_argument("--halo", help="halo Z,Y,X [what `run` would choose: the model's, else its receptive field]")
    g.add_argument("--batch-size", help="batch sizes, e.g. 1,2,4 or auto [what `run` would choose]")
    g.add_argument("--warmup", type=int, default=2, help="untimed passes per configuration [2]")
    g.add_argument("--iterations", type=int, default=5, help="timed passes per configuration [5]")
    g.add_argument("--pipeline", action="store_true", help="also run the real `blockpred run` path end to end")
    g.add_argument("--workers", type=int, help="dask workers for --pipeline [one per device]")
    g.add_argument("--train", action="store_true", help="also time training iterations on the same block")
    g = bench.add_argument_group("extrapolation and reports")
    g.add_argument("--extrapolate", help="dataset sizes: 8.1T, 1.9G, 200x3072x3072, cremi-padded, platynereis")
    g.add_argument("--gpus", default="1,2,4,8", help="GPU counts for the extrapolation [1,2,4,8]")
    g.add_argument("--assume-mvox-per-s", type=float, help="skip the measurement; extrapolate from this figure")
    g.add_argument("--json", help="write every figure, the volume and the environment to this JSON file")
    g.add_argument("--markdown", help="write the tables as markdown to this file")
    g.add_argument("--plot", help="PNG of throughput against batch size and precision (needs matplotlib: pip "
                   "install -e \".[bench]\")")

    check = sub.add_parser("check-model", help="what blockpred finds of a network, and whether a bioimage.io "
                           "package reproduces its own test output",
                           description="Load MODEL as `run` would; for a bioimage.io package, run its test input "
                                       "as the package defines it and compare with its test output (exit 2 if it "
                                       "does not match); then print the network's downsampling, the input sizes it "
                                       "takes, its receptive field and the halo `run` would take.")
    check.add_argument("model", help="preset, model file, package.module:factory or a bioimage.io package")
    _add_network_options(check)
    check.add_argument("--in-channels", type=int, help="input channels, where the network does not say [1]")
    check.add_argument("--input", metavar="VOLUME", help="also run one block of VOLUME at the normalisation named "
                       "(else the default) and at meanstd:auto and percentile:1,99.8: each one's input and output "
                       "statistics, and the one whose output spreads most, suggested")
    check.add_argument("--normalize", help="the normalisation to try first with --input (as for run)")
    check.add_argument("--json", action="store_true", help="print the result as one JSON object")

    serve = sub.add_parser("serve", help="look before you run: serve the prediction to neuroglancer, each block "
                           "predicted when first looked at", description="Serve INPUT and its prediction as OME-Zarr "
                           "over HTTP; a chunk of the prediction is a block of `run`, predicted on request.")
    serve.add_argument("input", help="as for run")
    serve.add_argument("output", nargs="?", help="write every block viewed here too, so that `run` with the same "
                       "options skips it [a temporary folder, removed when the server stops]")
    serve.add_argument("--config", help="as for run")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on [127.0.0.1: this machine only]")
    serve.add_argument("--port", type=int, default=8000, help="port [8000; 0: any free one]")
    serve.add_argument("--cache-mb", type=float, default=256, help="MiB of encoded chunks kept in memory [256]")
    serve.add_argument("--viewer", action="store_true", help="open a neuroglancer viewer of this process on both "
                       "layers and print its URL (pip install 'blockpred[viewer]')")
    serve.add_argument("--cors-origin", action="append", help="an origin whose pages may read the served data "
                       "(repeatable) [neuroglancer's public client, and with --viewer the local one]")
    _add_run_options(serve)

    demo = sub.add_parser("demo", help="predict a synthetic EM volume with the default network")
    demo.add_argument("--dir", default="blockpred-demo", help="where to write the demo volume and output [./blockpred-demo]")
    demo.add_argument("--shape", default="128,256,256", help="demo volume shape Z,Y,X [128,256,256]")
    demo.add_argument("--model", help="network [tiny]")
    demo.add_argument("--device", help="auto, cpu, cuda or cuda:N [auto]")
    return parser


def _run(args: argparse.Namespace) -> int:
    from .run.runner import predict

    options = {key: getattr(args, key) for key in _RUN_KEYS}
    summary = predict(args.input, args.output, config=args.config, start_time=process_start_time(None), **options)
    _say(_json({"ok": True, **summary.as_dict()}, args) if args.json else summary)
    return 0


def _say(text) -> None:
    """``text`` on standard output, at once (standard output is auxiliary: see :mod:`blockpred.process`)."""
    print(text, flush=True)


def _json(report: dict, args: argparse.Namespace) -> str:
    """``report`` as the JSON line of ``--json``, with what went wrong with stderr, if anything did."""
    warnings = getattr(args, "stream_warnings", None)
    return json.dumps({**report, "warnings": list(warnings)} if warnings else report)


def _plan(args: argparse.Namespace) -> int:
    from .errors import InvalidOptionError
    from .run.runner import plan

    try:
        gpus = tuple(int(n) for n in args.gpus.split(",") if n.strip())
    except ValueError:
        raise InvalidOptionError(f"--gpus must be a comma-separated list of GPU counts, got {args.gpus!r}") from None
    options = {key: getattr(args, key) for key in _RUN_KEYS}
    print(plan(args.input, args.output, config=args.config, assume_mvox_per_s=args.assume_mvox_per_s, gpus=gpus,
               **options))
    return 0


def _check_model(args: argparse.Namespace) -> int:
    from .config import make_config, parse_model_kwargs
    from .errors import PackageTestFailedError
    from .models import load_model
    from .models.check import check_model
    from .models.planes import stack_axis
    from .run.choose import network_downsampling, network_field_of
    from .run.halo import choose_halo

    kwargs = parse_model_kwargs(args.model_kwargs) if args.model_kwargs else {}
    result = check_model(args.model, args.weights, trust_pickle=bool(args.trust_pickle), plane=args.plane,
                         model_kwargs=kwargs)
    report: dict = {"model": result.name, "kind": result.kind, "test": str(result), "passed": result.passed}
    if result.passed is False:
        raise PackageTestFailedError(str(result))
    lines = [str(result)]
    try:
        loaded = load_model(args.model, weights=args.weights, model_kwargs=kwargs, trust_pickle=bool(args.trust_pickle),
                            plane=args.plane)
    except Exception as err:  # noqa: BLE001 - a package that normalises with a volume's statistics has none here
        lines.append(f"receptive field: measured by `run` and `plan`, which have a volume ({one_line(err)})")
        report["field"] = None
    else:
        cfg = make_config(model=args.model, weights=args.weights, model_kwargs=kwargs, plane=args.plane)
        in_channels = args.in_channels or loaded.in_channels or 1
        plane_axis = stack_axis(loaded.plane) if loaded.plane is not None else None
        field = network_field_of(cfg, loaded, in_channels)  # what a run finds (and caches)
        downsampling = network_downsampling(cfg, loaded, field)
        halo = choose_halo(named=None, model_halo=loaded.default_halo, field=field, downsampling=downsampling,
                           plane_axis=plane_axis, valid=loaded.padding == "valid", checked=loaded.kind == "bioimageio")
        shape = lambda c: "x".join(map(str, c))  # noqa: E731
        grid = ("the grid was not found (see the line above)" if field is None else
                f"downsampling {shape(field.downsampling)} ({'/'.join(field.grid.how)}); input sizes "
                f"{field.grid.sizes_taken()}"
                + (f"; valid: consumes {shape(field.grid.context)} per side" if any(field.grid.context) else ""))
        lines += [f"network   {'2D on ' + loaded.plane + ' planes' if loaded.plane else '3D'}, {in_channels} input "
                  f"channel(s); {grid}", f"halo      {halo.note(label='')}"]
        if halo.warning():
            lines.append(f"note      {halo.warning()}")
        if args.input:
            lines += _normalizations(args, loaded, halo.halo, downsampling, plane_axis, in_channels, report)
        report.update({"plane": loaded.plane, "grid_how": None if field is None else list(field.grid.how),
                       "sizes": None if field is None else field.grid.sizes_taken(), **halo.as_dict()})
    print(_json(report, args) if args.json else "\n".join(lines))
    return 0


def _normalizations(args, loaded, halo, downsampling, plane_axis, in_channels, report: dict) -> list[str]:
    """check-model --input: one block at each normalisation tried, and the one suggested (see
    :mod:`blockpred.run.normalization`)."""
    from .io import open_volume, parse_volume_path
    from .models.bioimageio import is_package
    from .run.normalization import suggest, try_normalizations

    if is_package(args.model):
        report["normalization"] = None
        return ["normalize the package's own preprocessing, with its statistics of the volume (run applies it)"]
    with open_volume(parse_volume_path(args.input)) as source:
        trials = try_normalizations(loaded.module, source, args.normalize, halo=halo, downsampling=downsampling,
                                    plane_axis=plane_axis, in_channels=in_channels)
    best, warning = suggest(trials)
    report["normalization"] = {"trials": [t.as_dict() for t in trials], "suggested": best.normalize,
                               "warning": warning or None}
    lines = ["normalize one block at the centre of the input, on the CPU:"] + [f"  {t.line()}" for t in trials]
    lines.append(f"suggested --normalize {best.normalize} ({best.resolved} on this volume): its output spreads most")
    return lines + ([f"note      {warning}"] if warning else [])


def _demo(args: argparse.Namespace) -> int:
    from .config import parse_shape
    from .io.synthetic import write_demo_volume
    from .run.runner import predict

    directory = Path(args.dir)
    shape = parse_shape(args.shape, "shape")
    print(f"writing a synthetic EM volume of {'x'.join(map(str, shape))} voxels to {directory / 'volume.zarr'} ...")
    raw = write_demo_volume(directory, shape)
    summary = predict(raw, model=args.model, device=args.device, overwrite=True)
    print(summary)
    print(f"input:  {raw}\noutput: {summary.output}  (zarr v3 + OME-NGFF: open it in napari, or with zarr.open_group(...)['0'])")
    print(f"the same from the command line: blockpred run {raw} --overwrite")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .serve.command import serve_command

    options = {key: getattr(args, key) for key in _RUN_KEYS}
    return serve_command(args.input, args.output, config=args.config, options=options, host=args.host,
                         port=args.port, cache_mb=args.cache_mb, open_viewer=args.viewer,
                         cors_origins=args.cors_origin)


def _bench(args: argparse.Namespace) -> int:
    from .bench.command import bench_command

    return bench_command(args, {key: getattr(args, key) for key in MODEL_KEYS})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    with StandardStreams(json_output=_asks_json(argv)) as streams:
        try:
            args = build_parser().parse_args(argv)
        except _UsageError as usage:  # its line is on stderr; with --json, the JSON error object too
            if streams.json_output:
                _say(json.dumps({"ok": False, "error": usage.line, "exit_code": usage.code}))
            raise
        args.stream_warnings = streams.warnings
        undo_logging = log_to_stderr(verbose=args.verbose or args.debug)
        try:
            return _command(args)
        finally:
            undo_logging()


def _command(args: argparse.Namespace) -> int:
    try:
        commands = {"run": _run, "plan": _plan, "bench": _bench, "demo": _demo, "check-model": _check_model,
                    "serve": _serve}
        return commands[args.command](args)
    except Exception as err:  # noqa: BLE001 - every error is one line (with --debug, its traceback)
        if args.debug:
            raise
        return _failed(args, one_line(err), getattr(err, "exit_code", 1))
    except KeyboardInterrupt as err:  # Ctrl-C, SIGTERM or SIGHUP: a local cluster's workers never see them
        resume = "; finished blocks are kept: run the same command again to resume" if args.command == "run" else ""
        return _failed(args, f"{str(err) or 'interrupted'}{resume}", 128 + getattr(err, "signal_number", 2), "")


def _asks_json(argv: list[str]) -> bool:
    """Whether the command line asks for its result as JSON: ``--json`` after a command other than bench (whose
    ``--json`` names a file), read before the arguments are parsed, so that a usage error is JSON too."""
    words = [i for i, word in enumerate(argv) if not word.startswith("-")]
    return bool(words) and argv[words[0]] != "bench" and "--json" in argv[words[0] + 1:]


def _failed(args: argparse.Namespace, line: str, code: int, kind: str = "error: ") -> int:
    """The failure in one line on stderr, and with ``--json`` as JSON on standard output; the exit code."""
    print(f"blockpred: {kind}{line}", file=sys.stderr)
    if getattr(args, "json", None) is True:  # run's and check-model's flag (bench's --json names a file)
        _say(_json({"ok": False, "error": line, "exit_code": code}, args))
    return code


def console() -> int:
    """The ``blockpred`` command as a process: :func:`main`, then a quick exit.

    The interpreter's shutdown would otherwise spend most of a second in the
    cyclic garbage collector over everything torch, dask and zarr allocated;
    every file is written and closed by now, and the OS frees the memory, so
    the objects are frozen out of that last collection.  (Only here: a caller
    of :func:`main` in its own process keeps its collector.)
    """
    import gc

    from .pipeline.hostmem import keep_freed_memory

    keep_freed_memory()  # before any large array: see blockpred.pipeline.hostmem
    end_on_signals()  # SIGTERM and SIGHUP: ended as Ctrl-C is
    code = main()
    gc.freeze()
    if code in SIGNAL_EXIT_CODES:
        exit_now(code)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(console())
