"""A bioimage.io package's own test tensors: run as the package defines them before its first run; a package
that does not reproduce its test output is refused in one line, before anything is written."""

import os
import shutil

import numpy as np
import pytest
import torch
import yaml

import blockpred
from blockpred.cli import main
from blockpred.errors import PackageTestFailedError
from blockpred.models import check
from blockpred.models.check import DEFAULT_TOLERANCE, CheckResult, check_model
from tests.helpers import build_2d_package, write_test_volume
from tests.models.test_planes import make_net2d

HALO, MIN, STEP = 8, 32, 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("check")
    scripted = root / "net2d.pt"
    torch.jit.script(make_net2d()).save(str(scripted))
    plane = np.random.default_rng(0).random((48, 32)).astype(np.float32) * 100
    package = build_2d_package(root, scripted, plane, halo=HALO, min_size=MIN, step=STEP, zmuv_axes=("y", "x"))
    volume = write_test_volume(str(root / "vol.zarr/raw"), np.random.default_rng(1).random((2, 32, 32), np.float32))
    return {"root": root, "scripted": scripted, "package": package, "volume": volume}


def altered(setup, tmp_path, name: str, change, config=None):
    """A copy of the package whose test output is ``change(output)``; ``config``: its rdf's config."""
    folder = tmp_path / name
    shutil.copytree(setup["package"].parent, folder)
    output = np.load(folder / "output.npy")
    np.save(folder / "output.npy", change(output.copy()))
    if config is not None:
        content = yaml.safe_load((folder / "rdf.yaml").read_text())
        content["config"] = config
        (folder / "rdf.yaml").write_text(yaml.safe_dump(content))
    return folder / "rdf.yaml"


def test_a_package_reproduces_its_test_output_as_the_package_defines_it(setup):
    result = check_model(str(setup["package"]))
    assert isinstance(result, CheckResult) and result.passed is True
    assert (result.name, result.kind, result.tolerance) == ("blockpred pkg2d", "bioimageio", DEFAULT_TOLERANCE)
    assert result.max_abs_diff <= 1e-6 and result.num_mismatched == 0 and result.num_values == 2 * 48 * 32
    assert result.compared == "test output 'pred' (1, 2, 48, 32) from test input 'raw' (1, 1, 48, 32)"
    line = str(result)
    assert "\n" not in line and line.startswith("blockpred pkg2d (bioimageio): test output 'pred'")
    assert "within |diff| <= 0.00015 + 0.0001 x |expected| (bioimageio.core's default" in line


def test_a_model_without_test_tensors_has_nothing_to_compare(setup):
    result = check_model(str(setup["scripted"]))
    assert result.passed is None and result.max_abs_diff is None and result.kind == "torchscript"
    assert "nothing to compare: only a bioimage.io package carries test tensors" in str(result)


def test_an_altered_test_output_fails_in_one_line_and_the_run_exits_2_writing_nothing(setup, tmp_path, capsys):
    rdf = altered(setup, tmp_path, "altered", lambda out: out * 0.5)
    result = check_model(str(rdf))
    assert result.passed is False and result.max_abs_diff > 0.1 and result.num_mismatched > 0
    line = str(result)
    assert "\n" not in line
    assert line.startswith(f"bioimage.io package {str(rdf)!r} does not reproduce its own test output 'pred'")
    assert f"{result.num_mismatched} of {2 * 48 * 32} values outside |diff| <= 0.00015 + 0.0001 x |expected|" in line
    target = tmp_path / "out.zarr"
    code = main(["run", setup["volume"], str(target), "--model", str(rdf), "--no-progress", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"blockpred: error: {line}"]
    assert not target.exists() and not os.path.exists(str(target) + ".blockpred")


def test_the_packages_stated_tolerance_is_the_one_compared_with(setup, tmp_path):
    def one_value_off(out):
        out[0, 0, 0, 0] += 1.0
        return out

    strict = check_model(str(altered(setup, tmp_path, "strict", one_value_off)))
    assert strict.passed is False and strict.num_mismatched == 1
    tolerant = check_model(str(altered(setup, tmp_path, "tolerant", one_value_off, config={"bioimageio": {
        "reproducibility_tolerance": [{"relative_tolerance": 1e-4, "absolute_tolerance": 1e-4,
                                       "mismatched_elements_per_million": 1000}]}})))
    assert tolerant.passed is True and tolerant.num_mismatched == 1 and tolerant.tolerance.stated
    assert "(up to 1000 values per million outside) (the package's reproducibility_tolerance)" in str(tolerant)


def test_a_package_is_checked_before_its_first_run_only(setup, tmp_path, monkeypatch):
    options = dict(model=str(setup["package"]), device="cpu", progress=False, local=True)
    calls = []
    real = check.check_model

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(check, "check_model", counted)
    blockpred.predict(setup["volume"], str(tmp_path / "first.zarr"), **options)
    assert len(calls) == 1
    blockpred.predict(setup["volume"], str(tmp_path / "second.zarr"), **options)  # passed before: cached
    blockpred.predict(setup["volume"], str(tmp_path / "first.zarr"), **options)  # a resume: not checked
    assert len(calls) == 1
    with pytest.raises(PackageTestFailedError, match="does not reproduce its own test output"):
        blockpred.predict(setup["volume"], str(tmp_path / "third.zarr"),
                          **(options | {"model": str(altered(setup, tmp_path, "off", lambda out: out + 1))}))
    assert len(calls) == 2 and not (tmp_path / "third.zarr").exists()


def test_the_check_model_command_reproduces_a_package_and_says_what_it_finds_of_a_network(setup, tmp_path, capsys):
    assert main(["check-model", str(setup["package"])]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("blockpred pkg2d (bioimageio): test output 'pred'") and "max |diff|" in out[0]
    # A package normalising with its input's statistics has no volume here: its field is for run and plan.
    assert out[1].startswith("receptive field: measured by `run` and `plan`")
    assert main(["check-model", str(setup["scripted"]), "--plane", "yx"]) == 0
    lines = {line[:10].strip(): line[10:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["network"].startswith("2D on yx planes, 1 input channel(s); downsampling 1x2x2 (planes/graph/graph)")
    assert " from the receptive field (receptive field radius 0x" in lines["halo"] and "covered" in lines["halo"]
    bad = altered(setup, tmp_path, "bad", lambda output: output + 0.5)
    assert main(["check-model", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("blockpred: error: bioimage.io package") and "does not reproduce" in err and "\n" not in err
