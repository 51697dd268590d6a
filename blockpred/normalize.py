"""Input normalisation and output conversion, each parsed once from a string.

Normalisation (``--normalize``):

* ``auto`` (default): integer dtypes are scaled to [0, 1] by the dtype's
  maximum (uint8 / 255, uint16 / 65535, int16 / 32767 ...); floats pass unchanged.
* ``none``: values are cast to float32 unchanged.
* ``minmax:LO,HI``: ``(x - LO) / (HI - LO)``, finite numbers with LO < HI.
* ``meanstd:M,S``: ``(x - M) / S``, finite numbers with S > 0.
* ``percentile:LOW,HIGH`` (CSBDeep's convention, ``0 <= LOW < HIGH <= 100``) and
  ``meanstd:auto``: the volume's own statistics, its LOW-th and HIGH-th
  percentiles (as ``minmax``) or its mean and standard deviation (as
  ``meanstd``), taken once per input from a bounded sample of it
  (:meth:`Normalization.resolved`, :mod:`blockpred.run.normalization`).

Anything else (``meanstd:nan,1``, ``minmax:3,3``) is refused: it would make every voxel NaN.

Output conversion (``--output-dtype``): ``float32`` and ``float16`` keep the
network's values; ``uint8`` maps [0, 1] to 0-255 (clipped, rounded), which
suits probabilities and affinities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import InvalidOptionError


@dataclass(frozen=True, slots=True)
class Normalization:
    kind: str  # "auto" | "none" | "minmax" | "meanstd" | "percentile" | "meanstd-auto"
    a: float = 0.0
    b: float = 1.0

    def __post_init__(self) -> None:
        """Refuse numbers that would make every voxel NaN or infinite: a run would go on and write only NaN."""
        if self.kind == "minmax" and not (math.isfinite(self.a) and math.isfinite(self.b) and self.a < self.b):
            raise InvalidOptionError(f"normalize {self} must be minmax:LO,HI with finite numbers and LO < HI, "
                                     f"got LO={self.a:g}, HI={self.b:g}")
        if self.kind == "meanstd" and not (math.isfinite(self.a) and math.isfinite(self.b) and self.b > 0):
            raise InvalidOptionError(f"normalize {self} must be meanstd:MEAN,STD with finite numbers and STD > 0, "
                                     f"got MEAN={self.a:g}, STD={self.b:g}")
        if self.kind == "percentile" and not (0 <= self.a < self.b <= 100):
            raise InvalidOptionError(f"normalize {self} must be percentile:LOW,HIGH with 0 <= LOW < HIGH <= 100, "
                                     f"got LOW={self.a:g}, HIGH={self.b:g}")
        if self.kind in ("minmax", "meanstd"):
            scale, offset = self.scale_offset(np.dtype(np.float32))
            with np.errstate(over="ignore"):
                if not (np.isfinite(np.float32(scale)) and np.isfinite(np.float32(offset)) and np.float32(scale)):
                    raise InvalidOptionError(f"normalize {self} scales by {scale:g} and shifts by {offset:g}, "
                                             f"beyond float32 (the input is normalised in float32)")

    @classmethod
    def parse(cls, text: "str | Normalization") -> "Normalization":
        if isinstance(text, Normalization):
            return text
        spec = str(text).strip().lower()
        if spec in ("auto", "none"):
            return cls(spec)
        kind, _, args = spec.partition(":")
        if spec == "meanstd:auto":
            return cls("meanstd-auto")
        if kind in ("minmax", "meanstd", "percentile"):
            try:
                a, b = (float(v) for v in args.split(","))
            except ValueError:
                numbers = {"minmax": "LO,HI", "meanstd": "MEAN,STD (or meanstd:auto)", "percentile": "LOW,HIGH"}
                raise InvalidOptionError(
                    f"normalisation {text!r} needs two numbers: {kind}:{numbers[kind]}"
                ) from None
            return cls(kind, a, b)  # checked by __post_init__
        raise InvalidOptionError(
            f"normalisation must be auto, none, minmax:LO,HI, meanstd:MEAN,STD, meanstd:auto or percentile:LOW,HIGH, "
            f"got {text!r}"
        )

    @property
    def needs_statistics(self) -> bool:
        """Whether it is taken of the volume (percentile, meanstd:auto): :meth:`resolved` gives the numbers."""
        return self.kind in ("percentile", "meanstd-auto")

    def resolved(self, sample: np.ndarray) -> "Normalization":
        """The normalisation with numbers, for a volume whose voxels ``sample`` holds (itself where it has them):
        percentile:LOW,HIGH as minmax of ``np.percentile(sample, (LOW, HIGH))``, meanstd:auto as meanstd of
        ``sample.mean()`` and ``sample.std()``.  One line where the volume gives no range (a constant volume)."""
        if not self.needs_statistics:
            return self
        if self.kind == "percentile":
            low, high = (float(v) for v in np.percentile(sample, (self.a, self.b)))
            if not low < high:
                raise InvalidOptionError(
                    f"normalize {self}: the volume's {self.a:g}th and {self.b:g}th percentiles are both {low:g}, "
                    f"which leaves no range to scale; name --normalize minmax:LO,HI (or none)")
            return Normalization("minmax", low, high)
        mean, std = float(sample.mean()), float(sample.std())
        if not std > 0:
            raise InvalidOptionError(f"normalize {self}: the volume is constant ({mean:g}), its standard deviation "
                                     f"0; name --normalize meanstd:MEAN,STD (or none)")
        return Normalization("meanstd", mean, std)

    def scale_offset(self, dtype: np.dtype) -> tuple[float, float]:
        """``(scale, offset)`` such that normalised = x * scale + offset, for input ``dtype``."""
        dtype = np.dtype(dtype)
        if self.needs_statistics:
            raise ValueError(f"normalize {self} is taken of the volume: resolve it first (Normalization.resolved)")
        if self.kind == "auto":
            if dtype.kind in "ui":
                return 1.0 / float(np.iinfo(dtype).max), 0.0
            return 1.0, 0.0
        if self.kind == "none":
            return 1.0, 0.0
        if self.kind == "minmax":
            scale = 1.0 / (self.b - self.a)
            return scale, -self.a * scale
        return 1.0 / self.b, -self.a / self.b

    def apply(self, data: np.ndarray) -> np.ndarray:
        """``data`` as normalised float32 (a new array)."""
        scale, offset = self.scale_offset(data.dtype)
        out = data.astype(np.float32)
        if scale != 1.0:
            out *= np.float32(scale)
        if offset != 0.0:
            out += np.float32(offset)
        return out

    def __str__(self) -> str:
        if self.kind in ("auto", "none"):
            return self.kind
        if self.kind == "meanstd-auto":
            return "meanstd:auto"
        return f"{self.kind}:{self.a:g},{self.b:g}"


OUTPUT_DTYPES = ("float32", "float16", "uint8")


def parse_output_dtype(text: str) -> np.dtype:
    name = str(text).strip().lower()
    if name not in OUTPUT_DTYPES:
        raise InvalidOptionError(f"output dtype must be one of {', '.join(OUTPUT_DTYPES)}, got {text!r}")
    return np.dtype(name)


def convert_output(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Network output (float) as ``dtype``; uint8 maps [0, 1] to 0-255."""
    if dtype == np.uint8:
        scaled = np.clip(values, 0.0, 1.0) * 255.0
        return np.rint(scaled).astype(np.uint8)
    return values.astype(dtype, copy=False)
