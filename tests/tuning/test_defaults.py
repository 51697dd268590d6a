"""Measured defaults: block, batch and memory format chosen when not named, once per network, never over a name.

The runs use ``tests.networks:logged`` with a delay per forward pass, so a
small volume is estimated long enough to be measured while the test stays
quick; the network logs every non-zero input block it sees, which shows
whether a run measured (trial passes on random data) or not.
"""

import dataclasses
import json
import math

import numpy as np
import pytest
import yaml

import blockpred
from blockpred.tuning.autosize import (MAX_CHECKS, NO_GUESSING, THIN_MARGIN, Guessing, SizeProblem, Trial,
                                      foreseen_saving_s, guessing, pick, recheck, recheck_due, search)
from blockpred.cli import main
from blockpred.tuning.defaults import BASE_BUDGET_S, MAX_BUDGET_S, MIN_RUN_S, measuring_budget
from blockpred.geometry import Box, Coord
from blockpred.io import open_volume
from blockpred.tuning.sizecache import CachedSizes
from tests.helpers import read_volume, write_test_volume

DELAY_S = 0.1  # x 32 blocks of 16^3: a run estimated at over 3 s, over the measuring threshold


def _read(path: str) -> np.ndarray:
    with open_volume(path) as volume:
        return volume.read(volume.box)


@pytest.fixture
def source(tmp_path) -> str:
    data = np.random.default_rng(3).integers(0, 255, (32, 64, 64), dtype=np.uint8)
    return write_test_volume(str(tmp_path / "in.zarr"), data)


def _slow(tmp_path, name: str, **kwargs) -> dict:
    return dict(model="tests.networks:logged", halo=10, progress=False,
                model_kwargs={"log_path": str(tmp_path / name), "delay_s": DELAY_S, "default_block": 16, **kwargs})


def _logged(tmp_path, name: str) -> list[str]:
    return (tmp_path / name).read_text().split()


@pytest.mark.slow
def test_runs_of_one_network_measure_on_where_the_last_stopped_check_again_and_then_measure_nothing(
        tmp_path, source):
    # The same model (its kwargs, log path included, are part of what the cache tells apart).  Each run may
    # measure for a quarter of its estimate (32 blocks x 0.1 s: 0.8 s), less than the whole quick search.
    runs, seen = [], 0
    for k in range(12):
        summary = blockpred.predict(source, str(tmp_path / f"out{k}.zarr"), **_slow(tmp_path, "run.log"))
        logged = _logged(tmp_path, "run.log")
        runs.append((summary, logged[seen:]))
        seen = len(logged)
        if summary.defaults.how == "cached":
            break
    first, seen_by_first = runs[0]
    last, seen_by_last = runs[-1]
    before_last = runs[-2][0]

    assert first.defaults.how == "measured" and first.defaults.measured_s > 0  # (how long: no timing asserted)
    assert first.defaults.block is not None and first.defaults.batch_size is not None
    assert first.defaults.memory_format in ("contiguous", "channels_last")
    assert len(seen_by_first) > first.stats.num_blocks  # the trials ran the network on random data
    assert all(run.defaults.how == "measured" for run, _ in runs[:-1])  # each went on with the search ...
    assert last.defaults.how == "cached" and last.defaults.measured_s == 0  # ... until it was done and checked
    assert (last.defaults.block, last.defaults.batch_size, last.defaults.memory_format) == (
        before_last.defaults.block, before_last.defaults.batch_size, before_last.defaults.memory_format)
    assert len(seen_by_last) == len(set(seen_by_last)) == last.stats.num_blocks  # the blocks, nothing else
    assert last.plan.block_shape == last.defaults.block and last.batch_size == last.defaults.batch_size
    assert str(last).splitlines()[0].startswith("chosen: block ") and "(cached)" in str(last)
    plan = blockpred.plan(source, str(tmp_path / "c.zarr"), **_slow(tmp_path, "run.log"))
    assert plan.defaults.endswith("(cached)") and plan.plan.block_shape == last.defaults.block  # plan says the same



def _quick_entry(cache_file) -> tuple[dict, dict]:
    """The cache file's entries and its one entry of the measured defaults' quick search."""
    entries = json.loads(cache_file.read_text())
    (entry,) = [e for group in entries.values() for e in group if e["key"].get("search") == "quick"]
    return entries, entry


@pytest.mark.slow
def test_a_choice_timed_on_a_busy_machine_is_timed_again_by_the_next_run_and_corrected(tmp_path):
    """The cache as a busy machine leaves it: batch 2 timed 2.2 times as slow as batch 1 a pass (per voxel
    slower), where this network (a sleep a pass) runs batch 2 almost as fast.  The next run that measures times
    the winner and the runner-up again and takes batch 2; the run after it measures nothing."""
    data = np.random.default_rng(4).integers(0, 255, (32, 64, 128), dtype=np.uint8)  # 64 blocks of 16^3
    source = write_test_volume(str(tmp_path / "in.zarr"), data)
    # 0.05 s a pass and the compute: 64 passes estimated at 3.2 s or more, a measuring budget of 0.8 s or more.
    # The sleep outweighs the compute even where another test loads the cores, so batch 2 stays the faster.
    slow = _slow(tmp_path, "run.log", delay_s=0.05) | {"block": 16, "memory_format": "contiguous"}  # batch open
    first = blockpred.predict(source, str(tmp_path / "first.zarr"), **slow)
    assert first.defaults.how == "measured"
    cache_file = tmp_path / "blockpred-cache" / "sizes.json"
    entries, entry = _quick_entry(cache_file)
    (one,) = [t for t in entry["trials"] if t["block"] == [16, 16, 16] and t["batch_size"] == 1 and
              t["outcome"] == "ok"]
    busy = dict(one, batch_size=2, seconds_per_pass=2.2 * one["seconds_per_pass"],
                mvox_per_s=one["mvox_per_s"] * 2 / 2.2)
    entry.update(trials=[one, busy], complete=True, checks=1)
    cache_file.write_text(json.dumps(entries))
    assert blockpred.plan(source, str(tmp_path / "p.zarr"), **slow).batch_size == 1  # what the cache says

    again = blockpred.predict(source, str(tmp_path / "again.zarr"), **slow)
    assert again.defaults.how == "measured" and again.defaults.batch_size == 2, str(again.defaults)
    _, entry = _quick_entry(cache_file)
    assert entry["checks"] == 2 and entry["complete"]
    timed = {t["batch_size"]: t["seconds_per_pass"] for t in entry["trials"]}
    assert timed[2] < busy["seconds_per_pass"] and timed[1] <= one["seconds_per_pass"]  # the faster timing kept
    last = blockpred.predict(source, str(tmp_path / "last.zarr"), **slow)
    # It measures nothing, unless the re-check (one pass, on a loaded machine) left batch 2 ahead by less than
    # THIN_MARGIN: then it is checked again, by design.
    thin = 2 * timed[1] / timed[2] < THIN_MARGIN
    assert last.defaults.how == ("measured" if thin else "cached") and last.defaults.batch_size == 2


def test_a_cached_choice_is_timed_again_once_and_while_its_lead_is_thin():
    problem = _quick_problem()
    clock, tried = TrialClock(), []
    quiet = {16: 1e-6, 32: 0.5e-6, 64: 0.45e-6}  # seconds per input voxel on a quiet machine: 64^3 wins

    def run(block: Coord, batch: int) -> Trial:
        tried.append(block[0])
        trial = _timed(block[0], quiet[block[0]])
        clock.sleep(2 * trial.seconds_per_pass)
        return trial

    busy = [_timed(16, 1e-6), _timed(32, 0.5e-6), _timed(64, 0.9e-6)]  # 64^3 timed while the machine was busy
    once = CachedSizes(busy, complete=True, checks=1)
    assert pick(problem, busy).block == Coord((32, 32, 32))
    assert recheck_due(problem, once)  # every cached search is measured by a second run
    trials, finished = recheck(problem, run, once, max_total_s=10.0, clock=clock)
    assert finished and sorted(tried) == [32, 64]  # the winner and the runner-up, nothing else
    assert pick(problem, trials).block == Coord((64, 64, 64))  # each configuration keeps its fastest timing
    assert {t.block[0]: t.seconds_per_pass for t in trials}[64] == _timed(64, 0.45e-6).seconds_per_pass

    lead = pick(problem, trials).mvox_per_s / problem.roi_mvox_per_s(trials[1])  # 64^3 over 32^3
    assert lead > 1.1 and not recheck_due(problem, CachedSizes(trials, True, 2))  # a clear lead: done
    close = [_timed(16, 1e-6), _timed(32, 0.5e-6), _timed(64, 0.65e-6)]  # 64^3 ahead by 5%
    assert recheck_due(problem, CachedSizes(close, True, 2)) and not recheck_due(problem, CachedSizes(close, True,
                                                                                                      MAX_CHECKS))
    assert not recheck_due(problem, CachedSizes(close, False, 1))  # a search cut short goes on instead

    tried.clear()
    # 32^3 foreseen from its cached pass (0.06 s); then 64^3 from that fresh 32^3 pass by voxels (0.37 s more).
    trials, finished = recheck(problem, run, once, max_total_s=0.3, clock=clock)
    assert tried == [32] and not finished  # the next run that may measure times it again


def test_a_search_cut_short_goes_on_from_its_trials_and_is_done_when_time_allows_no_new_one():
    import dataclasses

    problem = dataclasses.replace(_quick_problem(), fixed_batch=1)
    clock, tried = TrialClock(), []

    def run(block: Coord, batch: int) -> Trial:  # a pass takes 1 us per input voxel of the search's clock
        tried.append(block)
        trial = _timed(block[0], 1e-6)
        clock.sleep(2 * trial.seconds_per_pass)  # a warm-up pass and a timed one, as trial_runner's quick trials
        return trial

    first = search(problem, run, max_total_s=0.2, coarse=True, known=(_timed(16, 1e-6),), clock=clock)  # 32^3: 0.13 s
    again = search(problem, run, max_total_s=0.8, coarse=True, known=first.trials, clock=clock)  # 64^3: 0.75 s more
    stuck = search(problem, run, max_total_s=0.8, coarse=True, known=again.trials, clock=clock)  # 128^3 would take 5 s
    assert tried == [Coord((32, 32, 32)), Coord((64, 64, 64))]  # no trial ran twice across the three
    assert not first.complete and not again.complete
    assert stuck.complete and stuck.trials == again.trials  # no time for a new trial: done


@pytest.mark.slow
def test_the_measured_defaults_predict_what_batch_1_contiguous_at_the_same_block_does(tmp_path, source):
    chosen = blockpred.predict(source, str(tmp_path / "chosen.zarr"), **_slow(tmp_path, "a.log"))
    plain = blockpred.predict(source, str(tmp_path / "plain.zarr"), block=chosen.plan.block_shape, batch_size=1,
                              memory_format="contiguous", **_slow(tmp_path, "b.log"))
    assert plain.defaults is None
    np.testing.assert_allclose(_read(chosen.output), _read(plain.output), atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("named", [dict(block=32), dict(batch_size=3), dict(memory_format="channels_last")])
def test_a_named_block_batch_or_memory_format_is_never_measured_or_changed(tmp_path, source, named):
    summary = blockpred.predict(source, str(tmp_path / "out.zarr"), **named, **_slow(tmp_path, "run.log"))
    if "block" in named:
        assert summary.plan.block_shape == Coord((named["block"],) * 3)
    if "batch_size" in named:
        assert summary.batch_size == named["batch_size"]
    if "memory_format" in named:
        assert summary.memory_format is None  # not measured: the named layout is used as it is
    left_open = {"block", "batch_size", "memory_format"} - set(named)
    assert all(getattr(summary.defaults, key) is None for key in named)
    assert all(getattr(summary.defaults, key) is not None for key in left_open)


@pytest.mark.slow
def test_the_cli_names_what_it_chose_and_a_named_option_wins(tmp_path, source, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": "tests.networks:logged", "halo": 10, "model_kwargs": {
        "log_path": str(tmp_path / "cli.log"), "delay_s": DELAY_S, "default_block": 16}}))
    factory = ["--model", "tests.networks:logged"]  # code runs only from the command line, never from a file
    assert main(["run", source, str(tmp_path / "a.zarr"), "--config", str(config), *factory, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "chosen: block " in out and "measured in " in out
    seen = len((tmp_path / "cli.log").read_text().split())
    assert main(["run", source, str(tmp_path / "b.zarr"), "--config", str(config), *factory, "--no-progress",
                 "--batch-size", "1", "--memory-format", "contiguous", "--block", "16"]) == 0
    assert "chosen" not in capsys.readouterr().out
    assert len((tmp_path / "cli.log").read_text().split()) - seen == 32  # the 32 blocks; no trial ran


def test_a_run_too_short_to_pay_is_not_measured(tmp_path):
    # One block of 16^3 (input 24^3): milliseconds per pass, far below the 1 s threshold even on a loaded machine.
    data = np.random.default_rng(1).integers(0, 255, (16, 16, 16), dtype=np.uint8)
    source = write_test_volume(str(tmp_path / "in.zarr"), data)
    summary = blockpred.predict(source, str(tmp_path / "out.zarr"), block=16, halo=4, progress=False)
    assert summary.defaults.how.startswith("not measured: the run is estimated at")
    assert (summary.defaults.batch_size, summary.defaults.memory_format) == (1, "contiguous")
    assert summary.batch_size == 1


@pytest.mark.slow
def test_a_resume_keeps_the_block_the_run_started_with(tmp_path, source):
    out = str(tmp_path / "out.zarr")
    first = blockpred.predict(source, out, **_slow(tmp_path, "run.log"))
    written = read_volume(out)
    again = blockpred.predict(source, out, **_slow(tmp_path, "run.log"))  # no --overwrite: a resume, nothing left
    assert again.plan.block_shape == first.plan.block_shape
    assert (again.num_resumed, again.stats.num_blocks) == (first.plan.num_blocks, 0)  # nothing redone
    np.testing.assert_array_equal(read_volume(out), written)


def test_the_budget_is_nothing_below_the_threshold_a_few_seconds_above_and_capped():
    assert measuring_budget(MIN_RUN_S * 0.99) == 0
    assert 0 < measuring_budget(MIN_RUN_S) <= BASE_BUDGET_S
    assert measuring_budget(40.0) == BASE_BUDGET_S == 10.0  # a quarter of a 40 s run
    assert measuring_budget(300.0) == 30.0  # a tenth of a long run ...
    assert measuring_budget(1e6) == MAX_BUDGET_S == 60.0  # ... up to a minute


def test_the_quick_search_starts_no_trial_it_foresees_ending_past_its_time():
    # Seconds per pass grow with the network input's voxels; the budget allows the first two blocks only.
    problem = SizeProblem(in_channels=1, raw_dtype=np.dtype("uint8"), halo=Coord((4, 4, 4)), context=Coord((0, 0, 0)),
                          input_extra=Coord((0, 0, 0)), step=Coord((8, 8, 8)), base_block=Coord((16, 16, 16)),
                          roi=Box(Coord((0, 0, 0)), Coord((256, 256, 256))), fixed_batch=1)
    tried, clock = [], TrialClock()

    def run(block: Coord, batch: int) -> Trial:
        tried.append(block)
        seconds = problem.input_shape(block).prod() * batch * 1e-5
        clock.sleep(seconds)
        return Trial(block, batch, "ok", block.prod() * batch / seconds / 1e6, seconds)

    choice = search(problem, run, max_total_s=1.0, coarse=True, clock=clock)
    # 24^3 takes 0.14 s, 40^3 0.64 s; 72^3 would take 3.7 s more: not started.
    assert tried == [Coord((16, 16, 16)), Coord((32, 32, 32))]
    # Not timed, but chosen: 64 blocks of 72^3 compute 23.9 M input voxels over the region, 512 of 40^3 32.8 M.
    assert choice.block == Coord((64, 64, 64)) and choice.estimated and choice.batch_size == 1
    assert "estimated" in str(choice)


def test_a_known_trial_foresees_a_trial_of_two_passes_a_warm_up_and_a_timed_one():
    """The caller's timed pass of the start block is known; a trial of the next block runs two passes (as
    trial_runner's quick trials do): foreseen at one, a 2.1 s run's 0.5 s budget was spent twice over."""
    problem = dataclasses.replace(_quick_problem(), fixed_batch=1)
    tried = []

    def run(block: Coord, batch: int) -> Trial:
        tried.append(block)
        seconds = problem.input_shape(block).prod() * 1e-6
        return Trial(block, batch, "ok", block.prod() / seconds / 1e6, seconds)

    known = run(Coord((16, 16, 16)), 1)  # 24^3: 0.014 s a pass; 32^3's input 40^3: 0.064 s, a trial 0.128 s
    tried.clear()
    # 32^3, untimed
    assert search(problem, run, max_total_s=0.1, coarse=True, known=(known,), clock=TrialClock()).estimated
    assert tried == []  # 0.064 s would fit 0.1 s; the 0.128 s a trial takes does not
    search(problem, run, max_total_s=0.2, coarse=True, known=(known,), clock=TrialClock())
    assert tried[0] == Coord((32, 32, 32))


@pytest.mark.parametrize("larger_pays", [True, False], ids=["larger-block-faster", "smaller-block-faster"])
def test_the_quick_search_doubles_the_batch_of_the_fastest_and_the_largest_block_only(larger_pays):
    """A batch of a coarse block below a larger one that fit runs that block's voxels a call with more halo
    (unet12 on a CPU: 10.8 s of 22.3 s measuring went on batches of 64^3 after 128x120x120 won)."""
    problem = _quick_problem()
    tried = []

    def run(block: Coord, batch: int) -> Trial:  # seconds grow with the input's voxels; a call costs 0.2 s more
        tried.append((block[0], batch))
        if block[0] > 128:
            return Trial(block, batch, "out of memory")
        per_voxel = 1e-6 if larger_pays or block[0] < 64 else 8e-6
        seconds = problem.input_shape(block).prod() * batch * per_voxel + 0.2
        return Trial(block, batch, "ok", block.prod() * batch / seconds / 1e6, seconds)

    choice = search(problem, run, max_total_s=60.0, coarse=True, guess=NO_GUESSING)
    batched = {size for size, batch in tried if batch > 1}
    if larger_pays:  # 16, 32, 64, 128 fit; the largest is the fastest
        assert batched == {128} and choice.block == Coord((128, 128, 128)) and choice.batch_size > 1
    else:  # 64^3 and above are 8x slower per voxel: 32^3 is the fastest, 64^3 the largest timed (128^3 is
        # not tried: 64^3 gave none of the halo it saved, see foreseen_saving_s); 64^3's pass grows faster
        # than its voxels from 32^3's, so no cost of a call is left for a batch of it to save
        assert batched == {32} and choice.block == Coord((32, 32, 32)) and choice.batch_size > 1
    assert (16, 2) not in tried


@pytest.mark.parametrize("per_call_s, batched", [(0.002, False), (0.1, True)], ids=["cpu-like", "gpu-like"])
def test_the_quick_search_tries_no_batch_whose_trial_costs_more_than_a_batch_may_save(per_call_s, batched):
    """On a CPU a pass takes time in proportion to its voxels: a batch saves only the little a call costs
    beyond them (tiny over 63 Mvox on 2 cores: 0.35 s over the region, for a 3-4 s trial of two blocks)."""
    problem = _quick_problem()
    tried, clock = [], TrialClock()

    def run(block: Coord, batch: int) -> Trial:  # a call's cost plus the input's voxels, on the trials' clock
        tried.append((block[0], batch))
        if block[0] > 128:
            return Trial(block, batch, "out of memory")
        seconds = per_call_s + problem.input_shape(block).prod() * batch * 2e-9
        clock.sleep(seconds)
        return Trial(block, batch, "ok", block.prod() * batch / seconds / 1e6, seconds)

    choice = search(problem, run, max_total_s=60.0, coarse=True, guess=NO_GUESSING, trial_passes=1, clock=clock)
    # 128^3 is the fastest and the largest (8 blocks over the region).  cpu-like: a batch of 2 may save
    # 4 calls x 2 ms, its trial takes ~0.014 s.  gpu-like: 4 calls x 0.1 s against a ~0.21 s trial.
    assert [size for size, _ in tried if size < 256] == [16, 32, 64, 128] + ([128] if batched else [])
    assert ((128, 2) in tried) == batched and (choice.batch_size > 1) == batched
    assert choice.block == Coord((128, 128, 128))


@pytest.mark.parametrize("coarse", [False, True], ids=["block-auto", "measured-defaults"])
def test_the_search_never_returns_a_block_slower_over_the_region_than_its_start_block(coarse):
    """The H100's --block auto for cremi2018 returned a block slower than the one it started from (81x702x702 at
    94 Mvox/s): whatever the device does with larger or smaller blocks, the start block is timed and the
    choice is at least as fast over the region."""
    problem = dataclasses.replace(_quick_problem(), base_block=Coord((32, 32, 32)))
    clock = TrialClock()

    def run(block: Coord, batch: int) -> Trial:  # 32^3 is the sweet spot: per input voxel, 3x slower off it
        per_voxel = 1e-8 if block == Coord((32, 32, 32)) and batch == 1 else 3e-8
        seconds = problem.input_shape(block).prod() * batch * per_voxel
        clock.sleep(seconds)
        return Trial(block, batch, "ok", block.prod() * batch / seconds / 1e6, seconds)

    choice = search(problem, run, max_total_s=60.0, coarse=coarse, clock=clock)
    start = next(t for t in choice.trials if t.block == Coord((32, 32, 32)) and t.batch_size == 1)
    assert choice.block == Coord((32, 32, 32)) and choice.batch_size == 1
    assert choice.mvox_per_s >= problem.roi_mvox_per_s(start)


def test_the_quick_search_tries_no_larger_block_whose_trial_costs_more_than_it_may_save():
    problem = dataclasses.replace(_quick_problem(), fixed_batch=1)
    tried, clock = [], TrialClock()

    def run(block: Coord, batch: int) -> Trial:  # seconds in proportion to the input's voxels, on the trials' clock
        tried.append(block[0])
        seconds = problem.input_shape(block).prod() * 4e-8
        clock.sleep(seconds)
        return Trial(block, batch, "ok", block.prod() / seconds / 1e6, seconds)

    choice = search(problem, run, max_total_s=60.0, coarse=True, guess=NO_GUESSING, trial_passes=1, clock=clock)
    # 128^3 computes 0.79x the voxels of 64^3 over the region: ~0.2 s saved for a 0.1 s trial.  256^3
    # (one block) computes 0.93x those of 128^3: ~0.05 s saved for a 0.7 s trial: not tried.
    assert tried == [16, 32, 64, 128] and choice.block == Coord((128, 128, 128))


def test_the_foreseen_saving_counts_the_halo_saved_discounted_by_what_the_last_larger_block_gave():
    problem = dataclasses.replace(_quick_problem(), fixed_batch=1)
    computed = problem.computed_voxels

    def trial(size: int, seconds_per_computed_voxel: float) -> Trial:
        block = Coord((size,) * 3)
        seconds = problem.input_shape(block).prod() * seconds_per_computed_voxel
        return Trial(block, 1, "ok", block.prod() / seconds / 1e6, seconds)

    halo_gain = computed(Coord((64, 64, 64))) / computed(Coord((128, 128, 128)))
    run_s = computed(Coord((64, 64, 64))) * 1e-8  # the region at 64^3, the fastest trial
    assert foreseen_saving_s(problem, [trial(64, 1e-8)], Coord((128, 128, 128))) == pytest.approx(
        run_s * (1 - 1 / halo_gain))
    # 64^3 gave half of the halo it saved against 32^3 (in log terms): 128^3 is foreseen to give half too.
    gained = (computed(Coord((32, 32, 32))) / computed(Coord((64, 64, 64)))) ** 0.5
    slower = 1e-8 * computed(Coord((32, 32, 32))) / computed(Coord((64, 64, 64))) / gained
    trials = [trial(32, 1e-8), trial(64, slower)]
    run_s = computed(Coord((64, 64, 64))) * slower
    assert foreseen_saving_s(problem, trials, Coord((128, 128, 128))) == pytest.approx(
        run_s * (1 - halo_gain ** -0.5))
    # A larger block that gave nothing: nothing foreseen.
    flat = [trial(32, 1e-8), trial(64, 1e-8 * computed(Coord((32, 32, 32))) / computed(Coord((64, 64, 64))))]
    assert foreseen_saving_s(problem, flat, Coord((128, 128, 128))) == pytest.approx(0.0, abs=1e-12)


class TrialClock:
    """The search's clock, moved only by the trials that "sleep" on it: what the search decides from the
    time its trials took does not hang on how loaded the machine running the suite is."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _quick_problem() -> SizeProblem:
    return SizeProblem(in_channels=1, raw_dtype=np.dtype("uint8"), halo=Coord((4, 4, 4)), context=Coord((0, 0, 0)),
                       input_extra=Coord((0, 0, 0)), step=Coord((8, 8, 8)), base_block=Coord((16, 16, 16)),
                       roi=Box(Coord((0, 0, 0)), Coord((256, 256, 256))))


def _timed(block: int, seconds_per_input_voxel: float, outcome: str = "ok") -> Trial:
    seconds = (block + 8) ** 3 * seconds_per_input_voxel
    return Trial(Coord((block,) * 3), 1, outcome, block ** 3 / seconds / 1e6, seconds)


def test_an_untimed_block_is_chosen_only_while_larger_blocks_pay_and_nothing_was_refused_for_memory():
    problem = _quick_problem()
    paying = [_timed(16, 1e-6), _timed(32, 1e-6)]
    assert pick(problem, paying, extrapolate=True).block == Coord((64, 64, 64))
    assert pick(problem, paying).block == Coord((32, 32, 32))  # the full search chooses only what it timed
    # 32^3 slower per input voxel than 16^3 by more than the halo it saves: larger blocks stopped paying.
    assert pick(problem, [_timed(16, 1e-6), _timed(32, 2e-6)], extrapolate=True).block == Coord((16, 16, 16))
    refused = paying + [Trial(Coord((64, 64, 64)), 2, "out of memory")]
    assert pick(problem, refused, extrapolate=True).block == Coord((32, 32, 32))
    # The whole region is one timed block: nothing larger to estimate.
    whole = [_timed(16, 1e-6), _timed(128, 1e-6), _timed(256, 1e-6)]
    assert pick(problem, whole, extrapolate=True).block == Coord((256, 256, 256))


def test_an_untimed_block_reads_at_most_growth_times_the_largest_timed_input():
    problem = _quick_problem()  # halo 4: 32^3 reads 40^3, 64^3 reads 72^3 (5.8 times as much)
    paying = [_timed(16, 1e-6), _timed(32, 1e-6)]
    assert pick(problem, paying, extrapolate=True, guess=Guessing(growth=6.0)).block == Coord((64, 64, 64))
    choice = pick(problem, paying, extrapolate=True, guess=Guessing(growth=4.0))
    assert choice.block == Coord((32, 32, 32)) and not choice.estimated
    # A GPU takes the next block untimed at any growth; a CPU only with OpenVINO (flat per voxel), not with torch.
    assert guessing("cuda") == guessing("cuda", "torch") == Guessing(growth=math.inf, reach=1)
    assert guessing("cpu", "openvino").growth == 10.0 and guessing("cpu", "openvino").reach is None
    assert guessing("cpu", "openvino").cold_passes == 1.0 and guessing("cuda").cold_passes == 0.0
    assert not guessing("cpu").untimed and not guessing("cpu", "onnxruntime").untimed


def test_a_guess_is_the_best_estimate_its_reach_allows_and_the_memory_budget_holds():
    problem = _quick_problem()  # from 16^3 (reads 24^3): 32^3 reads 40^3 (4.6x), 64^3 72^3 (27x), 128^3 (2.3e2 x)
    start = [_timed(16, 1e-6)]
    assert pick(problem, start, extrapolate=True).block == Coord((32, 32, 32))  # a GPU: the next one only
    wide = Guessing(growth=30.0, reach=None)
    assert pick(problem, start, extrapolate=True, guess=wide).block == Coord((64, 64, 64))
    assert pick(problem, start, extrapolate=True, guess=Guessing(growth=10.0, reach=None)).block == Coord((32,) * 3)
    held = pick(problem, start, extrapolate=True, guess=wide, holds=lambda block: block[0] < 64)
    assert held.block == Coord((32, 32, 32)) and held.estimated
    nothing = pick(problem, start, extrapolate=True, guess=wide, holds=lambda block: False)
    assert nothing.block == Coord((16, 16, 16)) and not nothing.estimated
    # The region in one pass of 264^3 computes less than in 8 of 136^3; counted with its first pass twice (cold:
    # memory faulted in), the 8 win.
    anywhere = Guessing(growth=math.inf, reach=None)
    assert pick(problem, start, extrapolate=True, guess=anywhere).block == Coord((256, 256, 256))
    cold = Guessing(growth=math.inf, reach=None, cold_passes=1.0)
    assert pick(problem, start, extrapolate=True, guess=cold).block == Coord((128, 128, 128))


@pytest.mark.parametrize("region, timed", [(64, False), (1024, True)], ids=["short-run", "long-run"])
def test_a_block_the_search_may_guess_is_timed_only_where_its_trial_is_a_small_share_of_the_run(region, timed):
    """OpenVINO on the CPU costs the same per input voxel at every block: a trial of a block the search may take
    untimed tells little, and cost a short first run 1.3-5.1 s of 7-28 s (four networks at 18.9 Mvox)."""
    problem = dataclasses.replace(_quick_problem(), roi=Box.from_shape(Coord((region,) * 3)))
    tried, clock = [], TrialClock()

    def run(block: Coord, batch: int) -> Trial:  # seconds in proportion to the input's voxels, on the trials' clock
        tried.append((block[0], batch))
        seconds = problem.input_shape(block).prod() * 1e-7
        clock.sleep(seconds)
        return Trial(block, batch, "ok", block.prod() * batch / seconds / 1e6, seconds)

    known = (run(Coord((16, 16, 16)), 1),)
    tried.clear()
    guess = Guessing(growth=10.0, reach=None, trial_share=0.05)
    choice = search(problem, run, max_total_s=1e9, coarse=True, known=known, guess=guess, trial_passes=2,
                    clock=clock)
    # 32^3's trial: two passes of 40^3, 0.013 s.  The run at 16^3 (24^3 a pass): 64^3, 64 blocks, 0.088 s (the
    # trial 15% of it); 1024^3, 262144 blocks, 362 s.
    if timed:
        assert tried[0] == (32, 1)
    else:  # guessed (32^3 computes 0.58x the voxels over the region), and no batch of 16^3 is tried instead
        assert tried == [] and choice.block == Coord((32, 32, 32)) and choice.estimated
    # Without the share (a GPU), the same search times 32^3 whatever the run.
    clock2 = TrialClock()
    tried.clear()
    search(problem, run, max_total_s=1e9, coarse=True, known=known, trial_passes=2, clock=clock2)
    assert tried and tried[0] == (32, 1)


def test_a_network_with_no_halo_starts_at_a_block_that_amortises_per_block_costs(tmp_path):
    """The copy network's command at 64^3 ran at 0.6 of its Mvox/s at 64x256x256 (bench/bench_host_path.py):
    with nothing wasted in halos the larger block is never slower, and it is what the defaults choose."""
    data = np.random.default_rng(5).integers(0, 255, (64, 256, 256), dtype=np.uint8)
    source = write_test_volume(str(tmp_path / "in.zarr"), data, chunks=(64, 64, 64))
    summary = blockpred.predict(source, str(tmp_path / "out.zarr"), model="blockpred.models.standin:copy",
                                halo=0, output_dtype="uint8", progress=False)
    assert summary.plan.block_shape == Coord((64, 256, 256)) and summary.stats.num_blocks == 1
    out = _read(str(tmp_path / "out.zarr"))
    assert out.shape == (3, 64, 256, 256) and all(np.array_equal(channel, data) for channel in out)


def test_a_network_with_a_halo_keeps_the_start_block_when_the_run_is_too_short_to_measure(tmp_path):
    data = np.random.default_rng(5).integers(0, 255, (64, 128, 128), dtype=np.uint8)
    source = write_test_volume(str(tmp_path / "in.zarr"), data, chunks=(64, 64, 64))
    summary = blockpred.predict(source, str(tmp_path / "out.zarr"), model="blockpred.models.standin:copy",
                                halo=4, output_dtype="uint8", progress=False)
    assert summary.plan.block_shape == Coord((64, 64, 64))


@pytest.mark.slow
@pytest.mark.parametrize("shape", [pytest.param((32, 128, 128), id="a-larger-block-saves-halo"),
                                   pytest.param((24, 72, 72), id="the-start-block-overhangs")])
def test_on_a_stand_in_device_the_defaults_never_choose_a_block_slower_than_the_start_block(tmp_path, shape):
    """The stand-in copies its input and sleeps input voxels / rate, as a device would: a plan's device seconds
    are its blocks x input voxels / rate, known without a clock.  The measured (or estimated) choice must not
    cost more than the start block's plan by over 10% (the issue: measuring once chose 64^3, half as fast)."""
    data = np.random.default_rng(6).integers(0, 255, shape, dtype=np.uint8)
    source = write_test_volume(str(tmp_path / "in.zarr"), data)
    halo = Coord((4, 8, 8))
    rate = 0.5  # input Mvox/s: a 32x64x64 block (input 40x80x80) sleeps 0.51 s; runs estimated at 2-3 s
    summary = blockpred.predict(source, str(tmp_path / "out.zarr"), model="blockpred.models.standin:device",
                                model_kwargs={"rate_mvox_per_s": rate}, halo=tuple(halo), output_dtype="uint8",
                                progress=False)
    roi = Box.from_shape(Coord(shape))

    def device_s(block: Coord) -> float:
        from blockpred.pipeline.blocking import blocks_per_axis

        return blocks_per_axis(roi, block).prod() * (block + halo * 2).prod() / (rate * 1e6)

    start = Coord((64, 64, 64)).minimum(Coord(shape))
    assert summary.defaults.how.startswith("measured") and summary.defaults.block is not None
    assert device_s(summary.plan.block_shape) <= device_s(start) / 0.9
    assert np.array_equal(_read(str(tmp_path / "out.zarr"))[0], data)  # and it is the copy it should be


def test_a_run_says_before_it_starts_when_it_will_be_long_or_its_precision_is_slow_on_the_cpu():
    import torch

    from blockpred.tuning.defaults import Defaults
    from blockpred.run.prepare import _long_run_warning

    cpu = torch.device("cpu")
    hours = Defaults(block=None, batch_size=1, memory_format=None, estimated_run_s=3 * 3600, measured_s=0, how="")
    assert _long_run_warning(hours, cpu).startswith("this run is estimated at 3.0 h on cpu")
    assert "--device cuda" in _long_run_warning(hours, cpu)
    assert _long_run_warning(Defaults(None, 1, None, 599.0, 0, ""), cpu) == ""
    # A run measures bf16 against fp32 on its first block and warns where it is slower (tests/run/test_cpu_precision.py);
    # one that does not (blockpred plan) warns where torch's autocast runs it.
    from blockpred.run.cpu_precision import slow_precision_warning

    assert "use --precision fp32" in slow_precision_warning("bf16", cpu, "torch")
    assert slow_precision_warning("fp32", cpu, "torch") == slow_precision_warning("bf16", torch.device("cuda"), "torch") == ""
