"""Sampling device load while a benchmark runs.

On CUDA, NVML (``pynvml`` from nvidia-ml-py) is asked for utilisation, memory
and power of the GPU actually used, found by its UUID (NVML ignores
``CUDA_VISIBLE_DEVICES``, so indices would name the wrong GPU).  On the CPU the
process's CPU utilisation is sampled instead (psutil), and the report says so.
"""

from __future__ import annotations

import logging
import statistics
import threading

import torch

logger = logging.getLogger(__name__)


class DeviceMonitor:
    """A context manager that samples every ``interval_s`` in a thread; :meth:`summary` gives mean and max."""

    def __init__(self, device: torch.device, interval_s: float = 0.05):
        self.device, self.interval_s = device, interval_s
        self._samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sample = self._cpu_sampler() if device.type != "cuda" else self._gpu_sampler()

    def _cpu_sampler(self):
        import psutil

        process = psutil.Process()
        process.cpu_percent(None)
        self.kind = "cpu"
        return lambda: {"cpu_percent": process.cpu_percent(None)}

    def _gpu_sampler(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except Exception as err:  # noqa: BLE001 - monitoring must never stop a benchmark
            logger.warning("GPU monitoring unavailable: %s", err)
            self.kind = "none"
            return None
        self.kind = "gpu"

        def sample():
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return {"gpu_percent": float(util.gpu), "memory_used_bytes": float(memory.used),
                    "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0}

        return sample

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self._samples.append(self._sample())

    def __enter__(self):
        if self._sample is not None:
            self._thread = threading.Thread(target=self._run, name="blockpred-monitor", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._sample is not None:
            self._samples.append(self._sample())

    def summary(self) -> dict:
        """``{"kind", "<metric>_mean", "<metric>_max", "label"}``; the label is what the table prints."""
        out: dict = {"kind": self.kind, "samples": len(self._samples)}
        for key in self._samples[0] if self._samples else []:
            values = [s[key] for s in self._samples]
            out[f"{key}_mean"], out[f"{key}_max"] = statistics.fmean(values), max(values)
        if self.kind == "gpu":
            out["label"] = f"GPU {out['gpu_percent_mean']:.0f}% mean"
        elif self.kind == "cpu":
            out["label"] = f"CPU {out['cpu_percent_mean']:.0f}% (no GPU)"
        else:
            out["label"] = "not sampled"
        return out
