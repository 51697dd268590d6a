import pytest
from hypothesis import given, strategies as st

from blockpred.geometry import Box, Coord

coords = st.tuples(*(st.integers(-50, 50),) * 3).map(Coord)
shapes = st.tuples(*(st.integers(0, 30),) * 3).map(Coord)
boxes = st.builds(lambda b, s: Box.from_shape(s, b), coords, shapes)


def test_coord_arithmetic_is_element_wise():
    a, b = Coord((1, 2, 3)), Coord((4, 5, 6))
    assert a + b == (5, 7, 9) and b - a == (3, 3, 3) and a * 2 == (2, 4, 6) and b // 2 == (2, 2, 3)
    assert Coord((5, 6, 7)).ceil_div(2) == (3, 3, 4)


def test_coord_has_no_true_division():
    with pytest.raises(TypeError, match="no true division"):
        Coord((4, 4, 4)) / 2


def test_coord_refuses_non_integers():
    with pytest.raises(TypeError):
        Coord((1.5, 2, 3))


def test_coord_of_other_dimension_is_refused():
    with pytest.raises(ValueError, match="dimension mismatch"):
        Coord((1, 2, 3)) + (1, 2)


def test_box_is_hashable_and_immutable():
    box = Box.from_shape((2, 3, 4))
    assert {box: 1}[Box(Coord((0, 0, 0)), Coord((2, 3, 4)))] == 1
    with pytest.raises(AttributeError):
        box.begin = Coord((1, 1, 1))


def test_box_prints_as_slices():
    assert str(Box(Coord((0, 10, 5)), Coord((64, 20, 6)))) == "[0:64, 10:20, 5:6]"


def test_box_refuses_end_before_begin():
    with pytest.raises(ValueError, match="must be >= begin"):
        Box(Coord((5, 0, 0)), Coord((4, 1, 1)))


@given(boxes, boxes)
def test_intersection_is_contained_in_both_boxes(a, b):
    c = a.intersect(b)
    assert a.contains(c) and b.contains(c)
    assert c.size <= min(a.size, b.size)


@given(boxes, st.tuples(*(st.integers(0, 5),) * 3))
def test_grow_then_intersect_gives_the_box_back(box, amount):
    assert box.grow(amount).intersect(box) == box
    assert box.grow(amount).shape == box.shape + Coord(amount) * 2


@given(boxes, st.tuples(*(st.integers(1, 9),) * 3))
def test_snap_contains_the_box_and_lies_on_the_grid(box, grid):
    snapped = box.snap(grid)
    assert snapped.contains(box)
    assert snapped.begin % grid == (0, 0, 0) and snapped.end % grid == (0, 0, 0)


def test_to_slices_cuts_the_box_out_of_an_array():
    import numpy as np

    data = np.arange(4 * 5 * 6).reshape(4, 5, 6)
    box = Box(Coord((1, 2, 3)), Coord((3, 4, 6)))
    assert data[box.to_slices()].shape == tuple(box.shape)
