"""Ctrl-C in the middle of a pipeline: the run stops and returns, whatever the main thread was doing.

A SIGINT raised inside ``threading``'s own code (a writer slot's semaphore, a
future's condition) used to leave a lock held or a slot lost, and the
pipeline's cleanup then waited forever.  The child process runs a pipeline of
tiny blocks with a network that takes no time, so its main thread spends most
of the run submitting (where such interrupts land), and sends itself a real
SIGINT again and again, each time at another pass of the run (from the
network's own thread: the signal lands wherever the main thread is at that
moment).  The points are passes, not moments: every run is interrupted, on a
loaded machine too.
"""

import subprocess
import sys
import textwrap

from tests.helpers import child_env

#: Interrupted runs; before the fix one of the first ten hung in every stress of this kind.
RUNS = 24

CHILD = textwrap.dedent(f"""
    import faulthandler, os, signal, sys
    import numpy as np, torch
    from blockpred.geometry import Coord
    from blockpred.io import open_volume
    from blockpred.pipeline import PipelineSettings, Predictor, run_blocks
    from blockpred.pipeline.blocking import plan_blocks
    from tests.helpers import write_test_volume
    from tests.networks import Passthrough

    class Interrupting(Passthrough):
        # Passthrough, sending its own process SIGINT at its pass number ``at``.
        def __init__(self, at):
            super().__init__()
            self.at, self.passes = at, 0

        def forward(self, x):
            self.passes += 1
            if self.passes == self.at:
                os.kill(os.getpid(), signal.SIGINT)
            return super().forward(x)

    faulthandler.dump_traceback_later(120, exit=True)  # a run that never returns fails the test with its stacks
    root, shape, block = sys.argv[1], (16, 64, 64), Coord((8, 8, 8))
    data = np.random.default_rng(0).random(shape, dtype=np.float32)
    source = open_volume(write_test_volume(root + "/in.zarr", data, chunks=tuple(block)))
    sink = open_volume(write_test_volume(root + "/out.zarr", np.zeros((1,) + shape, np.float32),
                                         chunks=tuple(block)), mode="r+")
    plan = plan_blocks(volume_shape=Coord(shape), block_shape=block, halo=Coord((0, 0, 0)), input_shape=block,
                       downsampling=Coord((1, 1, 1)), chunk_shape=block)
    num_passes = plan.num_blocks // 2  # batches of 2
    interrupted = 0
    for i in range({RUNS}):
        at = 1 + i * (num_passes - 4) // {RUNS}  # spread over the run, up to a few passes before its end
        try:
            run_blocks(plan, source=source, sink=sink, settings=PipelineSettings(batch_size=2),
                       predictor=Predictor(Interrupting(at), torch.device("cpu")))
        except KeyboardInterrupt:
            interrupted += 1
    print(interrupted)
""")


def test_sigint_at_any_point_of_a_pipeline_stops_it_and_it_returns(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=child_env(), capture_output=True,
                          text=True, check=False, preexec_fn=_default_sigint)
    assert done.returncode == 0, done.stderr[-4000:]
    assert int(done.stdout.split()[-1]) == RUNS  # each run was interrupted, and returned


def _default_sigint() -> None:  # as a terminal's foreground job, even under a shell that ignores SIGINT
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
