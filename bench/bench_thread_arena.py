"""The network on the main thread against a thread, with glibc's default arenas and with ``MALLOC_ARENA_MAX=1``.

A dask task runs on a worker thread, never the main thread.  This runs the same
``blockpred.predict(..., local=True)`` on the main thread and then on a
``threading.Thread``, each in a fresh process per environment (glibc reads
``MALLOC_ARENA_MAX`` at start), and reports the pipeline's compute seconds.

    python bench/bench_thread_arena.py [--shape 128,384,384] [--repeats 2] [--model tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, threading
import blockpred
source, output, model, repeats = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
figures = {"main": [], "thread": []}

def run(where):
    summary = blockpred.predict(source, output, model=model, local=True, overwrite=True, progress=False)
    figures[where].append(summary.stats.compute_s)

for _ in range(repeats):
    run("main")
    thread = threading.Thread(target=run, args=("thread",))
    thread.start()
    thread.join()
print(json.dumps(figures))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="128,384,384")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dir", default="/tmp/blockpred-arena-bench")
    args = parser.parse_args()

    from blockpred.config import parse_shape
    from blockpred.io.synthetic import make_em_volume
    from blockpred.io import create_volume

    shape = parse_shape(args.shape, "shape")
    root = Path(args.dir)
    source = str(root / "raw.zarr")
    with create_volume(source, spatial_shape=shape, num_channels=None, dtype="uint8", chunk_shape=(64, 64, 64),
                       ome=False, overwrite=True) as volume:
        volume.write(volume.box, make_em_volume(shape))
    report = {"shape": list(shape), "model": args.model, "cpus": os.cpu_count()}
    for label, extra in (("glibc default", {}), ("MALLOC_ARENA_MAX=1", {"MALLOC_ARENA_MAX": "1"})):
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | extra
        result = subprocess.run([sys.executable, "-c", CHILD, source, str(root / "out.zarr"), args.model,
                                 str(args.repeats)], env=env, capture_output=True, text=True, check=True)
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        report[label] = figures
        print(f"{label:20s} compute s on the main thread {figures['main']}, on a thread {figures['thread']}",
              flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
