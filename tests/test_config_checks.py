"""Option values that would run and write nonsense (issue 38, item 9), and the paths a config file names.

Each refusal goes through the real command in this process: exit code 2, one ``blockpred: error:`` line that
names the option and the rule, and the disk as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from blockpred.cli import main
from blockpred.config import make_config
from blockpred.errors import InvalidOptionError
from blockpred.models import build_preset
from tests.helpers import snapshot, write_test_volume

#: (flags, or the text of a config file; what the one line must say)
BAD_VALUES = [
    (["--normalize", "meanstd:nan,1"], "normalize meanstd:nan,1 must be meanstd:MEAN,STD with finite numbers and STD > 0"),
    (["--normalize", "meanstd:inf,1"], "finite numbers and STD > 0, got MEAN=inf"),
    (["--normalize", "meanstd:0,0"], "finite numbers and STD > 0, got MEAN=0, STD=0"),
    (["--normalize", "meanstd:0,-1"], "STD > 0, got MEAN=0, STD=-1"),
    (["--normalize", "meanstd:0,1e-40"], "beyond float32"),
    (["--normalize", "minmax:3,3"], "normalize minmax:3,3 must be minmax:LO,HI with finite numbers and LO < HI"),
    (["--normalize", "minmax:3,1"], "LO < HI, got LO=3, HI=1"),
    (["--normalize", "minmax:nan,1"], "LO < HI, got LO=nan"),
    ("normalize: minmax:0,inf\n", "LO < HI, got LO=0, HI=inf"),
    (["--channels", "1,1"], "channels must name each channel once, got '1,1' (channel 1 more than once)"),
    ("channels: [0, 1, 0]\n", "channel 0 more than once"),
    (["--channels=-1,2"], "channels [-1, 2] must be indices into the network's 2 output channels"),
    ("progress_json: 5\n", ("progress_json in 'run.yaml' must be a path (text), got 5 (an int); "
                            'write progress_json: "5" if you mean a file named 5')),
    ("progress_json: ''\n", "progress_json in 'run.yaml' must be a path (text), got an empty string"),
    (["--progress-json", ""], "progress_json must be a path (text), got an empty string"),
    ("mask: [a.zarr]\n", "mask in 'run.yaml' must be a path (text), got ['a.zarr'] (a list)"),
    ("walltime: 4:00:00\ncluster: slurm\n", 'got 14400 (an int); quote it: walltime: "4:00:00"'),
]


@pytest.fixture
def volume(tmp_path):
    return write_test_volume(str(tmp_path / "g.zarr/raw"), np.zeros((16, 32, 32), np.uint8))


def test_values_that_would_write_nan_or_a_file_named_5_are_refused_in_one_line(tmp_path, volume, capsys,
                                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    for case, expected in BAD_VALUES:
        flags = case if isinstance(case, list) else ["--config", "run.yaml"]
        if isinstance(case, str):
            (tmp_path / "run.yaml").write_text(case)
        before = snapshot(tmp_path)
        code = main(["run", volume, "o.zarr", "--device", "cpu", "--block", "16,32,32", "--no-progress", *flags])
        err = capsys.readouterr().err
        assert code == 2, f"{case!r}: exit {code}, {err!r}"
        assert err.count("\n") == 1 and err.startswith("blockpred: error: "), f"{case!r}: {err!r}"
        assert expected in err, f"{case!r}: {err!r} lacks {expected!r}"
        assert snapshot(tmp_path) == before, case


def test_a_null_progress_json_in_a_config_file_means_no_events_and_a_path_object_is_taken(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("progress_json: null\nweights: null\n")
    assert make_config(path).progress_json is None and make_config(path).weights is None
    assert make_config(progress_json=tmp_path / "p.jsonl").progress_json == str(tmp_path / "p.jsonl")
    with pytest.raises(InvalidOptionError, match=r"scheduler must be an address \(text\), got 8786 \(an int\)"):
        make_config(scheduler=8786)


def test_files_a_config_file_reads_are_found_beside_it_and_flags_in_the_working_directory(tmp_path, monkeypatch):
    sub, elsewhere = tmp_path / "sub", tmp_path / "elsewhere"
    sub.mkdir(), elsewhere.mkdir()
    (sub / "tiny").write_text("")  # a file named like a preset: the preset is meant (./tiny reaches the file)
    monkeypatch.chdir(elsewhere)
    config = Path("..", "sub", "run.yaml")
    config.write_text("model: nets/my.pt\nweights: w.pt\nmask: m.h5:/mask\njobqueue_config: slurm.yaml\n"
                      "progress_json: events.jsonl\n")
    cfg = make_config(config)
    beside = {name: os.path.join("..", "sub", value) for name, value in
              [("model", "nets/my.pt"), ("weights", "w.pt"), ("mask", "m.h5:/mask"), ("jobqueue_config", "slurm.yaml")]}
    assert {name: getattr(cfg, name) for name in beside} == beside
    assert cfg.progress_json == "events.jsonl"  # written where the run is
    flags = make_config(config, model="flag.pt", weights="w.pt", mask="m.zarr/mask")
    assert (flags.model, flags.weights, flags.mask) == ("flag.pt", "w.pt", "m.zarr/mask")
    for model, expected in [("tiny", "tiny"), ("./tiny", os.path.join("..", "sub", "./tiny")),
                            ("net.onnx", os.path.join("..", "sub", "net.onnx")), ("tests.networks:Logged", None),
                            (str(tmp_path / "abs.pt"), str(tmp_path / "abs.pt")), ("s3://bucket/net.pt", None)]:
        config.write_text(f"model: {model}\nmask: s3://bucket/m.zarr/mask\n")
        cfg = make_config(config, trust_pickle=True)
        assert (cfg.model, cfg.mask) == (expected or model, "s3://bucket/m.zarr/mask"), model
    assert make_config("tiny").model == "tiny"  # a shipped config, by name


def test_a_model_file_named_relatively_in_a_config_file_is_planned_from_another_directory(tmp_path, volume, capsys,
                                                                                         monkeypatch):
    (tmp_path / "sub" / "nets").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    net = build_preset("tiny")
    net.receptive_radius = [9, 9, 9]  # stated, so that the plan measures nothing
    torch.jit.save(torch.jit.script(net), str(tmp_path / "sub" / "nets" / "my.ts"))
    (tmp_path / "sub" / "run.yaml").write_text("model: nets/my.ts\nblock: [16, 32, 32]\n")
    monkeypatch.chdir(tmp_path / "elsewhere")
    code = main(["plan", volume, "o.zarr", "--config", "../sub/run.yaml", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"model     {os.path.join('..', 'sub', 'nets/my.ts')} on cpu" in out
    assert not (tmp_path / "elsewhere" / "o.zarr").exists()
