"""cuDNN's kernel search, only where it pays.

With ``torch.backends.cudnn.benchmark`` on, cuDNN times its kernels for every
input shape and precision the first time it meets them.  cremi2018 at bf16 on
an input of 92x756x756, on an H200 (2026-11-27): the first pass took 17.52 s
with the search, 0.448 s without; the searched kernels then ran a pass in
0.190 s against 0.207 s.  A run's one-off passes (the field, the dry run, the
precision check, the trials) never pay for it: a
:class:`~blockpred.pipeline.Predictor` runs with the search off unless its
``search`` is set, which :func:`choose_search` does for the run's steady shape
(its blocks' input and batch) where it pays:

* a :class:`SearchRecord` cached for this network, device, shape, precision
  and layout (the search's seconds, a pass with and without it): on where the
  passes left times the seconds a pass saves exceed the search's seconds;
* none cached: where a search could pay at all, the passes left times
  :data:`MAX_GAIN` of a pass exceeding :data:`PRIOR_SEARCH_PASSES` passes (the
  H200's search above, in its passes), it is measured in four passes
  (:func:`measure_search`: two without, two with, the first of these paying
  the search), cached, and kept where its passes are faster (it is paid by
  then); a run too short for that never searches.  A client whose blocks run
  on other machines measures nothing: without a record, the workers search
  where the H200's search and gain (:data:`PRIOR_GAIN`) would pay.

Only a device that searches is measured: CUDA, and the stand-in GPU
(:class:`blockpred.models.standin.StandInGpu`, which says
``plays_kernel_search``) that lets a machine without one count the passes and
searches a run makes.  Workers of a dask run follow the client's choice
(:attr:`blockpred.pipeline.job.Job.kernel_search`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..cache import JsonFile, default_cache_dir, digest
from ..pipeline import Predictor

logger = logging.getLogger(__name__)

#: A search's cost where none was measured, in passes of the shape it searches (17.52 s / 0.19 s on an H200).
PRIOR_SEARCH_PASSES = 90
#: The most of a pass a search is assumed to save before one is measured.
MAX_GAIN = 0.5
#: What a search saves of a pass where none was measured and none can be (0.190 against 0.207 s on the H200).
PRIOR_GAIN = 0.08
#: The passes :func:`measure_search` takes (two without the search, two with it).
MEASURING_PASSES = 4
CACHE_VERSION = 1


@dataclass(frozen=True)
class SearchRecord:
    """What the search cost at one shape, and a warm pass's seconds without it and with it."""

    search_s: float
    heuristic_s: float
    searched_s: float
    cached: bool = False

    @property
    def saved_s(self) -> float:
        """Seconds a searched pass saves (negative where the search found slower kernels)."""
        return self.heuristic_s - self.searched_s

    def pays(self, passes: float) -> bool:
        return self.saved_s > 0 and passes * self.saved_s > self.search_s


@dataclass(frozen=True)
class SearchChoice:
    """Whether the run's steady passes search, and why (a line of the ``-v`` log)."""

    on: bool
    how: str

    def __str__(self) -> str:
        return f"kernel search {'on' if self.on else 'off'}: {self.how}"


def searches_kernels(predictor: Predictor) -> bool:
    """Whether the predictor's device searches kernels at a new shape: CUDA with cuDNN, in torch; a stand-in that
    plays one."""
    import torch

    if getattr(predictor.module, "plays_kernel_search", False):
        return True
    return predictor.device.type == "cuda" and predictor.backend == "torch" and torch.backends.cudnn.is_available()


def worth_measuring(passes: float) -> bool:
    """Whether a run of ``passes`` could repay a search of :data:`PRIOR_SEARCH_PASSES` passes and its measuring."""
    return passes * MAX_GAIN > PRIOR_SEARCH_PASSES + MEASURING_PASSES


def choose_search(predictor: Predictor, shape: tuple[int, ...], passes: float, model_key: dict, *,
                  measure: bool = True, cache: "SearchCache | None" = None) -> SearchChoice:
    """Whether the run's ``passes`` (batches left, per worker) at ``shape`` (B, C, Z, Y, X) search (see the module
    docstring); sets ``predictor.search`` to it.  ``measure``: this process may time passes for the device the
    blocks run on (else only a cached record decides, and a run without one does not search)."""
    predictor.search = False
    if not searches_kernels(predictor):
        return SearchChoice(False, "the device does not search kernels")
    cache = cache if cache is not None else SearchCache()
    key = _key(predictor, shape, model_key)
    record = cache.get(key)
    if record is None and measure and worth_measuring(passes):
        record = measure_search(predictor, shape)
        cache.put(key, record)
        on = record.saved_s > 0  # paid already: kept where it made passes faster
        predictor.search = on
        return SearchChoice(on, f"measured: the search took {record.search_s:.2f} s and a pass "
                                f"{record.searched_s:.3f} s with it, {record.heuristic_s:.3f} s without")
    if record is None and not measure:  # the workers' device, not this process's: the H200's search and gain
        predictor.search = passes * PRIOR_GAIN > PRIOR_SEARCH_PASSES
        return SearchChoice(predictor.search, f"not measured here: {passes:.0f} passes per worker, and a search of "
                            f"{PRIOR_SEARCH_PASSES} passes saving {PRIOR_GAIN:.0%} of each pays after "
                            f"{PRIOR_SEARCH_PASSES / PRIOR_GAIN:.0f}")
    if record is None:
        return SearchChoice(False, f"{passes:.0f} passes left: too few for a search to pay (one saving "
                            f"{MAX_GAIN:.0%} of each pays after {(PRIOR_SEARCH_PASSES + MEASURING_PASSES) / MAX_GAIN:.0f})")
    predictor.search = record.pays(passes)
    verdict = "pays" if predictor.search else "does not pay"
    return SearchChoice(predictor.search, f"cached: a search of {record.search_s:.2f} s saving "
                        f"{record.saved_s:.4f} s a pass {verdict} over {passes:.0f} passes")


def measure_search(predictor: Predictor, shape: tuple[int, ...]) -> SearchRecord:
    """Two passes at ``shape`` without the search (the second timed), then two with it (the first pays the search,
    the second is timed); ``predictor.search`` is left off."""
    batch = np.random.default_rng(0).random(shape, dtype=np.float32)

    def timed() -> float:
        started = time.perf_counter()
        predictor(batch)
        return time.perf_counter() - started

    try:
        predictor.search = False
        timed()
        heuristic = timed()
        predictor.search = True
        first = timed()
        searched = timed()
    finally:
        predictor.search = False
    return SearchRecord(max(0.0, first - searched), heuristic, searched)


def _key(predictor: Predictor, shape: tuple[int, ...], model_key: dict) -> dict:
    import torch

    cuda = predictor.device.type == "cuda"
    return {"version": CACHE_VERSION, "model": model_key, "shape": list(shape), "precision": predictor.precision,
            "memory_format": predictor.memory_format,
            "device": torch.cuda.get_device_name(predictor.device) if cuda else predictor.device.type,
            "torch": torch.__version__, "cudnn": torch.backends.cudnn.version() if cuda else None}


class SearchCache:
    """Searches measured, by key, in one JSON file of the cache directory (``searches.json``)."""

    def __init__(self, path: Path | None = None):
        self.path = path if path is not None else default_cache_dir() / "searches.json"
        self._file = JsonFile(self.path)

    def get(self, key: dict) -> SearchRecord | None:
        entry = self._file.read().get(digest(key))
        try:
            return SearchRecord(float(entry["search_s"]), float(entry["heuristic_s"]), float(entry["searched_s"]),
                                cached=True)
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: dict, record: SearchRecord) -> None:
        self._file.merge({digest(key): {"key": key, "search_s": record.search_s, "heuristic_s": record.heuristic_s,
                                        "searched_s": record.searched_s}}, "the kernel search's cost")
