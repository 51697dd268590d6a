"""Ctrl-C in the middle of a pipeline: the run stops and returns, whatever the main thread was doing.

A SIGINT raised inside ``threading``'s own code (a writer slot's semaphore, a
future's condition) used to leave a lock held or a slot lost, and the
pipeline's cleanup then waited forever.  The child process runs a pipeline of
tiny blocks with a network that takes no time, so its main thread spends most
of the run submitting (where such interrupts land), and sends itself a real
SIGINT at points spread over the run, again and again.
"""

import subprocess
import sys
import textwrap

from tests.helpers import child_env

#: Interrupted runs; before the fix one of the first ten hung in every stress of this kind.
RUNS = 24

CHILD = textwrap.dedent(f"""
    import faulthandler, os, signal, sys, threading, time
    import numpy as np, torch
    from blockpred.geometry import Coord
    from blockpred.io import open_volume
    from blockpred.pipeline import PipelineSettings, Predictor, run_blocks
    from blockpred.pipeline.blocking import plan_blocks
    from tests.helpers import write_test_volume
    from tests.networks import Passthrough

    faulthandler.dump_traceback_later(120, exit=True)  # a run that never returns fails the test with its stacks
    root, shape, block = sys.argv[1], (16, 64, 64), Coord((8, 8, 8))
    data = np.random.default_rng(0).random(shape, dtype=np.float32)
    source = open_volume(write_test_volume(root + "/in.zarr", data, chunks=tuple(block)))
    sink = open_volume(write_test_volume(root + "/out.zarr", np.zeros((1,) + shape, np.float32),
                                         chunks=tuple(block)), mode="r+")
    plan = plan_blocks(volume_shape=Coord(shape), block_shape=block, halo=Coord((0, 0, 0)), input_shape=block,
                       downsampling=Coord((1, 1, 1)), chunk_shape=block)
    run = lambda: run_blocks(plan, source=source, sink=sink, predictor=Predictor(Passthrough(), torch.device("cpu")),
                             settings=PipelineSettings(batch_size=2))
    started = time.perf_counter()
    run()
    whole_s = time.perf_counter() - started
    interrupted = 0
    for i in range({RUNS}):
        timer = threading.Timer(whole_s * (i + 0.5) / {RUNS}, os.kill, (os.getpid(), signal.SIGINT))
        try:
            try:
                timer.start()
                run()
            except KeyboardInterrupt:
                interrupted += 1
            timer.join()
        except KeyboardInterrupt:  # the run was through before the signal came
            timer.join()
    print(interrupted)
""")


def test_sigint_at_any_point_of_a_pipeline_stops_it_and_it_returns(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=child_env(), capture_output=True,
                          text=True, check=False, preexec_fn=_default_sigint)
    assert done.returncode == 0, done.stderr[-4000:]
    assert int(done.stdout.split()[-1]) >= RUNS // 2  # most signals came while a run was going on


def _default_sigint() -> None:  # as a terminal's foreground job, even under a shell that ignores SIGINT
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
