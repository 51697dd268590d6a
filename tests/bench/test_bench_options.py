"""`blockpred bench` takes the run's model options (one parser group for both), passes them to the network it times,
and chooses for the volume it was given, as the run does."""

import argparse
import json

import numpy as np
import pytest

from blockpred.cli import MODEL_GROUP, MODEL_KEYS, build_parser, main
from tests.helpers import write_test_volume

#: A value each model option takes, where it takes one and names no choices.
SAMPLES = {"--model": "tiny", "--weights": "w.pt", "--model-kwargs": "depth=2", "--downsampling": "1,2,2",
           "--normalize": "minmax:0,255", "--device": "cpu", "--memory-limit": "2GB"}


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _model_group(command: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    return next(g for g in command._action_groups if g.description == MODEL_GROUP)


def test_every_model_option_of_run_is_taken_by_bench_plan_and_serve_from_one_group():
    commands = _commands()
    run_options = _model_group(commands["run"])._group_actions
    assert tuple(a.dest for a in run_options) == MODEL_KEYS  # each one passed on to bench (cli.MODEL_KEYS)
    for name in ("bench", "plan", "serve"):
        flags = [a.option_strings for a in _model_group(commands[name])._group_actions]
        assert flags == [a.option_strings for a in run_options], name
    for action in run_options:
        flag = action.option_strings[0]
        value = [] if action.nargs == 0 else [action.choices[-1] if action.choices else SAMPLES[flag]]
        args = build_parser().parse_args(["bench", flag, *value])
        assert getattr(args, action.dest) not in (None, False), flag


def test_bench_passes_model_kwargs_to_the_factory_it_times(tmp_path, capsys):
    log = tmp_path / "passes.log"  # tests.networks:logged(log_path) appends a line per nonzero input block
    report_path = tmp_path / "bench.json"
    assert main(["bench", "--model", "tests.networks:logged", "--model-kwargs", f"log_path={log}", "--device", "cpu",
                 "--volume-shape", "16,32,32", "--block", "16", "--batch-size", "2", "--warmup", "1",
                 "--iterations", "2", "--json", str(report_path)]) == 0
    result = json.loads(report_path.read_text())["results"][0]
    assert result["model"] == "tests.networks:logged" and result["batch_size"] == 2
    assert len(log.read_text().splitlines()) >= 2 * 3  # its warm-up and timed passes, at batch 2
    assert capsys.readouterr().out.startswith("model tests.networks:logged on cpu over 16x32x32 uint8 (synthetic)")


def test_bench_reports_the_volume_it_was_given_and_chooses_for_it_as_run_does(tmp_path, capsys):
    data = np.random.default_rng(0).random((20, 36, 44), dtype=np.float32)
    source = write_test_volume(str(tmp_path / "in.zarr"), data)
    options = ["--model", "tiny", "--device", "cpu", "--normalize", "minmax:0,1"]
    assert main(["run", source, str(tmp_path / "out.zarr"), *options, "--no-progress", "--json"]) == 0
    ran = json.loads(capsys.readouterr().out)
    report_path = tmp_path / "bench.json"
    assert main(["bench", "--input", source, *options, "--warmup", "0", "--iterations", "1",
                 "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["volume"] == {"path": source, "shape": [20, 36, 44], "dtype": "float32", "channels": None,
                                "synthetic": False}
    result = report["results"][0]
    assert (result["block"], result["batch_size"]) == (ran["block"], ran["batch_size"])
    captured = capsys.readouterr()
    assert captured.out.startswith(f"model tiny on cpu over 20x36x44 float32 ({source}): block ")
    assert captured.err.startswith(f"measuring tiny fp32: as `blockpred run` would over 20x36x44 float32 ({source})")


def test_bench_takes_the_named_downsampling_as_run_does(capsys):
    assert main(["bench", "--model", "tiny", "--device", "cpu", "--downsampling", "4,4,4", "--block", "18,16,16",
                 "--iterations", "1"]) == 2
    assert "not a multiple of the network's downsampling (4, 4, 4)" in capsys.readouterr().err


@pytest.mark.parametrize("flags, expected", [
    pytest.param(["--normalize", "minmax:x"], "normalisation 'minmax:x' needs two numbers: minmax:LO,HI",
                 id="normalize"),
    pytest.param(["--model-kwargs", "depth"], "--model-kwargs must be KEY=VALUE pairs", id="model-kwargs"),
    pytest.param(["--downsampling", "0,2,2"], "downsampling must be positive on every axis, got (0, 2, 2)",
                 id="downsampling"),
    pytest.param(["--memory-limit", "lots"], "memory_limit must be a size such as 2GB", id="memory-limit"),
    pytest.param(["--input", "in.zarr", "--volume-shape", "8,8,8"], "name two volumes to bench for; give one",
                 id="two-volumes"),
])
def test_a_bad_model_option_is_one_line_and_exit_2_before_anything_is_timed(tmp_path, capsys, monkeypatch, flags,
                                                                            expected):
    monkeypatch.chdir(tmp_path)
    report = tmp_path / "bench.json"
    assert main(["bench", "--device", "cpu", *flags, "--json", str(report)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not report.exists()
    assert len(captured.err.splitlines()) == 1 and expected in captured.err
