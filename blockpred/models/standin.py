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
* :func:`copy` -- :class:`CopyNetwork`: its input repeated to ``channels``
  channels, a view (no compute, no new memory); the storage limit's network.

Both load as ``package.module:factory`` models from the command line::

    blockpred run in.zarr out.zarr --model blockpred.models.standin:device --halo 8,16,16 --output-dtype uint8

(60 input Mvox/s; another rate through a config's ``model_kwargs: {rate_mvox_per_s: 120}``).
They have no halo of their own (a 1x1x1 field); name the halo the real network
would need, since it decides how much the host reads.
"""

from __future__ import annotations

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


def copy(channels: int = 3) -> CopyNetwork:
    """The copy network: its input repeated to ``channels`` channels (see :class:`CopyNetwork`)."""
    return CopyNetwork(channels)
