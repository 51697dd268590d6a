"""Exact by default on the CPU, bf16 when asked: ``--precision auto`` stays fp32 on every backend; ``--precision bf16``
runs OpenVINO's bf16 where the CPU has AMX or AVX512-BF16 and the summary says how far the first block is from fp32;
torch's autocast says its time against fp32's, and warns where it is slower."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest

import blockpred
from blockpred.cli import main
from blockpred.io import open_volume
from blockpred.pipeline.backends import cpu_bf16, openvino_available
from blockpred.run.cpu_precision import CpuPrecision
from tests.ci import needs
from tests.helpers import write_test_volume

#: Small enough for a test: one block of the tiny preset.
RUN = ["--model", "tiny", "--device", "cpu", "--block", "16,32,32", "--batch-size", "1", "--no-progress", "--local"]
NOTE = re.compile(r"max difference from fp32 on the first block ([0-9.e+-]+) of the output range")

needs_bf16 = pytest.mark.skipif(not cpu_bf16(), reason="OpenVINO's bf16 needs OpenVINO and a CPU with AMX or "
                                                       "AVX512-BF16")


@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> str:
    data = np.random.default_rng(0).integers(0, 255, (16, 32, 32), dtype=np.uint8)
    return write_test_volume(str(tmp_path_factory.mktemp("cpu_precision") / "v.zarr"), data)


@pytest.fixture(scope="module")
def fp32(volume, tmp_path_factory) -> np.ndarray:
    """torch's output at fp32, the reference."""
    out = tmp_path_factory.mktemp("fp32") / "torch.zarr"
    assert main(["run", volume, str(out), *RUN, "--backend", "torch", "--precision", "fp32"]) == 0
    return read_all(out)


@pytest.fixture(scope="module")
def conversions(tmp_path_factory) -> str:
    """One cache directory for this module's OpenVINO runs: tiny is converted once (bf16 and fp32 runs share it)."""
    return str(tmp_path_factory.mktemp("conversions"))


def read_all(path) -> np.ndarray:
    with open_volume(str(path)) as v:
        return v.read(v.box)


@needs_bf16
def test_bf16_runs_openvino_unmeasured_close_to_fp32_and_the_summary_says_how_close(volume, fp32, tmp_path, capsys,
                                                                                  conversions, monkeypatch):
    monkeypatch.setenv("BLOCKPRED_CACHE_DIR", conversions)
    out = tmp_path / "bf16.zarr"
    assert main(["run", volume, str(out), *RUN, "--precision", "bf16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "backend: openvino" in lines
    (line,) = [line for line in lines if line.startswith("precision: ")]
    assert line.startswith(f"precision: bf16 (OpenVINO, {cpu_bf16()}): max difference from fp32 on the first block")
    said = float(NOTE.search(line).group(1))
    got = read_all(out)
    scale = float(np.ptp(fp32))
    assert 0 < said <= 1e-2 and np.abs(got - fp32).max() <= 1e-2 * scale
    assert not np.array_equal(got, fp32)  # bf16 computed, not f32


@needs(openvino_available(), "OpenVINO (a required dependency)")
def test_auto_precision_stays_fp32_on_openvino_and_equals_torch(volume, fp32, tmp_path, conversions, monkeypatch):
    monkeypatch.setenv("BLOCKPRED_CACHE_DIR", conversions)
    out = tmp_path / "auto.zarr"
    summary = blockpred.predict(volume, str(out), model="tiny", device="cpu", block=(16, 32, 32), batch_size=1,
                                backend="openvino", progress=False, local=True)
    assert (summary.precision, summary.precision_note, summary.backend) == ("fp32", "", "openvino")
    np.testing.assert_allclose(read_all(out), fp32, atol=1e-5 * float(np.ptp(fp32)), rtol=0)


def test_bf16_forced_onto_torch_says_its_time_against_fp32_and_warns_where_slower(volume, fp32, tmp_path, capsys,
                                                                                 caplog):
    with caplog.at_level(logging.WARNING, logger="blockpred"):
        assert main(["run", volume, str(tmp_path / "t.zarr"), *RUN, "--backend", "torch", "--precision", "bf16",
                     "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["backend"] == "torch"
    note = result["precision_note"]
    assert note.startswith("bf16 (torch autocast): max difference from fp32 on the first block"), note
    factor = float(re.search(r"its pass took ([0-9.]+)x fp32's time", note).group(1))
    warned = [r.getMessage() for r in caplog.records if "slower than fp32" in r.getMessage()]
    if factor > 1:  # what this CPU measured: one line with the factor, and why torch ran it
        (line,) = warned
        said = float(re.search(r"ran ([0-9.]+)x slower than fp32 \(torch autocast; ", line).group(1))
        assert abs(said - factor) <= 0.06, (line, note)
    else:
        assert warned == []


def test_the_slow_warning_names_the_factor_and_why_torch_ran_it():
    slow = CpuPrecision("bf16", "torch autocast", 2e-3, seconds=1.78, fp32_seconds=0.1,
                        why_torch="OpenVINO's bf16 needs AMX or AVX512-BF16")
    assert slow.warning() == ("--precision bf16 on this CPU ran 17.8x slower than fp32 (torch autocast; OpenVINO's "
                              "bf16 needs AMX or AVX512-BF16); use --precision fp32 unless you need bf16's numbers")
    assert CpuPrecision("bf16", "torch autocast", 2e-3, seconds=0.05, fp32_seconds=0.1).warning() == ""
    assert CpuPrecision("bf16", "OpenVINO, AMX", 6.1e-5, seconds=1.0, fp32_seconds=0.1).warning() == ""
    assert str(CpuPrecision("bf16", "OpenVINO, AMX", 6.1e-5, seconds=1.0, fp32_seconds=0.1)) == (
        "bf16 (OpenVINO, AMX): max difference from fp32 on the first block 6.1e-05 of the output range")
