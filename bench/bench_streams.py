"""The command's streams and signals, for each checkout named (issue 46): what a full stdout or stderr does to a
run, how long a refused ``--scheduler`` takes, and when Ctrl-C during a slow block is first answered.

    python bench/bench_streams.py /tmp/old "$PWD"      (an older tree, e.g. from `git archive`, and this one)

Per tree: the exit code of ``run --json >/dev/full`` and ``run --json 2>/dev/full`` and whether a traceback came;
the wall time of ``run --scheduler tcp://127.0.0.1:PORT`` with nothing listening (median of 3); and for a run whose
blocks take 8 s each (``tests.networks:logged``), the seconds from a SIGINT to the "stopping after the blocks in
flight" line (none before issue 46) and to the process's end.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RUN = ["--config", "tiny", "--device", "cpu", "--block", "16,32,32", "--backend", "torch"]


def _env(tree: str, cache: str) -> dict:
    return dict(os.environ, PYTHONPATH=tree, BLOCKPRED_CACHE_DIR=cache)


def _command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "blockpred", *argv]


def streams(tree: str, cache: str, work: Path, source: str) -> None:
    for name, redirect in (("--json >/dev/full", {"stdout": "/dev/full"}), ("--json 2>/dev/full",
                                                                            {"stderr": "/dev/full"})):
        out = str(work / f"out-{len(name)}-{time.monotonic_ns()}.zarr")
        files = {key: open(path, "w") for key, path in redirect.items()}
        try:
            result = subprocess.run(_command("run", source, out, *RUN, "--json"), env=_env(tree, cache), text=True,
                                    cwd=work,
                                    stdout=files.get("stdout", subprocess.PIPE),
                                    stderr=files.get("stderr", subprocess.PIPE), timeout=600)
        finally:
            for file in files.values():
                file.close()
        said = (result.stdout or "") + (result.stderr or "")
        print(f"{tree}: run {name}: exit {result.returncode}, traceback {'Traceback' in said}")


def scheduler(tree: str, cache: str, work: Path, source: str) -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    walls = []
    for _ in range(3):
        start = time.perf_counter()
        result = subprocess.run(_command("run", source, str(work / "never.zarr"), *RUN, "--no-progress",
                                         "--scheduler", f"tcp://127.0.0.1:{port}"), env=_env(tree, cache), cwd=work,
                                capture_output=True, text=True, timeout=600)
        walls.append(time.perf_counter() - start)
    print(f"{tree}: --scheduler with nothing listening: exit {result.returncode}, median {statistics.median(walls):.2f}"
          f" s of {[round(w, 2) for w in walls]}: {result.stderr.strip().splitlines()[-1]}")


def interrupt(tree: str, cache: str, work: Path, source: str) -> None:
    log = work / f"passes-{time.monotonic_ns()}.log"
    run = subprocess.Popen(_command("run", source, str(work / f"slow-{time.monotonic_ns()}.zarr"), *RUN,
                                    "--no-progress", "--model", "tests.networks:logged", "--model-kwargs",
                                    f"log_path={log},delay_s=8", "--batch-size", "1",
                                    "--memory-format", "contiguous"),
                           env=_env(tree, cache), cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.perf_counter(), line) for line in run.stderr))
    reader.start()
    while not log.exists():  # the first block's pass began (dry runs are all zeros, not logged)
        time.sleep(0.05)
    time.sleep(1.0)
    sent = time.perf_counter()
    run.send_signal(signal.SIGINT)
    run.wait(timeout=600)
    ended = time.perf_counter()
    reader.join()
    noted = [at - sent for at, line in lines if "stopping after the blocks in flight" in line]
    print(f"{tree}: SIGINT during an 8 s block: first line after "
          f"{f'{noted[0] * 1000:.1f} ms' if noted else 'none'}, exit {run.returncode} after {ended - sent:.1f} s")


def main(trees: list[str]) -> None:
    # Each command runs in the temporary folder, never in a checkout: ``python -m`` puts the working directory
    # ahead of PYTHONPATH.
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        sys.path.insert(0, trees[-1])
        from tests.helpers import write_test_volume
        import numpy as np

        data = np.random.default_rng(0).integers(0, 255, (32, 64, 64), dtype=np.uint8)
        source = write_test_volume(str(work / "in.zarr"), data, chunks=(16, 32, 32))
        for tree in trees:
            cache = str(work / f"cache-{Path(tree).name}")
            streams(tree, cache, work, source)
            scheduler(tree, cache, work, source)
            interrupt(tree, cache, work, source)


if __name__ == "__main__":
    main(sys.argv[1:])
