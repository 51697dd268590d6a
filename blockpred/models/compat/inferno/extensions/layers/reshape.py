"""``inferno.extensions.layers.reshape``: Concatenate."""

import torch
import torch.nn as nn

__all__ = ["Concatenate"]


class Concatenate(nn.Module):
    """Its inputs concatenated along ``dim`` (the channels by default)."""

    def __init__(self, dim=1):
        super().__init__()
        self.dim = dim

    def forward(self, *inputs):
        return torch.cat(inputs, dim=self.dim)
