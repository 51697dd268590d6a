"""Ctrl-C during a run in process: the first says at once, in one line, that the run stops after the blocks in
flight (it waits for them: a block on a CPU can take 19 s), and a second stops it now.  (SIGTERM and SIGHUP, in
process and with workers: ``tests/cluster/test_cluster.py``.)

The network holds every block at a gate (a file) that the test opens: while it is closed, the block in flight
cannot finish, so a line read then was said before the run's end, and a run that ends then did not wait for it.
"""

from __future__ import annotations

import ctypes
import platform
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from blockpred.cli import main
from tests.helpers import child_env, write_test_volume

NOTED = "blockpred: stopping after the blocks in flight; Ctrl-C again to stop now"
INTERRUPTED = "blockpred: interrupted; finished blocks are kept: run the same command again to resume"
STOPPED_NOW = "blockpred: interrupted; stopped now; finished blocks are kept: run the same command again to resume"
#: Seconds a test waits for what must come (a bound against a hang, not a measure).
PATIENCE_S = 180


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    data = np.random.default_rng(3).integers(1, 255, (16, 32, 64), dtype=np.uint8)  # no block all zeros
    return write_test_volume(str(tmp_path_factory.mktemp("signals") / "in.zarr"), data, chunks=(16, 16, 16))


class GatedRun:
    """``blockpred run`` of a network held at a closed gate, as a terminal's foreground job; its stderr read line
    by line as it comes."""

    def __init__(self, source: str, folder: Path):
        self.gate, self.arrived, self.output = folder / "gate", folder / "arrived", str(folder / "out.zarr")
        self.gate.touch()
        self.argv = ["run", source, self.output, "--model", "tests.networks:gated", "--model-kwargs",
                     f"gate_file={self.gate},held_file={self.arrived}", "--device", "cpu", "--block", "16",
                     "--batch-size", "1", "--memory-format", "contiguous", "--backend", "torch", "--no-progress"]
        self.process = subprocess.Popen([sys.executable, "-m", "blockpred", *self.argv], env=child_env(),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True, preexec_fn=_default_sigint)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.said: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for_a_block_at_the_gate(self) -> None:
        waited = 0.0
        while not self.arrived.exists():
            assert self.process.poll() is None, f"the run ended (exit {self.process.returncode}) before any block"
            assert waited < PATIENCE_S, "no block reached the gate"
            threading.Event().wait(0.02)
            waited += 0.02

    def wait_for_line(self, expected: str) -> None:
        while True:
            try:
                line = self.lines.get(timeout=PATIENCE_S)
            except queue.Empty:
                raise AssertionError(f"{expected!r} was not said (the run still going): {self.said}") from None
            assert line is not None, f"stderr ended without {expected!r}: {self.said}"
            self.said.append(line)
            if line == expected:
                return

    def finish(self) -> int:
        code = self.process.wait(timeout=PATIENCE_S)
        while (line := self.lines.get(timeout=PATIENCE_S)) is not None:
            self.said.append(line)
        return code

    def close(self) -> None:
        self.gate.unlink(missing_ok=True)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


#: The number of the Linux system call that sends a signal to one thread of a process, by machine.
_TGKILL = {"x86_64": 234, "aarch64": 131}


def to_a_thread_other_than_main(pid: int, signum: int) -> None:
    """``signum`` delivered to a thread of ``pid`` other than its main thread, as the kernel may deliver a process's
    signal (to any thread that does not block it): Python then runs the handler when the main thread next runs."""
    if platform.machine() not in _TGKILL:
        pytest.skip(f"no tgkill system call number for {platform.machine()} here")
    libc = ctypes.CDLL(None, use_errno=True)
    for task in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda p: -int(p.name)):
        tid = int(task.name)
        try:
            blocked = int(re.search(r"^SigBlk:\s*([0-9a-f]+)", (task / "status").read_text(), re.M).group(1), 16)
        except OSError:  # the thread ended
            continue
        if tid != pid and not blocked & (1 << (signum - 1)) and libc.syscall(_TGKILL[platform.machine()], pid, tid,
                                                                            signum) == 0:
            return
    raise AssertionError(f"process {pid} has no thread other than its main one that takes signal {signum}")


def _default_sigint() -> None:  # as a terminal's foreground job, even under a shell that ignores SIGINT
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_the_first_ctrl_c_says_at_once_that_the_run_stops_after_the_blocks_in_flight(source, tmp_path, capsys):
    run = GatedRun(source, tmp_path)
    try:
        run.wait_for_a_block_at_the_gate()
        run.process.send_signal(signal.SIGINT)
        run.wait_for_line(NOTED)
        assert run.process.poll() is None  # said while the block in flight was still held at the gate
        run.gate.unlink()
        assert run.finish() == 130, run.said
    finally:
        run.close()
    assert run.said.count(NOTED) == 1 and run.said[-1] == INTERRUPTED, run.said
    assert not any("Traceback" in line for line in run.said), run.said
    assert not Path(run.output + ".blockpred", "_root.lock").exists(), "the lock was left behind"
    capsys.readouterr()
    assert main(run.argv) == 0  # the gate is open: the same command resumes, and the blocks in flight were kept
    assert "already done)" in capsys.readouterr().out


@pytest.mark.slow
def test_a_second_ctrl_c_stops_the_run_now_without_waiting_for_the_blocks_in_flight(source, tmp_path):
    run = GatedRun(source, tmp_path)
    try:
        run.wait_for_a_block_at_the_gate()
        run.process.send_signal(signal.SIGINT)
        run.wait_for_line(NOTED)
        run.process.send_signal(signal.SIGINT)
        assert run.finish() == 130, run.said  # with the gate closed: the block in flight was not waited for
    finally:
        run.close()
    # As in the test below: twice in full local suite runs of 2026-11-28 (never alone, nor beside CPU hogs) the
    # orderly stop took past the grace, and the process ended by it; its lock is then taken over by the next run.
    assert run.said.count(NOTED) == 1 and run.said[-1] in (INTERRUPTED, STOPPED_NOW), run.said
    assert not any("Traceback" in line for line in run.said), run.said
    if run.said[-1] == INTERRUPTED:
        assert not Path(run.output + ".blockpred", "_root.lock").exists(), "the lock was left behind"


@pytest.mark.slow
def test_ctrl_c_delivered_to_a_thread_other_than_main_is_said_at_once_and_a_second_stops_the_run_now(source, tmp_path):
    """The main thread waits for the block held at the gate; each signal goes to another thread of the process."""
    run = GatedRun(source, tmp_path)
    try:
        run.wait_for_a_block_at_the_gate()
        to_a_thread_other_than_main(run.process.pid, signal.SIGINT)
        run.wait_for_line(NOTED)
        assert run.process.poll() is None
        to_a_thread_other_than_main(run.process.pid, signal.SIGINT)
        assert run.finish() == 130, run.said  # with the gate closed
    finally:
        run.close()
    # The orderly stop's line, or, where the second KeyboardInterrupt landed inside threading's own code and left a
    # lock its cleanup waits for (once in a full suite run of 2026-11-28), the line of the stop after the grace
    # (blockpred.process.STOP_NOW_GRACE_S): either way the run ends, exit 130, one line that says how to resume.
    assert run.said.count(NOTED) == 1 and run.said[-1] in (INTERRUPTED, STOPPED_NOW), run.said
    assert not any("Traceback" in line for line in run.said), run.said


def test_after_a_second_signal_the_process_ends_even_where_its_cleanup_would_wait_forever():
    """The orderly stop gets a grace period; a main thread that never gets out of its cleanup (here: it sleeps)
    does not keep the process alive past it: the signal's exit code and one line."""
    stuck = textwrap.dedent("""
        import os, signal, time
        import blockpred.process as p
        p.STOP_NOW_GRACE_S = 0.3
        p.end_on_signals()
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the first: the run stops after its blocks in flight
        except KeyboardInterrupt:
            pass
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the second: stop now
        except KeyboardInterrupt:
            time.sleep(60)  # a cleanup that never ends
    """)
    done = subprocess.run([sys.executable, "-c", stuck], capture_output=True, text=True, env=child_env(), timeout=50)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip().splitlines() == [
        "blockpred: interrupted; stopped now; finished blocks are kept: run the same command again to resume"]


def test_a_ctrl_c_python_swallowed_in_a_weakref_callback_is_raised_by_the_main_threads_next_wait():
    """Raised while the main thread runs a weakref callback (the garbage collector's, at any bytecode), Python
    prints a KeyboardInterrupt as "Exception ignored" and drops it: a second Ctrl-C did not stop a run.  The
    command keeps it, says nothing of it, and the main thread's next wait raises it."""
    child = textwrap.dedent("""
        import gc, sys, threading, weakref
        import blockpred.process as p
        from blockpred.pipeline import waits
        p.end_on_signals()
        class Held: pass
        held = Held()
        def interrupted(ref):
            raise KeyboardInterrupt  # as a signal's handler raises it wherever the main thread is
        ref = weakref.ref(held, interrupted)
        del held
        gc.collect()
        try:
            waits.acquire(threading.Semaphore(0))  # a wait that would never end
        except KeyboardInterrupt:
            sys.exit(130)
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=child_env(), timeout=50)
    assert done.returncode == 130 and done.stderr == "", done.stderr
