"""--scheduler and --workers are refused in one line before anything starts: an address that is not one, an
address where no scheduler answers, more local workers than the machine has devices for."""

import os
import socket

import dask
import numpy as np
import psutil
import pytest
import torch

from blockpred.cli import main
from blockpred.cluster.local import visible_cores
from tests.helpers import write_test_volume

#: A tiny run that measures nothing (no trials: the refusals come before or instead of them).
RUN = ["--config", "tiny", "--device", "cpu", "--block", "16,32,32", "--batch-size", "1",
       "--memory-format", "contiguous", "--no-progress"]


@pytest.fixture
def data(tmp_path):
    """A folder with only the input volume in it (the test's cache lives beside it, in tmp_path)."""
    folder = tmp_path / "data"
    write_test_volume(str(folder / "in.zarr"), np.zeros((16, 32, 32), np.float32))
    return folder


def refusal(capsys, data, *options: str) -> str:
    """The one line of a run refused with exit 2, after checking that it wrote and started nothing."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    code = main(["run", str(data / "in.zarr"), str(data / "out.zarr"), *RUN, *options])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2, lines
    assert len(lines) == 1 and "unexpected error" not in lines[0], lines
    assert sorted(os.listdir(data)) == ["in.zarr"]  # no output, no markers, no lock
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # no worker process
    return lines[0]


@pytest.mark.parametrize("address", [pytest.param("notaurl", id="no-port"),
                                     pytest.param("http://127.0.0.1:8786", id="unknown-scheme"),
                                     pytest.param("tcp://127.0.0.1:99999", id="port-out-of-range")])
def test_a_malformed_scheduler_address_is_refused_before_the_model_loads(capsys, data, address):
    # A model file that does not exist: had it been loaded first, its error would be the line.
    line = refusal(capsys, data, "--scheduler", address, "--model", str(data / "missing.pt"))
    assert address in line and "tcp://HOST:PORT" in line, line


def test_an_address_where_nothing_listens_is_refused_at_the_first_try_naming_it(capsys, data):
    """A refused connection is known at once: one line naming the address, not dask's retries for the whole of the
    first handshake's timeout (was: 10 s, then "no dask scheduler answered ... within 10 s")."""
    with socket.socket() as free:  # a port nothing listens on: connections to it are refused
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    line = refusal(capsys, data, "--scheduler", f"tcp://127.0.0.1:{port}")
    assert f"no dask scheduler at tcp://127.0.0.1:{port}: the connection was refused" in line, line
    assert "within" not in line and "file system" not in line, line
    line = refusal(capsys, data, "--scheduler", "tcp://no-such-host.invalid:8786")
    assert "no dask scheduler at tcp://no-such-host.invalid:8786: its host 'no-such-host.invalid' has no address" \
        in line, line


def test_an_address_that_accepts_but_never_answers_is_refused_within_the_first_handshakes_timeout(capsys, data):
    with socket.socket() as silent:  # listens, so connections are accepted (by the kernel), but says nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):  # the first handshake's bound, if shorter
            line = refusal(capsys, data, "--scheduler", f"tcp://127.0.0.1:{port}")
    assert f"no dask scheduler answered at tcp://127.0.0.1:{port} within 1 s" in line, line
    assert "did not answer as a dask scheduler" in line and "file system" not in line, line


def test_more_cpu_workers_than_cores_are_refused_before_any_starts(capsys, data):
    cores = visible_cores()
    line = refusal(capsys, data, "--workers", str(cores + 1))
    assert f"--workers {cores + 1}" in line and f"cores: {cores}" in line, line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_more_gpu_workers_than_gpus_are_refused_before_any_starts(capsys, data):
    gpus = torch.cuda.device_count()
    line = refusal(capsys, data, "--device", "cuda", "--workers", str(gpus + 1))
    assert f"--workers {gpus + 1}" in line and f"GPUs: {gpus} visible" in line, line
