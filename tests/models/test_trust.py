"""Trust to run code comes from the command line or the API call, never from a config file (issue 21, case 8).

Each payload here would leave an evidence file if it ran: a pickled checkpoint
whose ``__reduce__`` calls ``os.system("touch ...")``, and the factory
``subprocess:getoutput`` with ``cmd: "touch ..."`` from a YAML's ``model_kwargs``.
"""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
import torch
import yaml

from blockpred import predict
from blockpred.errors import InvalidOptionError
from tests.helpers import assert_refused, run_blockpred, write_test_volume


class _Evil:
    def __init__(self, evidence):
        self.evidence = str(evidence)

    def __reduce__(self):
        return (os.system, (f"touch {self.evidence}",))


@pytest.fixture
def volume(tmp_path):
    rng = np.random.default_rng(0)
    return write_test_volume(str(tmp_path / "g.zarr/raw"), rng.integers(0, 255, (16, 32, 32), dtype=np.uint8))


def _config(tmp_path, **options) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(options))
    return str(path)


def _blockpred(tmp_path, *args) -> subprocess.CompletedProcess:
    return run_blockpred(*args, cwd=tmp_path)


def test_a_config_file_cannot_trust_a_pickled_checkpoint(tmp_path, volume):
    evidence = tmp_path / "EVIDENCE"
    torch.save({"trainer": _Evil(evidence)}, tmp_path / "evil.pt")
    config = _config(tmp_path, model="evil.pt", trust_pickle=True)
    result = _blockpred(tmp_path, "run", volume, "out.zarr", "--config", config, "--device", "cpu", "--no-progress")
    assert_refused(result, "trust_pickle", "run.yaml", "--trust-pickle")
    assert not evidence.exists(), "the pickle's payload ran"
    assert not (tmp_path / "out.zarr").exists()


@pytest.mark.slow
def test_a_config_file_cannot_call_a_factory_the_command_line_did_not_name(tmp_path, volume):
    evidence = tmp_path / "EVIDENCE"
    config = _config(tmp_path, model="subprocess:getoutput", model_kwargs={"cmd": f"touch {evidence}"})
    result = _blockpred(tmp_path, "run", volume, "out.zarr", "--config", config, "--device", "cpu", "--no-progress")
    assert_refused(result, "run.yaml", "'subprocess:getoutput'", "--model", "--trust-pickle")
    assert not evidence.exists(), "the factory ran"
    assert not (tmp_path / "out.zarr").exists()
    plan = _blockpred(tmp_path, "plan", volume, "--config", config, "--device", "cpu")
    assert_refused(plan, "'subprocess:getoutput'")
    assert not evidence.exists(), "the factory ran under plan"


def test_the_python_api_takes_no_trust_from_a_config_file_either(tmp_path, volume):
    evidence = tmp_path / "EVIDENCE"
    torch.save({"trainer": _Evil(evidence)}, tmp_path / "evil.pt")
    pickled = _config(tmp_path, model=str(tmp_path / "evil.pt"), trust_pickle=True)
    with pytest.raises(InvalidOptionError, match="trust cannot come from a config file"):
        predict(volume, str(tmp_path / "a.zarr"), config=pickled, device="cpu", progress=False)
    for trust in ("false", False):  # any trust_pickle in a file is refused, whatever its value
        with pytest.raises(InvalidOptionError, match="trust_pickle"):
            predict(volume, str(tmp_path / "a.zarr"), config=_config(tmp_path, trust_pickle=trust), device="cpu")
    factory = _config(tmp_path, model="subprocess:getoutput", model_kwargs={"cmd": f"touch {evidence}"})
    with pytest.raises(InvalidOptionError, match="names the model factory 'subprocess:getoutput'"):
        predict(volume, str(tmp_path / "b.zarr"), config=factory, device="cpu", progress=False)
    assert not evidence.exists()
    assert not (tmp_path / "a.zarr").exists() and not (tmp_path / "b.zarr").exists()


def test_a_factory_from_a_config_file_runs_with_trust_from_the_command_line(tmp_path, volume):
    log = tmp_path / "blocks.log"
    config = _config(tmp_path, model="tests.networks:logged", model_kwargs={"log_path": str(log)}, block=16)
    result = _blockpred(tmp_path, "run", volume, "out.zarr", "--config", config, "--trust-pickle", "--device", "cpu",
                        "--no-progress")
    assert result.returncode == 0, result.stderr
    assert log.exists() and (tmp_path / "out.zarr").exists()


def test_a_factory_named_in_the_call_takes_its_arguments_from_the_config_file(tmp_path, volume):
    log = tmp_path / "blocks.log"
    config = _config(tmp_path, model="tests.networks:logged", model_kwargs={"log_path": str(log)}, block=16)
    summary = predict(volume, str(tmp_path / "out.zarr"), config=config, model="tests.networks:logged",
                      device="cpu", progress=False)
    assert summary.stats.num_blocks == 4 and log.exists()
