"""Networks written the way published ones are, for the real-data tests (``tests.realnets:<factory>``).

None of them is blockpred's: each is shaped after an architecture users bring, with the habits of its
field (residual blocks, batch norm, anisotropic pooling for serial-section EM, lists of outputs, valid
convolutions, transposed convolutions, padded pooling), so blockpred must find its geometry itself.
"""

import textwrap
from pathlib import Path

import torch
from torch import nn

#: What inferno's two 2D layers are (a 'same'-padded Conv2d, with and without ELU): inferno's last release does not
#: install on Python 3, so a user (and the tests) provide the names a model file imports (see
#: ../shared/realdata/README.md).
INFERNO_LAYERS_2D = """
    import torch.nn as nn

    class _ConvActivation(nn.Module):
        def __init__(self, in_channels, out_channels, kernel_size, activation):
            super().__init__()
            self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2)
            self.activation = activation

        def forward(self, x):
            x = self.conv(x)
            return x if self.activation is None else self.activation(x)

    class ConvELU2D(_ConvActivation):
        def __init__(self, in_channels, out_channels, kernel_size):
            super().__init__(in_channels, out_channels, kernel_size, nn.ELU())

    class Conv2D(_ConvActivation):
        def __init__(self, in_channels, out_channels, kernel_size):
            super().__init__(in_channels, out_channels, kernel_size, None)
"""


def write_inferno_layers(root: Path) -> Path:
    """A package ``inferno`` below ``root`` providing ``inferno.extensions.layers.convolutional``'s two 2D layers;
    returns ``root`` (to put on the path)."""
    layers = root / "inferno" / "extensions" / "layers"
    layers.mkdir(parents=True)
    for folder in (root / "inferno", root / "inferno" / "extensions", layers):
        (folder / "__init__.py").write_text("")
    (layers / "convolutional.py").write_text(textwrap.dedent(INFERNO_LAYERS_2D))
    return root


class ResBlock(nn.Module):
    """conv-BN-ELU twice with a skip, anisotropic kernels as serial-section EM networks use (1x3x3 then 3x3x3)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.project = nn.Conv3d(in_channels, out_channels, 1)
        self.conv1 = nn.Conv3d(out_channels, out_channels, (1, 3, 3), padding=(0, 1, 1))
        self.bn1 = nn.BatchNorm3d(out_channels)
        self.conv2 = nn.Conv3d(out_channels, out_channels, 3, padding=1)
        self.bn2 = nn.BatchNorm3d(out_channels)
        self.act = nn.ELU()

    def forward(self, x):
        x = self.project(x)
        y = self.act(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.act(x + y)


class SynapseUNet(nn.Module):
    """A residual 3D U-Net for synapse detection in serial-section EM: max pooling (1, 2, 2) twice, nearest
    upsampling, and a list of outputs (the prediction, and the bottleneck features a user's training used)."""

    def __init__(self, in_channels: int = 1, out_channels: int = 1, width: int = 4):
        super().__init__()
        self.enc0 = ResBlock(in_channels, width)
        self.enc1 = ResBlock(width, 2 * width)
        self.bottom = ResBlock(2 * width, 4 * width)
        self.dec1 = ResBlock(6 * width, 2 * width)
        self.dec0 = ResBlock(3 * width, width)
        self.pool = nn.MaxPool3d((1, 2, 2))
        self.up = nn.Upsample(scale_factor=(1, 2, 2), mode="nearest")
        self.head = nn.Conv3d(width, out_channels, 1)

    def forward(self, x):
        e0 = self.enc0(x)
        e1 = self.enc1(self.pool(e0))
        b = self.bottom(self.pool(e1))
        d1 = self.dec1(torch.cat([self.up(b), e1], 1))
        d0 = self.dec0(torch.cat([self.up(d1), e0], 1))
        return [torch.sigmoid(self.head(d0)), b]


class FirstOutput(nn.Module):
    """What a user writes around a network that returns a list: its first output."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)[0]


def synapse_unet(width: int = 4) -> nn.Module:
    """The user's factory: the network, wrapped to return its prediction (a state dict loads into it)."""
    return FirstOutput(SynapseUNet(1, 1, width))


class ValidUNet(nn.Module):
    """A funlib/gunpowder-style U-Net: valid 3x3x3 convolutions, max pooling 2, transposed-convolution
    upsampling, skips cropped to the upsampled size; the output is smaller than the input."""

    def __init__(self, width: int = 2):
        super().__init__()

        def convs(i, o):
            return nn.Sequential(nn.Conv3d(i, o, 3), nn.ReLU(), nn.Conv3d(o, o, 3), nn.ReLU())

        self.down = convs(1, width)
        self.bottom = convs(width, 2 * width)
        self.up = nn.ConvTranspose3d(2 * width, width, 2, stride=2)
        self.out = nn.Sequential(convs(2 * width, width), nn.Conv3d(width, 1, 1))
        self.pool = nn.MaxPool3d(2)

    def forward(self, x):
        d = self.down(x)
        u = self.up(self.bottom(self.pool(d)))
        crop = [(a - b) // 2 for a, b in zip(d.shape[2:], u.shape[2:])]
        d = d[(...,) + tuple(slice(c, c + s) for c, s in zip(crop, u.shape[2:]))]
        return self.out(torch.cat([d, u], 1))


def valid_unet() -> nn.Module:
    return ValidUNet()


class PaddedPoolNet(nn.Module):
    """Pooling with padding (kernel 3, stride 2, padding 1, as DeepLab-style and the CREMI DUNet pool), a
    transposed convolution back, and channels last in its own output: a (b, z, y, x, c) tensor the user's
    wrapper moves back."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv3d(1, 3, 3, padding=1), nn.ELU())
        self.pool = nn.MaxPool3d(3, stride=2, padding=1)
        self.mid = nn.Sequential(nn.Conv3d(3, 3, 3, padding=1), nn.ELU())
        self.up = nn.ConvTranspose3d(3, 3, 2, stride=2)
        self.head = nn.Conv3d(6, 2, 1)

    def forward(self, x):
        e = self.enc(x)
        y = self.head(torch.cat([e, self.up(self.mid(self.pool(e)))], 1))
        return y.permute(0, 2, 3, 4, 1)  # channels last, as some TensorFlow ports return


class ChannelsBack(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x).permute(0, 4, 1, 2, 3)


def padded_pool_net() -> nn.Module:
    return ChannelsBack(PaddedPoolNet())


class PadsOddSizes(nn.Module):
    """Pools by 4 but takes any size: pads its input up to a multiple of 4 and crops the output back, as MONAI's
    BasicUNet and many user networks do.  Its sizes say step 1; only its layers say 4."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.ReLU())
        self.pool = nn.MaxPool3d(4)
        self.mid = nn.Conv3d(2, 2, 3, padding=1)
        self.up = nn.Upsample(scale_factor=4, mode="nearest")
        self.head = nn.Conv3d(4, 1, 1)

    def forward(self, x):  # as torch.jit.script takes it too
        z, y, w = x.shape[2], x.shape[3], x.shape[4]
        x = nn.functional.pad(x, [0, (-w) % 4, 0, (-y) % 4, 0, (-z) % 4])
        e = self.conv(x)
        out = self.head(torch.cat([e, self.up(self.mid(self.pool(e)))], 1))
        return out[:, :, :z, :y, :w]


def pads_odd_sizes() -> nn.Module:
    return PadsOddSizes()


class RefusesLargeBlocks(nn.Module):
    """A 'same' 3x3x3 convolution that raises (not out of memory) on real data wider than ``max_side`` voxels in
    y or x: a shape check a network of the field does in its forward.  Dry runs on zeros pass at any size."""

    def __init__(self, max_side: int = 40):
        super().__init__()
        self.conv = nn.Conv3d(1, 1, 3, padding=1)
        self.max_side = max_side

    def forward(self, x):
        if bool(x.any()) and max(x.shape[3:]) > self.max_side:
            raise ValueError(f"this network takes at most {self.max_side} voxels in y and x, got {tuple(x.shape)}")
        return torch.sigmoid(self.conv(x))


def refuses_large_blocks(max_side: int = 40) -> nn.Module:
    return RefusesLargeBlocks(max_side)


class TransposedNet2d(nn.Module):
    """A small 2D U-Net that upsamples by a transposed convolution (as many published 2D networks do):
    (b, 1, y, x) -> (b, 2, y, x), one pooling, a skip connection."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(1, 4, 3, padding=1)
        self.pool = nn.AvgPool2d(2)
        self.mid = nn.Conv2d(4, 4, 3, padding=1)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.out = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x):
        skip = torch.relu(self.down(x))
        return self.out(torch.cat([skip, self.up(torch.relu(self.mid(self.pool(skip))))], dim=1))


def transposed_net2d() -> nn.Module:
    torch.manual_seed(0)
    return TransposedNet2d().eval()
