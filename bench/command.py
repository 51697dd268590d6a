"""The whole `blockpred run` once, as a user types it, and what its summary says (for the benches here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

_SUMMARY = re.compile(r"predicted ([\d.]+) Mvox in (\d+) blocks.* in ([\d.]+) s \(([\d.]+) Mvox/s[,)]")
_TIME = re.compile(r"started in ([\d.]+) s; stages summed over threads: read ([\d.]+) s, device ([\d.]+) s.*"
                   r"write ([\d.]+) s")
_BLOCK = re.compile(r"block (\d+)x(\d+)x(\d+)")


def run_blockpred(args: list[str], cache: Path, verbose: bool = False) -> dict:
    """``python -m blockpred run ARGS`` with its own size cache: wall seconds and its summary's figures.

    ``mvox``, ``blocks``, ``pipeline_s``, ``mvox_per_s`` from the ``predicted`` line; ``started_s``,
    ``read_s``, ``device_s``, ``write_s`` from the ``time:`` line; ``chosen`` (the line) and ``block``
    (what the defaults chose, or None).  ``verbose``: with ``-v``, its output (``stdout``, ``stderr``: the log)
    and the wall-clock time it started at (``start``, ``time.time()``) too.
    """
    command = [sys.executable, "-m", "blockpred", *(["-v"] if verbose else []), "run", *args]
    started_at = time.time()
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True,
                            env=dict(os.environ, BLOCKPRED_CACHE_DIR=str(cache)))
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {result.stderr.strip()[-2000:]}")
    summary, times = _SUMMARY.search(result.stdout), _TIME.search(result.stdout)
    chosen = next((line for line in result.stdout.splitlines() if line.startswith("chosen:")), "")
    block = _BLOCK.search(chosen)
    return {"wall_s": wall, "mvox": float(summary.group(1)), "blocks": int(summary.group(2)),
            "pipeline_s": float(summary.group(3)), "mvox_per_s": float(summary.group(4)),
            "started_s": float(times.group(1)), "read_s": float(times.group(2)),
            "device_s": float(times.group(3)), "write_s": float(times.group(4)),
            "chosen": chosen, "block": [int(v) for v in block.groups()] if block else None,
            **({"stdout": result.stdout, "stderr": result.stderr, "start": started_at} if verbose else {})}
