import pytest
from hypothesis import given, settings, strategies as st

from blockpred.pipeline.blocking import plan_blocks
from blockpred.errors import InvalidOptionError
from blockpred.geometry import Box, Coord

axis = st.integers(1, 40)


@given(
    volume=st.tuples(axis, axis, axis),
    block_mult=st.tuples(*(st.integers(1, 3),) * 3),
    chunk=st.tuples(*(st.integers(1, 8),) * 3),
    halo=st.tuples(*(st.integers(0, 5),) * 3),
    roi_frac=st.tuples(*(st.floats(0, 0.9),) * 3),
)
@settings(max_examples=150, deadline=None)
def test_every_voxel_of_the_roi_is_written_by_exactly_one_block_and_every_chunk_by_one(
    volume, block_mult, chunk, halo, roi_frac
):
    volume, chunk = Coord(volume), Coord(chunk)
    block = chunk * block_mult
    begin = Coord(int(f * v) for f, v in zip(roi_frac, volume))
    roi = Box(begin, volume)
    plan = plan_blocks(volume_shape=volume, block_shape=block, halo=Coord(halo), roi=roi, chunk_shape=chunk)
    covered = 0
    chunk_owner = {}
    for blk in plan:
        assert roi.contains(blk.write_box) and blk.core_box.contains(blk.write_box)
        assert blk.read_box.shape == plan.input_shape
        assert blk.read_box.contains(blk.core_box.grow(Coord(halo)))
        covered += blk.write_box.size
        # chunks touched by the write box belong to this block only
        first, last = blk.write_box.begin // chunk, (blk.write_box.end - 1) // chunk
        for z in range(first[0], last[0] + 1):
            for y in range(first[1], last[1] + 1):
                for x in range(first[2], last[2] + 1):
                    assert chunk_owner.setdefault((z, y, x), blk.index) == blk.index
        assert plan.block_from_id(plan.block_id(blk.index)) == blk
    assert covered == roi.size


def test_block_input_is_padded_up_to_the_downsampling_and_starts_on_its_grid():
    plan = plan_blocks(volume_shape=Coord((70, 133, 101)), block_shape=Coord((8, 54, 54)), halo=Coord((2, 5, 5)),
                       downsampling=Coord((1, 27, 27)))
    assert plan.input_shape == (12, 81, 81)
    for blk in plan:
        assert (blk.read_box.begin + Coord((2, 5, 5))) % Coord((1, 27, 27)) == (0, 0, 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param(dict(block_shape=Coord((64, 100, 100)), downsampling=Coord((1, 27, 27))),
                     r"block \(64, 100, 100\) is not a multiple of the network's downsampling \(1, 27, 27\)", id="downsampling"),
        pytest.param(dict(block_shape=Coord((64, 64, 64)), chunk_shape=Coord((48, 64, 64))),
                     r"not a multiple of the output chunk shape", id="chunks"),
        pytest.param(dict(block_shape=Coord((0, 64, 64))), r"block must be positive", id="zero-block"),
        pytest.param(dict(block_shape=Coord((64, 64, 64)), halo=Coord((-1, 0, 0))), r"halo must be non-negative", id="negative-halo"),
        pytest.param(dict(block_shape=Coord((64, 64, 64)), roi=Box(Coord((0, 0, 0)), Coord((10, 10, 500)))),
                     r"ROI .* inside the volume", id="roi-outside"),
    ],
)
def test_bad_plans_are_refused_with_the_rule_and_the_value(kwargs, message):
    kwargs = {"volume_shape": Coord((100, 100, 100)), "halo": Coord((4, 4, 4)), **kwargs}
    with pytest.raises(InvalidOptionError, match=message):
        plan_blocks(**kwargs)
