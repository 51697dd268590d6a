"""A finished output is recognised before the network runs, and a named block's dry run is its only trial pass.

``tests.networks:shapes_logged`` appends the shape of every pass to a file (dry runs, counts and trials
included), so a test counts the passes a command made at each shape.
"""

import json
from collections import Counter

import numpy as np
import pytest

from blockpred.cli import main
from tests.helpers import read_volume, write_test_volume

SHAPE = (16, 64, 64)


def run(capsys, *args) -> dict:
    assert main(["run", *args, "--device", "cpu", "--no-progress", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def volume(tmp_path) -> str:
    return write_test_volume(tmp_path / "in.zarr/raw", np.random.default_rng(0).integers(0, 255, SHAPE, np.uint8))


@pytest.mark.slow
def test_one_named_block_over_the_volume_runs_the_network_twice_at_its_shape_its_dry_run_and_the_block(volume,
                                                                                                        tmp_path,
                                                                                                        capsys):
    """A pass of over a second makes the measured defaults worth measuring; one pass is all the run has: its dry run
    stands for the timed pass (before: the dry run, a timed pass, then the block: three passes of the whole volume)."""
    log = tmp_path / "shapes.log"
    summary = run(capsys, volume, str(tmp_path / "out.zarr"), "--model", "tests.networks:shapes_logged",
                  "--model-kwargs", f"log_path={log},delay_s=1.2", "--block", "1024")
    assert summary["block"] == list(SHAPE) and summary["predicted_blocks"] == 1
    assert Counter(log.read_text().split())["1x1x36x84x84"] == 2, log.read_text()
    assert "longer than the" in summary["chosen"]


def test_a_finished_output_is_recognised_before_the_network_runs_and_is_left_as_it_was(volume, tmp_path, capsys):
    log, out = tmp_path / "shapes.log", str(tmp_path / "out.zarr")
    model = ["--model", "tests.networks:shapes_logged", "--model-kwargs", f"log_path={log}"]
    first = run(capsys, volume, out, *model, "--block", "1024")  # cut to the volume: the markers keep 16x64x64
    written = read_volume(out)
    log.unlink()
    again = run(capsys, volume, out, *model, "--block", "1024")
    assert not log.exists(), "the network ran for a finished output"
    assert again["predicted_blocks"] == 0 and again["resumed_blocks"] == first["blocks"] == 1
    assert again["block"] == first["block"] and again["halo"] == first["halo"]
    np.testing.assert_array_equal(read_volume(out), written)
    blocks = run(capsys, volume, str(tmp_path / "blocks.zarr"), *model, "--block", "16,32,32")
    log.unlink()
    assert run(capsys, volume, str(tmp_path / "blocks.zarr"), *model)["resumed_blocks"] == blocks["blocks"] == 4
    assert not log.exists()  # the block the output was started with, kept where none is named


def test_a_finished_output_run_with_other_settings_still_says_what_changed(volume, tmp_path, capsys):
    out = str(tmp_path / "out.zarr")
    run(capsys, volume, out, "--config", "tiny")
    code = main(["run", volume, out, "--config", "tiny", "--halo", "8", "--device", "cpu", "--no-progress"])
    assert code == 2 and "was made with other settings (halo (10, 10, 10) -> (8, 8, 8)" in capsys.readouterr().err
    code = main(["run", volume, out, "--config", "tiny", "--output-dtype", "uint8", "--device", "cpu",
                 "--no-progress"])
    assert code == 2 and "output_dtype float32 -> uint8" in capsys.readouterr().err
