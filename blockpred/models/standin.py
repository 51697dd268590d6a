"""Stand-in networks for measuring the host path: a device of a given speed, and a copy.

A GPU session is rare; the host side (read, batch, hand over, write, mark
done) must be proven on any machine, through the real command.  These two
networks take the device's place:

* :func:`device` -- :class:`StandInDevice`: it sleeps as long as a device
  running at ``rate_mvox_per_s`` input megavoxels per second would take over
  the batch (input voxels of every block / rate), then returns its input's
  first channel(s) as a view.  ``time.sleep`` releases the GIL as a CUDA
  kernel does, so the host's threads run meanwhile as they would beside a GPU.
  ``--workers 2`` with two stand-ins plays two GPUs.
* :func:`gpu` -- :class:`StandInGpu`: the stand-in device with a GPU's kernel
  search.  While ``torch.backends.cudnn.benchmark`` is on, its first pass at
  each new input shape and precision takes ``search_s`` more (cuDNN trying its
  kernels), and a searched shape runs at the rate; an unsearched pass takes
  ``gain`` longer (cuDNN's heuristic kernels).  Each pass appends a line to
  ``log`` (a file, shared by every process that runs the network), so a test
  counts the passes and searches a run makes.
* :func:`copy` -- :class:`CopyNetwork`: its input repeated to ``channels``
  channels, a view (no compute, no new memory); the storage limit's network.

Both load as ``package.module:factory`` models from the command line::

    blockpred run in.zarr out.zarr --model blockpred.models.standin:device --halo 8,16,16 --output-dtype uint8

(60 input Mvox/s; another rate through a config's ``model_kwargs: {rate_mvox_per_s: 120}``).
They have no halo of their own (a 1x1x1 field); name the halo the real network
would need, since it decides how much the host reads.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

#: The stand-in device's rate when none is named: the issue's 60 input Mvox/s.
DEFAULT_RATE_MVOX_PER_S = 60.0


class StandInDevice(nn.Module):
    """Takes as long as a device at ``rate_mvox_per_s`` input Mvox/s would; returns ``channels`` input channels."""

    in_channels = 1
    default_halo = (0, 0, 0)

    def __init__(self, rate_mvox_per_s: float = DEFAULT_RATE_MVOX_PER_S, channels: int = 1):
        super().__init__()
        if not rate_mvox_per_s > 0:
            raise ValueError(f"rate_mvox_per_s must be > 0, got {rate_mvox_per_s!r}")
        if channels < 1:
            raise ValueError(f"channels must be >= 1, got {channels!r}")
        self.rate_mvox_per_s = float(rate_mvox_per_s)
        self.out_channels = int(channels)
        #: Seconds slept so far (all calls): what the device was busy for.
        self.busy_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seconds = x.shape[0] * x[0, 0].numel() / (self.rate_mvox_per_s * 1e6)
        time.sleep(seconds)
        self.busy_s += seconds
        return x[:, :1].expand(-1, self.out_channels, -1, -1, -1)


#: The stand-in GPU's search when none is named: cremi2018's at bf16 on an H200 (17.5 s, 2026-11-27), scaled
#: to a test's seconds; and the share an unsearched pass took longer there (0.207 s against 0.190 s).
DEFAULT_SEARCH_S = 1.0
DEFAULT_GAIN = 0.08


class StandInGpu(StandInDevice):
    """:class:`StandInDevice` with a GPU's kernel search (see the module docstring).

    ``receptive_radius``: the field it states (z, y, x), so runs choose a halo as for a real U-Net (no field
    is measured for a network that states it).  The log's lines: ``pid shape precision searched|heuristic``,
    with ``search`` for a pass that searched first.
    """

    #: It plays a GPU's kernel search (:func:`blockpred.tuning.search.searches_kernels`); its log is a side effect
    #: no converted copy would keep (:func:`blockpred.run.formats.wants_backend`).
    plays_kernel_search = True
    torch_only = True

    def __init__(self, rate_mvox_per_s: float = DEFAULT_RATE_MVOX_PER_S, channels: int = 1,
                 search_s: float = DEFAULT_SEARCH_S, gain: float = DEFAULT_GAIN, log: str | None = None,
                 receptive_radius: tuple[int, int, int] | None = None):
        super().__init__(rate_mvox_per_s, channels)
        if search_s < 0 or gain < 0:
            raise ValueError(f"search_s and gain must be >= 0, got {search_s!r} and {gain!r}")
        self.search_s, self.gain, self.log = float(search_s), float(gain), log
        if receptive_radius is not None:
            self.receptive_radius = tuple(int(r) for r in receptive_radius)
            self.default_halo = None  # the halo comes from the field, as for a U-Net that states it
        #: (shape, precision) searched in this process, as cuDNN keeps them.
        self.searched: set[tuple] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        precision = str(torch.get_autocast_dtype(x.device.type)).removeprefix("torch.") \
            if torch.is_autocast_enabled(x.device.type) else "float32"
        key, searching = (tuple(x.shape), precision), torch.backends.cudnn.benchmark
        search = searching and key not in self.searched
        if search:
            time.sleep(self.search_s)
            self.searched.add(key)
        seconds = x.shape[0] * x[0, 0].numel() / (self.rate_mvox_per_s * 1e6)
        seconds *= 1.0 if searching else 1.0 + self.gain
        time.sleep(seconds)
        self.busy_s += seconds
        if self.log is not None:
            with open(self.log, "a") as log:  # one short line per append: lines of several processes stay whole
                log.write(f"{os.getpid()} {'x'.join(map(str, x.shape))} {precision} "
                          f"{'search' if search else 'searched' if searching else 'heuristic'}\n")
        return x[:, :1].expand(-1, self.out_channels, -1, -1, -1)


class CopyNetwork(nn.Module):
    """Its input repeated to ``channels`` channels (a view: no compute, no new memory)."""

    in_channels = 1
    default_halo = (0, 0, 0)

    def __init__(self, channels: int = 3):
        super().__init__()
        if channels < 1:
            raise ValueError(f"channels must be >= 1, got {channels!r}")
        self.out_channels = int(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :1].expand(-1, self.out_channels, -1, -1, -1)


def device(rate_mvox_per_s: float = DEFAULT_RATE_MVOX_PER_S, channels: int = 1) -> StandInDevice:
    """A stand-in device at ``rate_mvox_per_s`` input Mvox/s (see :class:`StandInDevice`)."""
    return StandInDevice(rate_mvox_per_s, channels)


def gpu(rate_mvox_per_s: float = DEFAULT_RATE_MVOX_PER_S, channels: int = 1, search_s: float = DEFAULT_SEARCH_S,
        gain: float = DEFAULT_GAIN, log: str | None = None,
        receptive_radius: tuple[int, int, int] | None = None) -> StandInGpu:
    """A stand-in GPU, kernel search included (see :class:`StandInGpu`)."""
    return StandInGpu(rate_mvox_per_s, channels, search_s, gain, log, receptive_radius)


def copy(channels: int = 3) -> CopyNetwork:
    """The copy network: its input repeated to ``channels`` channels (see :class:`CopyNetwork`)."""
    return CopyNetwork(channels)
