"""A run's start-up, pass by pass, on the stand-in GPU (issue 47): cuDNN's kernel search only where it pays, and a
cached run that repeats nothing.

:class:`blockpred.models.standin.StandInGpu` plays a GPU's kernel search on any device: while the search is on, its
first pass at each new shape and precision takes ``search_s`` more, and every pass is a line of its log (shape,
precision, and whether it searched).  The runs here are real ``blockpred.predict`` runs into real zarr outputs,
each test with its own cache directory (conftest); what they assert is counted in the log, never timed.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

import blockpred
from blockpred.tuning.search import (MEASURING_PASSES, PRIOR_GAIN, PRIOR_SEARCH_PASSES, SearchCache, SearchRecord,
                                     choose_search, worth_measuring)
from tests.helpers import read_volume, write_test_volume

RADIUS = (4, 8, 8)


def _passes(log) -> list[tuple[str, str, str]]:
    """(shape, precision, kind) of each pass in the log; kind: search, searched or heuristic."""
    if not log.exists():
        return []
    return [tuple(line.split()[1:]) for line in log.read_text().splitlines()]


def _run(source: str, output, log, *, rate: float = 60.0, search_s: float = 0.05, gain: float = 0.08, **options):
    return blockpred.predict(source, str(output), model="blockpred.models.standin:gpu",
                             model_kwargs={"rate_mvox_per_s": rate, "search_s": search_s, "gain": gain,
                                           "log": str(log), "receptive_radius": RADIUS},
                             output_dtype="uint8", progress=False, device="cpu", overwrite=True, **options)


def _steady(summary) -> str:
    """The shape of the run's own passes: its batch of block inputs."""
    return "x".join(map(str, (summary.batch_size, 1, *summary.plan.input_shape)))


@pytest.fixture
def volume(tmp_path):
    data = np.random.default_rng(47).integers(0, 255, (64, 192, 192), dtype=np.uint8)
    return write_test_volume(str(tmp_path / "in.zarr"), data), data


def test_a_cached_run_makes_no_dry_run_no_count_no_trial_and_at_most_one_search(tmp_path, volume):
    """Runs at the defaults until every choice is cached (the first measures, later ones may go on with a search
    their budget cut short); the cached run's passes are its blocks', all at one shape, with one search at most.
    The dask path (``--workers 1``: one worker, in this process) starts up the same way from that cache."""
    source, data = volume
    log = tmp_path / "passes.log"
    rate = 3.0  # input Mvox/s: the run is estimated at about 1.5 s, long enough to measure its defaults
    first = _run(source, tmp_path / "out.zarr", log, rate=rate)
    assert len(_passes(log)) > first.stats.num_blocks  # the first run's dry run, count and trials
    for _ in range(5):
        log.unlink()
        summary = _run(source, tmp_path / "out.zarr", log, rate=rate)
        if summary.defaults is not None and summary.defaults.how == "cached":
            break
    else:
        pytest.fail(f"no run's choices were all cached: {summary.defaults}")
    passes = _passes(log)
    batches = math.ceil(summary.stats.num_blocks / summary.batch_size)
    assert {shape for shape, _, _ in passes} == {_steady(summary)}, passes
    assert len(passes) == batches, passes  # no dry run, no count, no trial: the blocks' passes only
    assert sum(kind == "search" for _, _, kind in passes) <= 1
    assert np.array_equal(read_volume(str(tmp_path / "out.zarr"))[0], data)
    log.unlink()
    on_dask = _run(source, tmp_path / "out.zarr", log, rate=rate, local=False, workers=1)
    assert on_dask.workers and on_dask.defaults.how == "cached"
    assert len(_passes(log)) == batches and {shape for shape, _, _ in _passes(log)} == {_steady(summary)}


def test_a_precision_check_runs_once_and_a_later_run_takes_it_from_the_cache(tmp_path, volume):
    """A named bf16 on the CPU is compared with fp32 on the first block (its fp32 passes in the log); the second run
    takes the check from the cache: its passes are its blocks' only, at bf16, and its note is the first run's."""
    source, _ = volume
    log = tmp_path / "passes.log"
    named = dict(block=(64, 96, 96), batch_size=1, memory_format="contiguous", precision="bf16")
    first = _run(source, tmp_path / "out.zarr", log, **named)
    assert any(precision == "float32" for _, precision, _ in _passes(log)) and first.precision_note
    log.unlink()
    again = _run(source, tmp_path / "out.zarr", log, **named)
    assert {(shape, precision) for shape, precision, _ in _passes(log)} == {(_steady(again), "bfloat16")}
    assert len(_passes(log)) == again.stats.num_blocks and again.precision_note == first.precision_note


def test_a_first_run_searches_only_the_shape_it_keeps_and_at_most_once(tmp_path, volume):
    """The field is stated, so the first run's one-off passes are its dry run, its trials and its layouts: none
    searches.  Whatever the run decides for its own passes, a search happens at its steady shape only, once."""
    source, _ = volume
    log = tmp_path / "passes.log"
    summary = _run(source, tmp_path / "out.zarr", log)
    passes = _passes(log)
    searched = [shape for shape, _, kind in passes if kind == "search"]
    assert len(searched) <= 1 and set(searched) <= {_steady(summary)}, passes
    one_off = passes[:-math.ceil(summary.stats.num_blocks / summary.batch_size)]
    assert one_off and all(kind == "heuristic" for _, _, kind in one_off), one_off


@pytest.mark.parametrize("record", [pytest.param(SearchRecord(0.01, 0.002, 0.001), id="pays"),
                                    pytest.param(SearchRecord(30.0, 0.002, 0.001), id="does-not-pay")])
def test_a_long_run_measures_the_search_once_and_later_runs_follow_the_cached_record(tmp_path, volume, record):
    """288 blocks at batch 1, more than the passes after which a search could pay: the first run measures it
    (two passes without, two with, the first of these the only search) and caches the record; the next run
    measures nothing and searches once where the record says the search pays over its passes, else never.
    The record measured on a stand-in is a matter of sleeps a loaded machine stretches: the test puts the one
    each case needs in its place (a GPU's 30 s search, or one that pays after 10 passes)."""
    source, _ = volume
    log = tmp_path / "passes.log"
    options = dict(block=(8, 32, 32), batch_size=1, memory_format="contiguous")
    first = _run(source, tmp_path / "out.zarr", log, **options)
    batches = first.stats.num_blocks
    assert worth_measuring(batches)
    passes = _passes(log)
    measuring = passes[:-batches][-MEASURING_PASSES:]  # the last passes before the blocks'
    assert measuring == [(_steady(first), "float32", kind) for kind in ("heuristic", "heuristic", "search",
                                                                        "searched")], passes[:8]
    assert sum(kind == "search" for _, _, kind in passes) == 1
    [entry] = SearchCache()._file.read().values()
    assert entry["search_s"] >= 0 and entry["heuristic_s"] > 0 and entry["searched_s"] > 0
    kept = entry["heuristic_s"] > entry["searched_s"]  # paid already: kept where a searched pass was faster
    assert {kind for _, _, kind in passes[-batches:]} == {"searched" if kept else "heuristic"}
    SearchCache().put(entry["key"], record)

    log.unlink()
    _run(source, tmp_path / "out.zarr", log, **options)
    passes = _passes(log)
    assert len(passes) == batches  # nothing measured again
    assert sum(kind == "search" for _, _, kind in passes) == int(record.pays(batches))
    assert {kind for _, _, kind in passes} <= ({"search", "searched"} if record.pays(batches) else {"heuristic"})


def test_a_short_run_never_searches(tmp_path, volume):
    """Four blocks: no search could pay for itself, so none is measured and every pass runs without it."""
    source, _ = volume
    log = tmp_path / "passes.log"
    summary = _run(source, tmp_path / "out.zarr", log, block=(64, 96, 96), batch_size=1,
                   memory_format="contiguous")
    assert not worth_measuring(summary.stats.num_blocks)
    assert {kind for _, _, kind in _passes(log)} == {"heuristic"}
    assert not SearchCache()._file.read()


class _Predictor:
    """What :func:`choose_search` reads of a predictor: its device, backend, precision, layout and module."""

    def __init__(self, module, device: str = "cpu"):
        import torch

        self.module, self.device, self.backend = module, torch.device(device), "torch"
        self.precision, self.memory_format, self.search = "fp32", "contiguous", True


@pytest.mark.parametrize("passes", [10, 10_000])
def test_a_client_that_cannot_measure_follows_a_cached_record_else_the_measured_prior(passes):
    """A client whose blocks run on workers (a cluster, a scheduler) times nothing: with a record cached the record
    decides, without one the H200's search and gain do (:data:`PRIOR_GAIN`)."""
    from blockpred.models.standin import StandInGpu

    predictor = _Predictor(StandInGpu())
    choice = choose_search(predictor, (1, 1, 16, 32, 32), passes, {"name": "x"}, measure=False)
    assert choice.on == predictor.search == (passes * PRIOR_GAIN > PRIOR_SEARCH_PASSES)
    cache = SearchCache()
    record = SearchRecord(search_s=1.0, heuristic_s=0.0105, searched_s=0.01)  # pays after 2000 passes
    from blockpred.tuning.search import _key

    cache.put(_key(predictor, (1, 1, 16, 32, 32), {"name": "x"}), record)
    choice = choose_search(predictor, (1, 1, 16, 32, 32), passes, {"name": "x"}, measure=False)
    assert choice.on == predictor.search == (passes > 2000) and "cached" in choice.how


def test_a_device_that_searches_no_kernels_never_searches():
    """A CPU network that plays no GPU: off, nothing measured, whatever the run's length."""
    import torch

    predictor = _Predictor(torch.nn.Conv3d(1, 1, 3, padding=1))
    choice = choose_search(predictor, (1, 1, 16, 32, 32), 10**6, {"name": "conv"})
    assert not choice.on and not predictor.search
    assert Counter(SearchCache()._file.read()) == Counter()
