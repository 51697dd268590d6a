"""Where an output cannot be made: under a symbolic link to a place that does not exist (one line, exit 2)."""

from __future__ import annotations

import numpy as np
import pytest

from blockpred.cli import main
from tests.helpers import write_test_volume

ARGS = ("--config", "tiny", "--device", "cpu", "--block", "8,16,16", "--no-progress")


@pytest.mark.parametrize(("link", "output", "expected"), [
    pytest.param("out.zarr", "out.zarr", "is a symbolic link to", id="zarr-is-the-link"),
    pytest.param("out.zarr", "out.zarr/prediction", "lies under the symbolic link", id="zarr-container-is-the-link"),
    pytest.param("out.n5", "out.n5/prediction", "lies under the symbolic link", id="n5-container-is-the-link"),
    pytest.param("out.h5", "out.h5:/prediction", "is a symbolic link to", id="hdf5-file-is-the-link"),
    pytest.param("folder", "folder/out.zarr", "lies under the symbolic link", id="a-parent-is-the-link"),
])
def test_an_output_under_a_link_to_nothing_is_one_line_saying_so(tmp_path, capsys, link, output, expected):
    source = write_test_volume(tmp_path / "in.zarr", np.zeros((8, 16, 16), dtype=np.uint8))
    (tmp_path / link).symlink_to(tmp_path / "gone")
    code = main(["run", source, str(tmp_path / output), *ARGS])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "unexpected error" not in err, err
    assert expected in err and f"{tmp_path / 'gone'}, a place that does not exist" in err, err
    assert "remove the link" in err
    assert (tmp_path / link).is_symlink() and not (tmp_path / "gone").exists()
