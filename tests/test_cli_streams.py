"""The command's streams are auxiliary (issues 38 and 46): progress to a FIFO or a pipe whose reader is gone or
never came, a closed or full standard output, a full stderr, a progress file on a full disk, and ``--json`` on
failure and on a usage error.  The run's work, its output and its exit code stand in every case."""

import contextlib
import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from blockpred.cli import main
from blockpred.io import open_volume
from tests.helpers import HANG_S, child_env, read_volume, write_test_volume

RUN = ["--config", "tiny", "--device", "cpu", "--block", "16,32,32", "--no-progress", "--backend", "torch"]


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    root = tmp_path_factory.mktemp("streams")
    data = np.random.default_rng(0).integers(0, 255, (16, 32, 64), dtype=np.uint8)
    return write_test_volume(str(root / "in.zarr/raw"), data, chunks=(16, 32, 32))


def _complete(output: str) -> bool:
    with open_volume(output) as out:
        return bool(np.all(np.isfinite(out.read(out.box))) and out.read(out.box).any())


def _command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "blockpred", *argv]


def test_a_fifo_without_reader_warns_once_and_the_run_goes_on(volume, tmp_path, caplog):
    """Opened without waiting for a reader: nothing blocks before the first block."""
    fifo = tmp_path / "events"
    os.mkfifo(fifo)
    out = str(tmp_path / "out.zarr")
    assert main(["run", volume, out, *RUN, "--progress-json", str(fifo)]) == 0
    said = [r.getMessage() for r in caplog.records if r.name == "blockpred.events"]
    assert len(said) == 1 and "no process reads" in said[0] and "goes on without progress events" in said[0], said
    assert _complete(out)


def test_a_pipe_whose_reader_went_away_warns_once_and_the_run_completes(volume, tmp_path):
    """Progress and the summary both go to standard output, whose reader closes its end before the first event:
    each write would be EPIPE."""
    out = str(tmp_path / "out.zarr")
    run = subprocess.Popen(_command("run", volume, out, *RUN, "--progress-json", "/dev/stdout"), env=child_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run.stdout.close()
    stderr = run.stderr.read()
    assert run.wait(timeout=300) == 0, stderr
    assert stderr.count("its reader went away") == 1 and "Traceback" not in stderr, stderr
    assert _complete(out)
    # A closed standard output (>&-) in the same way: the run stands, exit 0, no traceback.
    line = " ".join(_command("run", volume, str(tmp_path / "closed.zarr"), *RUN)) + " >&-"
    result = subprocess.run(["bash", "-c", line], env=child_env(), capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert _complete(str(tmp_path / "closed.zarr"))


def test_json_on_failure_prints_the_failure_as_json(tmp_path, capsys):
    assert main(["run", str(tmp_path / "missing.zarr"), *RUN, "--json"]) == 2
    captured = capsys.readouterr()
    said = json.loads(captured.out)
    assert said == {"ok": False, "error": captured.err.strip().removeprefix("blockpred: error: "), "exit_code": 2}
    assert "missing.zarr" in said["error"]


def _shell(line: str) -> subprocess.CompletedProcess:
    """``line`` in bash (for its redirections to the real /dev/full), its output captured where not redirected."""
    return subprocess.run(["bash", "-c", line], env=child_env(), capture_output=True, text=True, timeout=300,
                          check=False)


def _blockpred(*argv: str) -> str:
    return shlex.join(_command(*argv))


@pytest.fixture(scope="module")
def normal(volume, tmp_path_factory):
    """A normal run of the command, with a working stdout and stderr: its output and its JSON summary."""
    out = str(tmp_path_factory.mktemp("normal") / "out.zarr")
    result = _shell(_blockpred("run", volume, out, *RUN, "--json"))
    assert result.returncode == 0, result.stderr
    return read_volume(out), json.loads(result.stdout)


def _no_traceback(*texts: str) -> None:
    for text in texts:
        assert "Traceback" not in text and "Exception ignored" not in text, text


@pytest.mark.slow
def test_json_to_a_full_stdout_finishes_the_run_with_its_output_exit_0_and_one_warning(volume, normal, tmp_path):
    """Was: a chained OSError traceback, exit 1, and "no space left on the device" of an output that was complete."""
    out = str(tmp_path / "out.zarr")
    result = _shell(_blockpred("run", volume, out, *RUN, "--json") + " >/dev/full")
    _no_traceback(result.stderr)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "blockpred: warning:" in line]
    assert warnings == ["blockpred: warning: stdout is full; its lines are dropped, and the run and its output are "
                        "not affected"], result.stderr
    assert "device" not in result.stderr, result.stderr
    np.testing.assert_array_equal(read_volume(out), normal[0])
    # The text summary to a full stdout in the same way.
    result = _shell(_blockpred("run", volume, str(tmp_path / "text.zarr"), *RUN) + " >/dev/full")
    assert result.returncode == 0 and result.stderr.count("stdout is full") == 1, result.stderr
    _no_traceback(result.stderr)
    np.testing.assert_array_equal(read_volume(tmp_path / "text.zarr"), normal[0])


@pytest.mark.slow
def test_a_full_stderr_with_the_progress_bar_finishes_the_run_and_json_names_it(volume, normal, tmp_path):
    """Was: the run aborted before any block (the progress bar's first draw), exit 1, and printed nothing."""
    out = str(tmp_path / "out.zarr")
    with_bar = [arg for arg in RUN if arg != "--no-progress"]
    result = _shell(_blockpred("run", volume, out, *with_bar, "--json") + " 2>/dev/full")
    assert result.returncode == 0, result.stdout
    said = json.loads(result.stdout)  # the whole of stdout: one JSON object
    assert said["ok"] is True and said["warnings"] == ["stderr is full; its lines were dropped"], said
    assert said["predicted_blocks"] == normal[1]["predicted_blocks"] == said["blocks"]
    np.testing.assert_array_equal(read_volume(out), normal[0])
    # Without --json the warning is the first line of stdout, the summary after it.
    result = _shell(_blockpred("run", volume, str(tmp_path / "text.zarr"), *with_bar) + " 2>/dev/full")
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and lines[0].startswith("blockpred: warning: stderr is full"), result.stdout
    assert "Mvox/s" in lines[-2] or "Mvox/s" in lines[-1], result.stdout
    _no_traceback(result.stdout)
    np.testing.assert_array_equal(read_volume(tmp_path / "text.zarr"), normal[0])


def test_a_failed_run_keeps_its_exit_code_when_stdout_is_full(tmp_path):
    result = _shell(_blockpred("run", str(tmp_path / "missing.zarr"), *RUN, "--json") + " >/dev/full")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert lines[0].startswith("blockpred: error: no zarr container") and "stdout is full" in lines[1], lines
    _no_traceback(result.stderr)


@pytest.fixture
def full_disk(tmp_path):
    """A real tmpfs with no space left (as root; skipped where mounting is not allowed), unmounted after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True,
                            text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        with open(mount / "filler", "wb") as filler:
            try:
                filler.write(b"\0" * (1 << 20))
            except OSError:
                pass
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_progress_file_on_a_full_disk_warns_once_naming_it_and_the_run_completes(volume, tmp_path, full_disk):
    progress = full_disk / "progress.jsonl"
    result = subprocess.run(_command("run", volume, str(tmp_path / "out.zarr"), *RUN, "--progress-json",
                                     str(progress)), env=child_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "progress" in line]
    assert len(warnings) == 1 and f"cannot write the progress file {progress}: its file system is full" in \
        warnings[0] and "the run goes on without progress events" in warnings[0], result.stderr
    _no_traceback(result.stderr)
    assert _complete(str(tmp_path / "out.zarr"))


def test_a_usage_error_with_json_prints_the_json_error_object_and_exits_2(capsys):
    """Was: only the line on stderr, and a script reading the JSON found nothing."""
    with pytest.raises(SystemExit) as info:
        main(["run", "x.zarr", "--json", "--precision", "fp64"])
    captured = capsys.readouterr()
    line = captured.err.strip()
    assert info.value.code == 2 and len(line.splitlines()) == 1 and "invalid choice: 'fp64'" in line
    assert json.loads(captured.out) == {"ok": False, "error": line.removeprefix("blockpred: error: "), "exit_code": 2}
    with pytest.raises(SystemExit):  # a missing argument, and check-model's --json, the same
        main(["check-model", "--json"])
    assert json.loads(capsys.readouterr().out)["exit_code"] == 2
    for argv in (["run", "x.zarr", "--precision", "fp64"], ["bench", "--json", "b.json", "--no-such-flag"]):
        with pytest.raises(SystemExit):  # no --json, or bench's (a file): the line only
            main(argv)
        assert capsys.readouterr().out == ""


@pytest.fixture(scope="module")
def malformed_ome_tiff(tmp_path_factory) -> str:
    """A TIFF whose OME-XML does not parse: tifffile logs an error (at each open) and reads it as a plain stack."""
    import tifffile

    path = tmp_path_factory.mktemp("tiff") / "bad.ome.tif"
    tifffile.imwrite(path, np.random.default_rng(1).integers(0, 255, (16, 32, 64), dtype=np.uint8), ome=True)
    data = bytearray(path.read_bytes())
    start = data.find(b"<OME")
    data[start + 10:start + 30] = b"x" * 20
    path.write_bytes(bytes(data))
    return str(path)


@pytest.mark.slow
def test_stderr_carries_blockpreds_own_lines_and_other_libraries_warnings_only_with_verbose(tmp_path,
                                                                                            malformed_ome_tiff):
    """Was: tifffile's "OME series raised ParseError" lines and a network's torch UserWarning (with its source
    line) among blockpred's.  The network calls ``nn.functional.upsample``, which torch deprecates."""
    options = [*RUN, "--model", "tests.networks:deprecated", "--halo", "10"]
    quiet = subprocess.run(_command("run", malformed_ome_tiff, str(tmp_path / "quiet.zarr"), *options),
                           env=child_env(), capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert "tifffile" not in quiet.stderr and "Warning" not in quiet.stderr, quiet.stderr
    assert all(" blockpred." in line or line.startswith("blockpred") for line in quiet.stderr.splitlines()), \
        quiet.stderr
    verbose = subprocess.run(_command("-v", "run", malformed_ome_tiff, str(tmp_path / "verbose.zarr"), *options),
                             env=child_env(), capture_output=True, text=True, timeout=300)
    assert verbose.returncode == 0, verbose.stderr
    lines = verbose.stderr.splitlines()
    assert any(" tifffile ERROR " in line and "OME series" in line for line in lines), verbose.stderr
    assert any(" py.warnings WARNING " in line and "upsample` is deprecated" in line for line in lines), \
        verbose.stderr
    np.testing.assert_array_equal(read_volume(tmp_path / "quiet.zarr"), read_volume(tmp_path / "verbose.zarr"))


def test_the_python_apis_progress_bar_on_a_full_stderr_warns_and_the_run_completes(volume, tmp_path, monkeypatch,
                                                                                    caplog):
    """``blockpred.predict`` has no guarded streams of the command around it: the bar itself stops, with one
    warning, where tqdm cannot write (was: the run raised tqdm's OSError before its first block)."""
    import blockpred

    full = open("/dev/full", "w")
    monkeypatch.setattr(sys, "stderr", full)
    try:
        summary = blockpred.predict(volume, str(tmp_path / "out.zarr"), model="tiny", device="cpu",
                                    block="16,32,32", backend="torch", progress=True)
    finally:
        monkeypatch.undo()
        with contextlib.suppress(OSError):  # what tqdm left in its buffer
            full.close()
    assert summary.stats.num_blocks == 2
    said = [r.getMessage() for r in caplog.records if r.name == "blockpred.progress"]
    assert said == ["the progress bar cannot be drawn on stderr (No space left on device); the run goes on "
                    "without it"], said
    assert _complete(str(tmp_path / "out.zarr"))


def test_after_a_bar_that_could_not_be_drawn_the_next_runs_bar_in_the_process_draws(volume, tmp_path, monkeypatch):
    """tqdm keeps its process-wide lock when a write raises inside it: the next bar of the process (a notebook's
    next run) then waited forever for it.  The bar draws on a stream that never raises."""
    import io
    import threading

    import blockpred

    options = dict(model="tiny", device="cpu", block="16,32,32", backend="torch", progress=True)
    full = open("/dev/full", "w")
    monkeypatch.setattr(sys, "stderr", full)
    try:
        blockpred.predict(volume, str(tmp_path / "first.zarr"), **options)
    finally:
        monkeypatch.undo()
        with contextlib.suppress(OSError):
            full.close()
    drawn = io.StringIO()
    monkeypatch.setattr(sys, "stderr", drawn)
    second = threading.Thread(target=blockpred.predict, args=(volume, str(tmp_path / "second.zarr")),
                              kwargs=options, daemon=True)
    second.start()
    second.join(timeout=HANG_S)  # a hang guard: nothing here is timed
    monkeypatch.undo()
    assert not second.is_alive(), "the second run's progress bar waited for the lock the first bar's tqdm kept"
    assert "blockpred" in drawn.getvalue() and _complete(str(tmp_path / "second.zarr"))
