import numpy as np
import pytest

from blockpred.config import make_config, parse_roi, parse_shape
from blockpred.errors import InputNotFoundError, InvalidOptionError
from blockpred.geometry import Box, Coord
from blockpred.normalize import Normalization, convert_output


@pytest.mark.parametrize("value", [64, "64", "64,64,64", [64, 64, 64], "64x64x64"])
def test_shapes_are_accepted_in_every_spelling(value):
    assert parse_shape(value, "block") == Coord((64, 64, 64))


def test_roi_is_parsed_from_text_and_lists():
    expected = Box(Coord((0, 10, 20)), Coord((5, 15, 25)))
    assert parse_roi("0:5,10:15,20:25") == expected == parse_roi([[0, 5], [10, 15], [20, 25]])


def test_flags_override_the_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: cremi2018\nblock: [8, 54, 54]\nbatch-size: 2\nnormalize: meanstd:128,32\n")
    cfg = make_config(path, batch_size=3)
    assert cfg.model == "cremi2018" and cfg.block == (8, 54, 54) and cfg.batch_size == 3
    assert cfg.normalize == Normalization("meanstd", 128, 32)


def test_unknown_options_are_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("blok: 64\n")
    with pytest.raises(InvalidOptionError, match="unknown option.*blok"):
        make_config(path)


def test_missing_config_file_is_reported():
    with pytest.raises(InputNotFoundError, match="does not exist"):
        make_config("/nonexistent/c.yaml")


@pytest.mark.parametrize("text", ["minmax:1", "meanstd:0,0", "zscore", "minmax:3,3"])
def test_bad_normalisations_are_refused(text):
    with pytest.raises(InvalidOptionError):
        Normalization.parse(text)


@pytest.mark.parametrize(
    "spec, dtype, value, expected",
    [
        ("auto", np.uint8, 255, 1.0),
        ("auto", np.uint16, 65535, 1.0),
        ("auto", np.float32, 3.5, 3.5),
        ("none", np.uint8, 200, 200.0),
        ("minmax:100,200", np.uint8, 150, 0.5),
        ("meanstd:10,4", np.float32, 18, 2.0),
    ],
)
def test_normalisation_maps_values(spec, dtype, value, expected):
    out = Normalization.parse(spec).apply(np.array([value], dtype=dtype))
    assert out.dtype == np.float32 and out[0] == pytest.approx(expected)


def test_uint8_output_maps_unit_interval_to_bytes():
    out = convert_output(np.array([-0.5, 0.0, 0.5, 1.0, 2.0], dtype=np.float32), np.dtype(np.uint8))
    assert out.tolist() == [0, 0, 128, 255, 255]


@pytest.mark.parametrize("text, expected", [
    ("shards: off\n", "off"), ("shards: block\n", "block"), ("shards: [16, 32, 32]\n", Coord((16, 32, 32))),
    ("", "auto"),
])
def test_shards_are_read_from_yaml_including_a_bare_off(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text("model: tiny\n" + text)
    assert make_config(path).shards == expected
