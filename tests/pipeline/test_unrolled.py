"""A traced copy's norms (:mod:`blockpred.pipeline.unrolled`): instance norms in 2D and 3D and a group norm, as
OpenVINO runs them from the copy, at the shape the copy was traced at and at others, equal torch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from blockpred.pipeline.backends import openvino_available
from blockpred.pipeline.unrolled import unrolled_copy
from tests.ci import needs

pytestmark = needs(openvino_available(), "OpenVINO (a required dependency)")


class _Normed(nn.Module):
    """Convolutions, each followed by a norm of another kind, the input of two of them offset by 100 (its mean far
    from 0, as after a ReLU): a variance taken as E[x^2] - E[x]^2 put the output 0.012 off (the test allows 1e-5
    of its span).  TorchScript's norms slice a list of the input's sizes, which the interpreter runs on Python lists."""

    def __init__(self, dims: int):
        super().__init__()
        conv = nn.Conv3d if dims == 3 else nn.Conv2d
        instance = nn.InstanceNorm3d if dims == 3 else nn.InstanceNorm2d
        self.a, self.b, self.c = conv(1, 8, 3, padding=1), conv(8, 8, 3, padding=1), conv(8, 2, 1)
        self.instance = instance(8, affine=True)
        self.plain = instance(8)  # no affine: weight and bias are None
        self.group = nn.GroupNorm(2, 8)
        with torch.no_grad():
            for norm in (self.instance, self.group):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.instance(self.a(x))) + 100.0
        x = self.plain(self.b(x))
        return self.c(self.group(torch.relu(x) + 100.0))


@pytest.mark.parametrize("dims", [2, 3])
def test_a_traced_copys_norms_run_on_openvino_and_equal_torch_at_other_shapes(dims):
    import openvino as ov

    torch.manual_seed(0)
    net = torch.jit.script(_Normed(dims).eval())
    shapes = [(24, 40, 56), (16, 48, 32), (40, 24, 24)] if dims == 3 else [(96, 120), (64, 200), (150, 72)]
    example = torch.rand((1, 1) + shapes[0]) * 4
    copy = unrolled_copy(net, example)
    kinds = {node.kind() for node in copy.module.graph.nodes()}
    assert "aten::instance_norm" not in kinds and "aten::group_norm" not in kinds, kinds  # recorded as sums
    compiled = ov.Core().compile_model(ov.convert_model(copy.module, example_input=example), "CPU",
                                       {"INFERENCE_PRECISION_HINT": "f32"})
    for shape in shapes:
        x = torch.rand((2, 1) + shape, generator=torch.Generator().manual_seed(len(shape))) * 4
        with torch.no_grad():
            expected = net(x).numpy()
        got = compiled({0: x.numpy()})[0]
        assert got.shape == expected.shape
        span = float(np.ptp(expected))
        assert span > 0
        np.testing.assert_allclose(got, expected, atol=1e-5 * span, rtol=0)
