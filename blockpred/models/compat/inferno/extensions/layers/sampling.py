"""``inferno.extensions.layers.sampling``: Upsample (``F.interpolate`` as a layer, no weights)."""

import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Upsample"]


class Upsample(nn.Module):
    def __init__(self, size=None, scale_factor=None, mode="nearest", align_corners=None):
        super().__init__()
        self.size, self.scale_factor, self.mode, self.align_corners = size, scale_factor, mode, align_corners

    def forward(self, input):
        return F.interpolate(input, self.size, self.scale_factor, self.mode, self.align_corners)
