"""``blockpred.predict`` called in one Python process, as a notebook user calls it: each call timed inside.

    python bench/predict_api.py SOURCE OUT --cache DIR --calls N --model M [--halo Z,Y,X]

Imports ``blockpred.predict`` (torch and the pipeline) first, untimed, as the peers' harness imports
torch and the peer before it times them, then times ``N`` calls of
``blockpred.predict(SOURCE, OUT, model=M, halo=..., overwrite=True)`` with
``BLOCKPRED_CACHE_DIR=DIR`` (the first on whatever ``DIR`` holds: empty for a
first run), and prints one JSON line: ``{"calls": [{"wall_s", "pipeline_s",
"chosen"}, ...]}``.  ``bench/compare_peers.py`` runs it in a process of its own,
so the peers it times in its own process run as their users run them (blockpred
sets glibc's malloc thresholds for its process, :mod:`blockpred.pipeline.hostmem`).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--cache", required=True, help="BLOCKPRED_CACHE_DIR for the calls")
    parser.add_argument("--calls", type=int, default=1)
    parser.add_argument("--model", required=True)
    parser.add_argument("--halo", default=None, help="Z,Y,X (the network's own when not given)")
    args = parser.parse_args()
    os.environ["BLOCKPRED_CACHE_DIR"] = args.cache
    from blockpred import predict  # imports torch and the pipeline (``import blockpred`` alone is lazy): untimed

    options = {"model": args.model}
    if args.halo:
        options["halo"] = tuple(int(v) for v in args.halo.split(","))
    calls = []
    for _ in range(args.calls):
        start = time.perf_counter()
        summary = predict(args.source, args.out, overwrite=True, progress=False, **options)
        calls.append({"wall_s": time.perf_counter() - start, "pipeline_s": summary.stats.seconds,
                      "chosen": str(summary.defaults)})
    print(json.dumps({"calls": calls}))


if __name__ == "__main__":
    main()
