"""``inferno.extensions.layers.normalization``: BatchNormND (its torch layer is its attribute ``bn``)."""

import torch.nn as nn

__all__ = ["BatchNormND"]


class BatchNormND(nn.Module):
    def __init__(self, dim, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__()
        if dim not in (1, 2, 3):
            raise ValueError(f"BatchNormND: dim must be 1, 2 or 3, got {dim!r}")
        self.bn = getattr(nn, f"BatchNorm{dim}d")(num_features=num_features, eps=eps, momentum=momentum,
                                                  affine=affine, track_running_stats=track_running_stats)

    def forward(self, x):
        return self.bn(x)
