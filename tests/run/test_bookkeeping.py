"""Bookkeeping in bulk: the mask's block coverage, marker logs, the task feed and `blockpred plan`."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import blockpred
from blockpred.pipeline.blocking import plan_blocks
from blockpred.cli import main
from blockpred.geometry import Box, Coord
from blockpred.io import open_volume
from blockpred.io.base import parse_volume_path
from blockpred.pipeline.markers import DoneMarkers
from blockpred.run.mask import Mask
from blockpred.cluster.scheduler import TaskFeed
from tests.helpers import ROOT, write_test_volume, child_env



@pytest.mark.parametrize("mask_shape, roi, tile_bytes", [
    pytest.param((8, 16, 16), None, 64 << 20, id="4x-whole"),
    pytest.param((13, 7, 29), Box(Coord((3, 5, 1)), Coord((50, 61, 58))), 64 << 20, id="uneven-roi"),
    pytest.param((52, 64, 60), Box(Coord((3, 5, 1)), Coord((50, 61, 58))), 300, id="full-size-tiled"),
])
def test_bulk_coverage_equals_the_per_block_rule(tmp_path, mask_shape, roi, tile_bytes):
    rng = np.random.default_rng(sum(mask_shape))
    mask_data = np.zeros(mask_shape, dtype=np.uint8)
    mask_data[tuple(rng.integers(0, n, 6) for n in mask_shape)] = 1
    path = write_test_volume(str(tmp_path / "mask.zarr"), mask_data, chunks=(4, 4, 4))
    volume_shape = Coord((52, 64, 60))
    plan = plan_blocks(volume_shape=volume_shape, block_shape=Coord((8, 16, 12)), halo=Coord((2, 2, 2)), roi=roi)
    mask = Mask.open(parse_volume_path(path), volume_shape)
    grid = mask.coverage(plan, max_tile_bytes=tile_bytes)
    expected = np.zeros(tuple(plan.grid_shape), dtype=bool)
    for block in plan:
        region = mask.region(block.write_box)
        expected[tuple(block.index - plan.grid_begin)] = mask_data[region.to_slices()].any()
    assert expected.any() and not expected.all()
    np.testing.assert_array_equal(grid, expected)


def _plan(grid=(3, 4, 5)):
    return plan_blocks(volume_shape=Coord(grid) * 8, block_shape=Coord((8, 8, 8)), halo=Coord((0, 0, 0)))


def test_marks_from_two_processes_are_read_back_in_bulk_and_a_torn_record_is_ignored(tmp_path):
    plan = _plan()
    masked = np.zeros(tuple(plan.grid_shape), dtype=bool)
    masked[2, 3, 4] = True
    markers = DoneMarkers.create(tmp_path / "m", plan, {"x": 1}, masked)
    markers.mark_done(plan.block(Coord((0, 0, 1))))
    markers.mark_skipped(plan.block(Coord((1, 2, 3))))
    code = ("import sys; from pathlib import Path; from blockpred.pipeline.markers import DoneMarkers; "
            "from blockpred.geometry import Coord; from blockpred.pipeline.blocking import plan_blocks; "
            "m = DoneMarkers.open(Path(sys.argv[1])); "
            "p = plan_blocks(volume_shape=Coord((24, 32, 40)), block_shape=Coord((8, 8, 8)), halo=Coord((0, 0, 0))); "
            "m.mark_done(p.block(Coord((2, 0, 0))))")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], check=True, env=child_env())
    logs = sorted((tmp_path / "m" / "done").iterdir())
    assert len(logs) == 2  # one per process, never a file per block
    with open(logs[0], "ab") as f:
        f.write(b"\x07\x00\x00")  # a record cut short by a crash
    again = DoneMarkers.open(tmp_path / "m")
    assert again.done_indices() == {Coord((0, 0, 1)), Coord((2, 0, 0))}
    assert again.skipped_indices() == {Coord((1, 2, 3)), Coord((2, 3, 4))}
    todo = again.todo_ids()
    assert len(todo) == 60 - 4 and plan.block_id(Coord((0, 0, 1))) not in todo and 0 in todo


def test_markers_made_anew_at_the_same_path_do_not_inherit_the_old_logs(tmp_path):
    plan = _plan()
    first = DoneMarkers.create(tmp_path / "m", plan, {})
    first.mark_done(plan.block(Coord((0, 0, 0))))
    second = DoneMarkers.create(tmp_path / "m", plan, {})  # --overwrite, in the same process
    second.mark_done(plan.block(Coord((1, 1, 1))))
    assert DoneMarkers.open(tmp_path / "m").done_indices() == {Coord((1, 1, 1))}
    assert not second.marked_here(plan.block(Coord((0, 0, 0)))) and second.marked_here(plan.block(Coord((1, 1, 1))))


def test_markers_of_an_older_blockpred_one_file_per_block_are_still_read(tmp_path):
    plan = _plan()
    markers = DoneMarkers.create(tmp_path / "m", plan, {})
    old = tmp_path / "m" / "done" / "c" / "1" / "2"
    old.mkdir(parents=True)
    (old / "3").write_bytes(b"\x01")
    (old / ".3.tmp").write_bytes(b"\x01")  # a write never renamed into place
    markers.mark_done(plan.block(Coord((0, 0, 0))))
    assert markers.done_indices() == {Coord((0, 0, 0)), Coord((1, 2, 3))}


def test_the_task_feed_hands_out_every_id_once_sized_by_the_measured_rate_and_the_tail():
    feed = TaskFeed(np.arange(1000), batch_size=2, task_s=1.0, max_blocks=64)
    first = feed.take(num_workers=4)
    assert list(first) == [0, 1, 2, 3]  # before any measurement: two batches
    feed.observe(num_blocks=4, seconds=0.1)  # 40 blocks per second -> 40 per 1 s task
    assert len(feed.take(4)) == 40
    feed.observe(num_blocks=10, seconds=0.05)  # faster: 200 per second, capped at 64
    assert len(feed.take(4)) == 64
    taken = [first, np.arange(4, 108)]
    sizes = []
    while (ids := feed.take(4)) is not None:
        taken.append(ids)
        sizes.append(len(ids))
    assert np.array_equal(np.concatenate(taken), np.arange(1000))
    assert sizes[-1] == 2 and max(sizes[-3:]) <= 8  # the tail is cut fine for 4 workers x 2 in flight


def test_plan_prints_the_plan_in_bulk_and_writes_nothing(tmp_path, capsys, monkeypatch):
    source = write_test_volume(str(tmp_path / "in.zarr"), np.ones((32, 64, 64), dtype=np.uint8))
    mask = np.zeros((8, 16, 16), dtype=np.uint8)
    mask[1, 2, 3] = 1  # block (0, 0, 0) of 16^3 blocks
    mask_path = write_test_volume(str(tmp_path / "mask.zarr"), mask)
    out = str(tmp_path / "out.zarr")
    before = sorted(p.name for p in tmp_path.iterdir())
    args = [source, out, "--block", "16", "--halo", "8", "--mask", mask_path]
    assert main(["plan", *args, "--assume-mvox-per-s", "0.001", "--gpus", "1,4"]) == 0
    text = capsys.readouterr().out
    assert "2x4x4 = 32 blocks: 1 to run, 31 masked out, 0 already done" in text
    assert "halo overhead 8.00" in text  # (16 + 2 x 8)^3 / 16^3
    assert "1 GPU 4.1 s, 4 GPUs 1 s at 0.001 Mvox/s per GPU (assumed)" in text  # 4096 voxels
    assert sorted(p.name for p in tmp_path.iterdir()) == before

    assert main(["run", *args, "--local", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["plan", *args]) == 0
    text = capsys.readouterr().out
    assert "0 to run, 31 masked out, 1 already done (resuming)" in text and "0 chunk files" in text
    assert "runtime   unknown" in text  # a run this short records no throughput
    assert "not measured yet" not in text  # a finished output: the run's choice, cached
    monkeypatch.setenv("BLOCKPRED_CACHE_DIR", str(tmp_path / "another-cache"))  # nothing cached: nothing left to measure
    assert main(["plan", *args]) == 0
    text = capsys.readouterr().out
    assert "(not measured: every block of this output is done)" in text and "not measured yet" not in text


def test_plan_uses_the_throughput_bench_measured(tmp_path, capsys):
    source = write_test_volume(str(tmp_path / "in.zarr"), np.ones((16, 32, 32), dtype=np.uint8))
    assert main(["bench", "--model", "tiny", "--block", "16", "--device", "cpu", "--warmup", "0",
                 "--iterations", "1"]) == 0
    capsys.readouterr()
    assert main(["plan", source, str(tmp_path / "out.zarr"), "--block", "16", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    # measured on a CPU: per CPU worker, never "per GPU"
    assert "Mvox/s per CPU worker (blockpred bench, model only at block 16x16x16 on cpu" in text
    assert "GPU" not in text.splitlines()[-1]


@pytest.mark.parametrize("flag, value, expected", [
    ("--assume-mvox-per-s", "-3", "must be a positive number"),
    ("--gpus", "two", "comma-separated list of GPU counts"),
])
def test_plan_refuses_bad_figures_in_one_line(tmp_path, capsys, flag, value, expected):
    source = write_test_volume(str(tmp_path / "in.zarr"), np.ones((16, 16, 16), dtype=np.uint8))
    assert main(["plan", source, "--block", "16", flag, value]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_readme_api_example_runs_as_a_plain_script_without_a_main_guard(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Python API", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "__main__" not in code and "blockpred.predict(" in code
    data = np.random.default_rng(2).integers(0, 255, (32, 64, 64), dtype=np.uint8)
    write_test_volume(str(tmp_path / "vol.zarr/raw"), data)
    (tmp_path / "script.py").write_text(code)
    env = child_env()
    result = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bootstrapping" not in result.stderr and "predicted" in result.stdout
    local = blockpred.predict(str(tmp_path / "vol.zarr/raw"), str(tmp_path / "local.zarr"), model="tiny",
                              block=32, halo=8, local=True, progress=False)
    got, want = open_volume(str(tmp_path / "vol.zarr/prediction")), open_volume(local.output)
    # The example names no batch or layout: the two runs may measure them differently (to float rounding).
    np.testing.assert_allclose(got.read(got.box), want.read(want.box), rtol=0, atol=1e-5)


def test_what_a_process_marked_is_one_bit_per_block_however_many_it_marked(tmp_path):
    """The client keeps its marked blocks for retries: 30 million blocks cost 3.75 MB, not 64 bytes a block."""
    from blockpred.pipeline import markers as module

    plan = plan_blocks(volume_shape=Coord((300, 1000, 1000)), block_shape=Coord((1, 10, 1)), halo=Coord((0, 0, 0)))
    assert plan.num_blocks == 30_000_000
    markers = DoneMarkers.create(tmp_path / "m", plan, {})
    for index in [(0, 0, 0), (299, 99, 999), (150, 50, 7)]:
        markers.mark_done(plan.block(Coord(index)))
    bits = module._MARKED[(str(markers.path), markers.token)]
    assert bits._bytes.nbytes == 30_000_000 // 8
    assert markers.marked_here(plan.block(Coord((299, 99, 999)))) and not markers.marked_here(plan.block(Coord((1, 1, 1))))


@pytest.mark.parametrize("workers", [pytest.param({"local": True}, id="in-process"),
                                     pytest.param({"workers": 1}, id="one-dask-worker")])
def test_a_run_in_this_process_leaves_no_descriptor_open_on_its_output(tmp_path, workers):
    """A notebook or a long-lived worker runs many runs: each run's marker logs are closed at its end."""
    import os

    source = write_test_volume(str(tmp_path / "in.zarr"), np.zeros((16, 32, 32), dtype=np.uint8) + 7)
    out = tmp_path / "out.zarr"

    def open_under(root: Path) -> list[str]:
        fds = Path("/proc/self/fd")
        targets = [os.path.realpath(fds / fd) for fd in os.listdir(fds)]
        return [t for t in targets if t.startswith(str(root.resolve()))]

    for k in range(2):  # the second: a resume with its own logs
        summary = blockpred.predict(source, str(out), model="tiny", block=16, halo=4, batch_size=1,
                                    memory_format="contiguous", device="cpu", progress=False,
                                    overwrite=k == 0, **workers)
        assert (summary.stats.num_blocks, summary.num_resumed) == ((4, 0) if k == 0 else (0, 4))
        assert open_under(tmp_path) == [], f"run {k}: still open"
    logs = list((tmp_path / "out.zarr.blockpred").rglob("*.ids"))
    assert logs, "the marks were written"


#: A child that marks three blocks done on markers made beforehand, says so, and waits to be killed.
_MARK_AND_WAIT = """
import sys, time
from pathlib import Path
from blockpred.geometry import Coord
from blockpred.pipeline.blocking import plan_blocks
from blockpred.pipeline.markers import DoneMarkers
markers = DoneMarkers.open(Path(sys.argv[1]))
plan = plan_blocks(volume_shape=Coord((24, 32, 40)), block_shape=Coord((8, 8, 8)), halo=Coord((0, 0, 0)))
for index in [(0, 0, 0), (1, 2, 3), (2, 3, 4)]:
    markers.mark_done(plan.block(Coord(index)))
print("marked", flush=True)
time.sleep(3600)
"""


def test_marks_reach_the_disk_while_the_run_goes_on_so_a_crash_of_the_machine_keeps_them(crashable_disk):
    """A run is one job on one machine: marks wait for no job's end, a thread fsyncs them within a second."""
    import time

    from blockpred.pipeline import mark_logs
    from tests.helpers import HANG_S

    path = crashable_disk.path / "out.zarr.blockpred" / "pred"
    DoneMarkers.create(path, _plan(), {"x": 1})
    child = subprocess.Popen([sys.executable, "-c", _MARK_AND_WAIT, str(path)], stdout=subprocess.PIPE, text=True,
                             env=child_env())
    try:
        assert child.stdout.readline().strip() == "marked"
        deadline = time.monotonic() + HANG_S
        while True:  # the disk as a crash would leave it, read until the marks are there
            copy = crashable_disk.crash()
            crashed = DoneMarkers.open(copy.path / "out.zarr.blockpred" / "pred")
            assert crashed is not None, "the markers' group did not reach the disk when it was made"
            if len(crashed.done_indices()) == 3 or time.monotonic() > deadline:
                break
            copy.discard()
            time.sleep(mark_logs.SYNC_S)
        assert crashed.done_indices() == {Coord((0, 0, 0)), Coord((1, 2, 3)), Coord((2, 3, 4))}
        assert child.poll() is None  # still running: its job has not ended
    finally:
        child.kill()
        child.wait()
