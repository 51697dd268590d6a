"""``--memory-format auto`` and ``--backend auto``: what runs this network fastest on this device, measured once.

``channels_last_3d`` halves the time of one 3D U-Net and does nothing for
another (issue 5 measured no gain on ``tiny``; a user's 12-feature U-Net ran
2.1x faster on two CPU cores), so it is measured, not guessed: one warm-up
and :data:`REPEATS` timed passes of the run's batch at the run's network input
shape in each layout (the caller passes a batch of one block: the layouts
compare the same at any batch, and one block fits where the run's batch may
not; a layout that runs out of memory even so loses).  The faster wins when it
is at least :data:`MIN_GAIN` faster, else ``contiguous``, the layout every
network supports.  The choice is
cached per model, weights, device, precision and shape in ``formats.json`` of
the cache directory (:mod:`blockpred.cache`), so only the first run pays.
Both layouts compute the same values (to float rounding): the choice is not
part of a run's fingerprint.

On the CPU OpenVINO is one more candidate (``--backend auto``; see
:mod:`blockpred.pipeline.backends`): its pass is timed after an untimed one
that converts the network (or reads its conversion from the cache) and
checks it against torch; a network that does not convert, or differs, loses.
It wins as a layout does, by :data:`MIN_GAIN` over torch's contiguous pass,
and runs in its own layout.  Its values equal torch's within 1e-5 of the
output range, so it is not part of a run's fingerprint either.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..cache import JsonFile, default_cache_dir
from ..config import MEMORY_FORMATS
from ..pipeline import Predictor, is_out_of_memory
from .sizecache import device_key
from .sizing import quick_trial_passes

REPEATS = 2
MIN_GAIN = 0.05
#: A candidate's seconds where the run's budget left it untimed (it loses; JSON has no infinity).
NOT_TIMED = "not timed"


#: What is timed under each name: (backend, memory format).
CANDIDATES = {"contiguous": ("torch", "contiguous"), "channels_last": ("torch", "channels_last"),
              "openvino": ("openvino", "contiguous")}


@dataclass(frozen=True)
class FormatChoice:
    memory_format: str
    #: Seconds per pass, per candidate (a layout of torch's, or ``openvino``).
    seconds: dict
    cached: bool = False
    #: What runs the network (``torch`` or ``openvino``).
    backend: str = "torch"

    @property
    def name(self) -> str:
        """The winner's name among :data:`CANDIDATES` (its key in :attr:`seconds`)."""
        return "openvino" if self.backend == "openvino" else self.memory_format

    def __str__(self) -> str:
        times = ", ".join(f"{name} {s:.3f} s" if s is not None else f"{name} out of memory or not converted"
                          for name, s in self.seconds.items() if s != NOT_TIMED)
        skipped = [name for name, s in self.seconds.items() if s == NOT_TIMED]
        if skipped:
            times += f"; not timed within the run's budget: {', '.join(skipped)}"
        return f"{self.name} (per pass: {times}; {'cached' if self.cached else 'measured'})"


def choose_memory_format(predictor: Predictor, batch_shape: tuple[int, ...], model_key: dict,
                         cache: JsonFile | None = None, repeats: int = REPEATS, cached_only: bool = False,
                         known: Mapping[str, float] | None = None, quick: bool = False,
                         layouts: tuple[str, ...] = MEMORY_FORMATS,
                         backends: tuple[str, ...] = ("torch",), skip: tuple[str, ...] = (),
                         reference: tuple[np.ndarray, np.ndarray] | None = None) -> FormatChoice | None:
    """The faster layout (and backend) for batches of ``batch_shape`` (B, C, Z, Y, X); ``predictor`` is left in it.

    ``repeats``: timed passes per layout after a warm-up.  ``quick`` (the measured defaults): the passes
    of a quick size trial instead (:func:`blockpred.tuning.sizing.quick_trial_passes`: on a CPU one pass, cold).
    ``cached_only``: None instead of a measurement when nothing is cached.
    ``known``: seconds per (warm) pass already measured for some layouts at this shape: not measured again.
    ``layouts``: torch's layouts to compare (one: a named layout); ``backends``: ``openvino`` among them adds it.
    ``skip``: candidates the run's budget leaves untimed: they lose, and the choice is cached under the full
    set of candidates all the same (a later run reads it rather than measuring again), except where OpenVINO is
    among them: a short first run (a crop tried before the real volume) must not keep a longer run from timing it.
    ``reference``: a batch and torch's fp32 output for it (the known pass's): the batch every candidate is timed
    on, and what a conversion is checked against.
    """
    names = ([*layouts] if "torch" in backends else []) + (["openvino"] if "openvino" in backends else [])
    cache = cache if cache is not None else JsonFile(default_cache_dir() / "formats.json")
    key = json.dumps({"model": model_key, "device": device_key(predictor), "precision": predictor.precision,
                      "compile": predictor.compile, "shape": list(batch_shape),
                      **({"candidates": names} if names != list(MEMORY_FORMATS) else {})},
                     sort_keys=True, default=str)
    entry = cache.read().get(key)
    if isinstance(entry, dict) and entry.get("memory_format") in MEMORY_FORMATS:
        choice = FormatChoice(entry["memory_format"], dict(entry.get("seconds", {})), cached=True,
                              backend=str(entry.get("backend", "torch")))
    elif cached_only:
        return None
    else:
        known = dict(known or {})
        warmups, repeats = (quick_trial_passes(predictor.device.type) - 1, 1) if quick else (1, repeats)
        seconds = {name: known[name] if name in known else math.inf if name in skip
                   else _seconds_per_pass(predictor, name, batch_shape, warmups, repeats, reference)
                   for name in names}
        base = "contiguous" if "contiguous" in seconds else names[0]
        fastest = min(seconds, key=seconds.get)
        winner = fastest if seconds[fastest] < (1 - MIN_GAIN) * seconds[base] else base
        backend, layout = CANDIDATES[winner]
        seconds = {name: NOT_TIMED if name in skip else (seconds[name] if math.isfinite(seconds[name]) else None)
                   for name in names}  # JSON: no inf
        choice = FormatChoice(layout, seconds, backend=backend)
        if "openvino" not in skip:  # OpenVINO left untimed: a later, longer run must still get its trial
            entries = cache.read()
            entries[key] = {"memory_format": layout, "backend": backend, "seconds": seconds}
            cache.write(entries, "the memory format and backend choice")
    predictor.use_backend(choice.backend)
    predictor.use_memory_format(choice.memory_format)
    if not choice.cached:
        predictor.release_memory(host=True)  # the candidates' passes (and a conversion) are not held through the run
    return choice


def _seconds_per_pass(predictor: Predictor, name: str, batch_shape: tuple[int, ...], warmups: int,
                      repeats: int, reference: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """Seconds per pass of candidate ``name``; infinite when the batch does not fit the device in it, or
    (OpenVINO) the network does not convert.  ``reference``: a batch of ``batch_shape`` and torch's fp32 output
    for it, which the conversion's check takes instead of running torch again."""
    backend, memory_format = CANDIDATES[name]
    predictor.use_backend(backend)
    predictor.use_memory_format(memory_format)
    converted = predictor.converted
    if reference is not None and tuple(reference[0].shape) == tuple(batch_shape):
        batch = reference[0]
        if converted is not None:
            converted.reference = reference
    else:
        batch = np.random.default_rng(0).random(batch_shape, dtype=np.float32)  # kernels may run faster on zeros
    try:
        if converted is not None:  # the first pass converts (or reads the conversion) and checks
            start = time.perf_counter()
            predictor(batch)
            if predictor.backend_note != predictor.backend:  # OpenVINO fell back to torch: not a candidate
                return math.inf
            if not converted.cached and warmups == 0 and repeats == 1:
                # Converted and checked at this very shape, by a pass of its own: this pass ran warm.
                return time.perf_counter() - start - converted.seconds
            warmups = max(0, warmups - 1)
        for _ in range(warmups):  # kernels chosen, memory allocated
            predictor(batch)
        start = time.perf_counter()
        for _ in range(repeats):
            predictor(batch)
    except Exception as err:  # noqa: BLE001 - out of memory is an outcome; anything else is the network's error
        if not is_out_of_memory(err):
            raise
        predictor.release_memory()
        return math.inf
    return (time.perf_counter() - start) / repeats
