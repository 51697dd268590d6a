"""The run's halo (blockpred.run.halo): the receptive field's, capped where it would cost more than it is worth."""

from blockpred.geometry import Coord
from blockpred.run.halo import MAX_WASTE, choose_halo, grow_start_block, waste
from blockpred.models.field import stated_field


def test_a_field_affordable_at_the_largest_block_is_covered_exactly():
    field = stated_field(Coord((1, 4, 4)), Coord((7, 41, 41)))
    choice = choose_halo(named=None, model_halo=None, field=field, downsampling=Coord((1, 4, 4)))
    assert choice.halo == Coord((7, 44, 44)) and choice.source == "field" and choice.covers and not choice.warning()


def test_a_field_that_would_read_over_four_times_at_the_largest_block_is_cut_and_said_in_one_line():
    # The CREMI-era U-Net: radius 14x132x132 on a 1x27x27 grid; covering it (14x135x135) at 256^3 reads 4.7x.
    field = stated_field(Coord((1, 27, 27)), Coord((14, 132, 132)))
    choice = choose_halo(named=None, model_halo=None, field=field, downsampling=Coord((1, 27, 27)))
    largest = Coord((256, 256, 256))
    assert waste(largest, Coord((14, 135, 135))) > MAX_WASTE >= waste(largest, choice.halo)
    assert choice.halo == Coord((14, 108, 108)) and choice.capped and choice.covers is False
    assert waste(largest, choice.halo + Coord((0, 27, 0))) > MAX_WASTE  # the largest halo on the grid that fits
    assert choice.warning() == (
        "the halo that covers the network's receptive field (radius 14x132x132), 14x135x135, would read over 4x the "
        "input voxels even at block 256x256x256; using halo 14x108x108: the output will differ at block borders; "
        "--halo 14,135,135 makes it exact")


def test_a_2d_networks_planes_are_wider_and_its_halo_across_them_is_none():
    field = stated_field(Coord((1, 8, 8)), Coord((0, 300, 300)))
    choice = choose_halo(named=None, model_halo=None, field=field, downsampling=Coord((1, 8, 8)), plane_axis=0)
    assert choice.halo == Coord((0, 304, 304)) and choice.covers  # at 1024-wide planes: 1.6x per axis


def test_named_and_model_halos_win_and_say_whether_they_cover():
    field = stated_field(Coord((2, 2, 2)), Coord((9, 9, 9)))
    named = choose_halo(named=Coord((8, 8, 8)), model_halo=Coord((10, 10, 10)), field=field,
                        downsampling=Coord((2, 2, 2)))
    model = choose_halo(named=None, model_halo=Coord((10, 10, 10)), field=field, downsampling=Coord((2, 2, 2)))
    assert (named.halo, named.source, named.covers) == (Coord((8, 8, 8)), "named", False)
    assert (model.halo, model.source, model.covers) == (Coord((10, 10, 10)), "model", True)
    assert "--halo 10,10,10 makes it exact" in named.warning() and not model.warning()


def test_the_start_block_grows_until_its_halo_costs_at_most_half_again_per_axis():
    block = grow_start_block(Coord((64, 64, 64)), Coord((5, 24, 24)), Coord((1, 4, 4)))
    assert block == Coord((64, 128, 128)) and all((b + 2 * h) / b <= 1.5 for b, h in zip(block, (5, 24, 24)))
    assert grow_start_block(Coord((64, 64, 64)), Coord((7, 44, 44)), Coord((1, 4, 4))) == Coord((64, 256, 256))
    # never past the largest block, however large the halo
    assert grow_start_block(Coord((64, 64, 64)), Coord((0, 300, 300)), Coord((1, 8, 8))) == Coord((64, 256, 256))
    assert grow_start_block(Coord((64, 64, 64)), Coord((10, 10, 10)), Coord((2, 2, 2))) == Coord((64, 64, 64))
