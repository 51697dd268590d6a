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


@pytest.mark.parametrize("name", ["trust_pickle", "overwrite", "progress", "local", "skip_empty"])
def test_a_boolean_option_is_a_real_boolean_never_a_string_or_number(tmp_path, name):
    path = tmp_path / "c.yaml"
    for text in ('"false"', "'true'", "0", "1", "[]"):
        path.write_text(f"{name}: {text}\n")
        # A file may not set trust at all, whatever the value (see test_trust.py).
        expected = "sets trust_pickle" if name == "trust_pickle" else f"{name} must be true or false"
        with pytest.raises(InvalidOptionError, match=expected):
            make_config(path)
    for value in ("false", "no", 0, 1.0, None.__class__):
        with pytest.raises(InvalidOptionError, match=f"{name} must be true or false"):
            make_config(**{name: value})
    if name != "trust_pickle":
        path.write_text(f"{name}: false\n")
        assert getattr(make_config(path), name) is False
    assert getattr(make_config(**{name: np.bool_(True)}), name) is True


def test_a_quoted_false_is_refused_with_how_to_write_it():
    with pytest.raises(InvalidOptionError) as info:
        make_config(overwrite="false")
    assert str(info.value) == ("overwrite must be true or false, got 'false' (a string); write overwrite: false "
                               "without quotes (in Python overwrite=False)")


@pytest.mark.parametrize("name, value", [
    ("block", [16.5, 64, 64]), ("block", "16.5"), ("halo", 2.5), ("output_chunks", [32, 32, 32.25]),
    ("downsampling", [1, 2, 2.5]), ("shards", [64, 64, 64.5]), ("roi", [[0, 8.5], [0, 8], [0, 8]]),
    ("batch_size", 2.5), ("prefetch", 1.5), ("num_readers", 2.5), ("workers", 1.5), ("retries", 1.5),
    ("pyramid", 1.5), ("channels", [0.5]), ("block", float("nan")), ("block", [True, 64, 64]),
])
def test_a_fraction_is_refused_where_a_whole_number_is_needed_never_truncated(name, value):
    with pytest.raises(InvalidOptionError, match=name.replace("roi", "ROI")):
        make_config(**{name: value})


def test_a_whole_number_is_taken_in_any_numeric_spelling():
    cfg = make_config(block=[16.0, np.int64(64), "64"], halo=np.float32(8), batch_size=2.0, retries=1.0,
                      pyramid="2", roi=[[0, 8.0], [0, 8], [0, 8]])
    assert cfg.block == (16, 64, 64) and cfg.halo == (8, 8, 8) and cfg.batch_size == 2
    assert cfg.retries == 1 and cfg.pyramid == 2 and cfg.roi == parse_roi("0:8,0:8,0:8")
    assert all(type(v) is int for v in (*cfg.block, *cfg.halo, cfg.batch_size, cfg.retries, cfg.pyramid))


def test_a_config_file_may_not_set_trust_or_name_a_factory_without_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trust_pickle: true\n")
    with pytest.raises(InvalidOptionError, match="trust cannot come from a config file"):
        make_config(path, trust_pickle=True)  # not even with trust given beside it: the file is wrong
    path.write_text("model: subprocess:getoutput\nmodel_kwargs: {cmd: 'touch X'}\n")
    with pytest.raises(InvalidOptionError, match="run.yaml' names the model factory 'subprocess:getoutput'"):
        make_config(path)
    assert make_config(path, trust_pickle=True).model == "subprocess:getoutput"
    assert make_config(path, model="subprocess:getoutput").model_kwargs == {"cmd": "touch X"}
    path.write_text("model: tiny\n")
    assert make_config(path).model == "tiny"  # a preset runs no code from anywhere


def test_a_bare_config_name_takes_the_shipped_config_from_any_directory(tmp_path, monkeypatch):
    from blockpred.config import load_config_file, make_config, shipped_configs

    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert {"tiny", "cremi2018", "unet32", "cluster-run"} <= set(shipped_configs()) and "slurm" not in shipped_configs()
    assert make_config("tiny").model == "tiny" and load_config_file("cremi2018.yaml")["model"] == "cremi2018"
    (tmp_path / "tiny").write_text("model: unet32\n")  # a file of that name here is what the user means
    assert make_config("tiny").model == "unet32"
    with pytest.raises(InputNotFoundError, match="blockpred's own are named cluster-run, cremi2018, tiny"):
        load_config_file("tyni")
