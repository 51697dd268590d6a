"""load_model: presets, TorchScript, factories, state dicts, (trusted) pickles and bad input."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from blockpred.errors import InputNotFoundError, InvalidOptionError, ModelLoadError, UntrustedPickleError
from blockpred.geometry import Coord
from blockpred.models.inferno import InfernoUNet
from blockpred.models.loading import file_sha256, load_model, state_dict_sha256
from blockpred.models.presets import PRESETS, build_preset
from blockpred.models.unet import UNet3d
from tests.ci import missing, needs
from tests.helpers import child_env

DATA = Path(__file__).parent / "data"
REGRESSION = DATA / "inferno_unet_regression.pt"


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module(x)


# ---------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_preset_loads_with_its_defaults_and_a_stable_fingerprint(name):
    loaded = load_model(name)
    preset = PRESETS[name]
    assert (loaded.name, loaded.kind, loaded.padding) == (name, "preset", "same")
    assert loaded.in_channels == preset.unet_kwargs["in_channels"]
    assert loaded.out_channels == preset.unet_kwargs["out_channels"]
    assert loaded.downsampling == loaded.module.downsampling
    assert (loaded.default_block, loaded.default_halo) == (preset.default_block, preset.default_halo)
    assert not loaded.module.training
    assert loaded.weights_sha256 == state_dict_sha256(loaded.module.state_dict())
    if name == "tiny":  # a second build gives the same fingerprint (cremi2018 takes seconds)
        assert load_model(name).weights_sha256 == loaded.weights_sha256


def test_preset_with_weights_loads_them_strictly(tmp_path):
    trained = build_preset("tiny")
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)
    weights = tmp_path / "tiny.pt"
    torch.save(trained.state_dict(), weights)
    loaded = load_model("tiny", weights=str(weights))
    assert same_weights(loaded.module, trained)
    assert loaded.weights_sha256 == file_sha256(weights)
    assert loaded.weights_sha256 != load_model("tiny").weights_sha256


def test_preset_weights_of_another_architecture_are_refused(tmp_path):
    weights = tmp_path / "other.pt"
    torch.save(UNet3d(in_channels=1, out_channels=2, depth=1, initial_features=8).state_dict(), weights)
    with pytest.raises(ModelLoadError, match="does not fit preset 'tiny'.*size mismatch"):
        load_model("tiny", weights=str(weights))


def test_missing_weights_file_is_input_not_found(tmp_path):
    with pytest.raises(InputNotFoundError, match="weights file .*nope.pt"):
        load_model("tiny", weights=str(tmp_path / "nope.pt"))


def test_model_kwargs_do_not_apply_to_presets():
    with pytest.raises(InvalidOptionError, match="model_kwargs apply to factories"):
        load_model("tiny", model_kwargs={"depth": 2})


# ---------------------------------------------------------------------- TorchScript


@pytest.mark.filterwarnings("ignore:`torch.jit")
def test_torchscript_archive_loads_with_its_attributes(tmp_path):
    net = UNet3d(in_channels=1, out_channels=3, depth=1, initial_features=2, pool_factors=(1, 2, 2))
    path = tmp_path / "net.ts"
    torch.jit.save(torch.jit.script(net), str(path))
    loaded = load_model(str(path))
    assert loaded.kind == "torchscript"
    assert (loaded.in_channels, loaded.out_channels, loaded.downsampling, loaded.padding) == (1, 3, Coord((1, 2, 2)), "same")
    assert loaded.weights_sha256 == file_sha256(path)
    x = torch.rand(1, 1, 3, 8, 8)
    torch.testing.assert_close(run(loaded.module, x), run(net.eval(), x))


# ---------------------------------------------------------------------- factories


@pytest.fixture
def factory_package(tmp_path, monkeypatch):
    package = tmp_path / "src" / "mynets"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "factory.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def make(channels=1, width=2):
            torch.manual_seed(0)
            return nn.Sequential(nn.Conv3d(channels, width, 3, padding=1), nn.ReLU(), nn.Conv3d(width, 1, 1))

        def not_a_module():
            return 42

        def broken():
            raise RuntimeError("out of ideas")
    """))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    return package


def test_factory_is_called_with_model_kwargs_and_loads_weights_strictly(factory_package, tmp_path):
    from mynets.factory import make

    trained = make(channels=2, width=3)
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(-1)
    weights = tmp_path / "w.pt"
    torch.save({"model_state_dict": trained.state_dict()}, weights)
    loaded = load_model("mynets.factory:make", weights=str(weights), model_kwargs={"channels": 2, "width": 3})
    assert (loaded.kind, loaded.name) == ("factory", "mynets.factory:make")
    assert same_weights(loaded.module, trained)
    assert loaded.weights_sha256 == file_sha256(weights)
    assert (loaded.in_channels, loaded.downsampling, loaded.padding, loaded.default_block) == (None, Coord((1, 1, 1)), None, None)


def test_factory_without_weights_keeps_its_own(factory_package):
    loaded = load_model("mynets.factory:make")
    assert loaded.weights_sha256 == state_dict_sha256(loaded.module.state_dict())
    assert not loaded.module.training


@pytest.mark.parametrize(
    "spec, kwargs, message",
    [
        pytest.param("nosuchpkg.nets:make", {}, "needs module 'nosuchpkg.nets', which cannot be imported", id="import"),
        pytest.param("mynets.factory:missing", {}, "has no attribute 'missing'", id="attribute"),
        pytest.param("mynets.factory:not_a_module", {}, "must return a torch.nn.Module, returned int", id="not-module"),
        pytest.param("mynets.factory:broken", {}, "failed .*RuntimeError: out of ideas", id="raises"),
        pytest.param("mynets.factory:make", {"depth": 3}, "failed with model_kwargs .*TypeError", id="bad-kwargs"),
    ],
)
def test_bad_factories_raise_model_load_error_naming_the_problem(factory_package, spec, kwargs, message):
    with pytest.raises(ModelLoadError, match=message):
        load_model(spec, model_kwargs=kwargs)


# ---------------------------------------------------------------------- state dicts


def test_inferno_state_dict_loads_with_the_architecture_read_from_its_shapes(tmp_path):
    torch.manual_seed(0)
    net = InfernoUNet(2, 3, depth=2, initial_features=3, gain=3).eval()
    path = tmp_path / "best.pytorch"
    torch.save(net.state_dict(), path)
    loaded = load_model(str(path))
    assert loaded.kind == "inferno-state-dict"
    assert isinstance(loaded.module, InfernoUNet)
    m = loaded.module
    assert (m.in_channels, m.out_channels, m.depth, m.initial_features, m.gain) == (2, 3, 2, 3, 3)
    assert (loaded.downsampling, loaded.padding) == (Coord((4, 4, 4)), "same")
    x = torch.rand(1, 2, 4, 8, 8)
    torch.testing.assert_close(run(loaded.module, x), run(net, x))


@needs(REGRESSION.exists(), f"the inferno regression fixture {REGRESSION.name} (tests/models/data)")
def test_real_inferno_weights_need_the_output_activation_named_and_then_match_inferno(tmp_path):
    fixture = torch.load(REGRESSION, weights_only=True)
    path = tmp_path / "weights.pt"
    torch.save(fixture["state_dict"], path)
    with pytest.raises(ModelLoadError, match="final_activation"):
        load_model(str(path))
    loaded = load_model(str(path), model_kwargs={"final_activation": "Sigmoid"})
    assert (run(loaded.module, fixture["input"]) - fixture["output"]).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(lambda sd: {"state_dict": sd, "epoch": 3}, id="state_dict"),
        pytest.param(lambda sd: {"model_state_dict": sd, "optimizer_state_dict": {}}, id="model_state_dict"),
        pytest.param(lambda sd: {f"module.{k}": v for k, v in sd.items()}, id="data-parallel-prefix"),
    ],
)
def test_wrapped_state_dicts_are_unwrapped(tmp_path, wrap):
    net = InfernoUNet(1, 1, depth=1, initial_features=2)
    path = tmp_path / "wrapped.pt"
    torch.save(wrap(net.state_dict()), path)
    assert same_weights(load_model(str(path)).module, net)


def test_unet3d_state_dict_matching_a_preset_takes_the_preset_s_activations(tmp_path):
    path = tmp_path / "tiny-trained.pt"
    torch.save(build_preset("tiny").state_dict(), path)
    loaded = load_model(str(path))
    assert loaded.kind == "state-dict"
    assert loaded.module.final_activation == "sigmoid" and loaded.downsampling == Coord((2, 2, 2))


def test_unet3d_state_dict_of_another_shape_needs_padding_and_activations(tmp_path):
    net = UNet3d(in_channels=2, out_channels=1, depth=2, initial_features=3, growth=3, pool_factors=[(1, 2, 2), 3],
                 activation="relu", final_activation="none")
    path = tmp_path / "custom.pt"
    torch.save(net.state_dict(), path)
    with pytest.raises(ModelLoadError, match="padding, activation, final_activation"):
        load_model(str(path))
    loaded = load_model(str(path), model_kwargs=dict(padding="same", activation="relu", final_activation="none"))
    assert loaded.module.pool_factors == (Coord((1, 2, 2)), Coord((3, 3, 3)))
    x = torch.rand(1, 2, 3, 12, 12)
    torch.testing.assert_close(run(loaded.module, x), run(net.eval(), x))


def test_an_unrecognised_state_dict_is_refused_with_its_keys_and_what_is_accepted(tmp_path):
    path = tmp_path / "resnet.pt"
    torch.save(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1)).state_dict(), path)
    with pytest.raises(ModelLoadError, match=r"does not recognise \(keys '0.weight', '0.bias', '1.weight', '1.bias', ...\); "
                                             r"blockpred accepts a preset name"):
        load_model(str(path))


def test_weights_do_not_apply_to_a_model_file(tmp_path):
    path = tmp_path / "m.pt"
    torch.save(InfernoUNet(1, 1, depth=1, initial_features=2).state_dict(), path)
    with pytest.raises(InvalidOptionError, match="weights apply to presets and factories"):
        load_model(str(path), weights=str(path))


# ---------------------------------------------------------------------- pickles


@pytest.mark.parametrize(
    "name", ["inferno_trainer_checkpoint.pytorch", "inferno_trainer_checkpoint_legacy.pytorch"]
)
def test_real_inferno_trainer_checkpoint_needs_trust_and_then_gives_inferno_s_output(name):
    path = DATA / name
    if not path.exists():
        missing(f"the fixture {name} (tests/models/data)")
    with pytest.raises(UntrustedPickleError, match=r"is a pickled Python object \(it references inferno\."):
        load_model(str(path))
    loaded = load_model(str(path), trust_pickle=True)
    assert (loaded.kind, loaded.in_channels, loaded.out_channels) == ("pickle", 1, 2)
    assert isinstance(loaded.module, InfernoUNet)
    assert "inferno" not in sys.modules
    fixture = torch.load(REGRESSION, weights_only=True)
    assert (run(loaded.module, fixture["input"]) - fixture["output"]).abs().max() <= 1e-5


#: A stand-in for the ``inferno`` package: the real module layout and class
#: names, with the state-dict keys of inferno's UNet.  It exists only in the
#: subprocess that pickles a trainer; the test process cannot import it.
FAKE_INFERNO = {
    "inferno/__init__.py": "",
    "inferno/extensions/__init__.py": "",
    "inferno/extensions/layers/__init__.py": "",
    "inferno/extensions/layers/convolutional.py": """
        from torch import nn

        class ConvActivation(nn.Module):
            def __init__(self, in_channels, out_channels, kernel_size, activation):
                super().__init__()
                self.conv = nn.Conv3d(in_channels, out_channels, kernel_size, padding=kernel_size // 2)
                self.activation = activation

            def forward(self, x):
                x = self.conv(x)
                return x if self.activation is None else self.activation(x)

        class ConvELU3D(ConvActivation):
            def __init__(self, in_channels, out_channels, kernel_size):
                super().__init__(in_channels, out_channels, kernel_size, nn.ELU())

        class Conv3D(ConvActivation):
            def __init__(self, in_channels, out_channels, kernel_size):
                super().__init__(in_channels, out_channels, kernel_size, None)
    """,
    "inferno/extensions/layers/sampling.py": """
        from torch import nn

        class Upsample(nn.Module):
            def forward(self, x):
                return nn.functional.interpolate(x, scale_factor=2, mode="trilinear", align_corners=False)
    """,
    "inferno/extensions/models/__init__.py": "",
    "inferno/extensions/models/unet.py": """
        import torch
        from torch import nn
        from ..layers.convolutional import Conv3D, ConvELU3D
        from ..layers.sampling import Upsample

        def two(i, o):
            return nn.Sequential(ConvELU3D(i, o, 3), ConvELU3D(o, o, 3))

        class UNet(nn.Module):
            def __init__(self, in_channels, out_channels, depth, initial_features, gain, final_activation):
                super().__init__()
                f = [initial_features * gain**i for i in range(depth + 1)]
                self.depth = depth
                self._conv_down_ops = nn.ModuleList(
                    [ConvELU3D(f[0], f[1], 3)] + [two(f[i], f[i + 1]) for i in range(1, depth)])
                self._downsample_ops = nn.ModuleList(nn.MaxPool3d(2) for _ in range(depth))
                self._upsample_ops = nn.ModuleList(Upsample() for _ in range(depth))
                self._conv_bottom_op = two(f[depth], f[depth])
                self._conv_up_ops = nn.ModuleList(
                    two(2 * f[depth - i], f[0] if i == depth - 1 else f[depth - i - 1]) for i in range(depth))
                self._initial_conv = ConvELU3D(in_channels, f[0], 3)
                self._output = nn.Sequential(Conv3D(f[0], out_channels, 1), getattr(nn, final_activation)())

            def forward(self, x):
                x = self._initial_conv(x)
                skips = []
                for conv, pool in zip(self._conv_down_ops, self._downsample_ops):
                    x = conv(x)
                    skips.append(x)
                    x = pool(x)
                x = self._conv_bottom_op(x)
                for up, conv in zip(self._upsample_ops, self._conv_up_ops):
                    x = conv(torch.cat([skips.pop(), up(x)], 1))
                return self._output(x)
    """,
    "inferno/trainers/__init__.py": "",
    "inferno/trainers/basic.py": """
        class Trainer:
            def __init__(self, model):
                self.model = model
                self.epoch_count = 7
                self.callbacks = {"on_save": print}
    """,
}

PICKLE_TRAINER = """
import sys, torch
from inferno.extensions.models.unet import UNet
from inferno.trainers.basic import Trainer
torch.manual_seed(5)
model = UNet(1, 2, depth=2, initial_features=2, gain=3, final_activation="Tanh").eval()
x = torch.rand(1, 1, 4, 8, 8)
with torch.no_grad():
    y = model(x)
torch.save(Trainer(model), sys.argv[1])
torch.save({"input": x, "output": y}, sys.argv[2])
"""


def test_pickled_trainer_of_a_package_that_is_not_installed_loads_only_with_trust(tmp_path):
    fake = tmp_path / "fake"
    for name, text in FAKE_INFERNO.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(textwrap.dedent(text))
    ckpt, expected = tmp_path / "ckpt.pytorch", tmp_path / "expected.pt"
    env = child_env(fake)
    subprocess.run([sys.executable, "-c", PICKLE_TRAINER, str(ckpt), str(expected)], env=env, check=True)

    with pytest.raises(ImportError):
        import inferno  # noqa: F401  (not importable here)
    with pytest.raises(UntrustedPickleError, match=r"ckpt.pytorch' is a pickled Python object .*"
                                                   r"pass --trust-pickle only if you trust where it came from"):
        load_model(str(ckpt))
    loaded = load_model(str(ckpt), trust_pickle=True)
    assert loaded.kind == "pickle" and isinstance(loaded.module, InfernoUNet)
    # The activation (Tanh) is not in the tensors; it came from the pickled module.
    assert isinstance(loaded.module._output[1], nn.Tanh)
    reference = torch.load(expected, weights_only=True)
    assert (run(loaded.module, reference["input"]) - reference["output"]).abs().max() <= 1e-5


class _MakesMarker:
    """Unpickling this creates a directory: proof of code running."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_no_code_runs_from_an_untrusted_pickle(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the error message uses the path as given
    marker = tmp_path / "marker"
    torch.save({"model": _MakesMarker(marker)}, "evil.pt")
    with pytest.raises(UntrustedPickleError, match=r"'evil.pt' is a pickled Python object \(it references "):
        load_model("evil.pt")
    assert not marker.exists()
    # the same file with trust does run its code (so the check above means something), and holds no model
    with pytest.raises(ModelLoadError, match="no model or state dict"):
        load_model("evil.pt", trust_pickle=True)
    assert marker.exists()


def test_a_pickled_module_of_importable_classes_runs_as_it_is(tmp_path):
    net = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.Sigmoid())
    path = tmp_path / "whole-model.pt"
    torch.save(net, path)
    with pytest.raises(UntrustedPickleError, match="torch.nn.modules.container.Sequential"):
        load_model(str(path))
    loaded = load_model(str(path), trust_pickle=True)
    assert loaded.kind == "pickle" and isinstance(loaded.module, nn.Sequential)
    x = torch.rand(1, 1, 4, 4, 4)
    torch.testing.assert_close(run(loaded.module, x), run(net, x))


# ---------------------------------------------------------------------- bad input


def test_a_missing_model_file_is_input_not_found(tmp_path):
    with pytest.raises(InputNotFoundError, match=r"does not exist \(no such file, and not a preset\); blockpred accepts") as info:
        load_model(str(tmp_path / "gone.pt"))
    assert isinstance(info.value, FileNotFoundError)


def test_a_directory_is_not_a_model(tmp_path):
    with pytest.raises(ModelLoadError, match="must be a file, found a directory"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda good: os.urandom(4096), id="random-bytes"),
        pytest.param(lambda good: good[: len(good) // 2], id="truncated-zip"),
        pytest.param(lambda good: b"", id="empty"),
        pytest.param(lambda good: b"just some text\n", id="text"),
    ],
)
def test_a_file_that_is_no_torch_file_is_called_corrupt(tmp_path, make):
    good = tmp_path / "good.pt"
    torch.save(InfernoUNet(1, 1, depth=1, initial_features=2).state_dict(), good)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(make(good.read_bytes()))
    with pytest.raises(ModelLoadError, match="is not a TorchScript archive, state dict or checkpoint \\(corrupt\\?\\)"):
        load_model(str(bad))


def test_a_corrupt_file_is_never_unpickled_even_with_trust(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(os.urandom(2048))
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_model(str(bad), trust_pickle=True)


def test_loading_never_touches_the_global_rng(tmp_path):
    state = torch.random.get_rng_state()
    load_model("tiny")
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_ready_module_is_put_in_eval_mode_and_described():
    net = UNet3d(in_channels=1, out_channels=2, depth=1, initial_features=2).train()
    loaded = load_model(net)
    assert loaded.module is net and not net.training
    assert (loaded.kind, loaded.name, loaded.in_channels, loaded.downsampling) == ("module", "UNet3d", 1, Coord((2, 2, 2)))
    with pytest.raises(InvalidOptionError, match="model_kwargs do not apply"):
        load_model(net, model_kwargs={"depth": 2})


def test_a_name_too_long_to_be_a_path_is_not_found():
    with pytest.raises(InputNotFoundError, match="does not exist"):
        load_model("x" * 5000)
