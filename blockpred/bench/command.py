"""``blockpred bench``: the command's measurements, extrapolation and reports (see :mod:`blockpred.bench.benchmark`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..geometry import Coord


def bench_command(args: argparse.Namespace) -> int:
    """Run ``blockpred bench`` with the parsed ``args``; its exit code."""
    from ..config import parse_shape
    from ..errors import InvalidOptionError
    from . import benchmark
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

    precisions = [p.strip() for p in args.precision.split(",")]
    from ..config import PRECISIONS

    if any(p not in PRECISIONS for p in precisions):
        raise InvalidOptionError(f"precisions must be among {', '.join(PRECISIONS)}, got {args.precision!r}")
    report: dict = {"environment": benchmark.environment(), "results": [], "extrapolation": []}
    mvox, overhead = args.assume_mvox_per_s, None
    results, pipeline, training = [], None, None
    say = lambda text: print(f"{text} ...", file=sys.stderr, flush=True)  # noqa: E731
    if mvox is None:
        block = None
        if args.block:
            block = "auto" if args.block.strip().lower() == "auto" else parse_shape(args.block, "block")
        halo = parse_shape(args.halo, "halo") if args.halo else None
        batch_sizes = (None if args.batch_size is None else ["auto"] if args.batch_size.strip().lower() == "auto"
                       else numbers(args.batch_size, "--batch-size"))
        results = benchmark.run(
            model=args.model, weights=args.weights, block=block, halo=halo,
            batch_sizes=None if batch_sizes is None else tuple(batch_sizes), precisions=tuple(precisions),
            device=args.device, warmup=args.warmup, iterations=args.iterations, compile=args.compile,
            memory_format=args.memory_format, region=parse_shape(args.volume_shape, "volume shape"),
            progress=lambda text: say(f"measuring {text}"), tta=args.tta,
            backends=None if not args.backend else tuple(b.strip() for b in args.backend.split(",") if b.strip()))
        first = results[0]
        print(f"model {first.model} on {first.device}: block {tuple(first.block)} -> network input "
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
                    model=args.model, weights=args.weights, block=Coord(best.block), halo=halo,
                    batch_size=best.batch_size, precision=best.precision, device=args.device, model_only=best,
                    compile=args.compile, memory_format=args.memory_format,
                    input_path=args.input, volume_shape=parse_shape(args.volume_shape, "volume shape"),
                    workdir=workdir, workers=args.workers)
            p = pipeline
            print(f"end to end over {'x'.join(map(str, p.volume_shape))} ({p.num_blocks} blocks, {p.workers} worker(s)): "
                  f"{p.mvox_per_s:.2f} Mvox/s of the volume, pipeline efficiency {p.efficiency:.2f} "
                  f"(end-to-end / model-only); stage time read {p.read_s:.1f} s, transfer {p.transfer_s:.1f} s, "
                  f"compute {p.compute_s:.1f} s, write {p.write_s:.1f} s: limited by {p.limiting_stage}; "
                  f"{p.load.get('label', 'load not sampled')}")
            report["pipeline"] = p.as_dict()
        record_bench(args, best, pipeline)
        if args.train:
            from ..models import load_model
            from ..pipeline import resolve_device

            say("timing training iterations")
            loaded = load_model(args.model, weights=args.weights)
            training = benchmark.measure_training(
                loaded.module, resolve_device(args.device), in_channels=loaded.in_channels or 1,
                input_shape=Coord(best.input_shape), batch_size=best.batch_size, precision=best.precision,
                warmup=1, iterations=max(2, args.iterations // 2))
            print(f"training (forward, loss, backward, Adam step), batch {training.batch_size}, input "
                  f"{tuple(training.input_shape)}: {training.iterations_per_minute:.1f} iterations/min, "
                  f"{training.hours_per_100k:.1f} h per 100k iterations")
            report["training"] = training.as_dict()
    if args.extrapolate:
        datasets = [parse_size(s) for s in args.extrapolate.split(",")]
        rows = extrapolate(datasets, numbers(args.gpus, "--gpus"), mvox)
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


def record_bench(args: argparse.Namespace, best, pipeline) -> None:
    """The measured throughput, for `blockpred plan`: end to end when --pipeline ran, else model only."""
    from ..models import load_model
    from ..run.plan import ThroughputLog
    from ..tuning.autosize import model_key

    loaded = load_model(args.model, weights=args.weights)
    key = model_key(loaded.name, loaded.weights_sha256, {})
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
