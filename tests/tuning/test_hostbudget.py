"""The host memory budget of the CPU's size trials (``--memory-limit``), and the memory the trials give back.

Real passes of the ``tiny`` preset on the CPU, on small blocks; the budget's limit is named (a tiny one refuses
every larger trial), so no outcome depends on the machine's free memory.
"""

import platform

import numpy as np
import pytest
import torch

from blockpred.cli import main
from blockpred.config import make_config
from blockpred.geometry import Box, Coord
from blockpred.models.loading import load_model
from blockpred.pipeline import Predictor
from blockpred.pipeline.blocking import plan_blocks
from blockpred.pipeline.hostmem import (
    ResidentPeak,
    keep_freed_memory,
    peak_resident_bytes,
    release_freed_memory,
    resident_bytes,
)
from blockpred.tuning.autosize import SizeCache, SizeProblem, Trial, choose_sizes
from blockpred.tuning.hostbudget import OVER_BUDGET, HostBudget, HostMeter, named_block_warning
from blockpred.tuning.network import NetworkGeometry
from blockpred.tuning.sizecache import CachedSizes
from tests.helpers import write_test_volume

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
BASE = Coord((16, 16, 16))


def problem(**changes) -> SizeProblem:
    return SizeProblem(in_channels=1, raw_dtype=np.dtype("uint8"), halo=Coord((10, 10, 10)), context=Coord((0, 0, 0)),
                       input_extra=Coord((0, 0, 0)), step=Coord((2, 2, 2)), base_block=BASE,
                       roi=Box.from_shape(Coord((128, 128, 128))), **changes)


@pytest.fixture(scope="module")
def predictor():
    return Predictor(load_model("tiny").module, torch.device("cpu"))


def test_a_trial_foreseen_over_the_memory_limit_is_not_run_and_the_search_stays_at_the_start_block(tmp_path,
                                                                                                   predictor):
    start = Trial(BASE, 1, "ok", 0.1, BASE.prod() / 0.1e6)  # timed by the caller, as the measured defaults do
    choice = choose_sizes(predictor, problem(), model_key={"name": "tiny"}, cache=SizeCache(tmp_path / "sizes.json"),
                          quick_s=30.0, known=(start,), host_budget=HostBudget(limit_bytes=2**20))
    assert (choice.block, choice.batch_size) == (BASE, 1)
    refused = [t for t in choice.trials if t.outcome == OVER_BUDGET]
    assert refused and all(t.seconds_per_pass == 0 for t in refused), "a trial over the budget ran"
    assert all(t.peak_bytes > 2**20 for t in refused)  # the foresight, measured at the start block and scaled
    assert "over the memory budget" in str(choice)


def test_a_memory_limit_from_yaml_below_what_the_smallest_block_takes_is_one_line_and_nothing_is_written(tmp_path,
                                                                                                        capsys):
    volume = write_test_volume(tmp_path / "in.zarr", np.random.default_rng(0).integers(0, 255, (16, 32, 64), np.uint8))
    config = tmp_path / "run.yaml"
    config.write_text("model: tiny\nhalo: 10\nmemory_limit: 1MB\n")
    code = main(["run", volume, str(tmp_path / "out.zarr"), "--config", str(config), "--device", "cpu", "--block",
                 "16,32,32", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert "--memory-limit 1 MiB is below what a run takes" in err and "block 16x16x16 (input 36x36x36" in err
    assert not (tmp_path / "out.zarr").exists()


def test_a_named_block_over_the_budget_after_its_dry_run_is_said_in_one_line(tmp_path):
    """Foreseen within the budget before its dry run, measured over it after: not refused (the user named it), said."""
    cfg = make_config(model="tiny", block="16,32,32", memory_limit="1MB")
    plan = plan_blocks(volume_shape=Coord((16, 32, 64)), block_shape=Coord((16, 32, 32)), halo=Coord((10, 10, 10)))
    geometry = NetworkGeometry(1, 2, plan.input_shape, plan.input_shape, Coord((0, 0, 0)))
    line = named_block_warning(HostBudget(limit_bytes=10**6), cfg, plan, 1, geometry, np.dtype("uint8"), "cpu")
    assert line.startswith("block 16x32x32 at batch 1 is foreseen to take") and "over the memory limit of" in line
    assert named_block_warning(HostBudget(limit_bytes=2**50), cfg, plan, 1, geometry, np.dtype("uint8"), "cpu") == ""


@pytest.mark.parametrize("text, size", [("2GB", 2 * 10**9), ("1.5GiB", 3 * 2**29), ("800 MB", 8 * 10**8),
                                        ("1e9", 10**9)])
def test_memory_limit_takes_decimal_and_binary_sizes(text, size):
    assert make_config(memory_limit=text).memory_limit == size


@pytest.mark.parametrize("bad", ["lots", "0", "-2GB", "2XB", "1.5 GiBs"])
def test_a_bad_memory_limit_is_one_line_exit_2(tmp_path, capsys, bad):
    volume = write_test_volume(tmp_path / "in.zarr", np.zeros((8, 8, 8), np.uint8))
    code = main(["run", volume, str(tmp_path / "out.zarr"), f"--memory-limit={bad}", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "memory_limit must be a size such as 2GB" in err
    assert not (tmp_path / "out.zarr").exists()


def test_cached_trials_are_taken_under_the_budget_of_the_run_that_reads_them():
    gib = 2**30
    cached = CachedSizes([Trial(BASE, 1, "ok", 1.0, 0.1, gib // 2), Trial(BASE * 2, 1, "ok", 2.0, 0.4, 2 * gib),
                          Trial(BASE * 4, 1, OVER_BUDGET, peak_bytes=8 * gib)], complete=True, checks=1)

    def review(limit: int) -> CachedSizes | None:
        return HostMeter(HostBudget(limit_bytes=limit), problem()).review(cached)

    same = review(4 * gib)
    assert [t.outcome for t in same.trials] == ["ok", "ok", OVER_BUDGET] and same.complete
    smaller = review(gib)
    assert [t.outcome for t in smaller.trials] == ["ok", OVER_BUDGET, OVER_BUDGET] and smaller.complete
    larger = review(16 * gib)  # the refused block would fit now: the search goes on and runs it
    assert [t.block for t in larger.trials] == [BASE, BASE * 2] and not larger.complete
    assert review(gib // 4) is None  # nothing cached fits: measured again


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_the_heap_hands_freed_memory_back():
    keep_freed_memory()  # freed memory stays in the process ...
    array = np.ones(64 * 2**20 // 8)
    del array
    assert release_freed_memory() >= 32 * 2**20  # ... until it is handed back
    assert release_freed_memory() >= 0


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_the_memory_of_a_trial_goes_back_before_the_run(tmp_path, predictor):
    block = Coord((64, 64, 64))  # an 84^3 input: tiny's pass holds about 0.2 GiB more
    before = resident_bytes()
    with ResidentPeak() as peak:
        choice = choose_sizes(predictor, problem(fixed_block=block, fixed_batch=1), model_key={"name": "tiny"},
                              cache=SizeCache(tmp_path / "sizes.json"), quick_s=30.0, host_budget=HostBudget())
    assert choice.trials[0].fits and choice.trials[0].peak_bytes > before
    grown = peak.bytes - before
    assert grown > 50 * 2**20, "the trial's pass grew the resident memory by too little to tell"
    assert resident_bytes() - before < grown / 2, "the trial's memory stayed resident"


def test_the_bound_without_a_measurement_takes_the_outputs_as_the_run_keeps_them_where_the_budget_says():
    # Where the budget knows a block's output per voxel (2 channels of float32), the queue's outputs are those; where
    # it does not, the whole peak so far stands for each output: a bound hundreds of times too large for 64^3.
    block, ratio = BASE * 4, (84 / 36) ** 3
    limit = resident_bytes() + int(peak_resident_bytes() * ratio) + (1 << 30)
    kept = HostMeter(HostBudget(limit_bytes=limit, output_bytes_per_voxel=8.0), problem())
    assert kept.fits_at_most(block, 1) and kept.holds(block, 1)
    unknown = HostMeter(HostBudget(limit_bytes=limit), problem())
    assert not unknown.fits_at_most(block, 1) and not unknown.holds(block, 1)
    assert HostMeter(HostBudget(limit_bytes=1, output_bytes_per_voxel=8.0), problem()).holds(block, 1) is False


def test_a_guess_the_bound_does_not_hold_is_foreseen_from_one_measured_pass_at_the_start_block():
    # The bound takes the whole peak so far as each start block's growth; one measured pass at the start block (it
    # grows the process by little here: it only returns its output's bytes) foresees the guess within the budget.
    calls = []

    def probe() -> int:
        calls.append(1)
        return BASE.prod() * 8

    block, ratio = BASE * 4, (84 / 36) ** 3
    limit = resident_bytes() + int(peak_resident_bytes() * ratio) + (1 << 30)
    meter = HostMeter(HostBudget(limit_bytes=limit), problem())
    assert not meter.holds(block, 1) and not calls  # the bound alone: refused, nothing run
    assert meter.holds(block, 1, probe) and calls == [1]
    assert meter.holds(block, 1, probe) and calls == [1]  # measured once
    roomy = HostMeter(HostBudget(limit_bytes=1 << 50), problem())
    assert roomy.holds(block, 1, probe) and calls == [1]  # the bound holds it: no pass


def test_the_outputs_per_voxel_are_the_channels_the_run_keeps_in_its_dtype():
    from blockpred.tuning.hostbudget import keeping_outputs

    assert keeping_outputs(HostBudget(), make_config(), 3).output_bytes_per_voxel == 12.0
    kept = keeping_outputs(HostBudget(limit_bytes=5), make_config(channels=[1], output_dtype="uint8"), 3)
    assert (kept.output_bytes_per_voxel, kept.limit_bytes) == (1.0, 5)
    assert keeping_outputs(None, make_config(), 3) is None


def test_the_start_blocks_pass_is_measured_only_where_a_larger_trial_might_not_fit():
    calls = []

    def probe() -> int:
        calls.append(1)
        return BASE.prod() * 8

    roomy = HostMeter(HostBudget(limit_bytes=1 << 50), problem())
    assert roomy.refuse(BASE * 2, 1, probe) is None and not calls  # fits with the whole peak so far as its growth
    tight = HostMeter(HostBudget(limit_bytes=resident_bytes() + (1 << 20)), problem())
    tight.refuse(BASE * 2, 1, probe)
    assert calls == [1]
