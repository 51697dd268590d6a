"""Normalisation taken of the volume (percentile, meanstd:auto), and the summary's line of what ran (issue 48).

Runs through the copy network (its output is its normalised input, float32), so the numbers the run applied are
read back from the output and held against numpy's on the same voxels."""

from __future__ import annotations

import numpy as np
import pytest

import blockpred
from blockpred.cli import main
from blockpred.errors import InvalidOptionError
from blockpred.normalize import Normalization
from blockpred.run.package_stats import volume_sample
from tests.helpers import read_volume, write_test_volume

COPY = dict(model="blockpred.models.standin:copy", model_kwargs={"channels": 1}, halo=(0, 0, 0), block=(16, 32, 32),
            batch_size=1, memory_format="contiguous", output_dtype="float32", local=True, progress=False,
            device="cpu")


@pytest.fixture
def volume(tmp_path):
    rng = np.random.default_rng(48)
    data = np.clip(rng.normal(120, 30, (16, 64, 64)), 0, 255).astype(np.uint8)
    return write_test_volume(str(tmp_path / "in.zarr"), data), data


@pytest.mark.parametrize("spec", ["percentile:1,99.8", "meanstd:auto"])
def test_statistics_of_the_volume_are_numpys_on_the_same_voxels_and_the_run_applies_them(tmp_path, volume, spec):
    source, data = volume
    summary = blockpred.predict(source, str(tmp_path / "out.zarr"), normalize=spec, **COPY)
    from blockpred.io import open_volume

    with open_volume(source) as opened:
        sample = volume_sample(opened)  # the whole volume here (under 16 Mvox)
    assert sample.shape[1] == data.size
    resolved = Normalization.parse(spec).resolved(sample)
    if spec.startswith("percentile"):
        low, high = np.percentile(sample, (1, 99.8))
        assert (resolved.kind, resolved.a, resolved.b) == ("minmax", float(low), float(high))
        expected = (data.astype(np.float64) - low) / (high - low)
    else:
        assert (resolved.kind, resolved.a, resolved.b) == ("meanstd", float(sample.mean()), float(sample.std()))
        expected = (data.astype(np.float64) - sample.mean()) / sample.std()
    np.testing.assert_allclose(read_volume(tmp_path / "out.zarr")[0], expected, rtol=0, atol=1e-5)
    assert summary.normalization.startswith(str(resolved)) and f"{spec} of the volume" in summary.normalization
    assert f"normalization: {resolved}" in str(summary)


def test_the_summary_says_the_default_and_a_named_normalisation(tmp_path, volume):
    source, _ = volume
    default = blockpred.predict(source, str(tmp_path / "a.zarr"), **COPY)
    assert default.normalization.startswith("auto (uint8 / 255 to [0, 1]), the default")
    named = blockpred.predict(source, str(tmp_path / "b.zarr"), normalize="meanstd:100,20", **COPY)
    assert named.normalization == "meanstd:100,20, as named" and named.as_dict()["normalization"] == named.normalization


@pytest.mark.parametrize("spec, said", [("percentile:5,5", "0 <= LOW < HIGH <= 100, got LOW=5, HIGH=5"),
                                        ("percentile:1", "needs two numbers: percentile:LOW,HIGH"),
                                        ("meanstd:auto", "the volume is constant (7), its standard deviation 0")])
def test_a_normalisation_that_cannot_hold_is_one_line_and_writes_nothing(tmp_path, spec, said, capsys):
    source = write_test_volume(str(tmp_path / "flat.zarr"), np.full((8, 16, 16), 7, np.uint8))
    code = main(["run", source, str(tmp_path / "out.zarr"), "--model", "blockpred.models.standin:copy",
                 "--normalize", spec, "--device", "cpu", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "out.zarr").exists()
    with pytest.raises(InvalidOptionError):
        Normalization.parse(spec).resolved(np.full((1, 10), 7.0, np.float32))
