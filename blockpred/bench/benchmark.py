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


@dataclass(frozen=True)
class RunChoice:
    """What ``blockpred run`` chooses for a uint8 volume of a shape (:func:`run_choice`)."""

    block: Coord
    halo: Coord
    batch_size: int
    memory_format: str
    #: The run's own words for the choice (its measured defaults' line and its halo's).
    how: str
    backend: str = "torch"


def run_choice(*, model: str, weights: str | None, region: Coord, precision: str, device: str,
               block: Coord | None = None, halo: Coord | None = None, batch_size: int | None = None,
               memory_format: str | None = None, tta: str = "off") -> RunChoice:
    """The block, halo, batch and memory format ``blockpred run`` would take over a uint8 volume of shape
    ``region`` on ``device`` at ``precision`` (what is named stays named): the run's own planning
    (:func:`blockpred.run.prepare.prepare`, its measured defaults and caches included) on an empty volume of
    that shape in a temporary directory (no chunk is written; its reads are of zeros)."""
    import tempfile
    from pathlib import Path

    from ..config import make_config
    from ..io import create_volume, open_volume, parse_volume_path
    from ..run.prepare import prepare

    with tempfile.TemporaryDirectory(prefix="blockpred-bench-") as workdir:
        source_path = parse_volume_path(str(Path(workdir) / "region.zarr"))
        create_volume(source_path, spatial_shape=region, num_channels=None, dtype="uint8",
                      chunk_shape=tuple(min(64, s) for s in region), ome=False).close()
        cfg = make_config(model=model, weights=weights, block=block, halo=halo, batch_size=batch_size,
                          memory_format=memory_format, precision=precision, device=device, tta=tta, local=True,
                          progress=False)
        with open_volume(source_path) as source:
            p = prepare(cfg, source, source_path, parse_volume_path(str(Path(workdir) / "out.zarr")))
    how = "; ".join(filter(None, [f"chosen {p.defaults}" if p.defaults is not None else "",
                                  p.layout.halo.note() if p.layout.halo is not None else ""]))
    return RunChoice(p.layout.plan.block_shape, p.layout.plan.halo, p.settings.batch_size, p.memory_format, how,
                     p.backend)


def run(*, model: str = "tiny", weights: str | None = None, block: Coord | str | None = None,
        halo: Coord | None = None, batch_sizes: tuple[int | str, ...] | None = None,
        precisions: tuple[str, ...] = ("fp32",), device: str = "auto", warmup: int = 2, iterations: int = 5,
        compile: str = "off", memory_format: str | None = None, region: Coord = Coord((128, 256, 256)),
        progress=None, tta: str = "off", backends: tuple[str, ...] | None = None) -> list[ThroughputResult]:
    """Measure every batch size x precision; shapes from the options, else what ``blockpred run`` would choose.

    ``tta`` times the network under test-time augmentation (a pass per flip), so
    Mvox/s and the extrapolation from it count what ``run --tta`` costs.

    What is not named (the block, the halo, the batch: ``batch_sizes=None``, the
    memory format) is what ``blockpred run`` would choose per precision for a
    uint8 volume of shape ``region`` (:func:`run_choice`: its measured
    defaults, its receptive-field halo).  ``block="auto"`` or a batch size
    ``"auto"`` run the full trial search of ``run --block auto`` instead.
    ``backends`` (``torch``, ``openvino``): a row for each, with its largest
    difference from torch at fp32; None: the backend the run would choose.
    """
    from ..models import load_model
    from ..models.planes import check_halo, stack_axis
    from ..models.tta import with_tta
    from ..pipeline import resolve_device
    from ..run.choose import DEFAULT_BLOCK
    from ..run.halo import fallback_halo
    from ..tuning.network import probe_network

    target = resolve_device(device)
    loaded = load_model(model, weights=weights)  # once: each predictor casts its own copy to its precision
    given = block if isinstance(block, Coord) else (loaded.default_block or DEFAULT_BLOCK)
    halo_ = halo if halo is not None else (loaded.default_halo if loaded.default_halo is not None else
                                           fallback_halo(stack_axis(loaded.plane) if loaded.plane else None))
    if loaded.plane is not None and halo is not None:
        check_halo(halo_, loaded.plane, loaded.name)
    in_channels = loaded.in_channels or 1
    if isinstance(block, Coord):  # the rule `run` applies, before any device time is spent
        check_block_on_grid(given, loaded.downsampling)
    from ..tuning.sizing import model_key

    results = []
    for precision in precisions:
        chosen, layout, choice = given, memory_format or "contiguous", None
        batches = list(batch_sizes) if batch_sizes is not None else [None]
        if block != "auto" and "auto" not in batches and (block is None or None in batches or memory_format is None
                                                          or halo is None):
            choice = run_choice(model=model, weights=weights, region=region, precision=precision, device=device,
                                block=block, halo=halo, batch_size=batches[0] if len(batches) == 1 else 1,
                                memory_format=memory_format, tta=tta)
            chosen, halo_, layout = choice.block, choice.halo, choice.memory_format
            batches = [choice.batch_size if b is None else b for b in batches]
            if progress is not None:
                progress(f"{loaded.name} {precision}: as `blockpred run` would over "
                         f"{'x'.join(map(str, region))} uint8: block {'x'.join(map(str, chosen))}, batch "
                         f"{batches[0]}, {layout}; {choice.how}")
        batches = [1 if b is None else b for b in batches]
        key = model_key(loaded.name, loaded.weights_sha256)
        runs_on = list(backends) if backends is not None else [choice.backend if choice is not None else "torch"]
        predictor = Predictor(with_tta(loaded.module, tta), target, precision, compile=compile,
                              memory_format=layout)
        if block == "auto" or "auto" in batches:
            sizing = _auto_size(loaded, predictor, in_channels, chosen, halo_, region,
                                search_block=block == "auto", fixed_batch=None if "auto" in batches else batches[0])
            if progress is not None:
                progress(f"{loaded.name} {precision}: auto size {sizing}")
            chosen = sizing.block
            batches = [sizing.batch_size if b == "auto" else b for b in batches]
        if target.type == "cpu" and progress is not None:
            progress(_cpu_estimate(predictor, loaded, in_channels, chosen, halo_, batches, warmup + iterations))
        geometry = probe_network(predictor, in_channels=in_channels, block=chosen, halo=halo_,
                                 downsampling=loaded.downsampling, count=False)
        sample = np.random.default_rng(0).random((1, in_channels) + tuple(geometry.input_shape), dtype=np.float32)
        reference = None
        for backend in runs_on:
            if backend != "torch" or len(runs_on) > 1:  # each backend its own predictor, compared with torch fp32
                if reference is None:
                    reference = Predictor(with_tta(loaded.module, tta), target, "fp32")(sample)
                predictor = Predictor(with_tta(loaded.module, tta), target, precision, compile=compile,
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


def _auto_size(loaded, predictor: Predictor, in_channels: int, block: Coord, halo: Coord, region: Coord, *,
               search_block: bool, fixed_batch: int | None):
    """The run's auto sizing for a uint8 volume of shape ``region`` (see :mod:`blockpred.tuning.autosize`)."""
    from ..geometry import Box
    from ..pipeline import DeviceSteps
    from ..tuning.autosize import SizeProblem, choose_sizes, model_key, probe_block
    from ..tuning.network import probe_network
    from ..tuning.tensors import max_input_voxels

    step = loaded.downsampling
    small = probe_block(block, step) if search_block else block
    geometry = probe_network(predictor, in_channels=in_channels, block=small, halo=halo, downsampling=step,
                             count=predictor.device.type == "cuda")
    problem = SizeProblem(
        in_channels=in_channels, raw_dtype=np.dtype("uint8"), halo=halo, context=geometry.context,
        input_extra=geometry.input_shape - (small + (halo + geometry.context) * 2), step=step, base_block=block,
        roi=Box.from_shape(region), steps=DeviceSteps(scale=1 / 255), fixed_block=None if search_block else block,
        fixed_batch=fixed_batch,
        max_input_voxels=max_input_voxels(geometry.largest_per_voxel) if predictor.device.type == "cuda" else None,
    )
    return choose_sizes(predictor, problem, model_key=model_key(loaded.name, loaded.weights_sha256))


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


def run_pipeline(*, model: str, weights: str | None, block: Coord, halo: Coord, batch_size: int, precision: str,
                 device: str, model_only: ThroughputResult, input_path: str | None, volume_shape: Coord,
                 workdir: str, workers: int | None = None, compile: str = "off",
                 memory_format: str = "contiguous") -> PipelineResult:
    """Predict ``input_path`` (or a synthetic EM volume of ``volume_shape``) with the real run path."""
    from pathlib import Path

    from ..io.synthetic import write_em_volume
    from ..run.runner import predict

    if input_path is None:
        input_path = write_em_volume(str(Path(workdir) / "bench-input.zarr"), volume_shape)
    from ..pipeline import resolve_device

    with DeviceMonitor(resolve_device(device)) as monitor:
        summary = predict(input_path, str(Path(workdir) / "bench-output.zarr"), model=model, weights=weights,
                          block=block, halo=halo, batch_size=batch_size, precision=precision, device=device,
                          overwrite=True, progress=False, workers=workers, compile=compile,
                          memory_format=memory_format)
    stats = summary.stats
    return PipelineResult(list(summary.plan.volume_box.shape), stats.num_blocks, stats.seconds, stats.mvox_per_s,
                          model_only.output_mvox_per_s, stats.read_s, stats.transfer_s, stats.compute_s,
                          stats.write_s,
                          max(1, len(summary.workers)), monitor.summary())


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
