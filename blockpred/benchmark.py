"""``blockpred bench``: model throughput on device-resident data, with device load.

Each configuration (batch size x precision) runs ``warmup`` untimed forward
passes, then ``iterations`` timed ones on a batch that already lives on the
device (so no transfer is counted); on CUDA each pass is bracketed by
synchronisation.  Reported per configuration:

* Mvox/s of **output** voxels (the block core each input yields, halo cropped)
  and of **network-input** voxels;
* latency per batch: mean, p50, p90, p95, p99;
* peak device memory (CUDA) or the process's peak RSS (CPU);
* device load sampled during the timed passes (:mod:`blockpred.monitor`).
"""

from __future__ import annotations

import platform
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .geometry import Coord
from .monitor import DeviceMonitor
from .pipeline import Predictor


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
    with torch.inference_mode(), predictor.autocast():
        for _ in range(warmup):
            predictor.module(batch)
        if cuda:
            torch.cuda.synchronize(device)
        with DeviceMonitor(device) as monitor:
            for _ in range(iterations):
                start = time.perf_counter()
                predictor.module(batch)
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
    header = (f"{'precision':<9} {'batch':>5} {'out Mvox/s':>10} {'in Mvox/s':>10} {'mean ms':>9} {'p50':>8} "
              f"{'p90':>8} {'p95':>8} {'p99':>8} {'peak mem':>10} {'load':>14}")
    lines = [header]
    for r in results:
        d = r.as_dict()
        load = r.load.get("label", "")
        lines.append(
            f"{r.precision:<9} {r.batch_size:>5} {r.output_mvox_per_s:>10.2f} {r.input_mvox_per_s:>10.2f} "
            f"{d['mean_s'] * 1e3:>9.1f} {d['p50_s'] * 1e3:>8.1f} {d['p90_s'] * 1e3:>8.1f} {d['p95_s'] * 1e3:>8.1f} "
            f"{d['p99_s'] * 1e3:>8.1f} {r.peak_memory_bytes / 2**30:>8.2f}Gi {load:>14}"
        )
    return "\n".join(lines)


def run(*, model: str = "tiny", weights: str | None = None, block: Coord | None = None, halo: Coord | None = None,
        batch_sizes: tuple[int, ...] = (1,), precisions: tuple[str, ...] = ("fp32",), device: str = "auto",
        warmup: int = 2, iterations: int = 5, progress=None) -> list[ThroughputResult]:
    """Measure every batch size x precision; shapes from the options or the model's defaults."""
    from .models import load_model
    from .network import probe_network
    from .pipeline import resolve_device
    from .runner import DEFAULT_BLOCK, DEFAULT_HALO

    loaded = load_model(model, weights=weights)
    target = resolve_device(device)
    block = block or loaded.default_block or DEFAULT_BLOCK
    halo = halo if halo is not None else (loaded.default_halo if loaded.default_halo is not None else DEFAULT_HALO)
    in_channels = loaded.in_channels or 1
    results = []
    for precision in precisions:
        predictor = Predictor(loaded.module, target, precision)
        geometry = probe_network(predictor, in_channels=in_channels, block=block, halo=halo,
                                 downsampling=loaded.downsampling)
        for batch_size in batch_sizes:
            if progress is not None:
                progress(f"{loaded.name} {precision} batch {batch_size}: input {tuple(geometry.input_shape)}")
            results.append(measure(predictor, model_name=loaded.name, in_channels=in_channels, block=block,
                                   input_shape=geometry.input_shape, batch_size=batch_size, warmup=warmup,
                                   iterations=iterations))
    return results
