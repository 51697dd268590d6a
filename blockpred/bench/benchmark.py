"""``blockpred bench``: model throughput on device-resident data, with device load.

Each configuration (batch size x precision) runs ``warmup`` untimed forward
passes, then ``iterations`` timed ones on a batch that already lives on the
device (so no transfer is counted); on CUDA each pass is bracketed by
synchronisation.  Reported per configuration:

* Mvox/s of **output** voxels (the block core each input yields, halo cropped)
  and of **network-input** voxels;
* latency per batch: mean, p50, p90, p95, p99;
* peak device memory (CUDA) or the process's peak RSS (CPU);
* device load sampled during the timed passes (:mod:`blockpred.bench.monitor`).
"""

from __future__ import annotations

import platform
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from ..geometry import Coord
from ..pipeline import Predictor
from ..pipeline.blocking import check_block_on_grid
from .choice import BenchVolume, run_choice
from .monitor import DeviceMonitor


@dataclass
class ThroughputResult:
    model: str
    device: str
    precision: str
    batch_size: int
    block: list[int]
    input_shape: list[int]
    latencies_s: list[float]
    peak_memory_bytes: int
    memory_kind: str  # "cuda max allocated" or "process peak RSS"
    load: dict = field(default_factory=dict)
    #: What ran the network (``torch``, ``openvino``; ``torch (openvino: ...)`` where it did not convert).
    backend: str = "torch"
    #: The largest difference from torch at fp32 on one seeded batch (None: not compared).
    max_diff: float | None = None

    def _percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q))

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.latencies_s)

    @property
    def output_mvox_per_s(self) -> float:
        return self.batch_size * Coord(self.block).prod() / self.mean_s / 1e6

    @property
    def input_mvox_per_s(self) -> float:
        return self.batch_size * Coord(self.input_shape).prod() / self.mean_s / 1e6

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update({"mean_s": self.mean_s, "p50_s": self._percentile(50), "p90_s": self._percentile(90),
                    "p95_s": self._percentile(95), "p99_s": self._percentile(99),
                    "output_mvox_per_s": self.output_mvox_per_s, "input_mvox_per_s": self.input_mvox_per_s})
        return out


def measure(predictor: Predictor, *, model_name: str, in_channels: int, block: Coord, input_shape: Coord,
            batch_size: int, warmup: int, iterations: int) -> ThroughputResult:
    """Time ``iterations`` forward passes of one configuration (see the module docstring)."""
    device = predictor.device
    cuda = device.type == "cuda"
    generator = torch.Generator(device="cpu").manual_seed(0)
    batch = torch.rand((batch_size, in_channels) + tuple(input_shape), generator=generator).to(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    latencies = []
    with torch.inference_mode():
        for _ in range(warmup):
            predictor.forward(batch)
        if cuda:
            torch.cuda.synchronize(device)
        with DeviceMonitor(device) as monitor:
            for _ in range(iterations):
                start = time.perf_counter()
                predictor.forward(batch)
                if cuda:
                    torch.cuda.synchronize(device)
                latencies.append(time.perf_counter() - start)
    if cuda:
        peak, kind = torch.cuda.max_memory_allocated(device), "cuda max allocated"
    else:
        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"
    return ThroughputResult(model_name, str(device), predictor.precision, batch_size, list(block), list(input_shape),
                            latencies, int(peak), kind, monitor.summary())


def environment() -> dict:
    """Versions and devices, for the JSON report."""
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
           "cpu": platform.processor() or platform.machine(), "cpu_count": torch.get_num_threads(),
           "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    return env


def format_table(results: list[ThroughputResult]) -> str:
    header = (f"{'backend':<11} {'precision':<9} {'batch':>5} {'out Mvox/s':>10} {'in Mvox/s':>10} {'mean ms':>9} "
              f"{'p50':>8} {'p90':>8} {'p95':>8} {'p99':>8} {'peak mem':>10} {'max |diff|':>10} {'load':>14}")
    lines = [header]
    for r in results:
        d = r.as_dict()
        load = r.load.get("label", "")
        diff = "" if r.max_diff is None else f"{r.max_diff:.2g}"
        lines.append(
            f"{r.backend.split(' ')[0]:<11} {r.precision:<9} {r.batch_size:>5} {r.output_mvox_per_s:>10.2f} "
            f"{r.input_mvox_per_s:>10.2f} {d['mean_s'] * 1e3:>9.1f} {d['p50_s'] * 1e3:>8.1f} {d['p90_s'] * 1e3:>8.1f} "
            f"{d['p95_s'] * 1e3:>8.1f} {d['p99_s'] * 1e3:>8.1f} {r.peak_memory_bytes / 2**30:>8.2f}Gi {diff:>10} "
            f"{load:>14}"
        )
    return "\n".join(lines)


def run(options: dict, volume: BenchVolume, loaded, *, block: Coord | str | None = None, halo: Coord | None = None,
        batch_sizes: tuple[int | str, ...] | None = None, precisions: tuple[str, ...] = ("auto",),
        backends: tuple[str, ...] = ("auto",), warmup: int = 2, iterations: int = 5,
        progress=None) -> list[ThroughputResult]:
    """Measure every batch size x precision x backend of the network ``loaded`` (from ``options``, the run's model
    options: :func:`blockpred.predict`'s keywords); what is not named is what ``blockpred run`` would choose.

    What is left open (the block, ``"auto"`` or None; the halo; the batch, ``batch_sizes=None`` or ``("auto",)``;
    the memory format; precision or backend ``"auto"``) is what a run with these options chooses over ``volume``
    (:func:`~blockpred.bench.choice.run_choice`: the run's own planning, measured defaults, trials and caches),
    per precision.  Several ``backends`` give a row each, with its largest difference from torch at fp32.
    ``options["tta"]`` times the network under test-time augmentation (a pass per flip), so Mvox/s and the
    extrapolation from it count what ``run --tta`` costs.
    """
    from ..config import make_config
    from ..models.planes import check_halo
    from ..models.tta import with_tta
    from ..pipeline import resolve_device
    from ..run.formats import model_key_of
    from ..tuning.network import probe_network

    cfg = make_config(**options)
    target = resolve_device(cfg.device)
    in_channels = volume.num_channels or 1
    batches_named = batch_sizes is not None and "auto" not in batch_sizes
    named = isinstance(block, Coord) and halo is not None and batches_named and cfg.memory_format not in (None, "auto")
    if isinstance(block, Coord):  # the rule `run` applies, before any device time is spent
        check_block_on_grid(block, cfg.downsampling or loaded.downsampling)
    if loaded.plane is not None and halo is not None:
        check_halo(halo, loaded.plane, loaded.name)
    key = model_key_of(cfg, loaded)
    results, timed = [], set()
    for precision in precisions:
        chosen, halo_, layout, downsampling = block, halo, cfg.memory_format, cfg.downsampling or loaded.downsampling
        batches = list(batch_sizes) if batches_named else None
        runs_as = "auto" if len(backends) > 1 else backends[0]
        choice = None
        if not named or precision == "auto" or runs_as == "auto":
            batch = None if batch_sizes is None else batch_sizes[0] if len(batch_sizes) == 1 else 1
            choice = run_choice({**options, "precision": precision, "backend": runs_as, "block": block, "halo": halo,
                                 "batch_size": batch}, volume)
            chosen, halo_, layout, downsampling = choice.block, choice.halo, choice.memory_format, choice.downsampling
            precision, batches = choice.precision, batches or [choice.batch_size]
            if progress is not None:
                progress(f"{loaded.name} {precision}: as `blockpred run` would over {volume}: block "
                         f"{'x'.join(map(str, chosen))}, batch {batches[0]}, {layout}, {choice.backend}; {choice.how}")
        runs_on = [b for b in dict.fromkeys(choice.backend if b == "auto" else b for b in backends)
                   if (precision, b) not in timed]  # auto may choose a precision (a backend) also named
        if not runs_on:
            continue
        timed.update((precision, b) for b in runs_on)
        predictor = Predictor(with_tta(loaded.module, cfg.tta), target, precision, compile=cfg.compile,
                              memory_format=layout)
        if target.type == "cpu" and progress is not None:
            progress(_cpu_estimate(predictor, loaded, in_channels, chosen, halo_, batches, warmup + iterations))
        geometry = probe_network(predictor, in_channels=in_channels, block=chosen, halo=halo_,
                                 downsampling=downsampling, count=False)
        sample = np.random.default_rng(0).random((1, in_channels) + tuple(geometry.input_shape), dtype=np.float32)
        reference = None
        for backend in runs_on:
            if backend != "torch" or len(runs_on) > 1:  # each backend its own predictor, compared with torch fp32
                if reference is None:
                    reference = Predictor(with_tta(loaded.module, cfg.tta), target, "fp32")(sample)
                predictor = Predictor(with_tta(loaded.module, cfg.tta), target, precision, compile=cfg.compile,
                                      memory_format=layout if backend == "torch" else "contiguous", backend=backend,
                                      backend_key=key)
            diff = None if reference is None else float(np.abs(predictor(sample) - reference).max())
            predictor.search = True  # the network at its searched kernels, as a long run gets (its warm-up pays)
            for batch_size in dict.fromkeys(batches):
                if progress is not None:
                    progress(f"{loaded.name} {backend} {precision} batch {batch_size}: input "
                             f"{tuple(geometry.input_shape)}")
                result = measure(predictor, model_name=loaded.name, in_channels=in_channels, block=chosen,
                                 input_shape=geometry.input_shape, batch_size=int(batch_size), warmup=warmup,
                                 iterations=iterations)
                results.append(replace(result, backend=predictor.backend_note, max_diff=diff))
    return results


def _cpu_estimate(predictor: Predictor, loaded, in_channels: int, block: Coord, halo: Coord, batches: list,
                  passes: int) -> str:
    """What the passes at ``block`` will take on the CPU, from one pass of a block a quarter as large per axis
    (a CPU's time grows with the voxels): said before minutes go into them."""
    from ..tuning.autosize import probe_block
    from ..tuning.network import probe_network

    small = probe_block(block, loaded.downsampling)
    started = time.perf_counter()
    try:
        probe = probe_network(predictor, in_channels=in_channels, block=small, halo=halo,
                              downsampling=loaded.downsampling, count=False)
    except Exception:  # noqa: BLE001 - too small for the network: the full block's dry run says what is wrong
        return f"{loaded.name} {predictor.precision}: block {tuple(block)} on the CPU (no estimate)"
    seconds = time.perf_counter() - started
    if seconds < 1.0:  # the first pass's start-up (threads, allocations) would dominate: time a warm one
        x = torch.rand((1, in_channels) + tuple(probe.input_shape))
        started = time.perf_counter()
        with torch.inference_mode():
            predictor.forward(x)
        seconds = time.perf_counter() - started
    full = (block + halo * 2).ceil_div(loaded.downsampling) * loaded.downsampling
    per_pass = seconds * full.prod() / probe.input_shape.prod()
    total = per_pass * (1 + passes * sum(int(b) for b in batches))  # the dry run, then each batch's passes
    return (f"{loaded.name} {predictor.precision}: block {tuple(block)} on the CPU, about {per_pass:.1f} s a block "
            f"(from a pass of input {tuple(probe.input_shape)} in {seconds:.2f} s): about "
            f"{f'{total:.0f} s' if total < 120 else f'{total / 60:.0f} min'} of passes")


@dataclass
class PipelineResult:
    """End-to-end: the real ``blockpred run`` path over a volume, against model-only at the same shapes."""

    volume_shape: list[int]
    num_blocks: int
    seconds: float
    mvox_per_s: float  # output voxels of the volume per second of pipeline
    model_only_mvox_per_s: float
    read_s: float
    transfer_s: float  # host <-> device copies (0 on the CPU)
    compute_s: float  # network calls, copies excluded
    write_s: float
    workers: int
    #: Device load sampled over the run (GPU utilisation of the first device; on the CPU, this process's).
    load: dict = field(default_factory=dict)

    @property
    def efficiency(self) -> float:
        return self.mvox_per_s / self.model_only_mvox_per_s if self.model_only_mvox_per_s else 0.0

    @property
    def limiting_stage(self) -> str:
        stages = {"read": self.read_s, "transfer": self.transfer_s, "compute": self.compute_s, "write": self.write_s}
        return max(stages, key=stages.get)

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(efficiency=self.efficiency, limiting_stage=self.limiting_stage)
        return out


def run_pipeline(options: dict, volume: BenchVolume, *, block: Coord, halo: Coord | None, batch_size: int,
                 precision: str, backend: str, model_only: ThroughputResult, workdir: str,
                 workers: int | None = None) -> PipelineResult:
    """Predict ``volume`` (a synthetic EM volume of its shape where it is synthetic) with the real run path and the
    run's ``options``, at the block, batch, precision and backend measured model-only."""
    from pathlib import Path

    from ..io.synthetic import write_em_volume
    from ..pipeline import resolve_device
    from ..run.runner import predict

    input_path = volume.path or write_em_volume(str(Path(workdir) / "bench-input.zarr"), volume.shape)
    with DeviceMonitor(resolve_device(options.get("device") or "auto")) as monitor:
        summary = predict(input_path, str(Path(workdir) / "bench-output.zarr"),
                          **{**options, "block": block, "halo": halo, "batch_size": batch_size,
                             "precision": precision, "backend": backend, "overwrite": True, "progress": False,
                             "workers": workers})
    stats = summary.stats
    return PipelineResult(list(summary.plan.volume_box.shape), stats.num_blocks, stats.seconds, stats.mvox_per_s,
                          model_only.output_mvox_per_s, stats.read_s, stats.transfer_s, stats.compute_s,
                          stats.write_s, max(1, len(summary.workers)), monitor.summary())


@dataclass
class TrainingResult:
    batch_size: int
    input_shape: list[int]
    seconds_per_iteration: float

    @property
    def iterations_per_minute(self) -> float:
        return 60.0 / self.seconds_per_iteration

    @property
    def hours_per_100k(self) -> float:
        return 100_000 * self.seconds_per_iteration / 3600.0

    def as_dict(self) -> dict:
        return {**asdict(self), "iterations_per_minute": self.iterations_per_minute,
                "hours_per_100k_iterations": self.hours_per_100k}


def measure_training(module: torch.nn.Module, device: torch.device, *, in_channels: int, input_shape: Coord,
                     batch_size: int, precision: str, warmup: int, iterations: int) -> TrainingResult:
    """Iterations of training (forward, MSE loss, backward, Adam step) on random data on the device."""
    import copy

    net = copy.deepcopy(module).to(device).train()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.rand((batch_size, in_channels) + tuple(input_shape), generator=generator).to(device)
    cuda = device.type == "cuda"
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    with torch.no_grad():
        target = torch.rand_like(net(x).float())

    def step():
        optimizer.zero_grad(set_to_none=True)
        if dtype is None:
            loss = torch.nn.functional.mse_loss(net(x), target)
        else:
            with torch.autocast(device_type=device.type, dtype=dtype):
                loss = torch.nn.functional.mse_loss(net(x).float(), target)
        loss.backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    return TrainingResult(batch_size, list(input_shape), (time.perf_counter() - start) / iterations)


def format_markdown(results: list[ThroughputResult], pipeline: PipelineResult | None,
                    training: TrainingResult | None, environment_info: dict) -> str:
    """Tables in the style of the published benchmarks."""
    devices = ", ".join(environment_info.get("devices") or []) or environment_info.get("cpu", "CPU")
    lines = [f"Device: {devices}; torch {environment_info['torch']}, CUDA {environment_info['cuda']}", ""]
    if results:
        lines += ["| model | precision | batch | block | network input | output Mvox/s | input Mvox/s | "
                  "latency mean / p50 / p90 / p95 / p99 (ms) | peak memory (GiB) | load |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in results:
            d = r.as_dict()
            latency = " / ".join(f"{d[k] * 1e3:.1f}" for k in ("mean_s", "p50_s", "p90_s", "p95_s", "p99_s"))
            lines.append(f"| {r.model} | {r.precision} | {r.batch_size} | {'×'.join(map(str, r.block))} | "
                         f"{'×'.join(map(str, r.input_shape))} | {r.output_mvox_per_s:.2f} | {r.input_mvox_per_s:.2f} | "
                         f"{latency} | {r.peak_memory_bytes / 2**30:.2f} | {r.load.get('label', '')} |")
    if pipeline is not None:
        p = pipeline
        lines += ["", "| volume | blocks | end-to-end Mvox/s | model-only Mvox/s | efficiency | read s | transfer s | "
                  "compute s | write s | limiting | load |", "|---|---|---|---|---|---|---|---|---|---|---|",
                  f"| {'×'.join(map(str, p.volume_shape))} | {p.num_blocks} | {p.mvox_per_s:.2f} | "
                  f"{p.model_only_mvox_per_s:.2f} | {p.efficiency:.2f} | {p.read_s:.1f} | {p.transfer_s:.1f} | "
                  f"{p.compute_s:.1f} | {p.write_s:.1f} | {p.limiting_stage} | {p.load.get('label', '')} |"]
    if training is not None:
        t = training
        lines += ["", "| training batch | input | iterations/min | hours per 100k iterations |", "|---|---|---|---|",
                  f"| {t.batch_size} | {'×'.join(map(str, t.input_shape))} | {t.iterations_per_minute:.1f} | "
                  f"{t.hours_per_100k:.1f} |"]
    return "\n".join(lines) + "\n"


#: How to install what ``--plot`` needs, from blockpred's checkout (blockpred is not on the package index).
PLOT_INSTALL = "pip install -e \".[bench]\" in blockpred's checkout (or pip install matplotlib)"


def check_plot() -> None:
    """Before any measuring: ``--plot`` needs matplotlib (one line saying how to install it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        from ..errors import InvalidOptionError

        raise InvalidOptionError(f"--plot needs matplotlib: {PLOT_INSTALL}") from None


def plot(results: list[ThroughputResult], path: str) -> None:
    """Output Mvox/s against batch size, one line per precision (matplotlib, from the ``bench`` extra)."""
    check_plot()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for precision in dict.fromkeys(r.precision for r in results):
        rows = sorted((r for r in results if r.precision == precision), key=lambda r: r.batch_size)
        axes.plot([r.batch_size for r in rows], [r.output_mvox_per_s for r in rows], marker="o", label=precision)
    first = results[0]
    axes.set_xticks(sorted({r.batch_size for r in results}))
    axes.set_xlabel("batch size (blocks per forward pass)")
    axes.set_ylabel("output Mvox/s")
    axes.set_title(f"{first.model} on {first.device}, block {'x'.join(map(str, first.block))}")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
