"""--precision auto: a low precision checked against fp32 on the first block, tf32 where it fails.

On this CPU machine auto means fp32; the check and its fallback run here through the CPU's bf16 autocast,
with the device's answer to "which low precision" (:func:`blockpred.tuning.precision.auto_precision`) set to bf16.
"""

import logging
import math

import numpy as np
import pytest
import torch

import blockpred
import blockpred.run.checks
from blockpred.config import make_config
from blockpred.errors import OutputExistsError
from blockpred.io import open_volume
from blockpred.pipeline import DeviceSteps, Predictor
from blockpred.tuning.precision import MAX_DIFF, MEAN_DIFF, PrecisionCheck, check_precision, differences
from blockpred.run.checks import start_precision
from tests.helpers import read_volume, run_blockpred, write_test_volume
from tests.networks import Cancelling, Smooth

CPU = torch.device("cpu")
#: Named so that runs compare bitwise: same block, batch and layout (nothing measured).
PINNED = dict(block=(16, 32, 32), halo=(0, 0, 0), batch_size=1, memory_format="contiguous", local=True,
              progress=False)


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    data = np.random.default_rng(0).integers(0, 256, (32, 64, 64), dtype=np.uint8)
    return write_test_volume(str(tmp_path_factory.mktemp("precision") / "in.zarr"), data)


def test_differences_are_shares_of_the_references_range_and_a_lost_finite_value_is_infinite():
    reference = np.array([0.0, 1.0, 2.0, 4.0])
    assert differences(reference + [0.0, 0.0, 0.0, 0.4], reference) == pytest.approx((0.1, 0.025))
    assert differences(np.array([0.0, np.inf]), np.array([0.0, 1.0])) == (math.inf, math.inf)
    assert differences(np.array([np.nan, 1.0, 3.0]), np.array([np.nan, 1.0, 3.0])) == (0.0, 0.0)  # NaN in both
    assert differences(np.full(3, 2.2), np.full(3, 2.0)) == pytest.approx((0.1, 0.1))  # constant: its magnitude


def test_a_low_precision_that_keeps_the_numbers_passes_and_one_that_loses_them_falls_back_to_tf32():
    sample = np.random.default_rng(1).integers(0, 256, (1, 8, 16, 16), dtype=np.uint8)
    steps = DeviceSteps(scale=1 / 255)
    kept = check_precision(Predictor(Smooth(), CPU, "bf16"), Smooth(), sample, steps)
    assert kept.passed and kept.precision == "bf16" and 0 < kept.max_diff <= MAX_DIFF and kept.mean_diff <= MEAN_DIFF
    assert str(kept).startswith("bf16 (auto: bf16 differed from fp32 by ") and kept.warning() == ""
    lost = check_precision(Predictor(Cancelling(), CPU, "bf16"), Cancelling(), sample, steps)
    assert not lost.passed and lost.precision == "tf32" and lost.mean_diff > MEAN_DIFF
    assert lost.warning().startswith("--precision auto: bf16 differed from fp32 by ")
    assert "running tf32 (--precision bf16 runs bf16 anyway)" in lost.warning()
    assert "\n" not in lost.warning()


def test_a_predictor_switched_to_another_precision_computes_as_one_made_at_it_and_leaves_the_network_given():
    given = Smooth()
    batch = np.random.default_rng(2).integers(0, 256, (1, 1, 8, 16, 16), dtype=np.uint8)
    predictor = Predictor(given, CPU, "bf16")
    low = predictor(batch)
    predictor.use_precision("fp32")
    assert predictor.precision == "fp32" and predictor.module.conv.weight.dtype == torch.float32
    assert np.array_equal(predictor(batch), Predictor(Smooth(), CPU, "fp32")(batch))
    assert not np.array_equal(predictor(batch), low)
    assert given.conv.weight.dtype == torch.float32  # the bf16 cast never reached the caller's network


def test_auto_on_the_cpu_is_fp32_bitwise_and_says_nothing_of_it(volume, tmp_path):
    auto = blockpred.predict(volume, str(tmp_path / "auto.zarr"), model="tests.networks:smooth", **PINNED)
    fp32 = blockpred.predict(volume, str(tmp_path / "fp32.zarr"), model="tests.networks:smooth", precision="fp32",
                             **PINNED)
    assert auto.precision == fp32.precision == "fp32" and auto.precision_note == ""
    assert "precision" not in str(auto)
    with open_volume(auto.output) as a, open_volume(fp32.output) as b:
        assert np.array_equal(a.read(a.box), b.read(b.box))


@pytest.fixture
def bf16_device(monkeypatch):
    """The device's low precision is bf16 (CUDA's answer on a recent GPU; the CPU's autocast computes it)."""
    monkeypatch.setattr(blockpred.run.checks, "auto_precision", lambda device: "bf16")
    monkeypatch.setattr(blockpred.run.checks, "auto_candidates", lambda device: ("bf16",))


def test_auto_checks_each_candidate_once_runs_the_faster_that_passes_and_a_later_run_checks_nothing(
        volume, tmp_path, monkeypatch):
    """bf16 and fp16, as on a recent GPU (the CPU's autocast computes both): each is checked against fp32 on the
    first block, the faster that passes runs, the note names the other; a second run takes both checks from the
    cache (issue 47) and says the same."""
    monkeypatch.setattr(blockpred.run.checks, "auto_precision", lambda device: "bf16")
    monkeypatch.setattr(blockpred.run.checks, "auto_candidates", lambda device: ("bf16", "fp16"))
    calls = []
    real = blockpred.run.checks.check_precision
    monkeypatch.setattr(blockpred.run.checks, "check_precision",
                        lambda predictor, *args: calls.append(predictor.precision) or real(predictor, *args))
    first = blockpred.predict(volume, str(tmp_path / "first.zarr"), model="tests.networks:smooth", **PINNED)
    assert calls == ["bf16", "fp16"] and first.precision in ("bf16", "fp16")
    other = {"bf16": "fp16", "fp16": "bf16"}[first.precision]
    assert f"also checked: {other} passed" in first.precision_note
    again = blockpred.predict(volume, str(tmp_path / "again.zarr"), model="tests.networks:smooth", **PINNED)
    assert calls == ["bf16", "fp16"]  # nothing checked again
    assert (again.precision, again.precision_note) == (first.precision, first.precision_note)


def test_auto_runs_bf16_where_the_first_block_keeps_fp32s_numbers_and_says_by_how_much(volume, tmp_path, bf16_device):
    summary = blockpred.predict(volume, str(tmp_path / "out.zarr"), model="tests.networks:smooth", **PINNED)
    assert summary.precision == "bf16" and summary.as_dict()["precision"] == "bf16"
    assert "precision: bf16 (auto: bf16 differed from fp32 by " in str(summary)
    exact = blockpred.predict(volume, str(tmp_path / "fp32.zarr"), model="tests.networks:smooth", precision="fp32",
                              **PINNED)
    with open_volume(summary.output) as a, open_volume(exact.output) as b:
        low, ref = a.read(a.box), b.read(b.box)
    assert not np.array_equal(low, ref) and np.abs(low - ref).max() <= MAX_DIFF  # bf16 ran, close to fp32


def test_dask_workers_run_the_precision_auto_chose(volume, tmp_path, bf16_device):
    local = blockpred.predict(volume, str(tmp_path / "local.zarr"), model="tests.networks:smooth", **PINNED)
    on_dask = blockpred.predict(volume, str(tmp_path / "dask.zarr"), model="tests.networks:smooth",
                                **{**PINNED, "local": False, "workers": 1})
    assert local.precision == on_dask.precision == "bf16" and on_dask.workers
    with open_volume(local.output) as a, open_volume(on_dask.output) as b:
        assert np.array_equal(a.read(a.box), b.read(b.box))  # bf16 on the worker too, not fp32


def test_auto_falls_back_to_tf32_with_one_warning_where_bf16_loses_the_numbers(volume, tmp_path, bf16_device, caplog):
    with caplog.at_level(logging.WARNING, logger="blockpred"):
        summary = blockpred.predict(volume, str(tmp_path / "out.zarr"), model="tests.networks:cancelling", **PINNED)
    warned = [r.getMessage() for r in caplog.records if "--precision auto" in r.getMessage()]
    assert len(warned) == 1 and "running tf32" in warned[0]
    assert summary.precision == "tf32" and "precision: tf32 (auto: bf16 differed from fp32" in str(summary)
    exact = blockpred.predict(volume, str(tmp_path / "fp32.zarr"), model="tests.networks:cancelling",
                              precision="fp32", **PINNED)
    with open_volume(summary.output) as a, open_volume(exact.output) as b:
        assert np.array_equal(a.read(a.box), b.read(b.box))  # tf32 on a CPU computes as fp32
    # The markers name what ran: a resume at auto goes on, one at bf16 is refused as other settings.
    written = read_volume(summary.output)
    again = blockpred.predict(volume, str(tmp_path / "out.zarr"), model="tests.networks:cancelling", **PINNED)
    assert (again.num_resumed, again.stats.num_blocks) == (summary.plan.num_blocks, 0)  # nothing redone
    np.testing.assert_array_equal(read_volume(again.output), written)
    with pytest.raises(OutputExistsError, match="precision"):
        blockpred.predict(volume, str(tmp_path / "out.zarr"), model="tests.networks:cancelling", precision="bf16",
                          **PINNED)


def test_an_output_started_at_fp32_resumed_at_auto_is_refused_naming_the_precision_that_goes_on(volume, tmp_path,
                                                                                                   bf16_device):
    out = str(tmp_path / "out.zarr")
    blockpred.predict(volume, out, model="tests.networks:smooth", precision="fp32", **PINNED)  # the old default
    with pytest.raises(OutputExistsError, match="precision fp32 -> bf16.*--precision fp32 goes on at the precision"):
        blockpred.predict(volume, out, model="tests.networks:smooth", **PINNED)
    written = read_volume(out)
    again = blockpred.predict(volume, out, model="tests.networks:smooth", precision="fp32", **PINNED)
    assert (again.num_resumed, again.stats.num_blocks) == (again.plan.num_blocks, 0)  # nothing redone
    np.testing.assert_array_equal(read_volume(out), written)


def test_auto_on_a_machine_without_cuda_that_runs_gpu_workers_is_tf32_unchecked():
    joining = make_config(scheduler="tcp://127.0.0.1:8786", device="cuda")
    precision, note = start_precision(joining, CPU, None)
    assert precision == "tf32" and "no CUDA device to compare" in note
    assert start_precision(make_config(), CPU, None) == ("fp32", "")
    assert start_precision(make_config(precision="fp16"), CPU, None) == ("fp16", "")


def test_the_command_takes_precision_auto_and_refuses_an_unknown_one(volume, tmp_path):
    ok = run_blockpred("run", volume, str(tmp_path / "out.zarr"), "--model", "tests.networks:smooth",
                       "--precision", "auto", "--block", "16,32,32", "--batch-size", "1", "--local")
    assert ok.returncode == 0, ok.stderr
    bad = run_blockpred("run", volume, str(tmp_path / "bad.zarr"), "--model", "tests.networks:smooth",
                        "--precision", "fp8")
    assert bad.returncode != 0 and "--precision" in bad.stderr and not (tmp_path / "bad.zarr").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_on_cuda_runs_a_low_precision_checked_against_fp32(volume, tmp_path):
    summary = blockpred.predict(volume, str(tmp_path / "out.zarr"), model="tests.networks:smooth", device="cuda",
                                **PINNED)
    assert summary.precision in ("bf16", "fp16") and summary.precision_note.startswith(summary.precision)


def test_auto_runs_the_faster_of_the_candidates_that_pass_and_says_which_others_it_checked():
    """bf16 and fp16 on a recent GPU (issue 47): the faster that passes its check runs; one that fails is never
    chosen however fast; none passing falls back as one candidate does; the note names the others."""
    from blockpred.tuning.precision import FALLBACK, choose_checked

    bf16 = PrecisionCheck("bf16", 0.01, 0.001, seconds=0.19)
    fp16 = PrecisionCheck("fp16", 0.01, 0.001, seconds=0.16)
    chosen, note = choose_checked([bf16, fp16])
    assert chosen is fp16 and "also checked: bf16 passed, 0.190 s a pass" in note and note.startswith("fp16")
    overflowing = PrecisionCheck("fp16", float("inf"), float("inf"), seconds=0.10)
    chosen, note = choose_checked([bf16, overflowing])
    assert chosen is bf16 and "fp16 failed" in note
    chosen, _ = choose_checked([PrecisionCheck("bf16", 0.5, 0.1), overflowing])
    assert not chosen.passed and chosen.precision == FALLBACK
    assert choose_checked([bf16]) == (bf16, str(bf16))
