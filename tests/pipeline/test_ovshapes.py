"""A converted model compiled per input shape (:class:`blockpred.pipeline.ovshapes.StaticShapes`): the same output
as torch at each shape, in any order of shapes, and the dynamic model where a shape does not compile alone."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from blockpred.pipeline.backends import openvino_available
from blockpred.pipeline.ovshapes import StaticShapes
from tests.ci import needs

pytestmark = needs(openvino_available(), "OpenVINO (a required dependency)")

SHAPES = [(1, 1, 16, 24, 32), (2, 1, 24, 16, 16), (1, 1, 16, 24, 32)]


def _network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.InstanceNorm3d(4, affine=True), nn.ReLU(),
                         nn.MaxPool3d(2), nn.Upsample(scale_factor=2), nn.Conv3d(4, 2, 1)).eval()


def _dynamic_model(net: nn.Module):
    import openvino as ov

    return ov.convert_model(net, example_input=torch.rand(SHAPES[0]), input=[ov.PartialShape([-1, 1, -1, -1, -1])])


def _compile(model, log: list):
    import openvino as ov

    log.append([d.is_static for d in model.inputs[0].get_partial_shape()])
    return ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


def _same_as_torch(net, run) -> None:
    for shape in SHAPES:
        x = torch.rand(shape, generator=torch.Generator().manual_seed(sum(shape)))
        with torch.no_grad():
            expected = net(x).numpy()
        got = run(x.numpy())
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=1e-5 * float(np.ptp(expected)), rtol=0)


def test_each_shape_is_compiled_for_itself_and_computes_what_torch_does():
    net, compiled = _network(), []
    runner = StaticShapes(_dynamic_model(net), lambda model: _compile(model, compiled))
    _same_as_torch(net, runner)
    # One compile per change of shape, each for a static shape (the third shape is the first again: the last
    # shape only is kept).
    assert compiled == [[True] * 5] * 3, compiled
    assert runner.inference_precision == "f32"
    runner.release_memory()
    _same_as_torch(net, runner)  # after its buffers were handed back


def test_a_model_that_does_not_compile_for_one_shape_runs_dynamic_for_every_shape(caplog):
    net, compiled = _network(), []

    def refuse_static(model):
        if all(d.is_static for d in model.inputs[0].get_partial_shape()):
            raise RuntimeError("no static shapes here")
        return _compile(model, compiled)

    runner = StaticShapes(_dynamic_model(net), refuse_static)
    with caplog.at_level("INFO", logger="blockpred"):
        _same_as_torch(net, runner)
    # The dynamic model (its channels fixed), compiled once.
    assert compiled == [[False, True, False, False, False]], compiled
    assert [r.getMessage() for r in caplog.records if "does not compile" in r.getMessage()] == [(
        "OpenVINO: the model does not compile for input 1x1x16x24x32 alone (no static shapes here); it runs with "
        "its shapes dynamic")]


def test_the_first_call_at_a_shape_is_the_one_that_compiles():
    """Nothing is compiled before a batch comes (the check or a trial decides the first shape)."""
    compiled = []
    runner = StaticShapes(_dynamic_model(_network()), lambda model: _compile(model, compiled))
    assert compiled == [] and runner.inference_precision == ""
    runner(np.zeros((1, 1, 8, 8, 8), dtype=np.float32))
    assert compiled == [[True] * 5]
