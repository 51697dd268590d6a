"""Every path a run writes besides its output is apart from the input and the output (issue 38).

``--progress-json``, the cache directory, a batch cluster's logs and TLS folder, and ``bench``'s reports,
pointed at the input, a file inside it, an existing finished output, through a symbolic link, through
``..`` or a hard link: refused in one line, exit 2, before anything is opened for writing; every file
under the test's folder stays byte-identical, and nothing is created.
"""

import json
import os

import h5py
import numpy as np
import pytest

from blockpred.cli import main
from tests.helpers import snapshot, write_test_volume

RUN = ["--config", "tiny", "--device", "cpu", "--block", "16,32,32", "--no-progress"]


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """An HDF5 input, a zarr v2 input, a finished HDF5 output, and links: a symlink into the zarr input, a hard link
    to the HDF5 input."""
    root = tmp_path_factory.mktemp("places")
    data = np.random.default_rng(0).integers(0, 255, (16, 32, 32), dtype=np.uint8)
    with h5py.File(root / "in.h5", "w") as file:
        file["raw"] = data
    write_test_volume(str(root / "in.zarr/raw"), data, chunks=(16, 32, 32), zarr_format=2)
    assert main(["run", str(root / "in.zarr/raw"), f"{root / 'res.h5'}:/pred", *RUN]) == 0  # a finished output
    os.symlink(root / "in.zarr" / "raw", root / "link")
    os.link(root / "in.h5", root / "hard.h5")
    os.mkdir(root / "work")
    return root


def _tree(root) -> tuple:
    """Every file under ``root`` with its bytes, and every folder and link by name: equal trees mean nothing was
    written, created, deleted or changed."""
    names = sorted(os.path.join(folder, name) for folder, dirs, files in os.walk(root) for name in dirs + files)
    return snapshot(root), names


def _refused(argv, root, capsys, expect: str) -> None:
    before = _tree(root)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockpred: error: ") and expect in lines[0], err
    assert "unexpected error" not in err
    assert _tree(root) == before, "a file changed, appeared or went"


TARGETS = [  # (the run's input and output, the place written, what the one line says)
    pytest.param("in.h5:/raw", "o.zarr", "in.h5", "is the input", id="the-input-hdf5"),
    pytest.param("in.h5:/raw", "o.zarr", "hard.h5", "(a hard link to it) is the input", id="hard-link-to-input"),
    pytest.param("in.zarr/raw", "o.zarr", "in.zarr/raw/.zarray", "lies inside the input", id="input-metadata"),
    pytest.param("in.zarr/raw", "o.zarr", "in.zarr/raw/0.0.0", "lies inside the input", id="input-chunk"),
    pytest.param("in.zarr/raw", "o.zarr", "work/../in.zarr/raw/.zarray", "lies inside the input", id="dotdot"),
    pytest.param("in.zarr/raw", "o.zarr", "link/new.json", "lies inside the input", id="through-a-symlink"),
    pytest.param("in.zarr/raw", "res.h5:/pred", "res.h5", "is the output", id="finished-output"),
    pytest.param("in.zarr/raw", "o.zarr", "o.zarr/events.json", "lies inside the output", id="inside-new-output"),
]


@pytest.mark.parametrize(("source", "target", "written", "expect"), TARGETS)
def test_progress_json_into_the_input_or_an_output_is_refused_and_changes_nothing(place, source, target, written,
                                                                                  expect, capsys, monkeypatch):
    monkeypatch.chdir(place)
    _refused(["run", source, target, *RUN, "--progress-json", written], place, capsys, f"--progress-json {written!r}")
    _refused(["run", source, target, *RUN, "--progress-json", written], place, capsys, expect)


@pytest.mark.parametrize("written", ["in.zarr/raw", "link", "work/../in.zarr", "res.h5"])
def test_a_cache_directory_in_the_input_or_the_output_is_refused_by_run_and_plan(place, written, capsys, monkeypatch):
    monkeypatch.chdir(place)
    monkeypatch.setenv("BLOCKPRED_CACHE_DIR", written)
    for command in ("run", "plan"):
        _refused([command, "in.zarr/raw", "res.h5:/pred", *RUN], place, capsys, "the cache directory")


def test_a_batch_clusters_logs_or_tls_folder_in_the_input_is_refused_before_any_job(place, capsys, monkeypatch):
    monkeypatch.chdir(place)
    for key in ("log-directory", "shared-temp-directory"):
        config = place.parent / f"jobqueue-{key}.yaml"
        config.write_text(json.dumps({"jobqueue": {"slurm": {key: str(place / "in.zarr" / "raw" / "x")}}}))
        _refused(["run", "in.zarr/raw", "o.zarr", *RUN, "--cluster", "slurm", "--cores", "1", "--memory", "1GB",
                  "--jobqueue-config", str(config)], place, capsys, f"jobqueue.slurm.{key}")


def test_bench_reports_into_its_input_are_refused_before_measuring(place, capsys, monkeypatch):
    monkeypatch.chdir(place)
    for flag, written in (("--json", "in.h5"), ("--markdown", "hard.h5")):
        _refused(["bench", "--device", "cpu", "--pipeline", "--input", "in.h5:/raw", flag, written], place, capsys,
                 f"{flag} {written!r}")


def test_a_progress_file_that_is_no_progress_log_is_never_replaced(place, capsys, monkeypatch):
    monkeypatch.chdir(place.parent)
    other = place.parent / "notes.txt"
    other.write_text("a user's notes\n")
    _refused(["run", str(place / "in.zarr/raw"), "o.zarr", *RUN, "--progress-json", str(other)], place.parent,
             capsys, "not a progress log")


@pytest.mark.parametrize(("written", "expect"), [("work", "is a folder"), ("/proc/nonexist/x.json", "does not exist")])
def test_a_progress_destination_that_cannot_be_a_file_is_one_line_naming_the_option(place, written, expect, capsys,
                                                                                    monkeypatch):
    monkeypatch.chdir(place)
    _refused(["run", "in.zarr/raw", "o.zarr", *RUN, "--progress-json", written], place, capsys,
             f"--progress-json {written!r}")


def test_an_output_in_a_linked_parent_folder_of_the_input_writes_no_container_there(tmp_path, capsys, monkeypatch):
    """``parent.zarr -> .``: ``parent.zarr/pred`` would make the input's own folder a zarr group."""
    data = np.zeros((16, 32, 32), dtype=np.uint8)
    write_test_volume(str(tmp_path / "in.zarr"), data)
    os.symlink(tmp_path, tmp_path / "parent.zarr")
    monkeypatch.chdir(tmp_path)
    _refused(["run", "in.zarr", "parent.zarr/pred", *RUN], tmp_path, capsys, "holds the input")
    assert not (tmp_path / "zarr.json").exists()
