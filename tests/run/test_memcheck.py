"""A block's memory checked before the network runs at it, and ``plan`` never running the network at the block.

The checks' rules on a foresight whose numbers are given (no outcome depends on this machine's memory), then
the command itself: a declared 100000^3 volume whose named block no memory holds ends in one line, in a child
process whose peak resident memory is read from the kernel (``wait4``, by a small process in between).
"""

import json
import logging
import re
import subprocess
import sys

import numpy as np
import pytest
import zarr

from blockpred.cache import default_cache_dir
from blockpred.cli import main
from blockpred.errors import MemoryBudgetError
from blockpred.geometry import Coord
from blockpred.run.memcheck import Foresight, check_block, check_limit, least_block
from blockpred.tuning.hostbudget import HostBudget
from blockpred.tuning.passmemory import MemoryRoom, PassMemory
from tests.helpers import ROOT, child_env, write_test_volume

MIB, GIB = 2**20, 2**30
#: Runs its arguments as a child and prints its exit code and peak resident memory (KiB).  A child's peak counts the
#: memory of the process it was started from until its exec (Linux keeps that mark): a small process in between
#: keeps the test process's own memory out of it.
PEAK_OF_CHILD = ("import os, subprocess, sys; child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL); "
                 "_, status, usage = os.wait4(child.pid, 0); print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)")
STEP = Coord((2, 2, 2))
LEAST = Coord((16, 16, 16))


def foresight(most: int = 2 * GIB, budget: int = GIB, named: bool = False) -> Foresight:
    """200 bytes per input voxel, 100 MiB held, halo 10, a uint8 input and two float32 outputs."""
    room = MemoryRoom("memory", 100 * MIB, most, "the most", budget, "the budget", named=named)
    memory = PassMemory(200.0, 8.0, 2, Coord((0, 0, 0)), Coord((32, 32, 32)))
    return Foresight(memory, room, Coord((10, 10, 10)), STEP, HostBudget(output_bytes_per_voxel=8), 1)


def named_block(message: str) -> Coord:
    return Coord(int(n) for n in re.search(r"--block (\d+),(\d+),(\d+)", message).groups())


def test_a_named_block_over_the_most_memory_is_refused_naming_the_largest_of_its_shape_within_the_budget():
    sight = foresight()
    block = Coord((128, 512, 512))
    with pytest.raises(MemoryBudgetError) as refused:
        check_block(sight, block, batch=1, origin="named", step=STEP, least=LEAST)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("block 128x512x512 (input 148x532x532, batch 1) is foreseen")
    assert "more than the most" in message and "--block auto" in message
    fitting = named_block(message)
    assert fitting.is_multiple_of(STEP) and sight.bytes(fitting) <= GIB < sight.bytes(block)
    assert fitting[1] == fitting[2] and fitting[1] > 2 * fitting[0]  # the named block's proportions
    larger = Coord(int(n * 1.26) // 2 * 2 for n in fitting)  # the next step up is over the budget
    assert sight.bytes(larger) > GIB


def test_a_named_block_within_the_most_memory_runs_and_blockpreds_own_start_block_is_made_to_fit_the_budget():
    sight = foresight()
    between = Coord((128, 128, 128))  # 148^3 x 200 bytes: 0.6 GiB, with the queue over a 0.5 GiB budget
    tight = foresight(budget=sight.bytes(between) - 1)
    assert check_block(tight, between, batch=1, origin="named", step=STEP, least=LEAST) == between
    smaller = check_block(tight, between, batch=1, origin="default", step=STEP, least=LEAST)
    assert smaller.prod() < between.prod() and tight.bytes(smaller) <= tight.room.budget_bytes
    assert check_block(sight, LEAST, batch=4, origin="named", step=STEP, least=LEAST) == LEAST


def test_a_resumed_block_that_no_longer_fits_says_how_to_start_again():
    with pytest.raises(MemoryBudgetError, match=r"^this output was started with block 256x256x256 .* --overwrite "
                                                r"--block \d+,\d+,\d+ \(foreseen at"):
        check_block(foresight(), Coord((256, 256, 256)), batch=1, origin="resumed", step=STEP, least=LEAST)


def test_where_even_the_least_block_does_not_fit_the_line_says_so_and_a_low_memory_limit_is_refused():
    with pytest.raises(MemoryBudgetError, match=r"and even block 16x16x16 .* free memory, or use a smaller"):
        check_block(foresight(most=101 * MIB, budget=101 * MIB), Coord((64, 64, 64)), batch=1, origin="default",
                    step=STEP, least=LEAST)
    with pytest.raises(MemoryBudgetError, match=r"^--memory-limit 50 MiB is below what a run takes: this process "
                                                r"holds 100 MiB before any block, and block 16x16x16 \(input 36x36x36"):
        check_limit(foresight(most=50 * MIB, budget=50 * MIB, named=True), LEAST)
    check_limit(foresight(most=50 * MIB, budget=50 * MIB, named=False), LEAST)  # the machine's: the block decides


def test_the_least_block_is_16_on_the_grid_at_least_what_the_network_takes_at_most_the_region():
    assert least_block(Coord((1, 27, 27)), Coord((100, 1000, 1000))) == Coord((16, 27, 27))
    assert least_block(STEP, Coord((100, 100, 100)), smallest=Coord((19, 1, 1))) == Coord((20, 16, 16))
    assert least_block(STEP, Coord((5, 100, 100))) == Coord((6, 16, 16))


def test_a_memory_limit_below_what_one_block_takes_is_one_line_and_nothing_is_written(tmp_path, capsys):
    volume = write_test_volume(tmp_path / "in.zarr/raw", np.zeros((16, 32, 32), np.uint8))
    code = main(["run", volume, str(tmp_path / "out.zarr"), "--config", "tiny", "--device", "cpu",
                 "--memory-limit", "10MB", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "--memory-limit 10 MiB is below what a run takes" in err, err
    assert not (tmp_path / "out.zarr").exists()


def test_a_run_keeps_its_count_for_the_next_and_a_refused_run_or_a_plan_keeps_nothing(tmp_path, capsys, caplog):
    volume = write_test_volume(tmp_path / "in.zarr/raw", np.zeros((16, 32, 32), np.uint8))
    cached = default_cache_dir() / "passes.json"
    common = [volume, str(tmp_path / "out.zarr"), "--config", "tiny", "--device", "cpu", "--no-progress"]
    with caplog.at_level(logging.INFO, logger="blockpred.tuning.passmemory"):
        assert main(["plan", *common]) == 0
        assert main(["run", *common, "--channels", "0,5"]) == 2  # refused after the count: nothing kept
        assert not cached.exists()
        assert main(["run", *common]) == 0
        assert cached.exists() and len(json.loads(cached.read_text())) == 1
        counts = [r for r in caplog.records if r.getMessage().startswith("memory of a pass at input 32x32x32")]
        assert len(counts) == 3
        assert main(["run", *common, "--overwrite"]) == 0
    assert len([r for r in caplog.records if r.getMessage().startswith("memory of a pass")]) == 3  # read, not run
    capsys.readouterr()


def test_plan_never_runs_the_network_at_the_block_it_plans(tmp_path, capsys):
    volume = write_test_volume(tmp_path / "in.zarr/raw", np.zeros((64, 128, 128), np.uint8))
    log = tmp_path / "shapes.log"
    assert main(["plan", volume, str(tmp_path / "out.zarr"), "--model", "tests.networks:shapes_logged",
                 "--model-kwargs", f"log_path={log}", "--device", "cpu", "--block", "64,128,128"]) == 0
    assert "network input 84x148x148" in capsys.readouterr().out
    shapes = log.read_text().split()
    assert shapes and all(np.prod([int(n) for n in s.split("x")]) <= 52**3 for s in shapes), shapes


@pytest.mark.slow
@pytest.mark.parametrize("command", [
    pytest.param(["plan", "--block", "512", "--shards", "block", "--memory-limit", "16GB"], id="plan, a limit"),
    pytest.param(["run", "--block", "512", "--memory-limit", "16GB"], id="run, a limit"),
    pytest.param(["run", "--block", "4096"], id="run, more than any machine has"),
])
def test_a_block_no_memory_holds_ends_in_one_line_before_its_dry_run_with_a_small_peak(tmp_path, command):
    """The issue's case: this block's dry run grew a process past 20 GB on a 24 GB machine until it was killed."""
    zarr.create_array(str(tmp_path / "huge.zarr"), name="raw", shape=(100_000,) * 3, chunks=(128,) * 3, dtype="uint8")
    verb, *options = command
    args = [sys.executable, "-m", "blockpred", verb, str(tmp_path / "huge.zarr/raw"), str(tmp_path / "out.zarr"),
            "--model", "tiny", "--device", "cpu", "--no-progress", *options]
    result = subprocess.run([sys.executable, "-c", PEAK_OF_CHILD, *args], capture_output=True, text=True, cwd=ROOT,
                            env=child_env())
    code, peak_kib = map(int, result.stdout.split())
    err = result.stderr.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "is foreseen to take" in err and re.search(r"--block \d+,\d+,\d+ is foreseen at", err), err
    assert peak_kib * 1024 < 2 * GIB  # Linux: kibibytes
    assert not (tmp_path / "out.zarr").exists()
