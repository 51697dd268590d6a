"""``inferno.extensions.layers.activations``: SELU, as inferno computed it."""

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["SELU"]


class SELU(nn.Module):
    """scale * (x if x >= 0 else alpha * elu(x)), inferno's constants."""

    def forward(self, input):
        return self.selu(input)

    @staticmethod
    def selu(x):
        alpha = 1.6732632423543772848170429916717
        scale = 1.0507009873554804934193349852946
        return scale * torch.where(x >= 0, x, alpha * F.elu(x))
