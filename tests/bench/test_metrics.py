import pytest

from blockpred.errors import InvalidOptionError
from blockpred.geometry import Coord
from blockpred.bench.metrics import extrapolate, halo_overhead, hours_for, mvox_per_s_for, parse_size


def test_platynereis_at_the_v100_figure_takes_177_hours_on_one_gpu():
    platy = parse_size("platynereis")
    assert platy.voxels == 8_100_000_000_000
    assert round(hours_for(platy.voxels, 12.7), 1) == 177.2


def test_the_inverses_give_the_throughput_and_the_volume_back():
    hours = hours_for(8.1e12, 12.7)
    assert mvox_per_s_for(8.1e12, hours) == pytest.approx(12.7)
    assert hours * 3600 * 12.7e6 == pytest.approx(8.1e12)
    assert hours_for(8.1e12, 12.7, gpus=8) == pytest.approx(hours / 8)
    assert hours_for(8.1e12, 12.7, gpus=8, efficiency=0.5) == pytest.approx(hours / 4)


@pytest.mark.parametrize(
    "text, voxels",
    [("8.1T", 8_100_000_000_000), ("1.9G", 1_900_000_000), ("200x3072x3072", 200 * 3072 * 3072),
     ("cremi-padded", 200 * 3072 * 3072), ("512M", 512_000_000), ("1e9", 1_000_000_000)],
)
def test_sizes_are_read_as_counts_shapes_or_names(text, voxels):
    assert parse_size(text).voxels == voxels


def test_an_unknown_size_names_what_is_accepted():
    with pytest.raises(InvalidOptionError, match="platynereis"):
        parse_size("huge")


def test_extrapolation_has_a_row_per_dataset_and_gpu_count():
    rows = extrapolate([parse_size("platynereis"), parse_size("1.9G")], [1, 2, 4], 12.7)
    assert [(r.dataset.name, r.gpus) for r in rows][:3] == [("platynereis", 1), ("platynereis", 2), ("platynereis", 4)]
    assert rows[0].days == pytest.approx(rows[0].hours / 24)


def test_halo_overhead_is_input_voxels_per_output_voxel():
    assert halo_overhead(Coord((55, 575, 575)), Coord((65, 675, 675))) == pytest.approx(65 * 675**2 / (55 * 575**2))
