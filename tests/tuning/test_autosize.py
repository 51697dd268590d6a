"""``--block auto`` / ``--batch-size auto`` against an injected device memory budget.

The search is tested over a synthetic device (a speed model and a memory
budget, so every outcome is known); the trial passes over a real network whose
device memory is injected (``tests.networks:memory_limited``); and a run.
"""

import json

import numpy as np
import pytest
import torch

import blockpred
from blockpred.tuning.autosize import SizeCache, SizeProblem, Trial, choose_sizes, search
from blockpred.errors import InvalidOptionError
from blockpred.geometry import Box, Coord
from blockpred.pipeline import Predictor
from tests.helpers import read_volume, write_test_volume
from tests.networks import MemoryLimited

HALO = Coord((10, 10, 10))


def problem(*, roi=(256, 256, 256), base=16, fixed_block=None, fixed_batch=None) -> SizeProblem:
    return SizeProblem(in_channels=1, raw_dtype=np.dtype("uint8"), halo=HALO, context=Coord((0, 0, 0)),
                       input_extra=Coord((0, 0, 0)), step=Coord((2, 2, 2)), base_block=Coord((base,) * 3),
                       roi=Box.from_shape(Coord(roi)), fixed_block=fixed_block, fixed_batch=fixed_batch)


def synthetic_device(prob: SizeProblem, budget_voxels: int, launch_s=0.01, s_per_voxel=1e-8):
    """A device whose pass costs launch_s + s_per_voxel x input voxels and holds budget_voxels of input."""
    log = []

    def run(block: Coord, batch: int) -> Trial:
        voxels = prob.input_shape(block).prod() * batch
        log.append((block, batch))
        if voxels > budget_voxels:
            return Trial(block, batch, "out of memory")
        seconds = launch_s + s_per_voxel * voxels
        return Trial(block, batch, "ok", block.prod() * batch / seconds / 1e6, seconds)

    return run, log


def test_the_search_climbs_to_the_largest_block_that_fits_then_doubles_the_batch_and_picks_the_fastest():
    prob = problem()
    # Block 42 is balanced to 38 (7 blocks over 256 either way; input 58^3): it fits at batch 1, and the
    # next candidate, 52 (72^3), does not.
    budget = 62**3
    run, log = synthetic_device(prob, budget)
    choice = search(prob, run)

    fitting = [t for t in choice.trials if t.fits]
    assert all(prob.input_shape(t.block).prod() * t.batch_size <= budget for t in fitting)
    assert all(prob.input_shape(t.block).prod() * t.batch_size > budget for t in choice.trials if not t.fits)
    batch1 = [t for t in choice.trials if t.batch_size == 1]
    assert max(t.block for t in batch1 if t.fits) == Coord((38,) * 3)
    assert not [t for t in batch1 if t.block == Coord((52,) * 3)][0].fits, "the search stopped before the limit"
    assert any(t.batch_size > 1 for t in choice.trials), "no batch was tried"
    assert choice.mvox_per_s == max(prob.roi_mvox_per_s(t) for t in fitting)
    assert (choice.block, choice.batch_size) == (Coord((38,) * 3), 1)  # bigger blocks waste less on the halo
    assert len(log) <= 12, "too many trial passes"


def test_when_the_default_block_does_not_fit_the_search_steps_down_until_one_does():
    prob = problem(base=64)
    run, _ = synthetic_device(prob, budget_voxels=50**3)
    choice = search(prob, run)
    assert choice.block == Coord((26,) * 3)  # input 46^3; 32 (input 52^3) is over
    assert [t.outcome for t in choice.trials[:2]] == ["out of memory", "out of memory"]


def test_a_small_region_caps_the_block_and_a_launch_bound_device_gets_a_bigger_batch():
    prob = problem(roi=(20, 40, 40))
    run, _ = synthetic_device(prob, budget_voxels=10**9, launch_s=1.0)
    choice = search(prob, run)
    assert all(t.block.minimum(Coord((20, 40, 40))) == t.block for t in choice.trials)
    assert choice.block == Coord((20, 40, 40)) and choice.batch_size == 1  # one block covers the region
    prob = problem(fixed_block=Coord((16, 16, 16)))
    choice = search(prob, synthetic_device(prob, budget_voxels=4 * 36**3, launch_s=1.0)[0])
    assert choice.block == Coord((16, 16, 16)) and choice.batch_size == 4


def test_when_nothing_fits_the_error_is_one_line_saying_what_to_do():
    prob = problem()
    with pytest.raises(InvalidOptionError, match="no block fits the device's memory") as caught:
        search(prob, synthetic_device(prob, budget_voxels=100)[0])
    assert "\n" not in str(caught.value)


def test_trials_on_a_real_network_respect_its_memory_and_are_cached(tmp_path):
    budget = 2 * 46**3  # block 26 at batch 2, or 32 (input 52^3) at batch 1, but not 42
    module = MemoryLimited(budget)
    predictor = Predictor(module, torch.device("cpu"))
    module = predictor.module  # the predictor's own copy counts the passes
    prob = problem(roi=(48, 48, 48), base=26)
    cache = SizeCache(tmp_path / "sizes.json")
    key = {"name": "memory-limited"}

    choice = choose_sizes(predictor, prob, model_key=key, cache=cache)
    assert not choice.cached and module.refusals > 0, "the trials never reached the memory limit"
    assert prob.input_shape(choice.block).prod() * choice.batch_size <= budget
    assert any(t.outcome == "out of memory" for t in choice.trials)
    assert json.loads(cache.path.read_text()), "nothing was cached"

    passes = module.passes
    again = choose_sizes(predictor, prob, model_key=key, cache=cache)
    assert again.cached and module.passes == passes, "a cached choice ran trials"
    assert (again.block, again.batch_size) == (choice.block, choice.batch_size)
    other_precision = Predictor(MemoryLimited(budget), torch.device("cpu"), "bf16")
    assert not choose_sizes(other_precision, prob, model_key=key, cache=cache).cached


def test_a_run_with_block_and_batch_auto_predicts_with_the_chosen_sizes_and_says_so(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, (40, 64, 64), dtype=np.uint8)
    path = write_test_volume(str(tmp_path / "in.zarr"), data)
    budget = 46**3
    summary = blockpred.predict(path, str(tmp_path / "out.zarr"), model="tests.networks:memory_limited",
                                model_kwargs={"budget_voxels": budget}, halo=10, block="auto", batch_size="auto",
                                progress=False, local=True)
    sizing = summary.sizing
    assert sizing is not None and summary.plan.block_shape == sizing.block
    assert (sizing.block + 20).prod() * sizing.batch_size <= budget
    assert summary.stats.out_of_memory == 0 and summary.stats.num_voxels == data.size
    assert f"auto size: block {'x'.join(map(str, sizing.block))}, batch {sizing.batch_size}" in str(summary)


def test_resuming_with_block_auto_keeps_the_block_the_output_was_started_with(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, (32, 48, 48), dtype=np.uint8)
    path = write_test_volume(str(tmp_path / "in.zarr"), data)
    out = str(tmp_path / "out.zarr")
    # Batch and layout named: neither run measures them (a loaded machine would, and cache what it found).
    pinned = dict(batch_size=1, memory_format="contiguous", progress=False, local=True)
    first = blockpred.predict(path, out, block=16, **pinned)
    written = read_volume(out)

    again = blockpred.predict(path, out, block="auto", **pinned)  # no --overwrite: a resume
    assert again.plan.block_shape == first.plan.block_shape == Coord((16, 16, 16))
    assert again.sizing is None, "trials ran for a resume"
    assert (again.num_resumed, again.stats.num_blocks) == (first.plan.num_blocks, 0)  # nothing redone
    np.testing.assert_array_equal(read_volume(out), written)


@pytest.mark.slow
def test_joining_a_cluster_the_trials_run_on_a_worker_and_the_blocks_with_the_chosen_sizes(tmp_path, monkeypatch):
    from distributed import LocalCluster

    import blockpred.tuning.autosize

    def no_search_here(*args, **kwargs):
        raise AssertionError("the client searched; the trials belong on a worker")

    monkeypatch.setattr(blockpred.tuning.autosize, "search", no_search_here)  # this process only, not the worker's
    data = np.random.default_rng(2).integers(0, 256, (32, 48, 48), dtype=np.uint8)
    path = write_test_volume(str(tmp_path / "in.zarr"), data)
    budget = 46**3
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        summary = blockpred.predict(path, str(tmp_path / "out.zarr"), model="tests.networks:memory_limited",
                                    model_kwargs={"budget_voxels": budget}, halo=10, block="auto",
                                    batch_size="auto", scheduler=cluster.scheduler_address, progress=False)
    sizing = summary.sizing
    assert sizing is not None and not sizing.cached and summary.plan.block_shape == sizing.block
    assert (sizing.block + 20).prod() * sizing.batch_size <= budget
    assert len(summary.workers) == 1 and summary.stats.num_voxels == data.size
    assert (tmp_path / "blockpred-cache" / "sizes.json").exists(), "the worker cached nothing"


def test_candidates_are_balanced_over_the_region_so_the_last_block_overhangs_least():
    prob = problem(roi=(128, 704, 704), base=64)
    prob = SizeProblem(**{**prob.__dict__, "step": Coord((8, 8, 8)), "halo": Coord((16, 16, 16))})
    blocks = prob.candidates(coarse=True)
    assert blocks == [Coord((64, 64, 64)), Coord((128, 120, 120)), Coord((128, 240, 240)), Coord((128, 352, 352)),
                      Coord((128, 704, 704))]  # 120 and 240: 6 and 3 blocks over 704, as 128 and 256 need
    for block in blocks:
        doubled = Coord(min(2 * b, m) for b, m in zip(block, prob.max_block))
        assert prob.blocks_over_region(prob.balanced(doubled)) == prob.blocks_over_region(doubled)


def test_a_known_pass_foresees_a_new_shapes_first_pass_too():
    """On CUDA a shape's first pass is far slower than a warm one (cuDNN tries its kernels): ``cold_s`` foresees it,
    so a budget that affords the warm passes of the next trial but not its first pass runs none (an H200 spent
    11.1 s measuring a 9.7 s run where trials were foreseen at their warm passes)."""
    prob = problem(base=16)
    start = prob.candidates(coarse=True)[0]
    seconds = 0.05
    known = (Trial(start, 1, "ok", start.prod() / seconds / 1e6, seconds),)
    ran = {}
    for cold_s in (0.0, 3.0):
        run, log = synthetic_device(prob, budget_voxels=10**9)
        search(prob, run, coarse=True, known=known, max_total_s=2.0, cold_s=cold_s, clock=lambda: 0.0)
        ran[cold_s] = log
    assert ran[0.0], "with warm passes foreseen the next block is tried"
    assert ran[3.0] == [], "a trial foreseen over the budget with its first pass ran"
