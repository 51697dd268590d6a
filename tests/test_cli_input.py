"""Option values and input paths a user gets wrong (issue 21, cases 5, 6 and 7), through the real command.

Each refusal is one ``blockpred: error:`` line on stderr, exit code 2, no
traceback, and the disk as it was: no output created, an existing one
byte-identical.
"""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
import zarr

from blockpred import predict
from blockpred.errors import InvalidOptionError
from tests.helpers import assert_refused, run_blockpred, write_test_volume


@pytest.fixture
def volume(tmp_path):
    rng = np.random.default_rng(0)
    return write_test_volume(str(tmp_path / "g.zarr/raw"), rng.integers(0, 255, (16, 32, 32), dtype=np.uint8))


@pytest.fixture
def existing(tmp_path, volume):
    """An output made with other settings (uint8) than the runs below."""
    target = str(tmp_path / "out.zarr")
    predict(volume, target, device="cpu", output_dtype="uint8", block=16, progress=False)
    return target


def _files(root) -> dict:
    """Every file under ``root`` with its bytes."""
    return {str(p): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def _config(tmp_path, **options) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(options))
    return str(path)


def _blockpred(tmp_path, *args) -> subprocess.CompletedProcess:
    return run_blockpred(*args, "--device", "cpu", "--no-progress", cwd=tmp_path)


# ---------------------------------------------------------------------- case 7: option values


def test_a_quoted_false_for_overwrite_is_refused_and_the_output_is_untouched(tmp_path, volume, existing):
    before = _files(tmp_path / "out.zarr")
    config = _config(tmp_path, overwrite="false")
    result = _blockpred(tmp_path, "run", volume, existing, "--config", config)
    assert_refused(result, "overwrite must be true or false, got 'false' (a string)", "without quotes")
    assert _files(tmp_path / "out.zarr") == before
    with pytest.raises(InvalidOptionError, match="overwrite must be true or false, got 'false'"):
        predict(volume, existing, device="cpu", overwrite="false", progress=False)
    assert _files(tmp_path / "out.zarr") == before


@pytest.mark.parametrize("name", ["trust_pickle", "overwrite", "progress", "local", "skip_empty"])
@pytest.mark.parametrize("value", ["false", "true", 0, 1, [True]])
def test_a_boolean_option_takes_only_true_or_false_in_the_python_api(tmp_path, volume, name, value):
    with pytest.raises(InvalidOptionError, match=re.escape(f"{name} must be true or false, got {value!r}")):
        predict(volume, str(tmp_path / "o.zarr"), device="cpu", **{name: value})
    assert not (tmp_path / "o.zarr").exists()


def test_a_quoted_false_for_trust_pickle_is_refused(tmp_path, volume):
    result = _blockpred(tmp_path, "run", volume, "o.zarr", "--config", _config(tmp_path, trust_pickle="false"))
    assert_refused(result, "trust_pickle")
    assert not (tmp_path / "o.zarr").exists()


def test_a_block_of_a_fraction_of_a_voxel_is_refused(tmp_path, volume):
    result = _blockpred(tmp_path, "run", volume, "o.zarr", "--config", _config(tmp_path, block=[16.5, 64, 64]))
    assert_refused(result, "block", "16.5 is not a whole number")
    assert not (tmp_path / "o.zarr").exists()
    with pytest.raises(InvalidOptionError, match="16.5 is not a whole number"):
        predict(volume, str(tmp_path / "o.zarr"), device="cpu", block=[16.5, 64, 64])
    assert not (tmp_path / "o.zarr").exists()


def test_a_block_smaller_than_twice_its_halo_is_run_with_one_warning_naming_the_overhead(tmp_path, caplog):
    source = write_test_volume(str(tmp_path / "s.zarr/raw"), np.full((8, 8, 8), 7, dtype=np.uint8))
    # halo 10 covers the tiny network's receptive field (radius 9): the overhead is the only warning
    result = _blockpred(tmp_path, "run", source, "o.zarr", "--block", "4", "--halo", "10")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "WARNING" in lines[0] and "216x" in lines[0] and "--block 8,8,8" in lines[0], lines[0]
    with caplog.at_level(logging.WARNING, logger="blockpred"):
        predict(source, str(tmp_path / "p.zarr"), device="cpu", block=4, halo=10, progress=False)
    warned = [r for r in caplog.records if "twice" in r.getMessage()]
    assert len(warned) == 1 and "216x" in warned[0].getMessage()


def test_a_block_as_large_as_a_small_volume_gets_no_warning(tmp_path, caplog):
    source = write_test_volume(str(tmp_path / "s.zarr/raw"), np.full((8, 16, 16), 7, dtype=np.uint8))
    with caplog.at_level(logging.WARNING, logger="blockpred"):
        predict(source, str(tmp_path / "p.zarr"), device="cpu", block=(8, 16, 16), halo=8, progress=False)
    assert not [r for r in caplog.records if "twice" in r.getMessage()]


# ---------------------------------------------------------------------- case 5: abbreviations and paths


def test_an_abbreviated_flag_is_not_taken_for_overwrite(tmp_path, volume, existing):
    before = _files(tmp_path / "out.zarr")
    result = _blockpred(tmp_path, "run", volume, existing, "--over")
    assert_refused(result, "--over")
    assert _files(tmp_path / "out.zarr") == before


@pytest.mark.slow
def test_dot_dot_in_a_dataset_path_is_refused_in_one_line(tmp_path, volume):
    result = _blockpred(tmp_path, "run", volume, "g.zarr/x/../raw2")
    assert_refused(result, "'..'", "without")
    assert not (tmp_path / "g.zarr" / "raw2").exists() and not (tmp_path / "g.zarr" / "x").exists()
    result = _blockpred(tmp_path, "run", "g.zarr/x/../raw", "o.zarr")
    assert_refused(result, "'..'")
    assert not (tmp_path / "o.zarr").exists()


# ---------------------------------------------------------------------- case 6: shapes


def test_an_input_with_an_empty_axis_says_there_is_nothing_to_predict(tmp_path):
    zarr.create_array(str(tmp_path / "e.zarr"), name="raw", shape=(0, 64, 64), chunks=(1, 64, 64), dtype="uint8")
    result = _blockpred(tmp_path, "run", "e.zarr/raw", "o.zarr")
    assert_refused(result, "has shape (0, 64, 64): an empty axis; there is nothing to predict")
    assert "ROI" not in result.stderr
    assert not (tmp_path / "o.zarr").exists()


def test_singleton_axes_of_a_5d_input_are_named(tmp_path):
    write_test_volume(str(tmp_path / "f.zarr/five"), np.zeros((1, 1, 16, 32, 32), dtype=np.uint8))
    result = _blockpred(tmp_path, "run", "f.zarr/five", "o.zarr")
    assert_refused(result, "axes 0, 1 have size 1", "without them, as (z, y, x)")
    assert not (tmp_path / "o.zarr").exists()
