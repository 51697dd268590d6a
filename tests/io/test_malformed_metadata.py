"""Damaged volume metadata is one line naming the file and what is wrong with it (exit 2), and changes nothing.

The runs are in process and fail before the network loads, except the few that
replace an output and so predict its one tiny block.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from blockpred.cli import main
from blockpred.io import create_volume, open_volume
from tests.helpers import snapshot, write_test_volume

ARGS = ("--config", "tiny", "--device", "cpu", "--block", "8,16,16", "--no-progress")
DATA = np.arange(8 * 16 * 16, dtype=np.uint8).reshape(8, 16, 16)


def _run(capsys, *args) -> tuple[int, str]:
    code = main(["run", *map(str, args), *ARGS])
    return code, capsys.readouterr().err


def _refused(capsys, *args) -> str:
    """The one error line of a run that must be refused with exit 2."""
    code, err = _run(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("blockpred: error: "), err
    assert "unexpected error" not in err and "Traceback" not in err
    return lines[0]


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:17])


def _edit(change):
    def edit(file: Path) -> None:
        meta = json.loads(file.read_text())
        change(meta)
        file.write_text(json.dumps(meta))
    return edit


def _plain(tmp_path: Path, fmt: str) -> Path:
    """A plain array: zarr v2 or v3 at ``in.zarr``, N5 at ``in.n5/raw``; returns its folder."""
    if fmt == "n5":
        write_test_volume(tmp_path / "in.n5/raw", DATA)
        return tmp_path / "in.n5/raw"
    write_test_volume(tmp_path / "in.zarr", DATA, zarr_format=int(fmt[-1]))
    return tmp_path / "in.zarr"


def _image(tmp_path: Path, fmt: str) -> Path:
    """An OME-NGFF image group (the array ``0`` inside) at ``in.zarr``."""
    with create_volume(tmp_path / "in.zarr", spatial_shape=DATA.shape, num_channels=None, dtype=DATA.dtype,
                       chunk_shape=DATA.shape, zarr_format=int(fmt[-1])) as volume:
        volume.write(volume.box, DATA)
    return tmp_path / "in.zarr"


CASES = [
    pytest.param(_plain, "v2", ".zarray", _truncate, "is not valid JSON at line", id="zarr-v2-truncated-zarray"),
    pytest.param(_plain, "v2", ".zarray", _edit(lambda m: m.update(shape="x")), "is not valid zarr metadata",
                 id="zarr-v2-shape-not-a-list"),
    pytest.param(_plain, "v2", ".zarray", _edit(lambda m: m.pop("shape")), "lacks the key 'shape'",
                 id="zarr-v2-no-shape"),
    pytest.param(_plain, "v2", ".zarray", _edit(lambda m: m.update(compressor={"id": "nonexistentcodec"})),
                 "names the codec 'nonexistentcodec', which is not installed", id="zarr-v2-unknown-codec"),
    pytest.param(_plain, "v3", "zarr.json", _truncate, "is not valid JSON at line", id="zarr-v3-truncated"),
    pytest.param(_plain, "v3", "zarr.json", lambda f: f.write_text("[3]"), "is not a JSON object (it holds a list)",
                 id="zarr-v3-a-list"),
    pytest.param(_plain, "v3", "zarr.json", _edit(lambda m: m.pop("shape")), "lacks the key 'shape'",
                 id="zarr-v3-no-shape"),
    pytest.param(_plain, "v3", "zarr.json", _edit(lambda m: m["codecs"].append({"name": "nonexistentcodec"})),
                 "names the codec 'nonexistentcodec', which is not installed", id="zarr-v3-unknown-codec"),
    pytest.param(_image, "v3", "zarr.json", _truncate, "is not valid JSON at line", id="ome-v3-group-truncated"),
    pytest.param(_image, "v3", "0/zarr.json", _truncate, "is not valid JSON at line", id="ome-v3-array-truncated"),
    pytest.param(_image, "v2", ".zattrs", _truncate, "is not valid JSON at line", id="ome-v2-group-attributes"),
    pytest.param(_plain, "n5", "attributes.json", _truncate, "is not valid JSON at line", id="n5-truncated"),
    pytest.param(_plain, "n5", "attributes.json", _edit(lambda m: m.update(dimensions="x")),
                 "is not valid N5 metadata", id="n5-dimensions-not-a-list"),
    pytest.param(_plain, "n5", "attributes.json", _edit(lambda m: m.pop("blockSize")), "lacks the key 'blockSize'",
                 id="n5-no-block-size"),
    pytest.param(_plain, "n5", "attributes.json", _edit(lambda m: m.update(compression={"type": "nonexistent"})),
                 "names the compression 'nonexistent'", id="n5-unknown-compression"),
]


@pytest.mark.parametrize(("make", "fmt", "name", "damage", "expected"), CASES)
def test_an_input_with_damaged_metadata_is_one_line_naming_the_file_and_nothing_changes(
        tmp_path, capsys, make, fmt, name, damage, expected):
    folder = make(tmp_path, fmt)
    damage(folder / name)
    before = snapshot(folder)
    line = _refused(capsys, folder, tmp_path / "out.zarr")
    assert f"{folder / name} {expected}" in line, line
    assert "cannot read the metadata of" in line
    assert snapshot(folder) == before
    assert not (tmp_path / "out.zarr").exists()


def test_a_mask_with_damaged_metadata_is_one_line_naming_it(tmp_path, capsys):
    source = write_test_volume(tmp_path / "in.zarr", DATA)
    mask = write_test_volume(tmp_path / "mask.zarr", np.ones_like(DATA), zarr_format=2)
    _truncate(tmp_path / "mask.zarr/.zarray")
    line = _refused(capsys, source, tmp_path / "out.zarr", "--mask", mask)
    assert f"{tmp_path / 'mask.zarr/.zarray'} is not valid JSON" in line, line


def test_an_output_of_ours_with_damaged_metadata_is_refused_on_resume_and_replaced_with_overwrite(tmp_path, capsys):
    source = write_test_volume(tmp_path / "in.zarr", DATA)
    target = tmp_path / "out.zarr"
    assert _run(capsys, source, target)[0] == 0
    _truncate(target / "zarr.json")  # the image group's: a pyramid's metadata cut short, say
    line = _refused(capsys, source, target)
    assert f"cannot be opened ({target / 'zarr.json'} is not valid JSON" in line and "--overwrite" in line, line
    assert _run(capsys, source, target, "--overwrite")[0] == 0
    assert open_volume(target).spatial_shape == DATA.shape


def test_a_damaged_array_at_the_output_needs_overwrite_and_a_damaged_group_of_arrays_is_never_replaced(
        tmp_path, capsys):
    source = write_test_volume(tmp_path / "in.zarr", DATA)
    write_test_volume(tmp_path / "out.zarr", DATA, zarr_format=2)
    _truncate(tmp_path / "out.zarr/.zarray")
    before = snapshot(tmp_path / "out.zarr")
    assert "exists; pass --overwrite" in _refused(capsys, source, tmp_path / "out.zarr")
    assert snapshot(tmp_path / "out.zarr") == before  # (--overwrite replaces it, as the test above shows)
    write_test_volume(tmp_path / "group.zarr/kept", DATA)
    _truncate(tmp_path / "group.zarr/zarr.json")
    before = snapshot(tmp_path / "group.zarr")
    line = _refused(capsys, source, tmp_path / "group.zarr", "--overwrite")
    assert "not a volume blockpred can open" in line, line
    assert snapshot(tmp_path / "group.zarr") == before


def test_a_chunk_that_does_not_decode_still_fails_its_block_not_as_metadata(tmp_path, capsys):
    source = write_test_volume(tmp_path / "in.zarr", DATA, zarr_format=2)
    (tmp_path / "in.zarr/0.0.0").write_bytes(b"not a zstd frame" * 10)
    code, err = _run(capsys, source, tmp_path / "out.zarr")
    assert code == 1, err
    assert "block (0, 0, 0)" in err and "cannot read the metadata" not in err
