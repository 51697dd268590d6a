"""Immutable geometry: :class:`Coord` (an integer vector) and :class:`Box`.

``Box(begin, end)`` is a half-open interval per axis: ``begin`` inclusive,
``end`` exclusive.  Both types are hashable and never change; every operation
returns a new value.  ``Coord`` has element-wise ``+ - * //`` and
:meth:`Coord.ceil_div` but deliberately no true division, so no coordinate is
silently truncated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence, SupportsIndex, Union

CoordLike = Union["Coord", Sequence[int], int]


class Coord(tuple):
    """An integer vector with element-wise arithmetic."""

    __slots__ = ()

    def __new__(cls, values: Iterable[SupportsIndex]):
        items = tuple(values)
        for v in items:
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise TypeError(f"Coord values must be integers, got {v!r} in {items!r}")
        return super().__new__(cls, (int(v.__index__()) for v in items))

    @property
    def ndim(self) -> int:
        return len(self)

    def _other(self, other: CoordLike) -> tuple[int, ...]:
        if isinstance(other, int) and not isinstance(other, bool):
            return (other,) * len(self)
        other = tuple(other)
        if len(other) != len(self):
            raise ValueError(f"dimension mismatch: {tuple(self)} has {len(self)} axes, {other} has {len(other)}")
        return other

    def __add__(self, other: CoordLike) -> "Coord":  # type: ignore[override]
        return Coord(a + b for a, b in zip(self, self._other(other)))

    __radd__ = __add__

    def __sub__(self, other: CoordLike) -> "Coord":
        return Coord(a - b for a, b in zip(self, self._other(other)))

    def __rsub__(self, other: CoordLike) -> "Coord":
        return Coord(b - a for a, b in zip(self, self._other(other)))

    def __mul__(self, other: CoordLike) -> "Coord":  # type: ignore[override]
        return Coord(a * b for a, b in zip(self, self._other(other)))

    __rmul__ = __mul__

    def __floordiv__(self, other: CoordLike) -> "Coord":
        return Coord(a // b for a, b in zip(self, self._other(other)))

    def __mod__(self, other: CoordLike) -> "Coord":
        return Coord(a % b for a, b in zip(self, self._other(other)))

    def __truediv__(self, other):  # pragma: no cover - the point is that it raises
        raise TypeError("Coord has no true division; use // or ceil_div")

    __rtruediv__ = __truediv__

    def __neg__(self) -> "Coord":
        return Coord(-a for a in self)

    def ceil_div(self, other: CoordLike) -> "Coord":
        return Coord(-(-a // b) for a, b in zip(self, self._other(other)))

    def maximum(self, other: CoordLike) -> "Coord":
        return Coord(max(a, b) for a, b in zip(self, self._other(other)))

    def minimum(self, other: CoordLike) -> "Coord":
        return Coord(min(a, b) for a, b in zip(self, self._other(other)))

    def prod(self) -> int:
        out = 1
        for v in self:
            out *= v
        return out

    def is_multiple_of(self, other: CoordLike) -> bool:
        return all(b != 0 and a % b == 0 for a, b in zip(self, self._other(other)))

    def __repr__(self) -> str:
        return f"Coord{tuple(self)}"


def as_coord(value: CoordLike, ndim: int = 3) -> Coord:
    """An int (repeated ``ndim`` times) or a sequence as a :class:`Coord`."""
    if isinstance(value, int) and not isinstance(value, bool):
        return Coord((value,) * ndim)
    return Coord(value)


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned half-open box ``[begin, end)``; prints as ``[0:64, 0:64]``."""

    begin: Coord
    end: Coord

    def __post_init__(self):
        begin, end = Coord(self.begin), Coord(self.end)
        if len(begin) != len(end):
            raise ValueError(f"Box begin {tuple(begin)} and end {tuple(end)} differ in dimension")
        if any(e < b for b, e in zip(begin, end)):
            raise ValueError(f"Box end {tuple(end)} must be >= begin {tuple(begin)} on every axis")
        object.__setattr__(self, "begin", begin)
        object.__setattr__(self, "end", end)

    @classmethod
    def from_shape(cls, shape: CoordLike, begin: CoordLike | None = None) -> "Box":
        shape = Coord(shape)
        begin = Coord((0,) * len(shape)) if begin is None else as_coord(begin, len(shape))
        return cls(begin, begin + shape)

    @property
    def ndim(self) -> int:
        return len(self.begin)

    @property
    def shape(self) -> Coord:
        return self.end - self.begin

    @property
    def size(self) -> int:
        return self.shape.prod()

    @property
    def empty(self) -> bool:
        return self.size == 0

    def intersect(self, other: "Box") -> "Box":
        begin = self.begin.maximum(other.begin)
        end = self.end.minimum(other.end).maximum(begin)
        return Box(begin, end)

    def grow(self, before: CoordLike, after: CoordLike | None = None) -> "Box":
        """Grow by ``before`` at the begin and ``after`` (default: ``before``) at the end."""
        before = as_coord(before, self.ndim)
        after = before if after is None else as_coord(after, self.ndim)
        return Box(self.begin - before, self.end + after)

    def shift(self, offset: CoordLike) -> "Box":
        offset = as_coord(offset, self.ndim)
        return Box(self.begin + offset, self.end + offset)

    def contains(self, other: "Box | Sequence[int]") -> bool:
        if isinstance(other, Box):
            if other.empty:
                return True
            return all(sb <= ob and oe <= se for sb, se, ob, oe in zip(self.begin, self.end, other.begin, other.end))
        point = Coord(other)
        return all(b <= p < e for b, e, p in zip(self.begin, self.end, point))

    def snap(self, grid: CoordLike) -> "Box":
        """The smallest box on multiples of ``grid`` that contains this one."""
        grid = as_coord(grid, self.ndim)
        return Box((self.begin // grid) * grid, self.end.ceil_div(grid) * grid)

    def to_slices(self) -> tuple[slice, ...]:
        return tuple(slice(b, e) for b, e in zip(self.begin, self.end))

    def relative_to(self, origin: CoordLike) -> "Box":
        """This box in the coordinates of a frame that starts at ``origin``."""
        return self.shift(-as_coord(origin, self.ndim))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{b}:{e}" for b, e in zip(self.begin, self.end)) + "]"

    def __repr__(self) -> str:
        return f"Box{self}"
