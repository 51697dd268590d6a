"""Small networks for tests, importable by dask worker processes as ``tests.networks:<factory>``."""

import multiprocessing
import os
import signal
import time
import zlib

import torch

from blockpred.models import build_preset
from blockpred.models.presets import TINY


class Logged(torch.nn.Module):
    """The tiny preset, appending a line per input block (its checksum) to a file at each forward pass.

    ``delay_s`` slows each pass down so a test can act mid-run; with ``delay_while`` only while that file
    exists (a test removes it so that the same command, run again, is quick).
    """

    def __init__(self, log_path: str, delay_s: float = 0.0, default_block: int | None = None,
                 delay_while: str | None = None):
        super().__init__()
        self.delay_while = delay_while
        self.net = build_preset("tiny")
        self.log_path, self.delay_s = log_path, delay_s
        self.in_channels, self.out_channels = 1, 2
        self.downsampling = self.net.downsampling
        self.receptive_radius = TINY.receptive_radius  # stated: never measured on random input
        self.torch_only = True  # its forward has side effects the tests count: never converted
        if default_block is not None:
            self.default_block = (default_block,) * 3

    def forward(self, x):
        if self.delay_s and (self.delay_while is None or os.path.exists(self.delay_while)):
            time.sleep(self.delay_s)
        # All-zero inputs are the dry runs, not blocks: not logged.
        lines = "".join(f"{zlib.crc32(x[i].numpy().tobytes()):08x}\n" for i in range(x.shape[0]) if x[i].any())
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)
        return self.net(x)


class FailsOnMarker(torch.nn.Module):
    """x / 2, but raises while ``fault_file`` exists and the input holds the value 1.0 (uint8 255)."""

    def __init__(self, fault_file: str):
        super().__init__()
        self.fault_file = fault_file
        self.in_channels = self.out_channels = 1
        # Its fault is a side effect a trace cannot see: never converted (with auto, OpenVINO against torch was
        # measured, and where it won on a loaded machine the converted network neither raised nor killed).
        self.torch_only = True

    def forward(self, x):
        if os.path.exists(self.fault_file) and bool((x == 1.0).any()):
            raise RuntimeError("marker voxel seen")
        return x * 0.5


class ShapesLogged(Logged):
    """The tiny preset, appending each pass's input shape (``1x1x84x84x84``), dry runs included, to a file."""

    def forward(self, x):
        if self.delay_s:
            time.sleep(self.delay_s)
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, ("x".join(map(str, x.shape)) + "\n").encode())
        finally:
            os.close(fd)
        return self.net(x)


def shapes_logged(log_path: str, delay_s: float = 0.0) -> ShapesLogged:
    return ShapesLogged(log_path, delay_s)


def logged(log_path: str, delay_s: float = 0.0, default_block: int | None = None,
           delay_while: str | None = None) -> Logged:
    return Logged(log_path, delay_s, default_block, delay_while)


def fails_on_marker(fault_file: str) -> FailsOnMarker:
    return FailsOnMarker(fault_file)


class MemoryLimited(torch.nn.Module):
    """The tiny preset on a device with an injected memory budget.

    A forward pass over more than ``budget_voxels`` input voxels (batch x
    spatial, all channels) raises :class:`torch.OutOfMemoryError`, as CUDA's
    allocator would.  ``spare_zeros``: all-zero inputs (dry runs) always fit,
    so a run can plan a block that then does not fit with real data.
    ``transient``: only the first ``transient`` passes over the budget fail
    (a fragmented device), the rest succeed.  ``valid``: a valid-convolution
    U-Net instead of the tiny preset.
    """

    def __init__(self, budget_voxels: int, spare_zeros: bool = False, transient: int | None = None,
                 valid: bool = False):
        super().__init__()
        self.net = build_preset("tiny") if not valid else _valid_unet()
        if valid:
            self.padding, self.valid_input_shape = "valid", self.net.valid_input_shape
        self.budget_voxels, self.spare_zeros, self.transient = budget_voxels, spare_zeros, transient
        self.in_channels, self.out_channels = 1, 2
        self.downsampling = self.net.downsampling
        self.receptive_radius = TINY.receptive_radius  # stated: never measured on random input
        self.torch_only = True  # its forward has side effects the tests count: never converted
        self.refusals = self.passes = 0

    def forward(self, x):
        self.passes += 1
        over = x.numel() > self.budget_voxels and not (self.spare_zeros and not bool(x.any()))
        if over and (self.transient is None or self.refusals < self.transient):
            self.refusals += 1
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {x.numel() * 4} bytes (injected budget {self.budget_voxels})"
            )
        return self.net(x)


def _valid_unet():
    from blockpred.models.unet import UNet3d

    torch.manual_seed(0)
    return UNet3d(in_channels=1, out_channels=2, depth=1, initial_features=4, growth=2, pool_factors=2,
                  padding="valid", activation="relu", final_activation="sigmoid").eval()


def memory_limited(budget_voxels: int, spare_zeros: bool = False, transient: int | None = None,
                   valid: bool = False) -> MemoryLimited:
    return MemoryLimited(int(budget_voxels), bool(spare_zeros), transient, bool(valid))


class Uneven(torch.nn.Module):
    """The tiny preset, slow on one worker: the first process to predict a block sleeps ``delay_s`` per pass.

    Which process is slow is claimed with ``claim_file`` (created exclusively);
    the client's dry runs (all-zero inputs) claim nothing.
    """

    def __init__(self, claim_file: str, delay_s: float):
        super().__init__()
        self.net = build_preset("tiny")
        self.claim_file, self.delay_s = claim_file, delay_s
        self.in_channels, self.out_channels = 1, 2
        self.downsampling = self.net.downsampling
        self.receptive_radius = TINY.receptive_radius  # stated: never measured on random input
        self.torch_only = True  # its forward has side effects the tests count: never converted
        self.slow = None

    def forward(self, x):
        if self.slow is None and x.any():
            try:
                os.close(os.open(self.claim_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                self.slow = True
            except FileExistsError:
                self.slow = False
        if self.slow:
            time.sleep(self.delay_s)
        return self.net(x)


class Gated(torch.nn.Module):
    """The tiny preset that holds every real block (with ``every_pass``, every pass: the dry run's too) while
    ``gate_file`` exists (a test opens the gate); creates ``held_file`` (where given) when it holds one."""

    def __init__(self, gate_file: str, delay_s: float = 0.0, held_file: str | None = None, every_pass: bool = False):
        super().__init__()
        self.net = build_preset("tiny")
        self.gate_file, self.delay_s, self.held_file, self.every_pass = gate_file, delay_s, held_file, every_pass
        self.in_channels, self.out_channels = 1, 2
        self.downsampling = self.net.downsampling
        self.receptive_radius = TINY.receptive_radius  # stated: never measured on random input
        self.torch_only = True  # its forward has side effects the tests count: never converted

    def forward(self, x):
        if self.every_pass or x.any():
            if self.held_file is not None and os.path.exists(self.gate_file):
                open(self.held_file, "a").close()
            while os.path.exists(self.gate_file):
                time.sleep(0.02)
            time.sleep(self.delay_s)
        return self.net(x)


def uneven(claim_file: str, delay_s: float) -> Uneven:
    return Uneven(claim_file, delay_s)


def gated(gate_file: str, delay_s: float = 0.0, held_file: str | None = None, every_pass: bool = False) -> Gated:
    return Gated(gate_file, delay_s, held_file, every_pass)


class PidLogged(torch.nn.Module):
    """The tiny preset, appending the id of the process that runs each real block to a file."""

    def __init__(self, log_path: str):
        super().__init__()
        self.net = build_preset("tiny")
        self.log_path = log_path
        self.in_channels, self.out_channels = 1, 2
        self.downsampling = self.net.downsampling
        self.receptive_radius = TINY.receptive_radius  # stated: never measured on random input
        self.torch_only = True  # its forward has side effects the tests count: never converted

    def forward(self, x):
        if x.any():
            with open(self.log_path, "a") as log:
                log.write(f"{os.getpid()}\n")
        return self.net(x)


def pid_logged(log_path: str) -> PidLogged:
    return PidLogged(log_path)


class Passthrough(torch.nn.Module):
    """A 'same' network of one channel that copies its input: NaN and inf come out where they went in."""

    def __init__(self):
        super().__init__()
        self.in_channels = self.out_channels = 1

    def forward(self, x):
        return x.clone()


def passthrough() -> Passthrough:
    return Passthrough()


class KillsOnMarker(FailsOnMarker):
    """x / 2, but SIGKILLs its own process (as the OOM killer would) on the marker value while ``fault_file`` exists."""

    def forward(self, x):
        if os.path.exists(self.fault_file) and bool((x == 1.0).any()):
            os.kill(os.getpid(), signal.SIGKILL)
        return x * 0.5


def kills_on_marker(fault_file: str) -> KillsOnMarker:
    return KillsOnMarker(fault_file)


class SlowToLoad(torch.nn.Module):
    """The tiny preset, slow to build in a worker process: it leaves ``<claim_dir>/<pid>``, then sleeps ``delay_s``
    and waits while the file ``hold_while`` exists (if one is named; at most 120 s).

    A test kills the worker while the run's plugin loads the network on it
    (held there until the test removes ``hold_while``: the other workers,
    and the one started again, then go on at once).
    The client (not a multiprocessing child) builds it at once.
    """

    def __init__(self, claim_dir: str, delay_s: float = 0.0, hold_while: str | None = None):
        super().__init__()
        if multiprocessing.parent_process() is not None:
            open(os.path.join(claim_dir, str(os.getpid())), "w").close()
            time.sleep(delay_s)
            deadline = time.monotonic() + 120
            while hold_while is not None and os.path.exists(hold_while) and time.monotonic() < deadline:
                time.sleep(0.02)
        self.net = build_preset("tiny")
        self.in_channels, self.out_channels = 1, 2
        self.downsampling = self.net.downsampling
        self.receptive_radius = TINY.receptive_radius  # stated: never measured on random input
        self.torch_only = True  # its forward has side effects the tests count: never converted

    def forward(self, x):
        return self.net(x)


def slow_to_load(claim_dir: str, delay_s: float = 0.0, hold_while: str | None = None) -> SlowToLoad:
    return SlowToLoad(claim_dir, delay_s, hold_while)


class Cancelling(torch.nn.Module):
    """A 'same' network of one channel that adds 1000 in one convolution and takes it away in the next:
    the identity at fp32, nearly nothing at bf16 (whose spacing at 1000 is 4), a network whose numbers
    do not survive a low precision."""

    def __init__(self):
        super().__init__()
        self.in_channels = self.out_channels = 1
        self.up, self.down = torch.nn.Conv3d(1, 1, 1), torch.nn.Conv3d(1, 1, 1)
        with torch.no_grad():
            self.up.weight.fill_(1.0), self.up.bias.fill_(1000.0)
            self.down.weight.fill_(1.0), self.down.bias.fill_(-1000.0)

    def forward(self, x):
        return self.down(self.up(x))


def cancelling() -> Cancelling:
    return Cancelling()


class Smooth(torch.nn.Module):
    """A 'same' network of two channels, a 3x3x3 convolution with seeded weights and a sigmoid: numbers
    a low precision keeps (bf16 differs from fp32 by well under a percent)."""

    def __init__(self):
        super().__init__()
        self.in_channels, self.out_channels = 1, 2
        self.conv = torch.nn.Conv3d(1, 2, 3, padding=1)
        seeded = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(self.conv.weight.shape, generator=seeded) / 5)
            self.conv.bias.copy_(torch.randn(self.conv.bias.shape, generator=seeded) / 5)

    def forward(self, x):
        return torch.sigmoid(self.conv(x))


def smooth() -> Smooth:
    return Smooth()


class LosesTheDevice(torch.nn.Module):
    """Fails every block (not the all-zero dry runs) as CUDA fails after an illegal memory access, logging each call.
    It states its field (pointwise): a field measured in the run would make its dry run one of random data."""

    def __init__(self, log_path: str):
        super().__init__()
        self.log_path = log_path
        self.in_channels = self.out_channels = 1
        self.torch_only = True
        self.receptive_radius, self.downsampling = (0, 0, 0), (1, 1, 1)

    def forward(self, x):
        if not bool(x.any()):
            return x * 0.5
        with open(self.log_path, "a") as log:
            log.write("call\n")
        raise RuntimeError(  # torch's text, as an H200 printed it (2026-11-26)
            "CUDA error: an illegal memory access was encountered\n"
            "Search for `cudaErrorIllegalAddress' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
            "group__CUDART__TYPES.html for more information.\n"
            "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
            "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1")


def loses_the_device(log_path: str) -> LosesTheDevice:
    return LosesTheDevice(log_path)


class Deprecated(torch.nn.Module):
    """The tiny preset through a deprecated torch call (``nn.functional.upsample`` by 1): torch's own UserWarning at
    each forward pass, as a user's network may give."""

    def __init__(self):
        super().__init__()
        self.net = build_preset("tiny")
        self.in_channels, self.out_channels = 1, 2
        self.downsampling = self.net.downsampling
        self.receptive_radius = TINY.receptive_radius

    def forward(self, x):
        return self.net(torch.nn.functional.upsample(x, scale_factor=1))


def deprecated() -> Deprecated:
    return Deprecated()
