"""Storage options reach object stores only: given to a run of local paths only, they are refused, not dropped."""

from __future__ import annotations

import pytest

from blockpred.errors import InvalidOptionError
from blockpred.io import check_storage_options, parse_volume_path


def test_storage_options_for_local_paths_only_are_refused_in_one_line_naming_them():
    local = parse_volume_path("in.zarr"), parse_volume_path("out.zarr/prediction"), None
    with pytest.raises(InvalidOptionError) as refused:
        check_storage_options(["endpoint_url=http://127.0.0.1:9000", "anonymous=true"], *local)
    message = str(refused.value)
    assert "endpoint_url=http://127.0.0.1:9000, anonymous=true" in message and "s3://" in message
    assert "'in.zarr'" in message and "'out.zarr/prediction'" in message and "\n" not in message


@pytest.mark.parametrize("remote", ["input", "output", "mask"])
def test_storage_options_are_taken_when_any_path_of_the_run_is_on_an_object_store(remote):
    options = ["anonymous=true"]
    paths = {role: parse_volume_path(f"{role}.zarr") for role in ("input", "output", "mask")}
    paths[remote] = parse_volume_path(f"s3://bucket/{remote}.zarr", options)
    check_storage_options(options, *paths.values())


def test_no_storage_options_or_only_defaults_need_no_object_store():
    check_storage_options(None, parse_volume_path("in.zarr"))
    check_storage_options(["anonymous=false"], parse_volume_path("in.zarr"))


def test_the_command_refuses_storage_options_for_a_run_of_local_paths(tmp_path, capsys):
    import numpy as np

    from blockpred.cli import main
    from tests.helpers import write_test_volume

    source = write_test_volume(str(tmp_path / "in.zarr"), np.zeros((8, 16, 16), dtype=np.uint8))
    assert main(["run", source, str(tmp_path / "out.zarr"), "--storage-option", "anonymous=true",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "s3://" in err, err
    assert not (tmp_path / "out.zarr").exists()
