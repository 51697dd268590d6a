"""``blockpred serve`` as a user starts it: time to the first chunk, per chunk cold and warm, 16 readers at once.

Starts ``python -m blockpred serve VOLUME --port 0 --model M [options]`` (a subprocess, an empty cache
directory of its own unless ``--cache`` names one) on a synthetic EM volume, and times:

* **ready**: from the command's start to its "Ctrl-C stops it" line (imports, model, dry run, measuring);
* **first chunk**: from the command's start to the first chunk of the prediction read over HTTP;
* **cold**: a chunk whose block is not predicted yet, one request at a time (the block is predicted);
* **warm**: the same chunks again (the encoded chunk from the server's cache);
* **16 readers**: 16 threads reading every remaining chunk in shuffled orders, overlapping: chunks answered per
  second and blocks predicted (each once).

    python bench/bench_serve.py [--model tiny] [--shape 128,256,256] [--cold 8] [--json out.json] [-- run options]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--shape", default="128,256,256")
    parser.add_argument("--cold", type=int, default=8, help="chunks timed one at a time, cold then warm")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--cache", default=None, help="BLOCKPRED_CACHE_DIR for the server [a fresh one]")
    parser.add_argument("--json", default=None)
    parser.add_argument("options", nargs="*", help="more `blockpred serve` options (after --)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-serve-"))
    shape = tuple(int(n) for n in args.shape.split(","))
    volume = root / f"em-{'x'.join(map(str, shape))}.zarr"
    if not volume.exists():
        from blockpred.geometry import Coord
        from blockpred.io.synthetic import write_em_volume

        write_em_volume(str(volume / "raw"), Coord(shape))
    env = dict(os.environ, BLOCKPRED_CACHE_DIR=args.cache or tempfile.mkdtemp(prefix="bench-serve-cache-"))
    command = [sys.executable, "-m", "blockpred", "serve", str(volume / "raw"), "--port", "0", "--model", args.model,
               *args.options]
    started = time.perf_counter()
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        for line in server.stdout:
            lines.append(line)
            if "Ctrl-C stops it" in line:
                break
        else:
            raise SystemExit(f"blockpred serve ended: {server.stderr.read()[-2000:]}")
        ready_s = time.perf_counter() - started
        url = next(line.split("zarr://", 1)[1].strip() for line in lines if "prediction: zarr://" in line)
        meta = json.loads(urllib.request.urlopen(f"{url}/0/.zarray").read())
        grid = [-(-n // c) for n, c in zip(meta["shape"], meta["chunks"])]
        lead = ["0"] * (len(grid) - 3)
        keys = [".".join(lead + [str(z), str(y), str(x)]) for z in range(grid[-3]) for y in range(grid[-2])
                for x in range(grid[-1])]
        random.Random(0).shuffle(keys)

        def get(key: str) -> float:
            t = time.perf_counter()
            body = urllib.request.urlopen(f"{url}/0/{key}").read()
            assert body
            return time.perf_counter() - t

        first = get(keys[0])
        first_s = time.perf_counter() - started
        cold = [get(key) for key in keys[1:1 + args.cold]]
        warm = [get(key) for key in keys[1:1 + args.cold]]
        rest = keys[1 + args.cold:]
        before = json.loads(urllib.request.urlopen(url.replace("/prediction.zarr", "/status.json")).read())

        def reader(seed: int) -> None:
            order = rest[:]
            random.Random(seed).shuffle(order)
            for key in order:
                get(key)

        t = time.perf_counter()
        threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        many_s = time.perf_counter() - t
        after = json.loads(urllib.request.urlopen(url.replace("/prediction.zarr", "/status.json")).read())
    finally:
        server.terminate()
        server.wait(timeout=60)
    result = {
        "command": " ".join(command), "chunk": meta["chunks"], "chunks": len(keys), "ready_s": ready_s,
        "first_chunk_s": first_s, "first_request_s": first, "cold_median_s": statistics.median(cold),
        "warm_median_s": statistics.median(warm), "readers": 16, "reader_chunks": 16 * len(rest),
        "reader_distinct_chunks": len(rest), "reader_s": many_s, "reader_chunks_per_s": 16 * len(rest) / many_s,
        "reader_distinct_chunks_per_s": len(rest) / many_s,
        "blocks_predicted_by_readers": after["blocks_predicted"] - before["blocks_predicted"],
        "status": after,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
