"""``blockpred bench``: the command's measurements, extrapolation and reports (see :mod:`blockpred.bench.benchmark`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..geometry import Coord


def bench_command(args: argparse.Namespace, options: dict) -> int:
    """Run ``blockpred bench`` with the parsed ``args``; ``options``: the model group's (``blockpred run``'s
    keywords: the network and how it runs; ``precision`` and ``backend`` as lists, a row each).  Its exit code."""
    from ..config import make_config, parse_shape
    from ..errors import InvalidOptionError
    from . import benchmark
    from .choice import bench_volume
    from .metrics import (
        extrapolate,
        format_extrapolation,
        halo_overhead,
        parse_size,
    )

    if args.plot:
        benchmark.check_plot()  # now, not after minutes of measuring
    _check_written_places(args)

    def numbers(text: str, name: str, kind=int) -> list:
        try:
            values = [kind(v) for v in str(text).split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or any(v <= 0 for v in values):
            raise InvalidOptionError(f"{name} must be a comma-separated list of positive numbers, got {text!r}")
        return values

    options = dict(options)
    precisions, backends = options.pop("precision") or ("auto",), options.pop("backend") or ("auto",)
    cfg = make_config(**options)  # every value checked, as run checks it, before anything is loaded
    if args.input and args.volume_shape:
        raise InvalidOptionError(f"--input {args.input} and --volume-shape {args.volume_shape} name two volumes to "
                                 f"bench for; give one (--input: the volume's own shape)")
    gpus = numbers(args.gpus, "--gpus")
    datasets = [parse_size(s) for s in args.extrapolate.split(",")] if args.extrapolate else []
    report: dict = {"environment": benchmark.environment(), "results": [], "extrapolation": []}
    mvox, overhead = args.assume_mvox_per_s, None
    results, pipeline, training = [], None, None
    say = lambda text: print(f"{text} ...", file=sys.stderr, flush=True)  # noqa: E731
    if mvox is None:
        from ..pipeline.job import ModelSpec

        block = None
        if args.block:
            block = "auto" if args.block.strip().lower() == "auto" else parse_shape(args.block, "block")
        halo = parse_shape(args.halo, "halo") if args.halo else None
        batch_sizes = (None if args.batch_size is None else ("auto",) if args.batch_size.strip().lower() == "auto"
                       else tuple(numbers(args.batch_size, "--batch-size")))
        loaded = ModelSpec(cfg.model, cfg.weights, cfg.model_kwargs, cfg.trust_pickle, cfg.plane).load()
        volume = bench_volume(args.input, parse_shape(args.volume_shape, "volume shape") if args.volume_shape
                              else None, loaded.in_channels)
        report["volume"] = volume.as_dict()
        results = benchmark.run(options, volume, loaded, block=block, halo=halo, batch_sizes=batch_sizes,
                                precisions=precisions, backends=backends, warmup=args.warmup,
                                iterations=args.iterations, progress=lambda text: say(f"measuring {text}"))
        first = results[0]
        print(f"model {first.model} on {first.device} over {volume}: block {tuple(first.block)} -> network input "
              f"{tuple(first.input_shape)}; Mvox/s of output (block) and network-input voxels")
        print(benchmark.format_table(results))
        report["results"] = [r.as_dict() for r in results]
        best = max(results, key=lambda r: r.output_mvox_per_s)
        mvox, overhead = best.output_mvox_per_s, halo_overhead(Coord(best.block), Coord(best.input_shape))
        if args.pipeline:
            import tempfile

            say(f"running the pipeline at {best.precision}, batch {best.batch_size}")
            with tempfile.TemporaryDirectory(prefix="blockpred-bench-") as workdir:
                pipeline = benchmark.run_pipeline(
                    options, volume, block=Coord(best.block), halo=halo, batch_size=best.batch_size,
                    precision=best.precision, backend=best.backend.split(" ")[0], model_only=best, workdir=workdir,
                    workers=args.workers)
            p = pipeline
            print(f"end to end over {'x'.join(map(str, p.volume_shape))} ({p.num_blocks} blocks, {p.workers} worker(s)): "
                  f"{p.mvox_per_s:.2f} Mvox/s of the volume, pipeline efficiency {p.efficiency:.2f} "
                  f"(end-to-end / model-only); stage time read {p.read_s:.1f} s, transfer {p.transfer_s:.1f} s, "
                  f"compute {p.compute_s:.1f} s, write {p.write_s:.1f} s: limited by {p.limiting_stage}; "
                  f"{p.load.get('label', 'load not sampled')}")
            report["pipeline"] = p.as_dict()
        record_bench(cfg, loaded, best, pipeline)
        if args.train:
            from ..pipeline import resolve_device

            say("timing training iterations")
            training = benchmark.measure_training(
                loaded.module, resolve_device(cfg.device), in_channels=volume.num_channels or 1,
                input_shape=Coord(best.input_shape), batch_size=best.batch_size, precision=best.precision,
                warmup=1, iterations=max(2, args.iterations // 2))
            print(f"training (forward, loss, backward, Adam step), batch {training.batch_size}, input "
                  f"{tuple(training.input_shape)}: {training.iterations_per_minute:.1f} iterations/min, "
                  f"{training.hours_per_100k:.1f} h per 100k iterations")
            report["training"] = training.as_dict()
    if datasets:
        rows = extrapolate(datasets, gpus, mvox)
        print(format_extrapolation(rows, mvox, 1.0, overhead, None if not results else best.device))
        report["extrapolation"] = [{"dataset": r.dataset.name, "voxels": r.dataset.voxels, "gpus": r.gpus,
                                    "hours": r.hours, "days": r.days, "mvox_per_s_per_gpu": mvox} for r in rows]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    if args.plot and results:
        benchmark.plot(results, args.plot)
        print(f"wrote {args.plot}")
    if args.markdown:
        Path(args.markdown).write_text(benchmark.format_markdown(results, pipeline, training, report["environment"]))
        print(f"wrote {args.markdown}")
    return 0


def record_bench(cfg, loaded, best, pipeline) -> None:
    """The measured throughput, for `blockpred plan` (under the run's key of the network: its arguments, its
    test-time augmentation): end to end when --pipeline ran, else model only."""
    from ..run.formats import model_key_of
    from ..run.plan import ThroughputLog

    key = model_key_of(cfg, loaded)
    if pipeline is not None:
        ThroughputLog().put(key, best.precision, pipeline.mvox_per_s / max(1, pipeline.workers),
                            "blockpred bench --pipeline, per worker", best.device)
    else:
        ThroughputLog().put(key, best.precision, best.output_mvox_per_s,
                            f"blockpred bench, model only at block {'x'.join(map(str, best.block))}", best.device)


def _check_written_places(args: argparse.Namespace) -> None:
    """The reports and the cache are never written into the volume ``--input`` names (before anything runs)."""
    if not args.input:
        return
    from ..cache import default_cache_dir
    from ..io import identity, parse_volume_path

    protected = [("input", parse_volume_path(args.input))]
    for what, place in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot),
                        ("the cache directory ($BLOCKPRED_CACHE_DIR)", default_cache_dir())):
        if place:
            identity.refuse_inside(place, what, protected)
