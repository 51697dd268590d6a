"""The command's streams are auxiliary (issue 38): progress to a FIFO or a pipe whose reader is gone or never
came, a closed standard output, and ``--json`` on failure.  The run's work stands in every case."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from blockpred.cli import main
from blockpred.io import open_volume
from tests.helpers import child_env, write_test_volume

RUN = ["--config", "tiny", "--device", "cpu", "--block", "16,32,32", "--no-progress", "--backend", "torch"]


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("streams")
    data = np.random.default_rng(0).integers(0, 255, (16, 32, 64), dtype=np.uint8)
    return write_test_volume(str(root / "in.zarr/raw"), data, chunks=(16, 32, 32))


def _complete(output: str) -> bool:
    with open_volume(output) as out:
        return bool(np.all(np.isfinite(out.read(out.box))) and out.read(out.box).any())


def _command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "blockpred", *argv]


def test_a_fifo_without_reader_warns_once_and_the_run_goes_on(volume, tmp_path, caplog):
    """Opened without waiting for a reader: nothing blocks before the first block."""
    fifo = tmp_path / "events"
    os.mkfifo(fifo)
    out = str(tmp_path / "out.zarr")
    assert main(["run", volume, out, *RUN, "--progress-json", str(fifo)]) == 0
    said = [r.getMessage() for r in caplog.records if r.name == "blockpred.events"]
    assert len(said) == 1 and "no process reads" in said[0] and "goes on without progress events" in said[0], said
    assert _complete(out)


def test_a_pipe_whose_reader_went_away_warns_once_and_the_run_completes(volume, tmp_path):
    """Progress and the summary both go to standard output, whose reader closes its end before the first event:
    each write would be EPIPE."""
    out = str(tmp_path / "out.zarr")
    run = subprocess.Popen(_command("run", volume, out, *RUN, "--progress-json", "/dev/stdout"), env=child_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run.stdout.close()
    stderr = run.stderr.read()
    assert run.wait(timeout=300) == 0, stderr
    assert stderr.count("its reader went away") == 1 and "Traceback" not in stderr, stderr
    assert _complete(out)
    # A closed standard output (>&-) in the same way: the run stands, exit 0, no traceback.
    line = " ".join(_command("run", volume, str(tmp_path / "closed.zarr"), *RUN)) + " >&-"
    result = subprocess.run(["bash", "-c", line], env=child_env(), capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert _complete(str(tmp_path / "closed.zarr"))


def test_json_on_failure_prints_the_failure_as_json(tmp_path, capsys):
    assert main(["run", str(tmp_path / "missing.zarr"), *RUN, "--json"]) == 2
    captured = capsys.readouterr()
    said = json.loads(captured.out)
    assert said == {"ok": False, "error": captured.err.strip().removeprefix("blockpred: error: "), "exit_code": 2}
    assert "missing.zarr" in said["error"]
