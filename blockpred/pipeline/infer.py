"""The device side: a network on one device, fed float32 numpy batches.

On CUDA the batch goes through a pinned host buffer and a non-blocking copy on
a side stream, so the host-to-device copy does not serialise with other work
on the default stream; the result comes back through a pinned buffer too.  The
same code runs on the CPU, where those steps fall away.
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch

from ..errors import InvalidOptionError

logger = logging.getLogger(__name__)

_AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """``auto`` -> the first CUDA device if there is one, else the CPU; checks the rest."""
    name = str(name).strip().lower()
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InvalidOptionError(f"device must be cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidOptionError(f"device {name!r} asked for, but no CUDA device is available; use --device cpu")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise InvalidOptionError(
                f"device {name!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise InvalidOptionError(f"device must be cpu, cuda or cuda:N, got {name!r}")
    return device


class Predictor:
    """Runs ``module`` on ``device`` at ``precision`` over (B, C, Z, Y, X) float32 batches."""

    def __init__(self, module: torch.nn.Module, device: torch.device, precision: str = "fp32"):
        self.device = device
        self.precision = precision
        self.module = module.to(device).eval()
        #: Seconds the last call spent copying between host and device (0 on the CPU).
        self.last_transfer_s = 0.0
        self._cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if self._cuda else None
        if self._cuda:
            allow_tf32 = precision == "tf32"
            torch.backends.cuda.matmul.allow_tf32 = allow_tf32
            torch.backends.cudnn.allow_tf32 = allow_tf32

    def autocast(self):
        """The autocast context of this precision (a no-op for fp32 and tf32)."""
        dtype = _AUTOCAST_DTYPES.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        """The network's float32 output for a float32 batch (both numpy, on the host).

        ``last_transfer_s`` is then the time the host-device copies of this call
        took (pinning included; 0 on the CPU), measured with CUDA events, so
        timing adds no synchronisation.
        """
        with torch.inference_mode():
            host = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32))
            if not self._cuda:
                self.last_transfer_s = 0.0
                with self.autocast():
                    result = self.module(host)
                return _as_tensor(result).float().numpy()
            start = time.perf_counter()
            host = host.pin_memory()
            pin_s = time.perf_counter() - start
            events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            with torch.cuda.stream(self._copy_stream):
                events[0].record(self._copy_stream)
                on_device = host.to(self.device, non_blocking=True)
                events[1].record(self._copy_stream)
            compute_stream = torch.cuda.current_stream(self.device)
            compute_stream.wait_event(events[1])
            on_device.record_stream(compute_stream)  # allocated on the copy stream, used on this one
            with self.autocast():
                result = _as_tensor(self.module(on_device)).float()
            out = torch.empty(result.shape, dtype=torch.float32, pin_memory=True)
            events[2].record(compute_stream)
            out.copy_(result, non_blocking=True)
            events[3].record(compute_stream)
            compute_stream.synchronize()
            copies_ms = events[0].elapsed_time(events[1]) + events[2].elapsed_time(events[3])
            self.last_transfer_s = pin_s + copies_ms / 1e3
            return out.numpy()

    def output_shape(self, input_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Dry run on zeros of ``input_shape`` (B, C, Z, Y, X): the output's shape."""
        return tuple(self(np.zeros(input_shape, dtype=np.float32)).shape)


def _as_tensor(result) -> torch.Tensor:
    """Networks that return a tuple or list give their first output."""
    if isinstance(result, (tuple, list)):
        result = result[0]
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"the network returned {type(result).__name__}, expected a tensor")
    return result
